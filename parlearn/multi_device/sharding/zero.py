"""Sharding the optimizer, the gradients and the parameters: weight-update sharding and ZeRO.

Plain data parallelism keeps N replicas of everything: each rank all-reduces the gradient
and then runs the same Adam update on the same full parameter vector, holding its own copy
of Adam's two moment buffers. Xu et al. (arXiv 2004.13336) observe that an all-reduce *is*
a reduce-scatter followed by an all-gather, and move the update in between:

    reduce-scatter(grad)   ->  rank r holds the summed gradient of its 1/N shard
    Adam on that shard     ->  1/N of the FLOPs and 1/N of the moment buffers
    all-gather(params)     ->  every rank has the full updated parameters again

The bytes on the wire are the same as the all-reduce's. ZeRO (Rajbhandari et al., arXiv
1910.02054) names the stages by what is sharded: stage 1 the optimizer state, stage 2 also
the gradients (each rank keeps only the gradient shard it updates), stage 3 also the
parameters (each layer's parameters are all-gathered just before its forward and again
before its backward, and freed right after). FSDP is stage 3.

:class:`ShardedAdam` implements stage 0 (plain DP, the baseline) and stages 1-3 from
scratch on ``torch.distributed`` collectives. A *unit* (FSDP's word) is a module whose own
parameters are laid end to end in one flat buffer padded to a multiple of N
(:class:`FlatShard`); rank r owns elements ``[r*S, (r+1)*S)`` with ``S = padded/N``.
:func:`train_serial` is the single-process ``torch.optim.Adam`` reference every stage
equals step by step; :func:`train_engine` runs the real engines,
``ZeroRedundancyOptimizer`` (stage 1) and FSDP2 ``fully_shard`` (stage 3).
:func:`memory_model` is the bytes-per-parameter calculator of the Ultra-Scale Playbook and
of the ZeRO paper; :func:`comm_model` the bytes each stage sends; :func:`jax_sharded_adam`
the same update in JAX with an explicit ``psum_scatter`` on a mesh of fake CPU devices.

Workers run under :func:`parlearn.dist.run` (or ``torchrun``: each worker only needs an
initialised process group). The runners here put CPU tensors on gloo ranks, also on a
machine with GPUs; ``ShardedAdam`` itself uses whatever device the model is on (it has been
checked on CPU/gloo only). float64 is used where exactness is the point.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist
from torch import nn

from parlearn.core.checks import check_choice, check_float, check_int, check_module, check_seed

__all__ = ["STAGES", "PRECISIONS", "FlatShard", "adam_update", "ShardedAdam", "mlp",
           "regression_data", "storage_bytes", "Spec", "train_serial", "train_sharded",
           "measure_memory", "ledger_wire_bytes",
           "train_engine", "memory_model", "comm_model", "gpus_needed", "draw_stages", "step_times",
           "jax_sharded_adam",
           "jax_sharded_adam_subprocess", "bench"]

STAGES = (0, 1, 2, 3)
"""0 = plain data parallel (replicated Adam), 1 = optimizer state sharded (weight-update
sharding), 2 = + gradients sharded, 3 = + parameters sharded (FSDP)."""

# Bytes per parameter held for (parameters, gradients, optimizer state) with Adam.
# "bf16-mixed" is the ZeRO paper's mixed precision: bf16/fp16 parameters and gradients,
# and an fp32 master copy plus fp32 Adam moments in the optimizer (K = 12).
PRECISIONS: dict[str, tuple[int, int, int]] = {
    "fp64": (8, 8, 16),
    "fp32": (4, 4, 8),
    "bf16-mixed": (2, 2, 12),
}


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
        self.shapes = [torch.Size(s) for s in shapes]
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
    beta1, beta2 = betas
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
    The model's initial parameters must be equal on every rank.
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
        if not tdist.is_initialized():
            raise RuntimeError("ShardedAdam needs an initialised process group: run it inside "
                               "parlearn.dist.run(...) or under torchrun")
        self.group = group
        self.world_size = tdist.get_world_size(group)
        self.rank = tdist.get_rank(group)
        self.steps = 0
        self.units = [self._make_unit(m) for m in model.modules()
                      if any(True for _ in m.parameters(recurse=False))]
        if not self.units:
            raise ValueError("model has no parameters")

    # -- set-up --------------------------------------------------------------------------
    def _make_unit(self, module: nn.Module) -> _Unit:
        params = list(module.parameters(recurse=False))
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
            unit.hooks += [
                module.register_forward_pre_hook(lambda *_, u=unit: self._gather(u)),
                module.register_forward_hook(
                    lambda _m, _i, out, u=unit: self._after_forward(u, out)),
            ]
        return unit

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
        """All parameters in model order, unpadded, as one flat copy (collective in stage 3)."""
        parts = []
        for unit in self.units:
            if self.stage == 3:
                self._gather(unit)
            parts.append(unit.flat_param[:unit.layout.numel].clone())
            if self.stage == 3:
                self._free(unit)
        return torch.cat(parts)

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds right now."""
        units = self.units
        params = [u.flat_param for u in units] + [u.param_shard for u in units]
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


# ---------------------------------------------------------------------------------------------
# A model and data to train, the serial reference, and the workers
# ---------------------------------------------------------------------------------------------

def mlp(sizes: Sequence[int], *, seed: int | torch.Generator = 0,
        dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """Linear-tanh-...-Linear with ``sizes`` (in, hidden..., out), initialised from ``seed``.

    Built on the meta device and filled from its own generator, so the global RNG is
    untouched and every rank building it from the same seed gets the same model.
    """
    sizes = [check_int(f"sizes[{i}]", s, lo=1) for i, s in enumerate(sizes)]
    if len(sizes) < 2:
        raise ValueError(f"sizes must have at least 2 entries (in, out), got {sizes}")
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(
        check_seed("seed", seed))
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b, device="meta", dtype=dtype))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    model = nn.Sequential(*layers).to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else p.shape[0]
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) / math.sqrt(fan_in))
    return model


def regression_data(n: int, n_in: int, n_out: int, *, seed: int = 0,
                    dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` inputs and noisy targets of a fixed random smooth map, from ``seed``."""
    check_int("n", n, lo=1)
    gen = torch.Generator().manual_seed(check_seed("seed", seed))
    x = torch.randn(n, n_in, generator=gen, dtype=dtype)
    w = torch.randn(n_in, n_out, generator=gen, dtype=dtype) / math.sqrt(n_in)
    y = torch.sin(x @ w) + 0.05 * torch.randn(n, n_out, generator=gen, dtype=dtype)
    return x, y


@dataclass(frozen=True)
class Spec:
    """What to train: an :func:`mlp` of ``sizes`` on ``batch`` examples per rank."""

    sizes: tuple[int, ...] = (8, 16, 4)
    steps: int = 3
    batch: int = 4
    lr: float = 1e-2
    seed: int = 0
    dtype: torch.dtype = torch.float64

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) < 2:
            raise ValueError(f"sizes must have at least 2 entries, got {self.sizes}")
        for i, s in enumerate(self.sizes):
            check_int(f"sizes[{i}]", s, lo=1)
        check_int("steps", self.steps, lo=1)
        check_int("batch", self.batch, lo=1)
        check_float("lr", self.lr, lo=0, lo_open=True)
        check_seed("seed", self.seed)
        check_choice("dtype", self.dtype, (torch.float32, torch.float64))

    def data(self, world_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: ``world_size * batch`` examples."""
        return regression_data(world_size * self.batch, self.sizes[0], self.sizes[-1],
                               seed=self.seed * 1000 + step + 1, dtype=self.dtype)

    def model(self) -> nn.Sequential:
        return mlp(self.sizes, seed=self.seed, dtype=self.dtype)

    @property
    def n_params(self) -> int:
        return sum(a * b + b for a, b in zip(self.sizes[:-1], self.sizes[1:], strict=True))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def train_serial(spec: Spec, world_size: int) -> dict:
    """The reference: one process, ``torch.optim.Adam`` on the whole global batch.

    Returns ``{"params": [flat parameters after each step], "losses": [...]}``; entry 0
    of ``params`` is the initial model.
    """
    check_int("world_size", world_size, lo=1)
    model = spec.model()
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr, foreach=False)
    params = [nn.utils.parameters_to_vector(model.parameters()).detach().clone()]
    losses = []
    for step in range(spec.steps):
        x, y = spec.data(world_size, step)
        opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        params.append(nn.utils.parameters_to_vector(model.parameters()).detach().clone())
    return {"params": params, "losses": losses}


def _local_batch(spec: Spec, rank: int, world_size: int, step: int):
    x, y = spec.data(world_size, step)
    sl = slice(rank * spec.batch, (rank + 1) * spec.batch)
    return x[sl], y[sl]


def _worker_train(rank: int, world_size: int, spec: Spec, stage: int) -> dict:
    """One rank of :func:`train_sharded`: params, loss, bytes sent and bytes held per step."""
    from parlearn import dist

    model = spec.model()
    opt = ShardedAdam(model, stage=stage, lr=spec.lr)
    out: dict = {"params": [opt.full_parameters()], "losses": [], "records": [], "held": [],
                 "state_numel": opt.state_numel(), "padded_numel": opt.padded_numel,
                 "n_params": spec.n_params}
    for step in range(spec.steps):
        x, y = _local_batch(spec, rank, world_size, step)
        with dist.ledger() as led:
            opt.zero_grad()
            loss = _loss(model, x, y)
            loss.backward()
            opt.step()
        out["losses"].append(loss.item())
        out["records"].append([(r.kind, r.bytes) for r in led.records])
        out["held"].append(opt.held_bytes())
        out["params"].append(opt.full_parameters())
    opt.remove_hooks()
    return out


def _worker_misuse(rank: int, world_size: int, spec: Spec, stage: int,
                   backwards: int) -> None:
    """``backwards`` backward passes, then one step: what stages 2-3 must refuse unless 1."""
    model = spec.model()
    opt = ShardedAdam(model, stage=stage, lr=spec.lr)
    x, y = _local_batch(spec, rank, world_size, 0)
    for _ in range(backwards):
        opt.zero_grad()
        _loss(model, x, y).backward()
    opt.step()


def train_sharded(spec: Spec, stage: int, world_size: int = 2, *, timeout: float = 60) -> list:
    """Train ``spec`` with :class:`ShardedAdam` at ``stage`` on ``world_size`` real ranks.

    Returns one dict per rank: ``params`` (full flat parameters, initial then after each
    step), ``losses`` (the rank's local loss), ``records`` (per step, the ``(kind, payload
    bytes)`` of every collective the step issued, from :func:`parlearn.dist.ledger`),
    ``held`` (per step, :meth:`ShardedAdam.held_bytes` after the step), ``state_numel``,
    ``padded_numel`` and ``n_params``.
    """
    from parlearn import dist

    check_choice("stage", stage, STAGES)
    check_int("world_size", world_size, lo=1)
    return dist.run(_worker_train, world_size, args=(spec, stage), backend="gloo",
                    timeout=timeout)


def _worker_memory(rank: int, world_size: int, spec: Spec) -> dict:
    """Bytes held by each stage after one training step on this rank."""
    out = {}
    for stage in STAGES:
        model = spec.model()
        opt = ShardedAdam(model, stage=stage, lr=spec.lr)
        x, y = _local_batch(spec, rank, world_size, 0)
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
        out[stage] = opt.held_bytes()
        out["padded_numel"] = opt.padded_numel
        opt.remove_hooks()
    return out


def measure_memory(spec: Spec, world_size: int = 2, *, timeout: float = 60) -> list[dict]:
    """Bytes of parameters, gradients and Adam state held per rank after one step, by stage.

    One dict per rank: ``{stage: {"params", "grads", "optimizer", "total"}, "padded_numel"}``,
    measured with :func:`storage_bytes` on what :class:`ShardedAdam` keeps between steps.
    """
    from parlearn import dist

    check_int("world_size", world_size, lo=1)
    return dist.run(_worker_memory, world_size, args=(spec,), backend="gloo", timeout=timeout)


def _worker_engine(rank: int, world_size: int, spec: Spec, engine: str) -> dict:
    """One rank of :func:`train_engine`."""
    model = spec.model()
    if engine == "zero":
        with warnings.catch_warnings():
            # torch's own package import jit-scripts its functional optimizers (torch 2.13).
            warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated",
                                    DeprecationWarning)
            from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                      lr=spec.lr, foreach=False)

        def flat() -> torch.Tensor:
            return nn.utils.parameters_to_vector(model.parameters()).detach().clone()

        def state_numel() -> int:
            return sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel()
                       for s in opt.optim.state.values())
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        net = fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=spec.lr, foreach=False)

        def flat() -> torch.Tensor:
            return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]).detach()

        def state_numel() -> int:
            return sum(s["exp_avg"].to_local().numel() + s["exp_avg_sq"].to_local().numel()
                       for s in opt.state.values())
    from parlearn import dist

    out: dict = {"params": [flat()], "losses": [], "records": []}
    for step in range(spec.steps):
        x, y = _local_batch(spec, rank, world_size, step)
        with dist.ledger() as led:
            opt.zero_grad()
            loss = _loss(net, x, y)
            loss.backward()
            opt.step()
        out["losses"].append(loss.item())
        out["records"].append([(r.kind, r.bytes) for r in led.records])
        out["params"].append(flat())
    grads = [p.grad for p in model.parameters()]
    moments = [t for s in (opt.optim.state if engine == "zero" else opt.state).values()
               for k, t in s.items() if k != "step"]
    out["held"] = {"params": storage_bytes(list(model.parameters())),
                   "grads": storage_bytes(grads), "optimizer": storage_bytes(moments)}
    out["state_numel"] = state_numel()
    return out


def train_engine(spec: Spec, engine: str, world_size: int = 2, *, timeout: float = 60) -> list:
    """Train ``spec`` with a real engine on ``world_size`` ranks, one dict per rank.

    ``engine="zero"``: DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer`` around
    Adam (stage 1; it assigns whole tensors to ranks, so shards are uneven).
    ``engine="fsdp2"``: ``fully_shard`` on every layer and the root over
    ``init_device_mesh("cpu", (world_size,))`` (stage 3), with plain ``torch.optim.Adam``
    on the sharded DTensor parameters. Keys: ``params``, ``losses``, ``records`` (per step,
    the collectives the ledger saw: FSDP2's all-gathers and reduce-scatters go through
    ``torch.distributed``'s Python API, DDP's gradient all-reduce runs in C++ and is not
    seen), ``held`` (bytes after the last step; Adam's step counters left out) and
    ``state_numel``.
    """
    from parlearn import dist

    check_choice("engine", engine, ("zero", "fsdp2"))
    check_int("world_size", world_size, lo=1)
    return dist.run(_worker_engine, world_size, args=(spec, engine), backend="gloo",
                    timeout=timeout)


# ---------------------------------------------------------------------------------------------
# The memory and communication models
# ---------------------------------------------------------------------------------------------

def memory_model(n_params: int, world_size: int, stage: int,
                 precision: str = "bf16-mixed") -> dict[str, float]:
    """Modeled bytes per rank of parameters, gradients and Adam state (no activations).

    With ``(p, g, k)`` bytes per parameter from :data:`PRECISIONS` and ``Psi`` parameters
    (ZeRO paper, Fig. 1; Ultra-Scale Playbook, "ZeRO"):
    stage 0: ``(p + g + k) Psi``; stage 1: ``(p + g) Psi + k Psi / N``;
    stage 2: ``p Psi + (g + k) Psi / N``; stage 3: ``(p + g + k) Psi / N``.
    Returns ``{"params", "grads", "optimizer", "total"}`` in bytes.
    """
    check_int("n_params", n_params, lo=0)
    n = check_int("world_size", world_size, lo=1)
    check_choice("stage", stage, STAGES)
    p, g, k = PRECISIONS[check_choice("precision", precision, tuple(PRECISIONS))]
    out = {"params": p * n_params / (n if stage >= 3 else 1),
           "grads": g * n_params / (n if stage >= 2 else 1),
           "optimizer": k * n_params / (n if stage >= 1 else 1)}
    out["total"] = sum(out.values())
    return out


def comm_model(n_params: int, world_size: int, stage: int,
               bytes_per_element: int = 2) -> dict[str, float]:
    """Modeled bytes each rank sends per step in a ring, by collective.

    A ring all-reduce of ``B`` bytes sends ``2 (N-1)/N B`` per rank; reduce-scatter and
    all-gather ``(N-1)/N B`` each. Stage 0 all-reduces the gradient; stages 1-2 reduce-scatter
    it and all-gather the parameters (the same total); stage 3 all-gathers the parameters
    twice (forward and backward) and reduce-scatters the gradient: 1.5x (ZeRO paper, Sec. 7).
    """
    check_int("n_params", n_params, lo=0)
    n = check_int("world_size", world_size, lo=1)
    check_choice("stage", stage, STAGES)
    b = check_int("bytes_per_element", bytes_per_element, lo=1) * n_params * (n - 1) / n
    if stage == 0:
        return {"all_reduce": 2 * b, "total": 2 * b}
    gathers = 2 if stage == 3 else 1
    return {"reduce_scatter": b, "all_gather": gathers * b, "total": (1 + gathers) * b}


def gpus_needed(n_params: int, gpu_bytes: float, stage: int,
                precision: str = "bf16-mixed", *, max_gpus: int = 1 << 20) -> int | None:
    """The fewest ranks at which :func:`memory_model` fits in ``gpu_bytes`` (None: never)."""
    check_float("gpu_bytes", gpu_bytes, lo=0, lo_open=True)
    for n in range(1, check_int("max_gpus", max_gpus, lo=1) + 1):
        if memory_model(n_params, n, stage, precision)["total"] <= gpu_bytes:
            return n
        if stage == 0:
            return None          # nothing is sharded: more ranks never help
    return None


def ledger_wire_bytes(records: Sequence[tuple[str, int]], world_size: int) -> float:
    """Ring bytes sent per rank for ``(kind, payload)`` records (:func:`dist.ring_bytes`)."""
    from parlearn import dist

    return sum(dist.ring_bytes(kind, nbytes, world_size) for kind, nbytes in records)


def draw_stages(axes, world_size: int = 4) -> None:
    """Draw what each rank holds in stages 0-3: one panel per stage, one row per rank.

    Each row has three boxes (parameters, gradients, Adam state) of widths 2 : 2 : 12 (the
    ZeRO paper's bf16-mixed bytes per parameter); the filled part is what this rank keeps,
    split into N slices so the shard it owns shows where it sits.
    """
    from matplotlib.patches import Rectangle

    n = check_int("world_size", world_size, lo=1)
    if len(axes) != len(STAGES):
        raise ValueError(f"axes must hold {len(STAGES)} axes, one per stage, got {len(axes)}")
    widths = PRECISIONS["bf16-mixed"]
    colors = ("C0", "C1", "C2")
    names = ("params", "grads", "Adam state")
    for stage, ax in zip(STAGES, axes, strict=True):
        sharded = (stage >= 3, stage >= 2, stage >= 1)
        for r in range(n):
            x = 0.0
            for w, c, full in zip(widths, colors, (not s for s in sharded), strict=True):
                ax.add_patch(Rectangle((x, r), w, 0.8, fill=False, edgecolor="gray"))
                lo, width = (x, w) if full else (x + w * r / n, w / n)
                ax.add_patch(Rectangle((lo, r), width, 0.8, color=c, alpha=0.8))
                x += w + 0.5
        ax.set(xlim=(0, sum(widths) + 1.5), ylim=(n, -0.2), xticks=[], yticks=
               [r + 0.4 for r in range(n)], yticklabels=[f"rank {r}" for r in range(n)])
        total = memory_model(1, n, stage)["total"]
        ax.set_title(f"stage {stage}: {total:.3g} B/param per rank (N={n})", fontsize=10)
    for w, c, name in zip(widths, colors, names, strict=True):
        axes[-1].bar(0, 0, color=c, label=f"{name} ({w} B/param)")
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize="small")


# ---------------------------------------------------------------------------------------------
# JAX: the same update with an explicit psum_scatter on a mesh
# ---------------------------------------------------------------------------------------------

def jax_sharded_adam(n_devices: int = 8, *, n_in: int = 13, n_out: int = 3, batch: int = 4,
                     steps: int = 3, lr: float = 1e-2, seed: int = 0) -> dict:
    """Weight-update sharding in JAX on ``n_devices`` devices, against the unsharded update.

    A linear model ``y = x W`` with ``W`` flattened and padded to a multiple of N. Inside
    ``jax.shard_map`` each device takes the gradient of its own batch slice, the gradients
    are ``psum_scatter``-ed (each device gets the sum of its 1/N slice), Adam runs on the
    slice, and ``all_gather`` rebuilds ``W``. The reference is one unsharded Adam step on
    the whole batch. Needs ``n_devices`` JAX devices (on CPU: ``JAX_NUM_CPU_DEVICES`` set
    before JAX starts, see :func:`jax_sharded_adam_subprocess`). Runs in float64 mode.

    Returns ``{"max_abs_diff", "n_devices", "numel", "padded", "collectives": {op: count},
    "hlo_shapes": {op: [shape text, ...]}}`` from the compiled HLO of one sharded step.
    """
    check_int("n_devices", n_devices, lo=1)
    for name, v in (("n_in", n_in), ("n_out", n_out), ("batch", batch), ("steps", steps)):
        check_int(name, v, lo=1)
    check_float("lr", lr, lo=0, lo_open=True)
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    if jax.device_count() < n_devices:
        raise RuntimeError(f"JAX has {jax.device_count()} device(s), need {n_devices}: set "
                           f"JAX_NUM_CPU_DEVICES={n_devices} before JAX starts, or call "
                           "jax_sharded_adam_subprocess")
    mesh = jax.make_mesh((n_devices,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n_devices])
    numel = n_in * n_out
    padded = math.ceil(numel / n_devices) * n_devices
    b1, b2, eps = 0.9, 0.999, 1e-8

    def loss(flat_w, x, y):
        w = flat_w[:numel].reshape(n_in, n_out)
        return jnp.mean((x @ w - y) ** 2)

    def adam(p, g, m, v, t):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr / (1 - b1 ** t) * m / (jnp.sqrt(v) / jnp.sqrt(1 - b2 ** t) + eps)
        return p, m, v

    def sharded_step(w, m, v, x, y, t):
        # w replicated (padded); m, v: this device's 1/N slice; x, y: this device's batch.
        g = jax.grad(loss)(w, x, y)            # the local gradient: check_vma=False, no psum
        g = jax.lax.psum_scatter(g, "d", scatter_dimension=0, tiled=True) / n_devices
        i = jax.lax.axis_index("d")
        w_mine = jax.lax.dynamic_slice_in_dim(w, i * (padded // n_devices), padded // n_devices)
        w_mine, m, v = adam(w_mine, g, m, v, t)
        return jax.lax.all_gather(w_mine, "d", tiled=True), m, v

    step = jax.jit(jax.shard_map(sharded_step, mesh=mesh,
                                 in_specs=(P(), P("d"), P("d"), P("d"), P("d"), P()),
                                 out_specs=(P(), P("d"), P("d")), check_vma=False))

    @jax.jit
    def full_step(w, m, v, x, y, t):
        return adam(w, jax.grad(loss)(w, x, y), m, v, t)

    key = jax.random.PRNGKey(seed)
    kw, kx, ky = jax.random.split(key, 3)
    w0 = jnp.zeros(padded).at[:numel].set(jax.random.normal(kw, (numel,)))
    ws, wf = w0, w0
    ms = vs = mf = vf = jnp.zeros(padded)
    x_all = jax.random.normal(kx, (steps, n_devices * batch, n_in))
    y_all = jax.random.normal(ky, (steps, n_devices * batch, n_out))
    # Compile once: the executable that runs the steps is the one whose HLO is counted.
    compiled = step.lower(ws, ms, vs, x_all[0], y_all[0], jnp.float64(1)).compile()
    diff, moved = 0.0, 0.0
    for t in range(1, steps + 1):
        x, y = x_all[t - 1], y_all[t - 1]
        ws_new, ms, vs = compiled(ws, ms, vs, x, y, jnp.float64(t))
        wf_new, mf, vf = full_step(wf, mf, vf, x, y, jnp.float64(t))
        moved = max(moved, float(jnp.max(jnp.abs(wf_new - wf))))
        ws, wf = ws_new, wf_new
        diff = max(diff, float(jnp.max(jnp.abs(ws - wf))))
    counts, shapes = _hlo_collectives(compiled.as_text())
    return {"max_abs_diff": diff, "max_update": moved, "n_devices": n_devices, "numel": numel,
            "padded": padded, "collectives": counts, "hlo_shapes": shapes}


_HLO_OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")


def _hlo_collectives(hlo: str) -> tuple[dict[str, int], dict[str, list[str]]]:
    """Count the collective instructions of compiled HLO text, with their result shapes."""
    counts = {op: 0 for op in _HLO_OPS}
    shapes: dict[str, list[str]] = {op: [] for op in _HLO_OPS}
    for line in hlo.splitlines():
        if "=" not in line:
            continue
        lhs, rhs = line.split("=", 1)
        rhs = rhs.strip()
        for op in _HLO_OPS:
            # "%x = f64[13]{0} reduce-scatter(...)" or the async "-start" form; "-done" is the
            # same collective's second half and is not counted again.
            head = rhs.split("(", 1)[0]
            if head.endswith(f" {op}") or head.endswith(f" {op}-start"):
                counts[op] += 1
                shapes[op].append(head.rsplit(" ", 1)[0])
    return counts, shapes


def jax_sharded_adam_subprocess(n_devices: int = 8, *, timeout: float = 120, **kwargs) -> dict:
    """:func:`jax_sharded_adam` in a fresh Python with ``JAX_NUM_CPU_DEVICES=n_devices``.

    The device count is fixed when JAX starts, so a notebook or test where JAX may already
    run asks a child process (about 2-5 s of start-up).
    """
    import json

    check_int("n_devices", n_devices, lo=1)
    check_float("timeout", timeout, lo=0, lo_open=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(n_devices), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    code = ("import json, sys; from parlearn.sharding import jax_sharded_adam; "
            "print(json.dumps(jax_sharded_adam(**json.loads(sys.argv[1]))))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps({"n_devices": n_devices,
                                                                   **kwargs})],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the JAX child process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# Bench
# ---------------------------------------------------------------------------------------------

def _quartiles(times: Sequence[float]) -> tuple[float, float]:
    import statistics

    if len(times) < 2:
        return times[0], times[0]
    q = statistics.quantiles(sorted(times), n=4, method="inclusive")
    return q[0], q[2]


def _worker_bench(rank: int, world_size: int, spec: Spec, repeat: int) -> dict:
    """Interleaved step times of stages 0-3 on the same rank, and bytes held by each."""
    from parlearn.core.timing import compare

    opts, closures = {}, {}
    for stage in STAGES:
        model = spec.model()
        opt = ShardedAdam(model, stage=stage, lr=spec.lr)
        x, y = _local_batch(spec, rank, world_size, 0)

        def one_step(model=model, opt=opt, x=x, y=y) -> None:
            opt.zero_grad()
            _loss(model, x, y).backward()
            opt.step()
        opts[stage], closures[f"stage {stage}"] = opt, one_step
    cmp = compare(closures, warmup=1, repeat=repeat)
    return {"times": {k: t.median for k, t in cmp.timings.items()},
            "quartiles": {k: _quartiles(t.times) for k, t in cmp.timings.items()},
            "reliable": cmp.reliable,
            "held": {s: o.held_bytes() for s, o in opts.items()},
            "padded_numel": opts[1].padded_numel}


def step_times(spec: Spec, world_size: int = 2, *, repeat: int = 5,
               timeout: float = 120) -> dict:
    """Median seconds per training step of stages 0-3, measured interleaved on real ranks.

    Rank 0's :func:`parlearn.timing.compare` of one step of each stage (same model, same
    local batch, one intra-op thread): ``times`` (medians), ``quartiles`` (first and third,
    seconds), ``reliable``, and ``held`` (the bytes each stage holds) with ``padded_numel``.
    """
    from parlearn import dist

    check_int("world_size", world_size, lo=1)
    check_int("repeat", repeat, lo=1)
    return dist.run(_worker_bench, world_size, args=(spec, repeat), backend="gloo",
                    timeout=timeout)[0]


def bench(device: torch.device, quick: bool) -> list:
    """Memory per rank by stage (measured vs :func:`memory_model`), step time vs plain DP.

    2 gloo ranks on CPU whatever ``device`` is (the collectives are the point here).
    Step-time ratios are plain DP time / stage time, measured interleaved on each rank.
    """
    from parlearn.core.bench import Row

    spec = Spec(sizes=(64, 256, 256, 16) if quick else (256, 1024, 1024, 64), batch=16,
                dtype=torch.float32)
    world = 2
    res = step_times(spec, world, repeat=3 if quick else 10, timeout=300)
    rows = []
    for stage in STAGES[1:]:
        held = res["held"][stage]["total"]
        model = memory_model(res["padded_numel"], world, stage, "fp32")["total"]
        ratio = res["times"]["stage 0"] / res["times"][f"stage {stage}"]
        rows.append(Row(f"sharding stage {stage}, {spec.n_params} params, N={world}",
                        "plain DP step (stage 0)", f"ZeRO-{stage} step", ratio, "cpu (gloo)",
                        "memory measured == modeled", held == model,
                        f"held {held / 2**20:.2f} MiB per rank measured, {model / 2**20:.2f} "
                        f"MiB modeled (fp32, padded); plain DP holds "
                        f"{res['held'][0]['total'] / 2**20:.2f} MiB"
                        + ("" if res["reliable"] else "; timing unreliable (busy cores)")))
    return rows

