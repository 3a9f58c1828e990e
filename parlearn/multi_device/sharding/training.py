"""What to train, the single-process reference, and the from-scratch stages on real ranks.

:class:`Spec` says what to train (an :func:`mlp` on :func:`regression_data`);
:func:`train_serial` is the single-process ``torch.optim.Adam`` reference every stage
equals step by step; :func:`train_sharded`, :func:`measure_memory` and :func:`step_times`
run :class:`parlearn.multi_device.sharding.zero.ShardedAdam` on real ranks; the bench rows
are at the end.

Workers run under :func:`parlearn.distributed.run` (or ``torchrun``: each worker only needs an
initialised process group). The runners here put CPU tensors on gloo ranks, also on a
machine with GPUs. float64 is used where exactness is the point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from parlearn.core.checks import (
    check_bool,
    check_choice,
    check_device,
    check_float,
    check_int,
    check_ints,
    check_seed,
)
from parlearn.multi_device.sharding.cost import memory_model
from parlearn.multi_device.sharding.zero import STAGES, ShardedAdam

__all__ = ["mlp", "regression_data", "Spec", "train_serial", "train_sharded",
           "measure_memory", "step_times", "bench"]


# ---------------------------------------------------------------------------------------------
# A model and data to train, the serial reference, and the workers
# ---------------------------------------------------------------------------------------------

def _check_dtype(dtype) -> torch.dtype:
    return check_choice("dtype", dtype, (torch.float32, torch.float64))


def mlp(sizes: Sequence[int], *, seed: int | torch.Generator = 0,
        dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """Linear-tanh-...-Linear with ``sizes`` (in, hidden..., out), initialised from ``seed``.

    Built on the meta device and filled from its own generator, so the global RNG is
    untouched and every rank building it from the same seed gets the same model.
    """
    sizes = check_ints("sizes", sizes, lo=1, min_len=2)   # (in, out) at least
    _check_dtype(dtype)
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
    check_int("n_in", n_in, lo=1)
    check_int("n_out", n_out, lo=1)
    _check_dtype(dtype)
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


def check_spec(spec) -> Spec:
    """``spec`` if it is a :class:`Spec` (its fields are checked when it is built)."""
    if not isinstance(spec, Spec):
        raise TypeError(f"spec must be a Spec, got {type(spec).__name__}")
    return spec


def train_serial(spec: Spec, world_size: int) -> dict:
    """The reference: one process, ``torch.optim.Adam`` on the whole global batch.

    Returns ``{"params": [flat parameters after each step], "losses": [...]}``; entry 0
    of ``params`` is the initial model.
    """
    check_spec(spec)
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
    from parlearn import distributed as dist

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
    bytes)`` of every collective the step issued, from :func:`parlearn.distributed.ledger`),
    ``held`` (per step, :meth:`ShardedAdam.held_bytes` after the step), ``state_numel``,
    ``padded_numel`` and ``n_params``.
    """
    from parlearn import distributed as dist

    check_spec(spec)
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
    from parlearn import distributed as dist

    check_spec(spec)
    check_int("world_size", world_size, lo=1)
    return dist.run(_worker_memory, world_size, args=(spec,), backend="gloo", timeout=timeout)


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
    from parlearn import distributed as dist

    check_spec(spec)
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
    from parlearn.core.timing import UNRELIABLE

    check_device("device", device)   # checked, then unused: see the docstring
    check_bool("quick", quick)
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
                        + ("" if res["reliable"] else f"; WARNING: {UNRELIABLE}")))
    return rows
