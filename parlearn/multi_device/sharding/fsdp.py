"""An FSDP-style module wrapper from scratch: :func:`shard_module` (ZeRO-3 as a module).

FSDP2's ``fully_shard`` turns a module's parameters into shards that any optimizer can step;
this does the same from ``torch.distributed`` collectives, small enough to read:

- A *unit* is a group of parameters gathered together: by default each top-level child that
  owns parameters (the children of a ModuleList, such as transformer blocks), and the root
  for what is left. A unit's parameters are laid end to end in
  one flat buffer padded to a multiple of N (lesson 12's ``FlatShard``); rank r keeps elements
  ``[r S, (r+1) S)`` as an ``nn.Parameter`` (``S = padded / N``). Those shards are all that
  ``model.parameters()`` yields, so ``torch.optim.AdamW(model.parameters())`` updates shards.
- Before a unit's forward, its shards are all-gathered (cast to ``param_dtype``) and the
  module's parameters become views of the gathered buffer. After the forward the buffer is
  dropped (``reshard_after_forward``); autograd's saved tensors keep a marker instead and the
  backward all-gathers the unit again (a ``saved_tensors_hooks`` pair).
- The gathered buffer's gradient is reduce-scattered (in ``reduce_dtype``, then averaged
  over the ranks) into the shards' ``.grad`` in their own dtype, so gradients are sharded
  too. Several backwards accumulate into ``.grad`` as usual; inside :meth:`no_sync` the
  full gradients are kept and summed locally, and reduce-scattered once by the next synced
  backward (fewer messages, a full gradient's memory).

Frozen parameters (``requires_grad=False``) sit in a unit's second buffer, gathered without
gradient; a parameter shared by two units is refused (put the modules in one unit with
``units=``). BatchNorm in training mode is refused: each rank's batch statistics differ.

Param groups see shards, not tensors: a unit's shard holds its parameters end to end, so an
optimizer cannot treat a unit's norms and biases apart from its matrices (FSDP2 shards each
tensor as a DTensor and can). ``flat_by`` fixes that: ``flat_by(name, param)`` gives each
trainable parameter a key, each unit keeps one flat shard per key, and
:meth:`ShardedModule.shards` lists a key's shards for a param group::

    model = shard_module(gpt, flat_by=lambda name, p: "decay" if p.dim() >= 2 else "none")
    opt = torch.optim.AdamW([{"params": model.fsdp.shards("decay"), "weight_decay": 0.1},
                             {"params": model.fsdp.shards("none"), "weight_decay": 0.0}])

(one more all-gather per key and unit). :meth:`ShardedModule.clip_grad_norm_` clips by the
norm over all ranks.

``replicate(name, param) -> bool`` keeps the parameters it picks whole on every rank instead
(a unit's extra flat that is not cut: its "gather" is a local cast, its gradient is
all-reduced and averaged instead of reduce-scattered). Small vectors such as norms' gains
cost a message each to shard and save almost nothing; course FSDP implementations and
FSDP2 with ``fully_shard`` on the linears only keep them replicated like this.

Memory per rank (modeled, :meth:`ShardedModule.held_bytes` measures it): every unit's shard
(``padded / N`` elements per sharded flat), every replicated flat whole (``numel`` elements,
on every rank, with a whole gradient), and, while a unit runs, that unit's gathered buffer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from parlearn.core.checks import check_bool, check_callable, check_float, check_module
from parlearn.core.recipe import _clip_to
from parlearn.distributed.agree import agree

__all__ = ["MixedPrecisionPolicy", "shard_module", "ShardedModule"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's names: ``param_dtype`` for the gathered parameters and the forward and
    backward computation (None: the parameters' own), ``reduce_dtype`` for the gradient
    reduce-scatter (None: ``param_dtype``). Shards and their gradients keep their dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype)
                                      or not value.is_floating_point):
                raise TypeError(f"{name} must be a floating torch.dtype or None, got {value!r}")


_MARK = object()   # tags a saved tensor that backward gathers again


class _Flat:
    """One unit's parameters of one kind (trainable with one ``flat_by`` key, or frozen) as a
    padded flat shard."""

    def __init__(self, owners: list[tuple[nn.Module, str]], params: list[nn.Parameter],
                 world: int, rank: int, trainable: bool, key: Hashable = None,
                 replicated: bool = False):
        self.owners, self.trainable, self.key = owners, trainable, key
        self.replicated = replicated
        if replicated:   # one "shard" that is the whole flat, on every rank
            world, rank = 1, 0
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.padded = math.ceil(self.numel / world) * world
        self.shard_numel = self.padded // world
        flat = torch.zeros(self.padded, dtype=params[0].dtype, device=params[0].device)
        for p, off, n in zip(params, self.offsets, self.numels, strict=True):
            flat[off:off + n] = p.detach().reshape(-1)
        lo = rank * self.shard_numel
        self.shard = nn.Parameter(flat[lo:lo + self.shard_numel].clone(),
                                  requires_grad=trainable)
        self.full: torch.Tensor | None = None      # the gathered buffer while the unit runs
        self.pending: torch.Tensor | None = None   # summed full gradient inside no_sync()
        self.regathered: torch.Tensor | None = None   # gathered again for the backward


class _Gather(torch.autograd.Function):
    """Forward: all-gather the shard (cast to the compute dtype). Backward: reduce-scatter
    the full gradient (in the reduce dtype), average, into the shard's gradient."""

    @staticmethod
    def forward(ctx, shard, wrapper: ShardedModule, flat: _Flat):
        ctx.wrapper, ctx.flat = wrapper, flat
        return wrapper._gather(flat)

    @staticmethod
    def backward(ctx, grad_full):
        w, flat = ctx.wrapper, ctx.flat
        flat.regathered = None   # this unit's backward is done with its parameters
        grad_full = grad_full.to(torch.float32 if grad_full.dtype in (torch.float16,
                                                                      torch.bfloat16)
                                  else grad_full.dtype)
        if flat.pending is not None:
            grad_full = grad_full + flat.pending.to(grad_full.dtype)
            flat.pending = None
        if not w._sync:
            flat.pending = grad_full.detach().to(flat.shard.dtype)
            return None, None, None
        reduce = w.policy.reduce_dtype or w.policy.param_dtype or flat.shard.dtype
        if flat.replicated:
            out = grad_full.to(reduce, copy=True).contiguous()
            tdist.all_reduce(out, group=w.group)
        else:
            out = torch.empty(flat.shard_numel, dtype=reduce, device=grad_full.device)
            tdist.reduce_scatter_single(out, grad_full.to(reduce).contiguous(), group=w.group)
        return out.div_(w.world).to(flat.shard.dtype), None, None


class ShardedModule:
    """What :func:`shard_module` attaches to a module (``module.fsdp``): the units, the
    policy, :meth:`no_sync`, :meth:`full_state_dict`, :meth:`held_bytes`."""

    def __init__(self, module: nn.Module, units: list[nn.Module], group: Any,
                 policy: MixedPrecisionPolicy, reshard_after_forward: bool,
                 keys: dict[int, Hashable], replicated: set[int] = frozenset()):
        self.module, self.group, self.policy = module, group, policy
        self.reshard = reshard_after_forward
        self.world, self.rank = tdist.get_world_size(group), tdist.get_rank(group)
        self._sync = True
        self._saving = None
        self.units: list[tuple[nn.Module, list[_Flat]]] = []
        claimed: dict[int, str] = {}
        for unit in units:
            owners: list[tuple[nn.Module, str, nn.Parameter]] = []
            for sub_name, sub in _own_modules(unit, units):
                for name, p in list(sub._parameters.items()):
                    if p is None:
                        continue
                    where = f"{sub_name}.{name}".lstrip(".")
                    if id(p) in claimed:
                        if claimed[id(p)] != str(id(unit)):
                            raise ValueError(f"module: parameter {where!r} is shared with "
                                             "another unit; pass units= so both uses sit in "
                                             "one unit")
                    claimed[id(p)] = str(id(unit))
                    owners.append((sub, name, p))
            flats = []
            # One flat per kind: (True, key, replicated) for each flat_by key in order of
            # first use, then (False, None, replicated) for the frozen parameters.
            def kind_of(p):
                return (p.requires_grad, keys[id(p)] if p.requires_grad else None,
                        id(p) in replicated)
            kinds: list[tuple[bool, Hashable, bool]] = []
            for _, _, p in owners:
                if kind_of(p) not in kinds:
                    kinds.append(kind_of(p))
            kinds.sort(key=lambda kind: not kind[0])   # stable: trainable first
            for trainable, key, whole in kinds:
                mine = [(s, n, p) for s, n, p in owners
                        if kind_of(p) == (trainable, key, whole)]
                seen: dict[int, nn.Parameter] = {}
                for _, _, p in mine:
                    seen.setdefault(id(p), p)
                params = list(seen.values())
                flat = _Flat([(s, n) for s, n, _ in mine], params, self.world, self.rank,
                             trainable, key, replicated=whole)
                flat.index = [next(i for i, q in enumerate(params) if q is p)
                              for _, _, p in mine]
                flats.append(flat)
            for s, n, _ in owners:
                del s._parameters[n]
            for k, flat in enumerate(flats):
                unit.register_parameter(f"_fsdp_shard_{k}", flat.shard)
            if flats or unit is module:   # the root's hooks also cast inputs, save markers
                self.units.append((unit, flats))
                unit.register_forward_pre_hook(self._pre_forward(flats), with_kwargs=True)
                unit.register_forward_hook(self._post_forward(flats))

    # -- collectives ------------------------------------------------------------------

    def _gather(self, flat: _Flat, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``flat``'s whole parameter buffer from every rank's shard, in ``dtype`` (default:
        the policy's compute dtype, what forward and backward use); a replicated flat is
        whole already: a local copy in ``dtype``."""
        shard = flat.shard.detach()
        dtype = dtype or self.policy.param_dtype or shard.dtype
        if flat.replicated:
            return shard.to(dtype, copy=True)
        out = torch.empty(shard.numel() * self.world, dtype=dtype, device=shard.device)
        tdist.all_gather_single(out, shard.to(dtype).contiguous(), group=self.group)
        return out

    # -- hooks ------------------------------------------------------------------------

    def _bind(self, flat: _Flat) -> None:
        if flat.trainable and torch.is_grad_enabled():
            full = _Gather.apply(flat.shard, self, flat)
        else:
            with torch.no_grad():
                full = self._gather(flat)
        flat.full = full
        views = [full[off:off + n].view(shape) for off, n, shape
                 in zip(flat.offsets, flat.numels, flat.shapes, strict=True)]
        for (sub, name), i in zip(flat.owners, flat.index, strict=True):
            setattr(sub, name, views[i])

    def _pre_forward(self, flats: list[_Flat]):
        def hook(module, args, kwargs):
            if module is self.module and self.reshard and torch.is_grad_enabled():
                self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack,
                                                                       self._unpack)
                self._saving.__enter__()
            for flat in flats:
                self._bind(flat)
            if module is self.module and self.policy.param_dtype is not None:
                cast = self._cast
                args = tuple(cast(a) for a in args)
                kwargs = {k: cast(v) for k, v in kwargs.items()}
            return args, kwargs
        return hook

    def _cast(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(self.policy.param_dtype)
        return x

    def _post_forward(self, flats: list[_Flat]):
        def hook(module, args, output):
            if self.reshard:
                for flat in flats:
                    flat.full = None
                if module is self.module and self._saving is not None:
                    self._saving.__exit__(None, None, None)
                    self._saving = None
            return output
        return hook

    # Autograd saves the parameter views it needs for backward (a Linear's weight). Saving
    # them would keep every gathered buffer alive until backward: FSDP's point is not to.
    # So a saved view of a gathered buffer is replaced by a marker, and backward gathers
    # the unit again when it first needs it (freed once the unit's gradient is reduced).
    def _pack(self, t: torch.Tensor) -> Any:
        ptr = t.untyped_storage().data_ptr()
        for _, flats in self.units:
            for flat in flats:
                if flat.full is not None and flat.full.untyped_storage().data_ptr() == ptr:
                    return (_MARK, flat, t.shape, t.stride(), t.storage_offset())
        return t

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not (isinstance(packed, tuple) and len(packed) == 5 and packed[0] is _MARK):
            return packed
        _, flat, shape, stride, offset = packed
        if flat.regathered is None:
            with torch.no_grad():
                flat.regathered = self._gather(flat)
        return flat.regathered.as_strided(shape, stride, offset)

    # -- what users call --------------------------------------------------------------

    def shards(self, key: Hashable = None) -> list[nn.Parameter]:
        """The trainable shards whose parameters ``flat_by`` gave ``key`` (every trainable
        shard when ``flat_by`` was not given), one per unit that has such parameters: the
        ``params`` of a param group."""
        flats = [f for _, fs in self.units for f in fs if f.trainable]
        known = list(dict.fromkeys(f.key for f in flats))
        if key not in known:
            raise ValueError(f"key must be one of the keys flat_by gave, {known}, got {key!r}")
        return [f.shard for f in flats if f.key == key]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside the block keep and sum full gradients locally; the next
        backward outside it reduce-scatters the sum once (DDP's and FSDP's convention)."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """FSDP2's switch: ``False`` is :meth:`no_sync` until switched back."""
        self._sync = check_bool("requires", requires)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: each rank holds a shard of
        every gradient, so the shards' ``norm_type`` powers are summed over the ranks (one
        all-reduce) before every shard is scaled by the same factor. Padding has gradient 0
        and adds nothing. A replicated flat's gradient is the same on every rank: rank 0
        alone counts it. Returns the total norm before clipping."""
        max_norm = check_float("max_norm", max_norm, lo=0, lo_open=True)
        norm_type = check_float("norm_type", norm_type, lo=1)
        flats = [f for _, fs in self.units for f in fs if f.shard.grad is not None]
        grads = [f.shard.grad for f in flats]
        total = torch.zeros((), dtype=torch.float64)
        for f in flats:
            if not f.replicated or self.rank == 0:
                total += f.shard.grad.detach().double().abs().pow(norm_type).sum().cpu()
        tdist.all_reduce(total, group=self.group)
        return _clip_to(grads, total, max_norm, norm_type)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, gathered, under its original name (a collective: call it on every
        rank), plus the buffers: what ``module.state_dict()`` was before sharding."""
        out = {}
        for unit, flats in self.units:
            prefix = next((n for n, m in self.module.named_modules() if m is unit), "")
            for flat in flats:
                # In the shards' own (master) dtype: the policy's param_dtype would round
                # fp32 weights to bf16/fp16 on the way.
                full = self._gather(flat, flat.shard.dtype)
                for (sub, name), i in zip(flat.owners, flat.index, strict=True):
                    sub_name = next(n for n, m in unit.named_modules() if m is sub)
                    key = ".".join(x for x in (prefix, sub_name, name) if x)
                    off, n = flat.offsets[i], flat.numels[i]
                    out.setdefault(key, full[off:off + n].view(flat.shapes[i]).clone())
        for name, b in self.module.named_buffers():
            out[name] = b.detach().clone()
        return out

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: ``shards`` (parameters), ``grads`` (their .grad),
        ``gathered`` (buffers of units between pre- and post-forward), ``pending``."""
        flats = [f for _, fs in self.units for f in fs]

        def size(t):
            return 0 if t is None else t.numel() * t.element_size()
        return {"shards": sum(size(f.shard) for f in flats),
                "grads": sum(size(f.shard.grad) for f in flats),
                "gathered": sum(size(f.full) + size(f.regathered) for f in flats),
                "pending": sum(size(f.pending) for f in flats)}


def _own_modules(unit: nn.Module, units: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """``unit`` and its descendants that no other unit claims (stop at another unit)."""
    others = {id(u) for u in units if u is not unit}
    out, seen, stack = [], set(), [("", unit)]
    while stack:
        name, m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append((name, m))
        for child_name, child in reversed(list(m._modules.items())):
            if child is not None and id(child) not in others:
                stack.append((f"{name}.{child_name}".lstrip("."), child))
    return out


def _default_units(module: nn.Module) -> list[nn.Module]:
    """Each top-level child with parameters; a ModuleList/ModuleDict (never called itself,
    so its hooks would never run) gives its own children instead, as FSDP users shard each
    transformer block."""
    out: list[nn.Module] = []
    todo = list(dict.fromkeys(module.children()))
    while todo:
        child = todo.pop(0)
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            todo[:0] = list(dict.fromkeys(child.children()))
        elif any(True for _ in child.parameters()):
            out.append(child)
    return [*dict.fromkeys(out), module]


def shard_module(module: nn.Module, *, group: Any = None,
                 mp_policy: MixedPrecisionPolicy | None = None,
                 units: Sequence[nn.Module] | None = None,
                 reshard_after_forward: bool = True,
                 flat_by: Callable[[str, nn.Parameter], Hashable] | None = None,
                 replicate: Callable[[str, nn.Parameter], bool] | None = None) -> nn.Module:
    """Shard ``module``'s parameters over ``group`` in place (module docstring) and return
    it; ``module.fsdp`` is its :class:`ShardedModule`. ``flat_by(name, param)``, called once
    per trainable parameter, splits each unit's shard by key, for param groups
    (:meth:`ShardedModule.shards`). ``replicate(name, param)`` (a bool per parameter)
    keeps the parameters it picks whole on every rank, their gradients all-reduced. Every
    rank must pass the same model (same parameter names, shapes, keys and choices, checked
    before the first message)."""
    check_module("module", module)
    check_bool("reshard_after_forward", reshard_after_forward)
    if flat_by is not None:
        check_callable("flat_by", flat_by)
    if replicate is not None:
        check_callable("replicate", replicate)
    policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {mp_policy!r}")
    if hasattr(module, "fsdp"):
        raise ValueError("module is sharded already")
    if not tdist.is_initialized():
        raise RuntimeError("shard_module needs an initialised process group (run the worker "
                           "with parlearn.distributed.run or torchrun)")
    units = _default_units(module) if units is None else list(units)
    inside = set(map(id, module.modules()))
    for i, u in enumerate(units):
        if not isinstance(u, nn.Module) or id(u) not in inside:
            raise ValueError(f"units[{i}] must be a submodule of module, got {type(u).__name__}")
        if isinstance(u, nn.ModuleList | nn.ModuleDict):
            raise ValueError(f"units[{i}] is a {type(u).__name__}, which is never called, so "
                             "its parameters could not be gathered: pass its children")
    if module not in units:
        units.append(module)
    from parlearn.multi_device.data_parallel.ddp import refuse_batch_statistics
    refuse_batch_statistics(module, "shard_module", training_only=True)
    keys: dict[int, Hashable] = {}
    for name, p in module.named_parameters():
        keys[id(p)] = None if flat_by is None or not p.requires_grad else flat_by(name, p)
        try:
            hash(keys[id(p)])
        except TypeError:
            raise TypeError(f"flat_by must return a hashable key, got {keys[id(p)]!r} for "
                            f"{name!r}") from None
    whole: set[int] = set()
    for name, p in module.named_parameters():
        choice = False if replicate is None else replicate(name, p)
        if not isinstance(choice, bool):
            raise TypeError(f"replicate must return a bool, got {choice!r} for {name!r}")
        if choice:
            whole.add(id(p))
    agree({"module (parameter names, shapes, dtypes, requires_grad, flat_by keys, replicated)":
           [(n, tuple(p.shape), str(p.dtype), p.requires_grad, repr(keys[id(p)]),
             id(p) in whole) for n, p in module.named_parameters()]}, group=group)
    module.fsdp = ShardedModule(module, units, group, policy, reshard_after_forward, keys,
                                whole)
    return module
