"""What a round costs (modeled), the runs against wall time (measured), and the bench rows.

- :func:`shotgun_limit`: Bradley et al.'s bound on how many coordinates Shotgun may update at
  once before it stops paying, ``P* = d / rho(X^T X / n)`` (columns scaled to
  ``|x_j|^2 = n``; ``rho`` the spectral radius): **modeled**.
- :func:`round_time_model`: seconds per round on ``R`` ranks, **modeled** by
  ``2 (n / R) |S| t_madd + 2 latency``: each rank's partial sums ``X_p[:, S]^T r_p`` and
  residual update ``X_p[:, S] delta`` are ``(n / R) |S|`` multiply-adds each, and a round
  sends two small messages (the schedule, the sums) whose cost is their latency.
- :func:`timed_runs`: objective gap against updates and wall time of scikit-learn's serial
  coordinate descent, our serial cyclic rounds, and Shotgun and STRADS on gloo ranks
  (**measured** on this machine).
"""

from __future__ import annotations

import math
import os
import statistics
import time

import torch

from parlearn.core.checks import check_float, check_int, check_tensor
from parlearn.serial_chain.strads.ranks import run_ranks
from parlearn.serial_chain.strads.solver import (
    check_problem,
    correlated_design,
    relative_gap,
    sklearn_lasso,
    solve,
)

__all__ = ["shotgun_limit", "round_time_model", "timed_runs", "time_to_gap", "bench"]


def shotgun_limit(x: torch.Tensor) -> float:
    """``d / rho(X^T X / n)`` for ``X`` with columns scaled to ``|x_j|^2 = n``: Bradley et
    al.'s (2011) largest number of simultaneous updates for which Shotgun's convergence
    bound still improves linearly (modeled; 1 when all columns are equal, ``d`` when they
    are orthogonal)."""
    check_tensor("x", x, ndim=2, floating=True)
    x = check_problem(x, x[:, 0], 1.0)[0]
    n = x.shape[0]
    z = x / x.norm(dim=0) * n ** 0.5
    return x.shape[1] / float(torch.linalg.eigvalsh(z.T @ z / n)[-1])


def round_time_model(workers: int, rows: int, ranks: int, *, madd_s: float,
                     latency_s: float) -> float:
    """Modeled seconds per round: ``2 (rows / ranks) workers madd_s + 2 latency_s`` (module
    docstring); ``rows / ranks`` rounded up, as the largest shard sets the pace."""
    workers, rows = check_int("workers", workers, lo=1), check_int("rows", rows, lo=1)
    ranks = check_int("ranks", ranks, lo=1)
    madd_s = check_float("madd_s", madd_s, lo=0)
    latency_s = check_float("latency_s", latency_s, lo=0)
    return 2 * -(-rows // ranks) * workers * madd_s + 2 * latency_s


def _sklearn_trace(x, y, alpha, epochs, repeat):
    """(updates, median seconds, objective) of scikit-learn's fit for each epoch count."""
    d = x.shape[1]
    out = []
    for k in epochs:
        ts = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            _, f = sklearn_lasso(x, y, alpha, max_iter=k, tol=0.0)
            ts.append(time.perf_counter() - t0)
        out.append((k * d, statistics.median(ts), f))
    return out


def timed_runs(x: torch.Tensor, y: torch.Tensor, alpha: float, f_star: float, *,
               workers: int = 8, rounds: int = 300, world_size: int = 2, rho: float = 0.5,
               seed: int = 0, sklearn_epochs: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
               repeat: int = 3) -> dict[str, dict[str, list[float]]]:
    """Measured traces ``{name: {"updates", "seconds", "gap"}}`` (gap: :func:`relative_gap`
    to ``f_star``) of ``"sklearn (serial)"`` (one fit per entry of ``sklearn_epochs``,
    median of ``repeat`` fits each, its own wall time; points before the first epoch are
    not observable), ``"cyclic (serial, ours)"`` (:func:`solve` in this process,
    ``rounds * workers`` single-coordinate rounds, one thread), and ``"shotgun"`` and
    ``"strads"`` on ``world_size`` gloo ranks with ``workers`` coordinates a round.
    A diverged run's trace stops where it was stopped."""
    from parlearn.core.device import threads

    x, y, alpha = check_problem(x, y, alpha)
    f_star = check_float("f_star", f_star)
    if f_star == 0:
        raise ValueError("f_star must not be 0: the gaps are relative to |f_star|")
    check_int("workers", workers, lo=1, hi=x.shape[1])
    check_int("rounds", rounds, lo=0)
    check_int("world_size", world_size, lo=1, hi=x.shape[0])
    check_float("rho", rho, lo=0, hi=1, lo_open=True)
    check_int("seed", seed, lo=0)
    if not isinstance(sklearn_epochs, list | tuple) or not sklearn_epochs:
        raise TypeError(f"sklearn_epochs must be a non-empty tuple of ints >= 1, got "
                        f"{sklearn_epochs!r}")
    for e in sklearn_epochs:
        check_int("sklearn_epochs", e, lo=1)
    check_int("repeat", repeat, lo=1)
    out: dict[str, dict[str, list[float]]] = {}
    sk = _sklearn_trace(x, y, alpha, sklearn_epochs, repeat)
    out["sklearn (serial)"] = {"updates": [u for u, _, _ in sk], "seconds": [t for _, t, _ in sk],
                               "gap": [relative_gap(f, f_star) for _, _, f in sk]}
    with threads(1):
        ser = solve(x, y, alpha, workers=1, rounds=rounds * workers, schedule="cyclic")
    runs = {"cyclic (serial, ours)": ser}
    for kind in ("shotgun", "strads"):
        runs[kind] = run_ranks(x, y, alpha, world_size=world_size, workers=workers,
                               rounds=rounds, schedule=kind, rho=rho, seed=seed)
    for name, r in runs.items():
        out[name] = {"updates": list(r.updates), "seconds": list(r.seconds),
                     "gap": [relative_gap(f, f_star) for f in r.objective]}
    return out


def time_to_gap(trace: dict[str, list[float]], target: float) -> float:
    """The first wall time at which ``trace["gap"]`` is at or below ``target``
    (``inf`` if never)."""
    if not isinstance(trace, dict) or not {"seconds", "gap"} <= set(trace):
        raise TypeError(f"trace must be a dict with 'seconds' and 'gap', got {trace!r}")
    if len(trace["seconds"]) != len(trace["gap"]):
        raise ValueError(f"trace's 'seconds' and 'gap' must be as long, got "
                         f"{len(trace['seconds'])} and {len(trace['gap'])}")
    target = check_float("target", target, lo=0, lo_open=True)
    return next((t for t, g in zip(trace["seconds"], trace["gap"], strict=True) if g <= target),
                float("inf"))


def _gap_at(trace: dict[str, list[float]], seconds: float) -> float:
    """The gap of the last point measured at or before ``seconds`` (``inf`` if none)."""
    seen = [g for t, g in zip(trace["seconds"], trace["gap"], strict=True) if t <= seconds]
    return seen[-1] if seen else float("inf")


def bench(device: torch.device, quick: bool) -> list:
    """Rows for ``python -m parlearn.bench strads``, on the CPU (``device`` is not used: the
    ranks are CPU processes). Lesson 25's correlated Lasso (``correlated_design``: 40
    columns in 4 groups, correlation 0.9; ``n`` rows), STRADS with ``P = 8`` coordinates a
    round on 2 gloo ranks against scikit-learn's serial coordinate descent (the engine a
    user would call) and our serial cyclic rounds.

    Row 1: coordinate updates per second, STRADS / scikit-learn; scikit-learn's rate from a
    fit of 500 epochs (``tol=0``), so its fixed overhead is amortised. Medians of ``repeat``
    runs, not interleaved: each rank run is its own launch. Row 2: time to a relative
    objective gap of ``1e-6``, scikit-learn / STRADS (scikit-learn's from fits of 1, 2, 4,
    ... epochs), with the gap each had reached at STRADS's finishing time in the detail
    (objective gap at equal wall time)."""
    from parlearn.core.bench import Row

    del device
    n, rounds, repeat = (2000, 1000, 3) if quick else (20000, 1000, 5)
    where = f"2 gloo ranks on CPU ({os.cpu_count()} cores), 1 thread each"
    x, y, _ = correlated_design(n, 40, groups=4, corr=0.9, k_true=6, seed=0)
    alpha = 0.1
    _, f_star = sklearn_lasso(x, y, alpha)
    sk_fit = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sklearn_lasso(x, y, alpha, max_iter=500, tol=0.0)
        sk_fit.append(time.perf_counter() - t0)
    traces = [timed_runs(x, y, alpha, f_star, workers=8, rounds=rounds, seed=s, repeat=1,
                         sklearn_epochs=tuple(2 ** k for k in range(9)))
              for s in range(repeat)]
    ups = {name: statistics.median(tr[name]["updates"][-1] / tr[name]["seconds"][-1]
                                   for tr in traces)
           for name in traces[0]}
    ups["sklearn (serial)"] = 500 * x.shape[1] / statistics.median(sk_fit)
    t_done = {name: statistics.median(time_to_gap(tr[name], 1e-6) for tr in traces)
              for name in traces[0]}
    at = statistics.median(tr["strads"]["seconds"][-1] for tr in traces)
    gaps = {name: statistics.median(_gap_at(tr[name], at) for tr in traces) for name in traces[0]}
    base = "scikit-learn Lasso (serial cyclic CD, compiled)"
    row1 = Row("strads", base, "STRADS, P=8 per round, 2 ranks: updates/s",
               ups["strads"] / ups["sklearn (serial)"], where,
               detail=f"n={n}, d=40; updates/s: sklearn {ups['sklearn (serial)']:.3g} (500-"
                      f"epoch fit), ours serial {ups['cyclic (serial, ours)']:.3g}, shotgun "
                      f"{ups['shotgun']:.3g} (until it diverged, where it did), strads "
                      f"{ups['strads']:.3g} "
                      f"(medians of {repeat} runs, each its own launch; not interleaved; "
                      f"measured under whatever load the machine has)")
    reached = math.isfinite(t_done["strads"])
    ratio = t_done["sklearn (serial)"] / t_done["strads"] if reached else 0.0
    row2 = Row("strads", base, "STRADS, P=8, 2 ranks: time to gap 1e-6", ratio, where,
               target="same optimum (gap < 1e-6)", met=reached,
               detail=("" if reached else f"STRADS did not reach 1e-6 in {rounds} rounds "
                       "(ratio set to 0); ")
               + "seconds to gap 1e-6: " + ", ".join(f"{k} {v:.3g}" for k, v in t_done.items())
               + f"; gap at STRADS's finishing time {at:.3g} s: " + ", ".join(
                   f"{k} {v:.2g}" for k, v in gaps.items()))
    return [row1, row2]
