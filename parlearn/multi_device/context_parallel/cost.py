"""What each scheme sends and keeps, per rank and per attention layer (modeled; lesson 17).

Notation: ``b`` batch, ``S`` sequence, ``H`` heads of width ``d`` (``h = H d``), ``G``
key/value heads (``kv_heads``; ``G = H`` is plain multi-head attention, ``G < H`` grouped-query
attention, Ainslie et al. 2023: Llama 3 has 8 of 32), ``N`` ranks, ``e`` bytes per element,
``s = S / N`` the shard (the formulas assume ``N`` divides ``S``). Payloads are as
:func:`parlearn.distributed.ledger` counts them; wire bytes are what a rank sends under the
ring / pairwise schedules (:func:`parlearn.distributed.ring_bytes`).

==========  ==============================================  ===========================
scheme      forward payload per rank                        messages (forward)
==========  ==============================================  ===========================
tp          all-reduce of ``S b h e`` (backward: another)     ``2(N-1)``
sp          all-gather + reduce-scatter of ``S b h e``        ``2(N-1)``
ulysses     all-to-all of ``b s (H + 2G) d e`` (q, k, v),     ``2(N-1)``
            then all-to-all of ``b s h e`` (the output)
ring        ``N-1`` sends of a K/V block, ``2 b s G d e``     ``N-1``
allgather   all-gather of K and V, ``2 b S G d e`` (Llama 3)  ``N-1``
==========  ==============================================  ===========================

Backward: tp and sp mirror forward; Ulysses mirrors forward; allgather reduce-scatters
``(dK, dV)``, the same payload; ring sends the K/V blocks
again (``N-1``) and the travelling ``(dK, dV)`` ``N`` times. Ring's volume per rank does not
fall with ``N`` (``(N-1) 2 b s G d e = 2 b S G d e (N-1)/N``; under GQA ``G/H`` of the
multi-head volume) but each of its ``N-1`` messages
can hide behind one block of attention, ``4 b s^2 h`` FLOPs: it hides when
``4 b s^2 h / F >= alpha + 2 b s h e beta`` (:func:`hiding_shard`).

Memory: :func:`attention_memory` counts the bytes autograd keeps for backward in the
attention core, term by term, and equals what :func:`saved_bytes` measures on each rank
(the tests check it): full attention keeps q, k, v and the ``b H S^2`` probabilities (and
the ``S^2`` causal mask); ring attention keeps q, k, v, the output and the log-sum-exp of
its own shard, O(S/N); Ulysses keeps the full-sequence q, k, v and probabilities of its
``H/N`` heads.
"""

from __future__ import annotations

import math

from parlearn.core.checks import check_bool, check_choice, check_float, check_int
from parlearn.distributed.cost import AlphaBeta, ring_bytes

__all__ = ["COST_SCHEMES", "scheme_cost", "attention_memory", "hiding_shard",
           "timeline_summary"]

COST_SCHEMES = ("tp", "sp", "ulysses", "ring", "allgather")


def _shape(batch, seq, heads, head_dim, world_size, elt):
    return (check_int("batch", batch, lo=1), check_int("seq", seq, lo=1),
            check_int("heads", heads, lo=1), check_int("head_dim", head_dim, lo=1),
            check_int("world_size", world_size, lo=1), check_int("elt", elt, lo=1))


def scheme_cost(scheme: str, *, batch: int, seq: int, heads: int, head_dim: int,
                world_size: int, elt: int = 8, kv_heads: int | None = None) -> dict:
    """Communication per rank of one attention layer (ring, ulysses) or one TP region (tp,
    sp) under ``scheme`` (table in the module docstring): ``{"forward": [(kind, payload
    bytes), ...], "backward": [...], "wire": bytes sent over forward and backward,
    "messages": forward messages on the critical path}``. ``kv_heads`` (default ``heads``)
    sizes the K/V that ring and Ulysses move; it must divide ``heads``, and Ulysses needs
    ``world_size`` to divide it. tp and sp move the layer's activations, whatever it is."""
    check_choice("scheme", scheme, COST_SCHEMES)
    b, S, H, d, N, e = _shape(batch, seq, heads, head_dim, world_size, elt)
    G = H if kv_heads is None else check_int("kv_heads", kv_heads, lo=1, hi=H)
    if H % G:
        raise ValueError(f"kv_heads={G} must divide heads={H}")
    if scheme in ("ulysses", "ring", "allgather") and S % N:
        raise ValueError(f"the model assumes world_size={N} divides seq={S}")
    if scheme == "ulysses" and H % N:
        raise ValueError(f"Ulysses needs world_size={N} to divide heads={H}")
    if scheme == "ulysses" and G % N:
        raise ValueError(f"Ulysses needs world_size={N} to divide kv_heads={G}")
    if scheme == "ring" and N < 2:
        raise ValueError(f"ring attention needs world_size >= 2, got {N}")
    full, shard = b * S * H * d * e, b * (S // N) * H * d * e
    kv = b * (S // N) * G * d * e   # one of K, V for this rank's tokens
    if scheme == "tp":
        fwd, bwd, msgs = [("all_reduce", full)], [("all_reduce", full)], 2 * (N - 1)
    elif scheme == "sp":
        fwd = [("all_gather", full), ("reduce_scatter", full)]
        bwd, msgs = [("all_gather", full), ("reduce_scatter", full)], 2 * (N - 1)
    elif scheme == "ulysses":
        fwd = [("all_to_all_single", shard + 2 * kv), ("all_to_all_single", shard)]
        bwd, msgs = list(reversed(fwd)), 2 * (N - 1)
    elif scheme == "allgather":   # K and V gathered whole; their gradients reduce-scattered
        fwd = [("all_gather", N * kv), ("all_gather", N * kv)]
        bwd, msgs = [("reduce_scatter", N * kv), ("reduce_scatter", N * kv)], N - 1
    else:
        fwd = [("isend", 2 * kv)] * (N - 1)
        bwd, msgs = [("isend", 2 * kv)] * (2 * N - 1), N - 1
    wire = sum(n if kind == "isend" else ring_bytes(kind, n, N) for kind, n in fwd + bwd)
    return dict(forward=fwd, backward=bwd, wire=wire, messages=msgs)


def attention_memory(scheme: str, *, batch: int, seq: int, heads: int, head_dim: int,
                     world_size: int = 1, causal: bool = False, elt: int = 8) -> int:
    """Bytes the attention core keeps for backward on one rank: ``scheme`` ``"full"`` (one
    process), ``"ring"``, ``"ulysses"`` or ``"allgather"`` (its shard's q, the gathered K
    and V, and the ``b H s S`` probabilities of its own queries; module docstring)."""
    check_choice("scheme", scheme, ("full", "ring", "ulysses", "allgather"))
    b, S, H, d, N, e = _shape(batch, seq, heads, head_dim, world_size, elt)
    causal = check_bool("causal", causal)
    mask = S * S if causal else 0  # a bool per (query, key)
    if scheme == "full":
        return (3 * b * H * S * d + b * H * S * S) * e + mask
    if S % N:
        raise ValueError(f"the model assumes world_size={N} divides seq={S}")
    if scheme == "ring":
        s = S // N
        return (4 * b * H * s * d + b * H * s) * e
    if scheme == "allgather":
        s = S // N
        return (b * H * s * d + 2 * b * H * S * d + b * H * s * S) * e + (s * S if causal
                                                                           else 0)
    if H % N:
        raise ValueError(f"Ulysses needs world_size={N} to divide heads={H}")
    g = H // N
    return (3 * b * g * S * d + b * g * S * S) * e + mask


def hiding_shard(model: AlphaBeta, flops: float, *, batch: int, heads: int, head_dim: int,
                 elt: int = 8) -> float:
    """The smallest shard ``s`` (tokens per rank) for which one block of attention,
    ``4 b s^2 h`` FLOPs at ``flops`` FLOP/s, takes at least as long as passing on a K/V
    block, ``alpha + 2 b s h e beta``: the positive root of the quadratic."""
    if not isinstance(model, AlphaBeta):
        raise TypeError(f"model must be an AlphaBeta, got {type(model).__name__}")
    flops = check_float("flops", flops, lo=0, lo_open=True)
    b, h = check_int("batch", batch, lo=1), check_int("heads", heads, lo=1) * check_int(
        "head_dim", head_dim, lo=1)
    e = check_int("elt", elt, lo=1)
    a2, a1, a0 = 4 * b * h / flops, 2 * b * h * e * model.beta, model.alpha
    return (a1 + math.sqrt(a1 * a1 + 4 * a2 * a0)) / (2 * a2)


def timeline_summary(timeline: list) -> dict:
    """Seconds of block computation and of waiting for messages in a ring timeline (from
    :func:`ring_attention`), forward and backward: the waits are the communication that
    did NOT hide behind computation."""
    if not isinstance(timeline, list):
        raise TypeError(f"timeline must be a list, got {type(timeline).__name__}")
    for entry in timeline:
        if (not isinstance(entry, (list, tuple)) or len(entry) != 4
                or not isinstance(entry[0], str)):
            raise ValueError(f"timeline must hold (label, step, t0, t1) entries, got "
                             f"{entry!r}")
        if entry[0] == "work":   # ("work", entries, 0, 0): a count, not a span
            continue
        t0 = check_float("timeline t0", entry[2])
        if check_float("timeline t1", entry[3]) < t0:
            raise ValueError(f"timeline entry {entry!r} ends before it starts")
    out = {"fwd compute": 0.0, "fwd wait": 0.0, "bwd compute": 0.0, "bwd wait": 0.0}
    for label, _, t0, t1 in timeline:
        key = "bwd wait" if label == "bwd grad wait" else label
        if key in out:
            out[key] += t1 - t0
    return out
