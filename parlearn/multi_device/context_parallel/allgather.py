"""All-gather context parallelism: every rank gathers the whole sequence's keys and values,
then attends with its own queries (lesson 17).

Llama 3's training (Grattafiori et al. 2024, "The Llama 3 Herd of Models", section 3.3.2)
shards long sequences this way rather than with ring attention: each rank holds ``S/N`` tokens
(zig-zag, two chunks each, so the causal work is balanced), all-gathers ``K`` and ``V``
before attention, and computes attention for its own queries against all keys with the
causal mask of its positions. What it buys:

- **Simplicity and any mask.** The attention is one ordinary local call, so document masks
  and other non-causal patterns need nothing new (ring attention must know which blocks to
  skip).
- **Cheap under grouped-query attention.** ``K`` and ``V`` have ``G`` heads, not ``H``
  (Llama 3: 8 of 32), so the gathered bytes ``2 b S G d e`` are a quarter of the queries';
  they are small next to the attention's ``4 b s S h`` FLOPs for long ``S``.
- **Fewer bytes than the ring:** ``4(N-1)`` K/V-shard volumes per rank over forward and
  backward, against ring attention's ``6N-4`` (whose backward sends K and V again, with
  the gradient accumulators).
- **The price:** the gather is exposed (it precedes the attention that needs it, unless
  the next layer's is started early) and each rank keeps the whole sequence's ``K, V``
  (``O(S)``, where ring attention keeps ``O(S/N)``).

Backward is the transpose of the gather: each rank computes ``dK, dV`` for every position
from its queries, and a reduce-scatter sums them and hands each rank its own shard's.
Shards may be uneven (the gather pads to the longest shard and cuts the padding off).
"""

from __future__ import annotations

import torch
import torch.distributed as tdist

from parlearn.core.checks import check_bool, check_choice, check_int, check_tensor
from parlearn.distributed.agree import agree
from parlearn.multi_device.context_parallel.blocks import LAYOUTS, check_shard, shard_index

__all__ = ["allgather_attention"]


class _GatherKV(torch.autograd.Function):
    """``_GatherKV.apply(x, lengths)``: the sequence shards ``x`` (dim 2, this rank's
    ``lengths[rank]`` tokens) of every rank, concatenated in rank order. Backward
    reduce-scatters the gradient: each rank receives the sum over ranks of its shard's."""

    @staticmethod
    def forward(ctx, x, lengths):
        world, longest = len(lengths), max(lengths)
        ctx.lengths = lengths
        pad = torch.zeros(*x.shape[:2], longest, *x.shape[3:], dtype=x.dtype, device=x.device)
        pad[:, :, :x.shape[2]] = x
        parts = [torch.empty_like(pad) for _ in range(world)]
        tdist.all_gather(parts, pad)
        return torch.cat([p[:, :, :n] for p, n in zip(parts, lengths, strict=True)], dim=2)

    @staticmethod
    def backward(ctx, grad):
        lengths, rank = ctx.lengths, tdist.get_rank()
        longest = max(lengths)
        parts = []
        for piece in grad.split(lengths, dim=2):
            pad = torch.zeros(*grad.shape[:2], longest, *grad.shape[3:], dtype=grad.dtype,
                              device=grad.device)
            pad[:, :, :piece.shape[2]] = piece
            parts.append(pad)
        out = torch.empty_like(parts[0])
        tdist.reduce_scatter(out, parts)
        return out[:, :, :lengths[rank]], None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq: int,
                        layout: str = "contiguous", causal: bool = False) -> torch.Tensor:
    """This rank's output rows of attention over ``seq`` tokens: ``q`` (``(batch, heads,
    shard_len, head_dim)``), ``k`` and ``v`` (``(batch, kv_heads, shard_len, head_dim)``,
    ``kv_heads`` dividing ``heads``: grouped-query attention) are this rank's sequence
    shards in ``layout``; ``K`` and ``V`` are all-gathered (module docstring).
    Differentiable."""
    if not tdist.is_initialized():
        raise RuntimeError("allgather_attention needs an initialised torch.distributed group")
    world, rank = tdist.get_world_size(), tdist.get_rank()
    # Checked on every rank, the verdicts agreed before the gather: a refusal on one rank
    # is an error on all of them, never a hang.
    err, lengths = None, None
    try:
        seq = check_int("seq", seq, lo=1)
        check_choice("layout", layout, LAYOUTS)
        causal = check_bool("causal", causal)
        check_tensor("q", q, ndim=4, floating=True)
        check_tensor("k", k, ndim=4, dtype=q.dtype)
        check_tensor("v", v, shape=tuple(k.shape), dtype=q.dtype)
        if (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3]):
            raise ValueError(f"k must match q in batch, tokens and head_dim, got k "
                             f"{tuple(k.shape)} and q {tuple(q.shape)}")
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"k's kv_heads={k.shape[1]} must divide q's heads={q.shape[1]}")
        lengths = check_shard("q", q, seq, world, rank, layout)
    except (TypeError, ValueError) as e:
        err = e
    agree({"seq": seq, "layout": layout, "causal": causal,
           "q dtype": str(getattr(q, "dtype", None)),
           "k (batch, kv_heads, head_dim)": (k.shape[0], k.shape[1], k.shape[3])
           if isinstance(k, torch.Tensor) and k.dim() == 4 else None}, err)
    k_all, v_all = _GatherKV.apply(k, lengths), _GatherKV.apply(v, lengths)
    rep = q.shape[1] // k.shape[1]       # each K/V head serves ``rep`` query heads
    if rep > 1:
        k_all, v_all = (t.repeat_interleave(rep, dim=1) for t in (k_all, v_all))
    scores = (q @ k_all.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        keys = torch.cat([shard_index(seq, world, r, layout) for r in range(world)])
        mine = shard_index(seq, world, rank, layout)
        scores = scores.masked_fill((keys[None, :] > mine[:, None]).to(q.device),
                                    float("-inf"))
    return torch.softmax(scores, dim=-1) @ v_all
