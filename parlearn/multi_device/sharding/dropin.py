"""One training recipe, unchanged, under every drop-in wrapper: :func:`dropin_check`.

The recipe is what a torch user writes: AdamW with weight decay on matrices only (norms and
biases excluded, two param groups), gradient accumulation over micro-batches, clipping by the
global gradient norm, and a warm-up then cosine learning-rate schedule. It runs on a small
MLP with a LayerNorm (so the param groups matter), in float64:

- ``"one process"``: the whole global batch in one backward, the reference;
- ``"ddp"``: :class:`parlearn.data_parallel.BucketedDP`, micro-batches accumulated inside
  ``no_sync()`` and the last one synchronised (DDP's convention);
- ``"zero1"``, ``"zero2"``: :class:`ShardedOptimizer` around ``torch.optim.AdamW``;
- ``"torch zero"``: torch's ``ZeroRedundancyOptimizer`` (gradients averaged by hand, as
  under DDP);
- ``"fsdp"``: :func:`shard_module` with ``flat_by`` splitting matrices from vectors.

Every rank sees ``micro_batches`` micro-batches of its slice of the same global batch, so
global batch = micro-batch x accumulation steps x ranks, and every variant equals the one-process
run to round-off. Each also reports what a rank holds (measured on the live objects) beside
what the ZeRO model says it should.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as tdist
from torch import nn

from parlearn.core.checks import check_choice, check_float, check_int
from parlearn.core.recipe import Recipe

__all__ = ["VARIANTS", "dropin_check", "recipe_worker"]

VARIANTS = ("ddp", "zero1", "zero2", "torch zero", "fsdp")
LR = 3e-3
RECIPE = Recipe(weight_decay=0.1, clip=0.5, warmup=2, betas=(0.9, 0.999))


def _model(seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32),
                          nn.GELU(), nn.Linear(32, 4)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model


def _batches(steps: int, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + 1)
    return [(torch.randn(batch, 12, generator=g, dtype=torch.float64),
             torch.randn(batch, 4, generator=g, dtype=torch.float64)) for _ in range(steps)]


def _one_process(steps: int, batch: int, seed: int) -> list[dict[str, torch.Tensor]]:
    model = _model(seed)
    opt = torch.optim.AdamW(RECIPE.param_groups(model.parameters()), lr=LR,
                            betas=RECIPE.betas)
    sched = RECIPE.scheduler(opt, steps)
    out = []
    for x, y in _batches(steps, batch, seed):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE.clip)
        opt.step()
        sched.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def recipe_worker(rank: int, world_size: int, variant: str, steps: int, batch: int,
                  micro_batches: int, seed: int) -> dict:
    """Worker: the recipe under ``variant`` on this rank; the full parameters after each step
    and what this rank holds (elements of parameters, gradients, optimizer state) after the
    last one."""
    from parlearn.multi_device.data_parallel.ddp import BucketedDP
    from parlearn.multi_device.sharding.fsdp import shard_module
    from parlearn.multi_device.sharding.optimizer import ShardedOptimizer

    _check(variant, steps, batch, micro_batches, seed, world_size)
    model = _model(seed)
    groups, kw = RECIPE.param_groups(model.parameters()), {"lr": LR, "betas": RECIPE.betas}
    if variant == "ddp":
        wrapped = BucketedDP(model, bucket_bytes=2**12, record=False)
        opt = torch.optim.AdamW(groups, **kw)
    elif variant in ("zero1", "zero2"):
        wrapped = model
        opt = ShardedOptimizer(groups, torch.optim.AdamW, stage=int(variant[-1]), **kw)
    elif variant == "torch zero":
        import warnings

        with warnings.catch_warnings():   # importing torch.distributed.optim warns about
            warnings.simplefilter("ignore", DeprecationWarning)   # TorchScript in torch 2.13
            from torch.distributed.optim import ZeroRedundancyOptimizer
        wrapped = model
        opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **kw)
    else:
        wrapped = shard_module(model, flat_by=lambda name, p: "decay" if p.dim() >= 2
                               else "none")
        opt = torch.optim.AdamW([{"params": model.fsdp.shards("decay"),
                                  "weight_decay": RECIPE.weight_decay},
                                 {"params": model.fsdp.shards("none"), "weight_decay": 0.0}],
                                **kw)
    sched = RECIPE.scheduler(opt, steps)
    local, out = batch // world_size, {"params": []}
    micro = local // micro_batches
    for x, y in _batches(steps, batch, seed):
        opt.zero_grad()
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        for m in range(micro_batches):
            part = slice(m * micro, (m + 1) * micro)
            last = m == micro_batches - 1
            sync = wrapped.no_sync() if variant == "ddp" and not last else contextlib.nullcontext()
            with sync:
                loss = nn.functional.mse_loss(wrapped(x[part]), y[part]) / micro_batches
                loss.backward()
        if variant == "fsdp":
            model.fsdp.clip_grad_norm_(RECIPE.clip)
        elif variant in ("zero1", "zero2"):
            opt.reduce_gradients()
            opt.clip_grad_norm_(RECIPE.clip)
        else:
            if variant == "torch zero":   # no wrapper averaged the gradients: do it here
                for p in model.parameters():
                    tdist.all_reduce(p.grad)
                    p.grad.div_(world_size)
            torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE.clip)  # grads replicated
        opt.step()
        sched.step()
        out["params"].append(model.fsdp.full_state_dict() if variant == "fsdp" else
                             {n: p.detach().clone() for n, p in model.named_parameters()})
    params = list(model.parameters())
    inner = opt.optim if variant in ("zero1", "zero2", "torch zero") else opt
    out["held"] = {
        "params": sum(p.numel() for p in params),
        "grads": sum(p.grad.numel() for p in params if p.grad is not None),
        "state": sum(v.numel() for s in inner.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)}
    return out


def _check(variant, steps, batch, micro_batches, seed, world_size) -> None:
    check_choice("variant", variant, VARIANTS)
    check_int("steps", steps, lo=1)
    check_int("batch", batch, lo=1)
    check_int("micro_batches", micro_batches, lo=1)
    check_int("seed", seed, lo=0)
    if batch % (world_size * micro_batches):
        raise ValueError(f"batch={batch} must split into world_size={world_size} ranks of "
                         f"micro_batches={micro_batches} equal micro-batches")


def dropin_check(world_size: int = 2, *, variants=VARIANTS, steps: int = 4, batch: int = 16,
                 micro_batches: int = 2, seed: int = 0, timeout: float = 60) -> dict:
    """Run the recipe under each of ``variants`` on ``world_size`` gloo ranks and once in one
    process on the whole batch. Returns ``{variant: {"diff": max |parameter - one process|
    over steps and ranks, "held": [per rank {"params", "grads", "state"} elements]}}`` and
    ``"n_params"``."""
    from parlearn.distributed import run

    world_size = check_int("world_size", world_size, lo=1)
    check_float("timeout", timeout, lo=0, lo_open=True)
    if isinstance(variants, str) or not list(variants):
        raise ValueError(f"variants must be a non-empty list of {list(VARIANTS)}, got "
                         f"{variants!r}")
    for i, v in enumerate(variants):
        check_choice(f"variants[{i}]", v, VARIANTS)
        _check(v, steps, batch, micro_batches, seed, world_size)
    reference = _one_process(steps, batch, seed)
    out: dict = {"n_params": sum(t.numel() for t in reference[0].values())}
    for variant in variants:
        ranks = run(recipe_worker, world_size, backend="gloo", timeout=timeout,
                    args=(variant, steps, batch, micro_batches, seed))
        diff = max((got[n] - want[n]).abs().max().item() for r in ranks
                   for got, want in zip(r["params"], reference, strict=True) for n in want)
        out[variant] = {"diff": diff, "held": [r["held"] for r in ranks]}
    return out
