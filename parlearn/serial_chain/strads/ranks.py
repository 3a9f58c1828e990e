"""The same rounds on real gloo ranks, the data sharded by rows.

Rank ``p`` holds rows ``p`` of ``X`` and ``y`` (near-equal contiguous blocks) and its part
``r_p`` of the residual. Once, at the start, the ranks all-reduce ``X_p^T X_p`` so the
scheduler (rank 0) knows the column correlations. Then every round:

1. rank 0 schedules ``S`` (STRADS, Shotgun or cyclic: the scheduler of
   :mod:`~parlearn.serial_chain.strads.solver`) and broadcasts it;
2. every rank computes its partial sums ``X_p[:, S]^T r_p`` and ``|r_p|^2`` and the ranks
   all-reduce them (one message of ``|S| + 1`` numbers): the sum is ``X_S^T r`` and
   ``|r|^2``, so every rank knows the objective before the round;
3. every rank applies the same update :func:`~parlearn.serial_chain.strads.solver.round_update`
   to ``w_S`` and subtracts ``X_p[:, S] delta_S`` from its own residual.

Two messages a round: the schedule and the sums. :func:`run_ranks` launches it through
:func:`parlearn.distributed.run` and returns rank 0's record, with its wall clock per round.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as tdist

from parlearn.core.checks import check_float, check_int, check_seed
from parlearn.serial_chain.strads.solver import (
    LassoRun,
    _blocks,
    _check_common,
    _check_plan,
    _Scheduler,
    check_problem,
    column_correlations,
    round_update,
)

__all__ = ["run_ranks", "strads_rank"]


def strads_rank(rank: int, world: int, x: torch.Tensor, y: torch.Tensor, alpha: float,
                workers: int, rounds: int, schedule: str, rho: float, floor: float,
                candidates: int, seed: int, replay) -> tuple[LassoRun, torch.Tensor]:
    """One rank's loop (the module docstring). Returns rank 0's :class:`LassoRun` (other
    ranks return theirs without the record) and the rank's final ``w``: every rank holds
    all of ``w``, and they must agree."""
    n, d = x.shape
    a, b = _blocks(n, world)[rank]
    xp, yp = x[a:b].clone(), y[a:b].clone()   # all this rank ever touches of the data
    w = torch.zeros(d, dtype=x.dtype)
    c = xp.square().sum(0)
    gram = xp.T @ xp
    tdist.all_reduce(c)
    c /= n
    sched = _Scheduler(schedule, d, workers, None, rho, floor, candidates, seed, replay) \
        if rank == 0 else None
    if schedule == "strads" and replay is None:
        tdist.all_reduce(gram)
        if rank == 0:
            sched.corr = column_correlations(gram)
    r = yp - xp @ w
    out = LassoRun(w)
    slot = torch.empty(workers + 1, dtype=torch.long)   # |S|, then S (padded)
    tdist.barrier()
    start, done = time.perf_counter(), 0
    for t in range(rounds + 1):
        if t < rounds:
            if rank == 0:
                s = sched.next(t)
                slot.zero_()
                slot[0] = len(s)
                slot[1:1 + len(s)] = s
            tdist.broadcast(slot, src=0)
            s = slot[1:1 + int(slot[0])].clone()
        else:
            s = torch.empty(0, dtype=torch.long)
        sums = torch.cat([xp[:, s].T @ r, (r @ r).reshape(1)])
        tdist.all_reduce(sums)
        # Every rank sees the same objective, so all of them stop together.
        if out.record(float(sums[-1]) / (2 * n) + alpha * float(w.abs().sum()), done,
                      start) or t == rounds:
            break
        new = round_update(sums[:-1], w[s], c[s], n, alpha)
        delta = new - w[s]
        w[s] = new
        r -= xp[:, s] @ delta
        if rank == 0:
            sched.moved(s, delta)
        out.schedule.append(s.tolist())
        done += len(s)
    return (out if rank == 0 else None), w.clone()


def run_ranks(x: torch.Tensor, y: torch.Tensor, alpha: float, *, world_size: int = 2,
              workers: int = 4, rounds: int = 1000, schedule: str = "strads",
              rho: float = 0.5, floor: float = 1e-6, candidates: int | None = None,
              seed: int = 0, replay: list[list[int]] | None = None,
              timeout: float = 60) -> LassoRun:
    """:func:`~parlearn.serial_chain.strads.solver.solve`'s rounds on ``world_size`` gloo
    ranks (:func:`parlearn.distributed.run`), rows sharded; arguments as there. Returns rank 0's
    :class:`LassoRun` (``seconds``: rank 0's wall clock, measured from a barrier after the
    set-up). Raises ``RuntimeError`` if the ranks' final ``w`` are not identical."""
    from parlearn.distributed import run

    x, y, alpha = check_problem(x, y, alpha)
    world_size = check_int("world_size", world_size, lo=1, hi=x.shape[0])
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    workers, rounds, rho, floor, candidates = _check_common(workers, rounds, schedule, rho,
                                                            floor, candidates)
    seed = check_seed("seed", seed)
    if isinstance(seed, torch.Generator):
        raise TypeError("seed must be an int for run_ranks (a generator does not cross "
                        "processes)")
    _check_plan(workers, rounds, replay, x.shape[1])
    res = run(strads_rank, world_size, args=(x, y, alpha, workers, rounds, schedule, rho, floor,
                                             candidates, seed, replay), timeout=timeout)
    out, w0 = res[0]
    for rank, (_, w) in enumerate(res[1:], 1):
        if not torch.equal(w, w0):
            raise RuntimeError(f"rank {rank}'s w differs from rank 0's by "
                               f"{(w - w0).abs().max().item():.3g}")
    out.w = w0
    return out
