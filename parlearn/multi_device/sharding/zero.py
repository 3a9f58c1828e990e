"""ZeRO stages 0-3 from scratch: :class:`ShardedAdam` on ``torch.distributed`` collectives.

:class:`ShardedAdam` implements stage 0 (plain DP, the baseline) and stages 1-3 from
scratch on ``torch.distributed`` collectives. A *unit* (FSDP's word) is a module whose own
parameters are laid end to end in one flat buffer padded to a multiple of N
(:class:`FlatShard`); rank r owns elements ``[r*S, (r+1)*S)`` with ``S = padded/N``.
:func:`adam_update` is the elementwise Adam step it runs on a shard, the same operations as
``torch.optim.Adam``, and :func:`storage_bytes` what a rank really holds.
``ShardedAdam`` itself uses whatever device the model is on (it has been checked on
CPU/gloo only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist
from torch import nn

from parlearn.core.checks import (
    check_choice,
    check_float,
    check_int,
    check_module,
    check_tensor,
)

__all__ = ["STAGES", "FlatShard", "adam_update", "storage_bytes", "ShardedAdam"]


STAGES = (0, 1, 2, 3)
"""0 = plain data parallel (replicated Adam), 1 = optimizer state sharded (weight-update
sharding), 2 = + gradients sharded, 3 = + parameters sharded (FSDP)."""


# ---------------------------------------------------------------------------------------------
# The flat padded buffer and the Adam update
# ---------------------------------------------------------------------------------------------

class FlatShard:
    """Tensors of ``shapes`` laid end to end in one flat buffer, padded to a multiple of N.

    ``numel`` is the real element count, ``padded = ceil(numel / N) * N``, every rank owns
    ``shard_numel = padded / N`` consecutive elements, rank r the range ``[lo, hi)``. The
    padding (at most N-1 zeros, at the end) is sent and updated like real elements, and
    :meth:`views` never exposes it.
    """

    def __init__(self, shapes: Sequence[torch.Size], world_size: int, rank: int) -> None:
        self.world_size = check_int("world_size", world_size, lo=1)
        self.rank = check_int("rank", rank, lo=0, hi=world_size - 1)
        if isinstance(shapes, str) or not isinstance(shapes, Sequence) or not shapes:
            raise TypeError(f"shapes must be a non-empty sequence of shapes, got {shapes!r}")
        self.shapes = []
        for i, shape in enumerate(shapes):
            if isinstance(shape, str) or not isinstance(shape, Sequence):
                raise TypeError(f"shapes[{i}] must be a shape, got {shape!r}")
            self.shapes.append(torch.Size(check_int(f"shapes[{i}]", d, lo=0) for d in shape))
        self.numels = [s.numel() for s in self.shapes]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)
        self.padded = math.ceil(self.numel / world_size) * world_size
        self.shard_numel = self.padded // world_size
        self.lo = rank * self.shard_numel
        self.hi = self.lo + self.shard_numel

    @property
    def padding(self) -> int:
        return self.padded - self.numel

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """A new padded flat buffer holding ``tensors`` (zeros in the padding)."""
        flat = tensors[0].new_zeros(self.padded)
        for t, off, n in zip(tensors, self.offsets, self.numels, strict=True):
            flat[off:off + n].copy_(t.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like the original tensors (the padding left out)."""
        return [flat[off:off + n].view(shape)
                for off, n, shape in zip(self.offsets, self.numels, self.shapes, strict=True)]

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice ``flat[lo:hi]`` (a view)."""
        return flat[self.lo:self.hi]


def adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step: int, *, lr: float, betas: tuple[float, float],
                eps: float) -> None:
    """One Adam step in place (Kingma & Ba, Alg. 1), elementwise, on any slice of a model.

    The same operations in the same order as ``torch.optim.Adam`` (``foreach=False``), so a
    shard updated here equals the same elements updated by torch on the whole tensor:
    ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``,
    ``p -= lr / (1-b1^t) * m / (sqrt(v) / sqrt(1-b2^t) + eps)``.
    """
    param = check_tensor("param", param, floating=True)
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        check_tensor(name, t, shape=tuple(param.shape), dtype=param.dtype)
    check_int("step", step, lo=1)
    lr = check_float("lr", lr, lo=0)
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise TypeError(f"betas must be a pair of floats, got {betas!r}")
    beta1 = check_float("betas[0]", betas[0], lo=0, hi=1, hi_open=True)
    beta2 = check_float("betas[1]", betas[1], lo=0, hi=1, hi_open=True)
    eps = check_float("eps", eps, lo=0)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def storage_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors``, each storage counted once.

    What a rank really holds: a view costs nothing extra, a storage resized to 0 (a freed
    stage-3 parameter) counts 0. DTensors are measured by their local shard.
    """
    if isinstance(tensors, str | torch.Tensor) or not hasattr(tensors, "__iter__"):
        raise TypeError(f"tensors must be an iterable of tensors (None skipped), got "
                        f"{type(tensors).__name__}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if t is not None and not isinstance(t, torch.Tensor) and not hasattr(t, "to_local"):
            raise TypeError(f"tensors[{i}] must be a tensor or None, got {type(t).__name__}")
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        s = t.untyped_storage()
        seen[s.data_ptr() if s.nbytes() else id(s)] = s.nbytes()
    return sum(seen.values())


# ---------------------------------------------------------------------------------------------
# Sharded data-parallel Adam, stages 0-3, from scratch
# ---------------------------------------------------------------------------------------------

@dataclass
class _Unit:
    """One module's parameters as a flat padded buffer, with this rank's shards."""

    module: nn.Module
    params: list[nn.Parameter]
    layout: FlatShard
    flat_param: torch.Tensor                 # full padded parameters (freed in stage 3)
    exp_avg: torch.Tensor                    # Adam moments: full (stage 0) or our shard
    exp_avg_sq: torch.Tensor
    flat_grad: torch.Tensor | None = None    # stages 0-1: full padded gradient, persistent
    grad_shard: torch.Tensor | None = None   # averaged gradient of our shard (kept in
                                             # stages 2-3, for one step in stage 1)
    param_shard: torch.Tensor | None = None  # stage 3: our shard of the parameters
    ready: int = 0                           # parameters whose gradient has landed
    reduced: bool = False                    # stages 2-3: gradient reduce-scattered this step
    hooks: list = field(default_factory=list)


class ShardedAdam:
    """Data-parallel Adam on ``model`` with the update sharded over the ranks of ``group``.

    Use it like an optimizer, with each rank feeding its own slice of the batch::

        opt = ShardedAdam(model, stage=2, lr=1e-2)
        opt.zero_grad(); loss_fn(model(x_local), y_local).backward(); opt.step()

    Stage 0: all-reduce the gradients, every rank updates everything (plain DP).
    Stage 1: reduce-scatter the gradients, Adam on this rank's shard, all-gather the
    parameters (Xu et al.'s weight-update sharding; ZeRO-1 holds the same state).
    Stage 2: as stage 1, but each unit's gradient is reduce-scattered from a hook the moment
    it is complete and the full gradient is dropped: only the shard is kept (ZeRO-2).
    Stage 3: parameters live as shards; a forward pre-hook all-gathers a unit's parameters,
    a forward hook frees them and hooks the unit's output, whose gradient arriving in
    backward gathers them again; the gradient hook frees them after the reduce-scatter
    (ZeRO-3 / FSDP). Freeing resizes the storage to 0 (what FSDP1 does), so the references
    autograd saved in forward see the re-gathered values in backward.

    Gradients are averaged over ranks (SUM then /N), as DDP does: with equal local batch
    sizes and a mean loss, the update equals single-process Adam on the whole batch.
    Stages 2-3 take exactly one backward per step, through every unit (a second backward,
    or a step without one, raises ``RuntimeError``: no gradient accumulation). In stage 3
    the model's parameters are only materialised inside its forward and backward; read them
    with :meth:`full_parameters`.
    Units are the modules that own parameters directly, each one flat padded buffer.
    Frozen parameters (``requires_grad=False``) belong to no unit: every rank keeps them
    whole, with no gradient and no Adam state. A tied parameter belongs to the first module
    holding it. The model's initial parameters must be equal on every rank (its names,
    shapes and dtypes are checked to agree, a ``ValueError`` on every rank otherwise). A
    model with BatchNorm is refused: its statistics of each rank's shard would not equal
    the whole batch's.
    """

    def __init__(self, model: nn.Module, *, stage: int, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 group=None) -> None:
        self.model = check_module("model", model)
        self.stage = check_choice("stage", stage, STAGES)
        self.lr = check_float("lr", lr, lo=0, lo_open=True)
        if (not isinstance(betas, tuple) or len(betas) != 2):
            raise TypeError(f"betas must be a tuple of two floats, got {betas!r}")
        self.betas = (check_float("betas[0]", betas[0], lo=0, hi=1, hi_open=True),
                      check_float("betas[1]", betas[1], lo=0, hi=1, hi_open=True))
        self.eps = check_float("eps", eps, lo=0)
        from parlearn.multi_device.data_parallel.ddp import (
            check_same_on_every_rank,
            refuse_batch_statistics,
        )

        refuse_batch_statistics(model, "ShardedAdam")
        if not tdist.is_initialized():
            raise RuntimeError("ShardedAdam needs an initialised process group: run it inside "
                               "parlearn.distributed.run(...) or under torchrun")
        check_same_on_every_rank(model, group, "ShardedAdam")
        self.group = group
        self.world_size = tdist.get_world_size(group)
        self.rank = tdist.get_rank(group)
        self.steps = 0
        # A parameter belongs to the first module that holds it (the order of
        # model.parameters()): a tied weight is one tensor, trained once. Frozen parameters
        # (requires_grad=False) join no unit: they stay as they are, replicated, never
        # hooked, updated or given a gradient buffer.
        self.units: list[_Unit] = []
        owner: dict[int, _Unit] = {}
        for m in model.modules():
            own = [p for p in m.parameters(recurse=False) if id(p) not in owner]
            trainable = [p for p in own if p.requires_grad]
            if trainable:
                unit = self._make_unit(m, trainable)
                self.units.append(unit)
                owner.update((id(p), unit) for p in trainable)
            if self.stage == 3:
                # A module computing with a weight another module's unit owns (tied) must
                # see it materialised too.
                borrowed = {id(owner[id(p)]): owner[id(p)] for p in m.parameters(recurse=False)
                            if id(p) in owner and owner[id(p)].module is not m}
                for unit in borrowed.values():
                    self._hook_forward(m, unit)
        if not self.units:
            raise ValueError("model has no parameters that require grad")

    # -- set-up --------------------------------------------------------------------------
    def _make_unit(self, module: nn.Module, params: list[nn.Parameter]) -> _Unit:
        layout = FlatShard([p.shape for p in params], self.world_size, self.rank)
        with torch.no_grad():
            flat = layout.flatten([p.detach() for p in params])
        for p, view in zip(params, layout.views(flat), strict=True):
            p.data = view                       # the module now computes with the flat buffer
        full_state = self.stage == 0
        moments = flat if full_state else layout.shard(flat)
        unit = _Unit(module, params, layout, flat, torch.zeros_like(moments),
                     torch.zeros_like(moments))
        if self.stage <= 1:
            unit.flat_grad = torch.zeros_like(flat)
            for p, g in zip(params, layout.views(unit.flat_grad), strict=True):
                p.grad = g                      # autograd accumulates into the flat buffer
        if self.stage >= 2:
            unit.grad_shard = torch.zeros_like(layout.shard(flat))
            for p in params:
                unit.hooks.append(p.register_post_accumulate_grad_hook(
                    lambda _p, u=unit: self._on_grad(u)))
        if self.stage == 3:
            unit.param_shard = layout.shard(flat).clone()
            self._free(unit)
            self._hook_forward(module, unit)
        return unit

    def _hook_forward(self, module: nn.Module, unit: _Unit) -> None:
        """Stage 3: gather ``unit`` before ``module``'s forward, free it after."""
        unit.hooks += [
            module.register_forward_pre_hook(lambda *_, u=unit: self._gather(u)),
            module.register_forward_hook(
                lambda _m, _i, out, u=unit: self._after_forward(u, out)),
        ]

    # -- the collectives -------------------------------------------------------------------
    def _gather(self, unit: _Unit) -> None:
        """Stage 3: materialise the unit's full parameters from every rank's shard."""
        unit.flat_param.untyped_storage().resize_(unit.layout.padded
                                                  * unit.flat_param.element_size())
        tdist.all_gather_single(unit.flat_param, unit.param_shard, group=self.group)

    def _after_forward(self, unit: _Unit, output: torch.Tensor) -> None:
        """Stage 3: free the parameters; gather them again when backward reaches this unit."""
        self._free(unit)
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"stage 3 needs units that return one tensor, "
                            f"{type(unit.module).__name__} returned {type(output).__name__}")
        if output.requires_grad:
            # The gradient of the output arrives just before the unit's own backward runs.
            output.register_hook(lambda _grad: self._gather(unit))

    @staticmethod
    def _free(unit: _Unit) -> None:
        unit.flat_param.untyped_storage().resize_(0)

    def _reduce_scatter(self, unit: _Unit, flat_grad: torch.Tensor) -> None:
        tdist.reduce_scatter_single(unit.grad_shard, flat_grad, group=self.group)
        unit.grad_shard.div_(self.world_size)

    def _on_grad(self, unit: _Unit) -> None:
        """Stages 2-3: once every parameter of the unit has its gradient, keep only our shard."""
        unit.ready += 1
        if unit.ready < len(unit.params):
            return
        unit.ready = 0
        if unit.reduced:
            # A second backward would overwrite the shard, not add to it: refuse, not corrupt.
            raise RuntimeError(f"stage {self.stage}: a second backward before step(); gradient "
                               "accumulation is not supported here (call step() after each "
                               "backward, or use stage 0 or 1)")
        unit.reduced = True
        with torch.no_grad():
            flat_grad = unit.layout.flatten([p.grad for p in unit.params])
        for p in unit.params:
            p.grad = None
        self._reduce_scatter(unit, flat_grad)
        if self.stage == 3:
            self._free(unit)

    # -- the optimizer interface -------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the gradient buffers this stage keeps (stages 2-3 keep none between steps)."""
        for unit in self.units:
            if unit.flat_grad is not None:
                unit.flat_grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients over ranks and update, as the stage prescribes."""
        self.steps += 1
        adam = dict(lr=self.lr, betas=self.betas, eps=self.eps)
        for unit in self.units:
            if self.stage >= 2 and not unit.reduced:
                # Its shard still holds the last step's gradient: refuse to apply it again.
                raise RuntimeError(f"stage {self.stage}: step() without a complete backward "
                                   f"for unit {type(unit.module).__name__} (every unit must "
                                   "take part in the loss)")
            unit.reduced = False
            if self.stage == 0:
                tdist.all_reduce(unit.flat_grad, group=self.group)
                unit.flat_grad.div_(self.world_size)
                adam_update(unit.flat_param, unit.flat_grad, unit.exp_avg, unit.exp_avg_sq,
                            self.steps, **adam)
                continue
            if self.stage == 1:
                # ZeRO-1 keeps the full gradient; the reduced shard lives for this step only.
                unit.grad_shard = torch.empty_like(unit.layout.shard(unit.flat_grad))
                self._reduce_scatter(unit, unit.flat_grad)
            shard = unit.param_shard if self.stage == 3 else unit.layout.shard(unit.flat_param)
            adam_update(shard, unit.grad_shard, unit.exp_avg, unit.exp_avg_sq, self.steps,
                        **adam)
            if self.stage <= 2:
                tdist.all_gather_single(unit.flat_param, shard.clone(), group=self.group)
            if self.stage == 1:
                unit.grad_shard = None

    # -- inspection ----------------------------------------------------------------------
    @torch.no_grad()
    def full_parameters(self) -> torch.Tensor:
        """All parameters in ``model.parameters()`` order (frozen ones included, a tied one
        once), as one flat copy, like ``parameters_to_vector`` (collective in stage 3)."""
        by_param = {id(p): u for u in self.units for p in u.params}
        parts, held = [], None
        for p in self.model.parameters():
            unit = by_param.get(id(p))          # None: frozen, held whole on every rank
            if self.stage == 3 and unit is not None and unit is not held:
                if held is not None:
                    self._free(held)
                self._gather(unit)              # one unit materialised at a time
                held = unit
            parts.append(p.detach().reshape(-1).clone())   # a view of the flat buffer
        if held is not None:
            self._free(held)
        return torch.cat(parts)

    # -- checkpoints ------------------------------------------------------------------------
    def _names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def state_dict(self) -> dict:
        """The Adam state as whole tensors, keyed by parameter name, so it can be loaded on
        any number of ranks: ``{"step": n, "state": {name: {"exp_avg": t, "exp_avg_sq":
        t}}}`` (trainable parameters only; a tied one once, under its first name). Stages
        1-3 all-gather each unit's moment shards over the group: call it on every rank."""
        names, state = self._names(), {}
        for unit in self.units:
            moments = []
            for shard in (unit.exp_avg, unit.exp_avg_sq):
                if self.stage == 0:
                    full = shard
                else:
                    full = shard.new_empty(unit.layout.padded)
                    tdist.all_gather_single(full, shard.contiguous(), group=self.group)
                moments.append(unit.layout.views(full))
            for p, m, v in zip(unit.params, *moments, strict=True):
                state[names[id(p)]] = {"exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        return {"step": self.steps, "state": state}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` returned (from any number of ranks, any stage): each
        rank keeps its own shard of the moments. Refuses, before changing anything, a
        state that misses or adds a parameter, or has the wrong shape or dtype."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"step", "state"}:
            raise TypeError("state_dict must be a dict with keys 'step' and 'state', as "
                            "ShardedAdam.state_dict() returns")
        step = check_int("state_dict['step']", state_dict["step"], lo=0)
        state, names = state_dict["state"], self._names()
        want = {names[id(p)]: p for u in self.units for p in u.params}
        if not isinstance(state, dict) or set(state) != set(want):
            got = set(state) if isinstance(state, dict) else set()
            raise ValueError(f"state_dict['state'] must hold exactly the trainable parameters "
                             f"{sorted(want)}; missing {sorted(set(want) - got)}, extra "
                             f"{sorted(got - set(want))}")
        for name, p in want.items():
            entry = state[name]
            if not isinstance(entry, dict) or set(entry) != {"exp_avg", "exp_avg_sq"}:
                raise ValueError(f"state_dict['state'][{name!r}] must hold 'exp_avg' and "
                                 "'exp_avg_sq'")
            for key in ("exp_avg", "exp_avg_sq"):
                check_tensor(f"state_dict['state'][{name!r}][{key!r}]", entry[key],
                             shape=tuple(p.shape), dtype=p.dtype)
        for unit in self.units:
            for key, mine in (("exp_avg", unit.exp_avg), ("exp_avg_sq", unit.exp_avg_sq)):
                full = unit.layout.flatten([state[names[id(p)]][key] for p in unit.params])
                mine.copy_(full if self.stage == 0 else unit.layout.shard(full))
        self.steps = step

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds right now
        (frozen parameters included: every rank holds them whole)."""
        units = self.units
        mine = {id(p) for u in units for p in u.params}
        frozen = [p for p in self.model.parameters() if id(p) not in mine]
        params = [u.flat_param for u in units] + [u.param_shard for u in units] + frozen
        grads = ([u.flat_grad for u in units] + [u.grad_shard for u in units]
                 + [p.grad for u in units for p in u.params if self.stage >= 2])
        optim = [u.exp_avg for u in units] + [u.exp_avg_sq for u in units]
        out = {"params": storage_bytes(params), "grads": storage_bytes(grads),
               "optimizer": storage_bytes(optim)}
        out["total"] = sum(out.values())
        return out

    def state_numel(self) -> int:
        """Elements of Adam state (both moments) this rank holds."""
        return sum(u.exp_avg.numel() + u.exp_avg_sq.numel() for u in self.units)

    @property
    def padded_numel(self) -> int:
        """Parameters including each unit's padding: what every buffer is sized by."""
        return sum(u.layout.padded for u in self.units)

    def remove_hooks(self) -> None:
        for unit in self.units:
            for h in unit.hooks:
                h.remove()
            unit.hooks.clear()
