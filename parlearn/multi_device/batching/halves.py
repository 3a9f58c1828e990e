"""The two half-batch gradients: in one process, and on two sub-groups of real ranks.

:func:`half_gradients` is the serial reference: the mean gradients over the first and the
second half of a batch, computed as the ranks do. On real ranks each half all-reduces on
its own process group (:func:`half_groups`) and partners in the two halves exchange their
half's mean, so every rank holds both (:func:`worker_half_gradients`);
:func:`probe_bytes` models what that costs on the wire against one plain all-reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as tdist
from torch import nn

from parlearn.core.checks import check_callable, check_int, check_module, check_tensor

__all__ = ["half_gradients", "half_groups", "worker_half_gradients", "probe_bytes"]


# ---------------------------------------------------------------------------------------
# The two half-batch gradients: in one process, and on two sub-groups of real ranks.

def _flat_grad(params: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


def _mean_grad(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor,
               accum: int) -> torch.Tensor:
    """Gradient of the mean loss over ``x`` as ``accum`` equal micro-batches."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]   # the caller's .grad is put back afterwards
    try:
        for p in params:
            p.grad = None
        for xm, ym in zip(x.chunk(accum), y.chunk(accum), strict=True):
            (loss_fn(model(xm), ym) / accum).backward()
        return _flat_grad(params).detach().clone()
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g


def half_gradients(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, *,
                   world_size: int = 2, accum: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Serial reference: the mean gradients over the first and the second half of the
    batch, each half computed as the ranks do (``world_size / 2`` shards of ``accum``
    micro-batches, averaged). Returns flat vectors; ``model``'s ``.grad`` is left as it was."""
    check_module("model", model)
    check_callable("loss_fn", loss_fn)
    world_size = _check_world(world_size)
    accum = check_int("accum", accum, lo=1)
    n = _check_batch(x, y, world_size, accum)
    per = n // world_size
    shards = [_mean_grad(model, loss_fn, x[r * per:(r + 1) * per], y[r * per:(r + 1) * per],
                         accum) for r in range(world_size)]
    h = world_size // 2
    return sum(shards[:h]) / h, sum(shards[h:]) / h


def _check_world(world_size: int) -> int:
    world_size = check_int("world_size", world_size, lo=2)
    if world_size % 2:
        raise ValueError(f"world_size must be even (two halves), got {world_size}")
    return world_size


def _check_batch(x: torch.Tensor, y: torch.Tensor, world_size: int, accum: int) -> int:
    """The batch size of ``x, y``: finite tensors with the same first dimension, which splits
    into ``world_size`` shards of ``accum`` equal micro-batches (none silently shorter)."""
    check_tensor("x", x, finite=True)
    check_tensor("y", y, finite=True)
    if x.dim() == 0 or y.dim() == 0:
        raise ValueError(f"x and y need a batch dimension, got shapes {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")
    n = x.shape[0]
    if y.shape[0] != n:
        raise ValueError(f"x and y must hold the same number of examples, got shapes "
                         f"{tuple(x.shape)} and {tuple(y.shape)}")
    if n == 0 or n % (world_size * accum):
        raise ValueError(f"x's batch of {n} does not split into world_size={world_size} "
                         f"ranks x accum={accum} equal micro-batches")
    return n


def _layout(world_size: int) -> tuple[list[int], list[int], list[int]]:
    """The ranks of half a, of half b, and each rank's partner in the other half (same
    position): the probe's plan, which the ranks follow and :func:`draw_probe` draws."""
    h = _check_world(world_size) // 2
    return (list(range(h)), list(range(h, world_size)),
            [(r + h) % world_size for r in range(world_size)])


def half_groups(world_size: int) -> tuple[object, object, int]:
    """Inside a worker: the process groups of ranks ``[0, W/2)`` and ``[W/2, W)``, and
    which half (0 or 1) this rank is in. Every rank calls ``new_group`` for both, in the
    same order, as torch.distributed requires."""
    world_size = _check_world(world_size)
    if not tdist.is_initialized():
        raise RuntimeError("half_groups runs inside a worker: no process group is initialised "
                           "(run it with parlearn.distributed.run)")
    if world_size != tdist.get_world_size():
        raise ValueError(f"world_size={world_size} differs from the process group's "
                         f"{tdist.get_world_size()} ranks")
    ranks_a, ranks_b, _ = _layout(world_size)
    groups = (tdist.new_group(ranks_a), tdist.new_group(ranks_b))
    half = int(tdist.get_rank() in ranks_b)
    return groups[0], groups[1], half


class _HalfProbe:
    """A rank's side of the two-half probe: :class:`parlearn.data_parallel.BucketedDP` on
    its half's group (accumulation under ``no_sync``) leaves the half mean in ``.grad``;
    one exchange with the partner rank in the other half (same position) gives both
    halves to both, bitwise the same on every rank, so every rank takes the same decisions."""

    def __init__(self, model: nn.Module, world_size: int, bucket_bytes: int = 2**20) -> None:
        from parlearn.multi_device.data_parallel import BucketedDP

        self.world_size = _check_world(world_size)
        g0, g1, self.half = half_groups(world_size)
        self.rank = tdist.get_rank()
        self.partner = _layout(world_size)[2][self.rank]
        self.dp = BucketedDP(model, bucket_bytes=bucket_bytes,
                             group=(g0, g1)[self.half], record=False)
        self.params = [p for p in model.parameters() if p.requires_grad]

    def halves(self, loss_fn, x: torch.Tensor, y: torch.Tensor, accum: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shard of the batch ``x, y`` (the full batch, same on every rank)
        -> ``(a, b)``, the two halves' mean gradients."""
        from parlearn.multi_device.data_parallel import shard

        xs, ys = shard(x, self.rank, self.world_size), shard(y, self.rank, self.world_size)
        for p in self.params:
            p.grad = None
        for j, (xm, ym) in enumerate(zip(xs.chunk(accum), ys.chunk(accum), strict=True)):
            ctx = self.dp.no_sync() if j < accum - 1 else contextlib.nullcontext()
            with ctx:
                (loss_fn(self.dp(xm), ym) / accum).backward()
        mine = _flat_grad(self.params).detach().clone()
        theirs = torch.empty_like(mine)
        ops = [tdist.P2POp(tdist.isend, mine, self.partner),
               tdist.P2POp(tdist.irecv, theirs, self.partner)]
        for w in tdist.batch_isend_irecv(ops):
            w.wait()
        return (mine, theirs) if self.half == 0 else (theirs, mine)


def worker_half_gradients(rank: int, world_size: int, model: nn.Module, x: torch.Tensor,
                          y: torch.Tensor, accum: int = 1) -> dict:
    """A :func:`parlearn.distributed.run` worker: the two halves' mean gradients of a
    cross-entropy loss over the batch ``x, y`` on real ranks (two sub-groups, then the
    partner exchange), and the payload bytes the ledger saw by kind of collective."""
    from parlearn.distributed import ledger

    # Every argument is checked before the sub-groups are built (the first message):
    # dist.run hands every rank the same ones, so every rank refuses alike.
    world_size = _check_world(world_size)
    check_int("rank", rank, lo=0, hi=world_size - 1)
    check_module("model", model)
    accum = check_int("accum", accum, lo=1)
    _check_batch(x, y, world_size, accum)
    probe = _HalfProbe(model, world_size)
    with ledger() as led:
        a, b = probe.halves(nn.functional.cross_entropy, x, y, accum)
    return {"a": a, "b": b, "bytes": {k: v[1] for k, v in led.summary().items()}}


def probe_bytes(n_params: int, world_size: int, element_size: int = 4) -> dict:
    """Modeled wire bytes per rank per step: the two-half probe (ring all-reduce within a
    half of ``W/2`` ranks, ``2 (W/2 - 1)/(W/2) n``, plus ``n`` to the partner) against one
    plain ring all-reduce over all ``W`` ranks (``2 (W-1)/W n``); ``n`` in bytes."""
    n = check_int("n_params", n_params, lo=1) * check_int("element_size", element_size, lo=1)
    w = _check_world(world_size)
    h = w // 2
    probe = 2 * (h - 1) / h * n + n
    plain = 2 * (w - 1) / w * n
    return {"probe": probe, "plain": plain, "ratio": probe / plain}
