"""The serial pieces every context-parallel scheme is made of: where each rank's tokens are,
attention on one (query block, key block) pair with its log-sum-exp, the online-softmax
merge, and the block backward (lesson 17).

Layouts. A sequence of ``S`` tokens is cut into chunks (``torch.tensor_split`` sizes, so
lengths that do not divide evenly differ by one token at most):

- ``"contiguous"``: ``N`` chunks, rank ``r`` holds chunk ``r``;
- ``"zigzag"``: ``2N`` chunks, rank ``r`` holds chunks ``r`` and ``2N-1-r`` (an early and
  a late one), which evens out causal work.

A rank's shard is its chunks concatenated; :func:`shard_chunks` gives their global
``(start, stop)`` positions, which is all the causal mask needs.

The merge. For one query row, attention over keys ``K = K1 u K2`` is
``o = sum_j e^{s_j} v_j / sum_j e^{s_j}``. With ``l_i = log sum_{j in K_i} e^{s_j}`` and
``o_i`` the attention over ``K_i`` alone, ``l = log(e^{l_1} + e^{l_2})`` and
``o = e^{l_1 - l} o_1 + e^{l_2 - l} o_2`` (:func:`merge`): partial results over key blocks
combine exactly, in any order, without ever holding the full row of scores.

The block backward (the FlashAttention recurrence, Dao et al. 2022). With the final
``o``, its log-sum-exp ``l`` and ``D = rowsum(dO * o)``, a key block contributes
``P = exp(S - l)``, ``dV = P^T dO``, ``dS = P * (dO V^T - D)``, ``dQ += dS K / sqrt(d)``,
``dK = dS^T Q / sqrt(d)``: exact per block, so the backward can travel the ring too.

Work is counted in score entries computed, at chunk granularity: a (query chunk, key
chunk) tile fully above the causal diagonal is skipped, any other tile is computed whole
(what a tiled kernel that skips masked tiles does).
"""

from __future__ import annotations

import math

import torch

from parlearn.core.checks import check_bool, check_choice, check_int, check_tensor

__all__ = ["LAYOUTS", "shard_chunks", "shard_index", "full_attention", "block_attention",
           "merge", "block_backward", "causal_work", "idle_fraction"]

LAYOUTS = ("contiguous", "zigzag")


def shard_chunks(seq: int, world_size: int, rank: int, layout: str = "contiguous"
                 ) -> list[tuple[int, int]]:
    """Global ``(start, stop)`` of the chunks rank ``rank`` holds, in the order its shard
    concatenates them. Every chunk must hold at least one token."""
    world_size = check_int("world_size", world_size, lo=1)
    seq = check_int("seq", seq, lo=1)
    rank = check_int("rank", rank, lo=0, hi=world_size - 1)
    check_choice("layout", layout, LAYOUTS)
    pieces = world_size if layout == "contiguous" else 2 * world_size
    if seq < pieces:
        raise ValueError(f"seq={seq} is shorter than the {pieces} chunks layout={layout!r} "
                         f"cuts on world_size={world_size}")
    base, extra = divmod(seq, pieces)
    bounds = [0]
    for i in range(pieces):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    own = [rank] if layout == "contiguous" else [rank, pieces - 1 - rank]
    return [(bounds[i], bounds[i + 1]) for i in own]


def shard_lengths(seq: int, world_size: int, layout: str = "contiguous") -> list[int]:
    """How many tokens of ``seq`` each rank holds under ``layout``, in rank order."""
    return [sum(b - a for a, b in shard_chunks(seq, world_size, r, layout))
            for r in range(world_size)]


def check_shard(name: str, tensor: torch.Tensor, seq: int, world_size: int, rank: int,
                layout: str) -> list[int]:
    """Refuse ``tensor`` unless its dim -2 holds rank ``rank``'s shard of ``seq`` under
    ``layout`` (naming ``name``); returns every rank's shard length."""
    lengths = shard_lengths(seq, world_size, layout)
    if tensor.shape[-2] != lengths[rank]:
        raise ValueError(f"{name} holds {tensor.shape[-2]} tokens but rank {rank}'s shard of "
                         f"seq={seq} ({layout}) has {lengths[rank]}")
    return lengths


def shard_index(seq: int, world_size: int, rank: int, layout: str = "contiguous"
                ) -> torch.Tensor:
    """The global positions of rank ``rank``'s shard, in shard order (int64)."""
    return torch.cat([torch.arange(a, b) for a, b in shard_chunks(seq, world_size, rank, layout)])


def _check_qkv(q, k, v) -> None:
    check_tensor("q", q, ndim=4, floating=True)
    check_tensor("k", k, ndim=4, dtype=q.dtype)
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on "
                         f"(batch, heads, ., head_dim)")
    check_tensor("v", v, shape=tuple(k.shape), dtype=q.dtype)
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, "
                         f"v {v.device}")


def _check_chunks(name: str, chunks, length: int, tensor: str) -> list[tuple[int, int]]:
    """``chunks`` a list of ``(start, stop)`` with ``0 <= start < stop`` whose lengths add up
    to ``length``, the rows of ``tensor`` (nothing silently truncated or left out)."""
    if isinstance(chunks, (str, bytes)) or not isinstance(chunks, (list, tuple)):
        raise TypeError(f"{name} must be a list of (start, stop) pairs, got {chunks!r}")
    out = []
    for c in chunks:
        if (not isinstance(c, (list, tuple)) or len(c) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) for x in c)
                or not 0 <= c[0] < c[1]):
            raise ValueError(f"{name} must hold (start, stop) int pairs with 0 <= start < "
                             f"stop, got {c!r} in {chunks!r}")
        out.append((int(c[0]), int(c[1])))
    total = sum(b - a for a, b in out)
    if total != length:
        raise ValueError(f"{name} must cover the {length} rows of {tensor} (chunk lengths "
                         f"adding up to {length}), got {chunks!r} ({total} rows)")
    return out


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False
                   ) -> torch.Tensor:
    """The serial reference: ``softmax(q k^T / sqrt(d) [+ causal mask]) v`` on
    ``(batch, heads, seq, head_dim)`` tensors, through autograd."""
    _check_qkv(q, k, v)
    causal = check_bool("causal", causal)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        s_q, s_k = q.shape[-2], k.shape[-2]
        scores = scores.masked_fill(torch.ones(s_q, s_k, dtype=torch.bool).triu(1),
                                    float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _tiles(q_chunks, k_chunks, causal: bool):
    """(query rows, key rows, mask or None) of every tile to compute; masked tiles skipped."""
    q_off = 0
    for qa, qb in q_chunks:
        k_off = 0
        for ka, kb in k_chunks:
            rows, cols = slice(q_off, q_off + qb - qa), slice(k_off, k_off + kb - ka)
            k_off += kb - ka
            if causal and ka > qb - 1:
                continue  # every key of this tile is after every query: nothing to see
            mask = None
            if causal and kb - 1 > qa:  # the tile straddles the diagonal
                mask = torch.arange(ka, kb)[None, :] > torch.arange(qa, qb)[:, None]
            yield rows, cols, mask
        q_off += qb - qa


def _safe(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a row that saw no key yet) replaced by 0, so exp(x - lse) is 0."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge of two partial attentions over disjoint key sets:
    ``lse = log(e^lse1 + e^lse2)``, ``o = e^(lse1-lse) o1 + e^(lse2-lse) o2``. A row with
    ``lse = -inf`` (no keys seen) contributes nothing. ``o1`` and ``o2`` must have one shape
    and dtype, ``lse1`` and ``lse2`` that shape without its last dimension (nothing is
    broadcast)."""
    check_tensor("o1", o1, floating=True)
    if o1.dim() < 1:
        raise ValueError(f"o1 must have at least 1 dimension, got shape {tuple(o1.shape)}")
    check_tensor("o2", o2, shape=tuple(o1.shape), dtype=o1.dtype)
    check_tensor("lse1", lse1, shape=tuple(o1.shape[:-1]), dtype=o1.dtype)
    check_tensor("lse2", lse2, shape=tuple(o1.shape[:-1]), dtype=o1.dtype)
    lse = torch.logaddexp(lse1, lse2)
    safe = _safe(lse)
    return (torch.exp(lse1 - safe)[..., None] * o1
            + torch.exp(lse2 - safe)[..., None] * o2), lse


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    q_chunks: list[tuple[int, int]], k_chunks: list[tuple[int, int]],
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Attention of the queries ``q`` (global chunks ``q_chunks``) over the keys ``k, v``
    (chunks ``k_chunks``) alone: ``(o, lse, work)`` with ``lse`` the log-sum-exp of each
    query row's scores (-inf where the mask hides every key) and ``work`` the score
    entries computed. No autograd: the schemes write their own backward. The chunks'
    lengths must add up to the rows of ``q`` and of ``k`` (nothing is truncated)."""
    _check_qkv(q, k, v)
    q_chunks = _check_chunks("q_chunks", q_chunks, q.shape[-2], "q")
    k_chunks = _check_chunks("k_chunks", k_chunks, k.shape[-2], "k")
    causal = check_bool("causal", causal)
    scale = 1.0 / math.sqrt(q.shape[-1])
    o = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    work = 0
    for rows, cols, mask in _tiles(q_chunks, k_chunks, causal):
        s = (q[..., rows, :] @ k[..., cols, :].transpose(-2, -1)) * scale
        if mask is not None:
            s = s.masked_fill(mask.to(s.device), float("-inf"))
        t_lse = torch.logsumexp(s, dim=-1)
        t_o = torch.exp(s - _safe(t_lse)[..., None]) @ v[..., cols, :]
        o[..., rows, :], lse[..., rows] = merge(o[..., rows, :], lse[..., rows], t_o, t_lse)
        work += s.shape[-2] * s.shape[-1]
    return o, lse, work


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, q_chunks, k_chunks, causal: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One key block's share of the attention gradient: ``(dq, dk, dv)``, with ``lse`` the
    FINAL log-sum-exp of the query rows (after every block was merged) and ``delta`` the
    row sums of ``do * o``. ``dq`` sums over blocks; ``dk, dv`` belong to this block."""
    _check_qkv(q, k, v)
    check_tensor("do", do, shape=tuple(q.shape), dtype=q.dtype)
    check_tensor("lse", lse, shape=tuple(q.shape[:-1]), dtype=q.dtype)
    check_tensor("delta", delta, shape=tuple(q.shape[:-1]), dtype=q.dtype)
    q_chunks = _check_chunks("q_chunks", q_chunks, q.shape[-2], "q")
    k_chunks = _check_chunks("k_chunks", k_chunks, k.shape[-2], "k")
    causal = check_bool("causal", causal)
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, cols, mask in _tiles(q_chunks, k_chunks, causal):
        qt, kt, vt, dot = q[..., rows, :], k[..., cols, :], v[..., cols, :], do[..., rows, :]
        s = (qt @ kt.transpose(-2, -1)) * scale
        if mask is not None:
            s = s.masked_fill(mask.to(s.device), float("-inf"))
        p = torch.exp(s - _safe(lse[..., rows])[..., None])
        dv[..., cols, :] += p.transpose(-2, -1) @ dot
        ds = p * (dot @ vt.transpose(-2, -1) - delta[..., rows, None])
        dq[..., rows, :] += (ds @ kt) * scale
        dk[..., cols, :] += (ds.transpose(-2, -1) @ qt) * scale
    return dq, dk, dv


def causal_work(seq: int, world_size: int, layout: str = "contiguous",
                causal: bool = True) -> list[int]:
    """Score entries each rank computes over a whole ring pass (every key block visits),
    counted by the same tiles :func:`block_attention` computes."""
    causal = check_bool("causal", causal)
    world_size = check_int("world_size", world_size, lo=1)
    shard_chunks(seq, world_size, 0, layout)   # seq and layout checked before any work
    chunks = [shard_chunks(seq, world_size, r, layout) for r in range(world_size)]
    return [sum((rows.stop - rows.start) * (cols.stop - cols.start)
                for src in chunks for rows, cols, _ in _tiles(mine, src, causal))
            for mine in chunks]


def idle_fraction(work: list[int]) -> float:
    """Share of the ranks' time spent waiting when the slowest sets the pace:
    ``1 - mean(work) / max(work)``."""
    if isinstance(work, (str, bytes)) or not isinstance(work, (list, tuple)):
        raise TypeError(f"work must be a list of numbers, got {work!r}")
    for w in work:
        if (isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)
                or w < 0):
            raise ValueError(f"work must hold finite numbers >= 0, got {w!r} in {work!r}")
    if not work or max(work) <= 0:
        raise ValueError(f"work must be a non-empty list with a positive entry, got {work}")
    return 1.0 - sum(work) / len(work) / max(work)
