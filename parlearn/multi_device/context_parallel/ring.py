"""Ring attention from send/recv on real ranks, forward and backward written out (lesson 17).

Each of ``N`` ranks keeps its queries; the key/value blocks travel round the ring
(rank ``r`` sends to ``r+1`` and receives from ``r-1``), so at step ``t`` rank ``r`` holds
the block that started on rank ``r - t``. Forward, per step: start passing the block on,
compute attention of the local queries over the block in hand (:func:`block_attention`),
fold it into the running result with the online-softmax :func:`merge`, then wait for the
next block. ``N`` block computations, ``N - 1`` exchanges, each of which can hide behind a
block computation (Liu, Zaharia & Abbeel 2023; picotron and torchtitan have the same loop).

Backward is a second ring, not autograd over the communication: the K/V blocks travel
again, and with each block travels its gradient accumulator ``(dK, dV)``; every rank adds
its queries' share (:func:`block_backward`, from the final log-sum-exp saved in forward)
and passes both on. After ``N`` steps the accumulators have visited every rank and one
last pass brings each home: ``N - 1`` K/V exchanges and ``N`` gradient exchanges.
Each step must use the block it RECEIVED: a backward that reuses its own first K/V at
every step still returns gradients of the right shape, and its forward is exact, so only
a backward check against full attention catches it (the bug of diffusers#14265; the
regression test applies that mutation to this module).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as tdist

from parlearn.core.checks import check_bool, check_choice, check_int, check_tensor
from parlearn.distributed.agree import agree
from parlearn.multi_device.context_parallel.blocks import (
    LAYOUTS,
    block_attention,
    block_backward,
    check_shard,
    merge,
    shard_chunks,
)

__all__ = ["ring_attention", "RingAttention"]

_KV_TAG, _GRAD_TAG = 17, 18  # two messages in flight between the same pair: keep them apart


class _Pass:
    """One ring hop in flight: this rank's tensor to ``rank + 1``, the previous rank's
    into a fresh buffer of shape ``incoming``; :meth:`wait` returns it and logs the wait."""

    def __init__(self, tensor: torch.Tensor, incoming: tuple[int, ...], tag: int,
                 timeline: list | None, label: str, step: int):
        rank, world = tdist.get_rank(), tdist.get_world_size()
        self.buf = torch.empty(incoming, dtype=tensor.dtype, device=tensor.device)
        self.reqs = [tdist.isend(tensor.contiguous(), (rank + 1) % world, tag=tag),
                     tdist.irecv(self.buf, (rank - 1) % world, tag=tag)]
        self.timeline, self.label, self.step = timeline, label, step

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        for req in self.reqs:
            req.wait()
        if self.timeline is not None:
            self.timeline.append((self.label, self.step, t0, time.perf_counter()))
        return self.buf


def _timed(timeline, label: str, step: int, fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    if timeline is not None:
        timeline.append((label, step, t0, time.perf_counter()))
    return out


def _check_and_agree(q, k, v, seq, layout, causal, timeline) -> None:
    """Every argument of :func:`ring_attention` checked on every rank, then the verdicts
    and what must match exchanged, before the first send (also for a direct
    ``RingAttention.apply``)."""
    if not tdist.is_initialized():
        raise RuntimeError("ring_attention needs an initialised torch.distributed group")
    world = tdist.get_world_size()
    if world < 2:
        raise ValueError(f"ring attention needs world_size >= 2 (a ring), got {world}")
    # Every check runs on every rank and the verdicts are exchanged before the first send:
    # a rank that fails after its neighbours posted their sends would leave them waiting.
    err = None
    try:
        _check_ring_args(q, k, v, seq, layout, causal, timeline, world)
    except (TypeError, ValueError) as e:
        err = e
    agree({"seq": seq, "layout": layout, "causal": causal,
           "q dtype": str(getattr(q, "dtype", None)),
           "k dtype": str(getattr(k, "dtype", None)),
           "v dtype": str(getattr(v, "dtype", None)),
           "q (batch, heads, head_dim)": _bhd(q), "k (batch, heads, head_dim)": _bhd(k)}, err)


class RingAttention(torch.autograd.Function):
    """``apply(q, k, v, seq, layout, causal, timeline)``: see :func:`ring_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, seq, layout, causal, timeline):
        _check_and_agree(q, k, v, seq, layout, causal, timeline)
        rank, world = tdist.get_rank(), tdist.get_world_size()
        chunks = [shard_chunks(seq, world, r, layout) for r in range(world)]
        lengths = [sum(b - a for a, b in c) for c in chunks]
        shape = lambda src: (2, *k.shape[:2], lengths[src], k.shape[-1])  # noqa: E731
        o = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv, src, work = torch.stack((k, v)), rank, 0
        for step in range(world):
            nxt = (src - 1) % world
            hop = (_Pass(kv, shape(nxt), _KV_TAG, timeline, "fwd wait", step)
                   if step < world - 1 else None)
            bo, bl, w = _timed(timeline, "fwd compute", step, block_attention,
                               q, kv[0], kv[1], chunks[rank], chunks[src], causal)
            o, lse = merge(o, lse, bo, bl)
            work += w
            if hop is not None:
                kv, src = hop.wait(), nxt
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.seq, ctx.layout, ctx.causal, ctx.timeline = seq, layout, causal, timeline
        if timeline is not None:
            timeline.append(("work", work, 0.0, 0.0))
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        rank, world = tdist.get_rank(), tdist.get_world_size()
        chunks = [shard_chunks(ctx.seq, world, r, ctx.layout) for r in range(world)]
        lengths = [sum(b - a for a, b in c) for c in chunks]
        shape = lambda src: (2, *k.shape[:2], lengths[src], k.shape[-1])  # noqa: E731
        do = do.contiguous()
        delta = (do * o).sum(-1)
        dq = torch.zeros_like(q)
        kv, src, tl = torch.stack((k, v)), rank, ctx.timeline
        dkv = torch.zeros(shape(rank), dtype=k.dtype, device=k.device)
        for step in range(world):
            nxt = (src - 1) % world
            hop = (_Pass(kv, shape(nxt), _KV_TAG, tl, "bwd wait", step)
                   if step < world - 1 else None)
            bq, bk, bv = _timed(tl, "bwd compute", step, block_backward, q, kv[0], kv[1], do,
                                lse, delta, chunks[rank], chunks[src], ctx.causal)
            dq += bq
            # The block's gradient travels on with it; the last hop brings it home.
            grads = _Pass(dkv + torch.stack((bk, bv)), shape(nxt), _GRAD_TAG, tl,
                          "bwd grad wait", step)
            if hop is not None:
                kv = hop.wait()
            dkv, src = grads.wait(), nxt
        return dq, dkv[0], dkv[1], None, None, None, None


def _bhd(t) -> tuple | None:
    return (*t.shape[:2], t.shape[-1]) if isinstance(t, torch.Tensor) and t.dim() == 4 else None


def _check_ring_args(q, k, v, seq, layout, causal, timeline, world: int) -> None:
    seq = check_int("seq", seq, lo=1)
    check_choice("layout", layout, LAYOUTS)
    check_bool("causal", causal)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=4, floating=True)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must have one dtype, got q {q.dtype}, k {k.dtype}, "
                        f"v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, "
                         f"v {v.device}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_shard(name, t, seq, world, tdist.get_rank(), layout)
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must "
                         f"agree on (batch, heads, ., head_dim)")
    if timeline is not None and not isinstance(timeline, list):
        raise TypeError(f"timeline must be a list or None, got {type(timeline).__name__}")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq: int,
                   layout: str = "contiguous", causal: bool = False,
                   timeline: list | None = None) -> torch.Tensor:
    """This rank's share of attention over a sequence of ``seq`` tokens split over the
    group's ranks by ``layout`` (see :func:`shard_chunks`): ``q, k, v`` are this rank's
    shards ``(batch, heads, shard_len, head_dim)``; returns this rank's output rows.
    Differentiable (the backward is the ring of the module docstring). ``timeline``, when a
    list, receives ``(label, step, t0, t1)`` for every block computation and every wait
    (``perf_counter`` seconds), and ``("work", entries, 0, 0)`` with the score entries
    this rank computed. Needs an initialised group of at least 2 ranks."""
    return RingAttention.apply(q, k, v, seq, layout, causal, timeline)
