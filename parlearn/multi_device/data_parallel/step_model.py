"""The alpha-beta cost model of one data-parallel step (modeled, from
:mod:`parlearn.distributed`'s collective prices): :func:`dp_step_model`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from parlearn.core.checks import check_choice, check_float, check_int, check_ints

__all__ = ["DPStepModel", "dp_step_model"]


# ---------------------------------------------------------------------------------------
# Cost model of one data-parallel step (alpha-beta, from parlearn.distributed).

@dataclass(frozen=True)
class DPStepModel:
    """Modeled seconds of one step: ``compute`` (forward + backward), ``comm`` (all the
    all-reduces back to back), ``step`` (wall time with the strategy's overlap),
    ``hidden`` = ``compute + comm - step`` (communication hidden behind backward), and
    ``buckets``: ``(ready, start, end)`` seconds of each bucket's all-reduce."""

    compute: float
    comm: float
    step: float
    hidden: float
    buckets: list[tuple[float, float, float]] = field(default_factory=list)


def dp_step_model(param_bytes: Sequence[int], world_size: int, model, *,
                  compute_seconds: float, strategy: str = "bucketed",
                  bucket_bytes: int = 25 * 2**20, backward_fraction: float = 2 / 3,
                  algorithm: str = "ring") -> DPStepModel:
    """Modeled time of one data-parallel step (Li et al. 2020's overlap, alpha-beta comm).

    ``param_bytes`` are the gradient sizes in registration order; ``model`` is a
    :class:`parlearn.distributed.AlphaBeta`; one all-reduce of ``n`` bytes on N ranks takes
    ``t(n) = collective_time("all_reduce", n, N)`` (ring: ``2(N-1) alpha + 2(N-1)/N n
    beta``). Forward takes ``T_f = (1 - backward_fraction) * compute_seconds``, backward
    ``T_b`` the rest, and produces gradients in reverse order at a rate proportional to
    their size, so bucket i (buckets as :class:`BucketedDP` builds them) is ready at
    ``r_i = T_f + T_b * (bytes of buckets 0..i) / (all bytes)``. One channel carries the
    all-reduces one after another:

    - ``"naive"``: one all-reduce per gradient after backward:
      ``step = T_f + T_b + sum_p t(n_p)``;
    - ``"bucketed"``: ``s_i = max(r_i, e_{i-1})``, ``e_i = s_i + t(n_i)``,
      ``step = max(T_f + T_b, e_last)``;
    - ``"one_bucket"``: all gradients in one all-reduce after backward.

    Nothing else is modeled: no contention between compute and communication, no
    optimizer step, no copies into bucket buffers.
    """
    from parlearn.distributed import AlphaBeta, collective_time

    sizes = check_ints("param_bytes", param_bytes, lo=1)
    world_size = check_int("world_size", world_size, lo=1)
    if not isinstance(model, AlphaBeta):
        raise TypeError(f"model must be a parlearn.dist.AlphaBeta, got {type(model).__name__}")
    compute = check_float("compute_seconds", compute_seconds, lo=0)
    check_choice("strategy", strategy, ("naive", "bucketed", "one_bucket"))
    check_int("bucket_bytes", bucket_bytes, lo=1)
    frac = check_float("backward_fraction", backward_fraction, lo=0, hi=1)

    def t(n: int) -> float:
        return 0.0 if world_size == 1 else collective_time("all_reduce", n, world_size,
                                                           model, algorithm)

    t_f, t_b = (1 - frac) * compute, frac * compute
    if strategy == "naive":
        comm = sum(t(n) for n in sizes)
        return DPStepModel(compute, comm, compute + comm, 0.0)
    if strategy == "one_bucket":
        comm = t(sum(sizes))
        return DPStepModel(compute, comm, compute + comm, 0.0,
                           [(compute, compute, compute + comm)])
    buckets: list[int] = []
    size = 0
    for n in reversed(sizes):
        if not buckets or size + n > bucket_bytes:
            buckets.append(0)
            size = 0
        buckets[-1] += n
        size += n
    total, done, end, spans = sum(sizes), 0, 0.0, []
    for n in buckets:
        done += n
        ready = t_f + t_b * done / total
        start = max(ready, end)
        end = start + t(n)
        spans.append((ready, start, end))
    comm = sum(t(n) for n in buckets)
    step = max(compute, end)
    return DPStepModel(compute, comm, step, compute + comm - step, spans)
