"""What an MoE layer costs: all-to-all bytes, the busiest expert, the capacity trade (modeled).

All-to-all bytes of one MoE layer's forward on ``N`` EP ranks, each holding ``T`` tokens of
width ``h`` at ``b`` bytes per element, ``k`` experts per token, nothing dropped:

    payload each way per rank = T k h b            (what ``all_to_all_single`` is passed,
                                                    rows for its own experts included)
    wire each way per rank    = T k h b (N-1)/N    (rows that leave it, uniform routing)

"Each way" is dispatch and combine; backward repeats both, so a training step moves
``4 T k h b (N-1)/N`` per rank and layer, plus ``E`` integers of split sizes per forward.
Under uneven routing a rank's dispatch payload is its kept assignments and its combine
payload what its experts received: their sums over ranks are exactly ``N T k h b`` each.

Imbalance: the experts of a layer run in parallel, so its step time is set by the busiest
one. ``imbalance = max_e n_e / mean_e n_e`` (1 when balanced, ``E`` when one expert gets
every token). With a capacity ``C`` per expert a static-shape implementation pads every
expert to ``C`` rows: ``E C - sum_e min(n_e, C)`` rows of padding are computed for nothing,
``sum_e max(n_e - C, 0)`` assignments are dropped, and the modeled step time is that of
``C`` rows on every expert, against ``max_e n_e`` without a capacity.

Expert parallelism against replicated experts (:func:`ep_vs_replicated`). EP does not
spread expert *compute*: with or without it each rank runs about ``T k`` token-expert
products per layer (exactly so under uniform routing). What EP spreads is expert *memory*,
and it pays for that in all-to-all traffic. Per MoE layer and rank, ``E`` experts of
``m h f`` parameters each (``m = 2`` matrices for a GELU MLP, 3 for SwiGLU), ``s`` bytes
of training state per parameter (16 for mixed-precision Adam: bf16 weights and gradients,
fp32 master weights and two moments, the ZeRO paper's ``2 + 2 + 12``):

    replicated (DP only): memory E m h f s,      bytes/step 2 (N-1)/N E m h f b
                          (each rank holds all E; ring all-reduce of their gradients)
    EP over N ranks:      memory (E/N) m h f s,  bytes/step 4 T k h b (N-1)/N
                          (each expert on one rank; 2 all-to-alls forward, 2 backward)

The replicated bytes grow with the parameters and come once per step (they can overlap
the backward); EP's grow with the tokens ``T`` per rank and step and sit on the critical
path of every layer. Whether the all-to-all can hide behind the expert compute is
:func:`ep_pays`: compute ``2 T k m h f`` FLOPs against ``2 ((N-1) alpha + wire beta)``;
both grow like ``T``, so their ratio tends to ``m f / (F b beta (N-1)/N)`` (``F`` the
FLOP/s) whatever ``T``: a larger ``T`` only amortises the latency ``alpha``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from parlearn.core.checks import check_float, check_int

__all__ = ["all_to_all_bytes", "imbalance", "capacity_trade", "ep_pays",
           "ep_vs_replicated"]


def _seq(name: str, value) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of ints, got {value!r}")
    return list(value)


def all_to_all_bytes(tokens: int, d_model: int, k: int, ep: int, element_bytes: int = 4
                     ) -> dict[str, float]:
    """Modeled ``{"payload", "wire"}`` bytes each way per rank, one MoE forward (module
    docstring): ``tokens`` on the rank, ``ep`` ranks in the EP group."""
    T, h = check_int("tokens", tokens, lo=0), check_int("d_model", d_model, lo=1)
    k, N = check_int("k", k, lo=1), check_int("ep", ep, lo=1)
    payload = T * k * h * check_int("element_bytes", element_bytes, lo=1)
    return {"payload": payload, "wire": payload * (N - 1) / N}


def imbalance(counts: Sequence[int]) -> float:
    """``max / mean`` of the tokens per expert (1 when balanced; 1 for no tokens at all)."""
    counts = [check_int("counts", c, lo=0) for c in _seq("counts", counts)]
    if not counts:
        raise ValueError("counts must name at least one expert")
    mean = sum(counts) / len(counts)
    return 1.0 if mean == 0 else max(counts) / mean


def capacity_trade(wanted: Sequence[int], capacity: int | None) -> dict[str, float]:
    """For assignments ``wanted`` per expert and a per-expert ``capacity`` (None: none):
    ``dropped`` assignments, ``padding`` rows computed for nothing, ``rows`` the busiest
    expert computes (its time, modeled), and ``rows_needed`` the balanced ideal
    ``ceil(sum / E)``."""
    wanted = [check_int("wanted", w, lo=0) for w in _seq("wanted", wanted)]
    if not wanted:
        raise ValueError("wanted must name at least one expert")
    E, total = len(wanted), sum(wanted)
    ideal = -(-total // E) if E else 0
    if capacity is None:
        return {"dropped": 0, "padding": 0, "rows": max(wanted), "rows_needed": ideal}
    C = check_int("capacity", capacity, lo=0)
    kept = sum(min(w, C) for w in wanted)
    return {"dropped": total - kept, "padding": E * C - kept, "rows": C, "rows_needed": ideal}


def ep_pays(tokens: int, d_model: int, d_ff: int, k: int, ep: int, alpha: float, beta: float,
            flops_per_s: float, element_bytes: int = 4, matrices: int = 2
            ) -> dict[str, float]:
    """Modeled seconds of one MoE forward on a rank: the expert compute ``2 T k (m h f)``
    FLOPs at ``flops_per_s`` (``m = matrices``: 2 for a GELU MLP, 3 for SwiGLU), and the
    two all-to-alls on the pairwise schedule, ``2 ((N-1) alpha + wire beta)``. The
    all-to-all can hide behind (or is small against) the expert compute when the first
    is the larger (module docstring; lesson 18's exercise).

    ``"limit"`` is what ``compute / all_to_all`` tends to as ``tokens`` grows (the latency
    amortised away): ``m f / (F b beta (N-1)/N)``, ``inf`` when nothing grows with the
    bytes (``beta`` 0, as a fit to noisy times can return, or ``ep`` 1)."""
    check_float("alpha", alpha, lo=0)
    check_float("beta", beta, lo=0)
    check_float("flops_per_s", flops_per_s, lo=0, lo_open=True)
    m = check_int("matrices", matrices, lo=2, hi=3)
    b = all_to_all_bytes(tokens, d_model, k, ep, element_bytes)
    compute = 2 * tokens * k * m * d_model * check_int("d_ff", d_ff, lo=1) / flops_per_s
    comm = 2 * ((ep - 1) * alpha + b["wire"] * beta)
    per_token = beta * element_bytes * (ep - 1) / ep * flops_per_s
    limit = math.inf if per_token == 0 else m * d_ff / per_token
    return {"compute": compute, "all_to_all": comm, "limit": limit}


def ep_vs_replicated(tokens: int, d_model: int, d_ff: int, n_experts: int, k: int, ep: int,
                     *, matrices: int = 2, element_bytes: int = 2, state_bytes: int = 16
                     ) -> dict[str, dict[str, float]]:
    """Modeled per-rank cost of one MoE layer's experts over ``ep`` ranks, two ways
    (module docstring): ``{"ep": ..., "replicated": ...}``, each ``{"memory"`` (bytes of
    expert weights, gradients and optimizer state), ``"bytes"`` (sent off-rank per training
    step), ``"flops"`` (expert FLOPs per step, forward and backward: the same both ways)}``.
    ``tokens`` per rank and step, ``matrices`` 2 (GELU) or 3 (SwiGLU), ``element_bytes``
    of activations and gradients on the wire, ``state_bytes`` per parameter held."""
    T, h = check_int("tokens", tokens, lo=0), check_int("d_model", d_model, lo=1)
    f, E = check_int("d_ff", d_ff, lo=1), check_int("n_experts", n_experts, lo=1)
    k, N = check_int("k", k, lo=1, hi=E), check_int("ep", ep, lo=1, hi=E)
    if E % N:
        raise ValueError(f"ep={N} must divide n_experts={E}")
    m = check_int("matrices", matrices, lo=2, hi=3)
    b = check_int("element_bytes", element_bytes, lo=1)
    s = check_int("state_bytes", state_bytes, lo=1)
    params = m * h * f  # one expert
    flops = 3 * 2 * T * k * params  # forward 2 per multiply-add, backward twice that
    a2a = all_to_all_bytes(T, h, k, N, b)["wire"]
    return {"ep": {"memory": E // N * params * s, "bytes": 4 * a2a, "flops": flops},
            "replicated": {"memory": E * params * s,
                           "bytes": 2 * (N - 1) / N * E * params * b, "flops": flops}}
