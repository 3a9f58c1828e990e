"""DeepSpeed-Ulysses: swap a sequence split for a head split around attention (lesson 17).

Before attention every rank holds a slice of the sequence for all ``H`` heads. One
all-to-all turns that into the WHOLE sequence for ``H / N`` heads (rank ``j`` receives
head group ``j`` from every rank), attention runs locally and unchanged per head, and a
second all-to-all turns the output back into a sequence slice (Jacobs et al. 2023).
Heads are independent, so nothing else needs to move; the price is that the degree ``N``
can be no larger than the number of heads, and must divide it.

Per rank, forward sends ``q, k, v`` once (``3 b H (S/N) d`` elements) and the output once
(``b H (S/N) d``); backward mirrors it. Under a pairwise all-to-all a rank keeps ``1/N``
of what it sends, so its wire bytes are ``(N-1)/N`` of these payloads: unlike ring
attention, the volume per rank falls as ``N`` grows (at fixed ``S``).

The all-to-all here is an autograd function whose backward is the reverse all-to-all, so
autograd differentiates the local attention; the sequence may split unevenly (one
``all_to_all_single`` with uneven splits).
"""

from __future__ import annotations

import torch
import torch.distributed as tdist

from parlearn.core.checks import check_bool, check_choice, check_int, check_tensor
from parlearn.distributed.agree import _unrecorded, agree
from parlearn.multi_device.context_parallel.blocks import LAYOUTS, check_shard, shard_index

__all__ = ["AllToAll", "ulysses_attention"]


class AllToAll(torch.autograd.Function):
    """``AllToAll.apply(x, split_dim, send_sizes, cat_dim, recv_sizes)``: split ``x`` along
    ``split_dim`` into ``send_sizes`` (part ``j`` to rank ``j``), concatenate what arrives
    along ``cat_dim`` (``recv_sizes[i]`` from rank ``i``). Backward is the same exchange
    reversed."""

    @staticmethod
    def forward(ctx, x, split_dim, send_sizes, cat_dim, recv_sizes):
        _check_exchange(x, split_dim, send_sizes, cat_dim, recv_sizes)
        ctx.args = (split_dim, send_sizes, cat_dim, recv_sizes)
        return _exchange(x, split_dim, send_sizes, cat_dim, recv_sizes)

    @staticmethod
    def backward(ctx, grad):
        split_dim, send_sizes, cat_dim, recv_sizes = ctx.args
        return _exchange(grad, cat_dim, recv_sizes, split_dim, send_sizes), None, None, None, None


def _sizes(name: str, value, world: int) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of {world} sizes, got {value!r}")
    if len(value) != world:
        raise ValueError(f"{name} must hold one size per rank ({world}), got {value!r}")
    return [check_int(name, n, lo=0) for n in value]


def _check_exchange(x, split_dim, send_sizes, cat_dim, recv_sizes) -> None:
    """Each rank's arguments, then that every block rank ``i`` sends rank ``j`` has the
    shape ``j`` expects from ``i``, on every rank before the exchange (a mismatch would
    abort or hang inside it)."""
    err, shape = None, None
    try:
        check_tensor("x", x)
        shape = list(x.shape)
        split_dim = check_int("split_dim", split_dim, lo=0, hi=max(x.dim() - 1, 0))
        cat_dim = check_int("cat_dim", cat_dim, lo=0, hi=max(x.dim() - 1, 0))
        world = tdist.get_world_size() if tdist.is_initialized() else 1
        send_sizes = _sizes("send_sizes", send_sizes, world)
        recv_sizes = _sizes("recv_sizes", recv_sizes, world)
        if x.dim() == 0 or sum(send_sizes) != x.shape[split_dim]:
            raise ValueError(f"send_sizes must sum to x.shape[split_dim] "
                             f"({shape[split_dim] if shape else None}), got {send_sizes}")
    except (TypeError, ValueError) as e:
        err = e
    agree({"x.dtype": str(getattr(x, "dtype", None)), "split_dim": split_dim,
           "cat_dim": cat_dim}, err)
    table: list = [None] * tdist.get_world_size()
    with _unrecorded():   # bookkeeping, like agree's own exchange: not in the ledger
        tdist.all_gather_object(table, (shape, list(send_sizes), list(recv_sizes)))
    for i, (shape_i, send_i, _) in enumerate(table):
        for j, (shape_j, send_j, recv_j) in enumerate(table):
            sent, want = list(shape_i), list(shape_j)
            sent[split_dim] = send_i[j]
            want[split_dim], want[cat_dim] = send_j[j], recv_j[i]
            if sent != want:
                raise ValueError(f"send_sizes and recv_sizes must match across ranks: rank {i} "
                                 f"sends rank {j} a block of shape {tuple(sent)}, which "
                                 f"expects {tuple(want)}")


def _exchange(x, split_dim, send_sizes, cat_dim, recv_sizes):
    """Part ``j`` of ``x`` along ``split_dim`` to rank ``j``; what rank ``i`` sends me has
    my part's size along ``split_dim`` and ``recv_sizes[i]`` along ``cat_dim``. One
    ``all_to_all_single`` on the flattened parts, so parts may differ in size."""
    parts = x.split(list(send_sizes), dim=split_dim)
    mine = send_sizes[tdist.get_rank()]
    shapes = []
    for n in recv_sizes:
        shape = list(x.shape)
        shape[split_dim], shape[cat_dim] = mine, n
        shapes.append(shape)
    numels = [torch.Size(s).numel() for s in shapes]
    flat = torch.empty(sum(numels), dtype=x.dtype, device=x.device)
    tdist.all_to_all_single(flat, torch.cat([p.reshape(-1) for p in parts]),
                            output_split_sizes=numels,
                            input_split_sizes=[p.numel() for p in parts])
    return torch.cat([c.view(s) for c, s in zip(flat.split(numels), shapes, strict=True)],
                     dim=cat_dim)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq: int,
                      layout: str = "contiguous", causal: bool = False) -> torch.Tensor:
    """This rank's output rows of attention over ``seq`` tokens, Ulysses-style: ``q, k, v``
    are this rank's sequence shards ``(batch, heads, shard_len, head_dim)`` (``layout`` as
    in :func:`shard_chunks`); the group's size must divide ``heads``. Differentiable."""
    if not tdist.is_initialized():
        raise RuntimeError("ulysses_attention needs an initialised torch.distributed group")
    world, rank = tdist.get_world_size(), tdist.get_rank()
    # Every rank checks, then the verdicts and what must match are exchanged before the
    # all-to-all: a refusal on one rank is an error on all of them, never a hang.
    err = None
    try:
        seq = check_int("seq", seq, lo=1)
        check_choice("layout", layout, LAYOUTS)
        causal = check_bool("causal", causal)
        check_tensor("q", q, ndim=4, floating=True)
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t, shape=tuple(q.shape), dtype=q.dtype)
            if t.device != q.device:
                raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        heads = q.shape[1]
        if heads % world:
            raise ValueError(f"Ulysses needs the degree (world_size={world}) to divide the "
                             f"number of heads (q.shape[1]={heads}); the degree can be at "
                             f"most {heads}")
        lengths = check_shard("q", q, seq, world, rank, layout)
    except (TypeError, ValueError) as e:
        err = e
    agree({"seq": seq, "layout": layout, "causal": causal,
           "q dtype": str(getattr(q, "dtype", None)),
           "q (batch, heads, head_dim)": (*q.shape[:2], q.shape[-1])
           if isinstance(q, torch.Tensor) and q.dim() == 4 else None}, err)
    group = heads // world
    qkv = torch.stack((q, k, v))  # (3, b, H, s_r, d): heads are dim 2, sequence dim 3
    # sequence shard, all heads  ->  whole sequence (in rank order), H/N heads
    qkv = AllToAll.apply(qkv, 2, [group] * world, 3, lengths)
    q_all, k_all, v_all = qkv.unbind(0)
    scores = (q_all @ k_all.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        pos = torch.cat([shard_index(seq, world, r, layout) for r in range(world)])
        scores = scores.masked_fill((pos[None, :] > pos[:, None]).to(q.device), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v_all
    # whole sequence, H/N heads  ->  this rank's sequence shard, all heads
    return AllToAll.apply(out, 2, lengths, 1, [group] * world)
