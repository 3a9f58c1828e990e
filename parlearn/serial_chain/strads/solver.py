"""The Lasso, its serial reference, the two ways of picking P coordinates at once, and the
single-process solver that runs any of them.

Objective (scikit-learn's scaling, exactly): for ``X`` of shape ``(n, d)``,
``F(w) = |y - X w|^2 / (2 n) + alpha |w|_1``. With the residual ``r = y - X w`` and
``c_j = |x_j|^2 / n``, the exact minimiser over coordinate ``j`` alone is

    w_j <- S(x_j^T r / n + c_j w_j, alpha) / c_j,     S(z, a) = sign(z) max(|z| - a, 0),

the coordinate update of scikit-learn's ``Lasso`` (cyclic coordinate descent). A *round*
updates a set ``S`` of coordinates **at once** from the same residual (every worker takes
its update without seeing the others'), then the residual takes all of them:

- ``"cyclic"``: ``|S| = 1``, coordinates ``0, 1, ..., d-1, 0, ...``: scikit-learn's order,
  the serial reference (:func:`sklearn_lasso` is the real engine);
- ``"shotgun"`` (Bradley et al. 2011): ``P`` coordinates drawn uniformly, no schedule;
- ``"strads"`` (Lee et al. 2014): :func:`strads_schedule`, ``P`` coordinates drawn by
  priority and filtered to a nearly independent set.

:func:`solve` runs rounds in one process. Its ``shards`` argument computes every
``x_j^T r`` as the sum of partial sums over row blocks, in rank order, as
:func:`parlearn.serial_chain.strads.ranks.run_ranks` does across gloo ranks, so the two
differ only by the order of a few additions.
"""

from __future__ import annotations

import math
import numbers
import time
import warnings
from dataclasses import dataclass, field

import torch

from parlearn.core.checks import (
    check_choice,
    check_float,
    check_int,
    check_seed,
    check_tensor,
)

__all__ = ["SCHEDULES", "correlated_design", "objective", "soft_threshold", "sklearn_lasso",
           "column_correlations", "priorities", "dependency_filter", "strads_schedule",
           "shotgun_schedule", "cyclic_schedule", "LassoRun", "round_update", "solve",
           "relative_gap", "check_problem"]

SCHEDULES = ("cyclic", "shotgun", "strads")


# ---------------------------------------------------------------------------------------
# The problem.

def correlated_design(n: int, d: int, *, groups: int = 10, corr: float = 0.9,
                      k_true: int = 10, noise: float = 0.1, seed: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float64 design with correlated columns, and a sparse regression target.

    Columns fall into ``groups`` groups (column ``j`` in group ``j % groups``); column ``j``
    is ``sqrt(corr) f_g + sqrt(1 - corr) e_j`` with ``f_g`` the group's shared factor and
    ``e_j`` its own noise, all standard normal, so two columns of one group have
    correlation ``corr`` in expectation, of different groups 0. Columns are then centred and
    scaled to ``|x_j|^2 = n`` (so ``x_j^T x_k / n`` is their sample correlation).
    ``y = X w_true + noise * N(0, 1)`` with ``k_true`` non-zero weights of +-1 to +-2.
    Returns ``(X, y, w_true)``; a private generator from ``seed``."""
    n, d = check_int("n", n, lo=2), check_int("d", d, lo=1)
    groups = check_int("groups", groups, lo=1, hi=d)
    corr = check_float("corr", corr, lo=0, hi=1, hi_open=True)
    k_true = check_int("k_true", k_true, lo=0, hi=d)
    noise = check_float("noise", noise, lo=0)
    gen = torch.Generator().manual_seed(check_int("seed", seed, lo=0))
    f = torch.randn(n, groups, generator=gen, dtype=torch.float64)
    e = torch.randn(n, d, generator=gen, dtype=torch.float64)
    x = math.sqrt(corr) * f[:, torch.arange(d) % groups] + math.sqrt(1 - corr) * e
    x = x - x.mean(0)
    x = x / x.norm(dim=0) * math.sqrt(n)
    w = torch.zeros(d, dtype=torch.float64)
    idx = torch.randperm(d, generator=gen)[:k_true]
    sign = torch.randint(0, 2, (k_true,), generator=gen).to(torch.float64) * 2 - 1
    w[idx] = sign * (1 + torch.rand(k_true, generator=gen, dtype=torch.float64))
    y = x @ w + noise * torch.randn(n, generator=gen, dtype=torch.float64)
    return x, y, w


def check_problem(x, y, alpha) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(X, y, alpha)`` checked: ``X`` a 2-D float tensor with no zero column, ``y`` of
    length ``n`` and the same dtype, ``alpha > 0``."""
    x = check_tensor("x", x, ndim=2, floating=True, finite=True)
    y = check_tensor("y", y, shape=(x.shape[0],), floating=True, finite=True)
    if y.dtype != x.dtype:
        raise TypeError(f"y must have X's dtype {x.dtype}, got {y.dtype}")
    if bool((x.norm(dim=0) == 0).any()):
        raise ValueError("x must have no all-zero column (its coordinate update divides by "
                         "|x_j|^2)")
    return x, y, check_float("alpha", alpha, lo=0, lo_open=True)


def objective(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, alpha: float) -> float:
    """``|y - X w|^2 / (2 n) + alpha |w|_1``: scikit-learn's Lasso objective."""
    x, y, alpha = check_problem(x, y, alpha)
    w = check_tensor("w", w, shape=(x.shape[1],), floating=True)
    return float((y - x @ w).square().sum() / (2 * x.shape[0]) + alpha * w.abs().sum())


def relative_gap(value: float, optimum: float) -> float:
    """``(F - F*) / |F*|``: how far above the optimum an objective value is."""
    value = check_float("value", value)
    optimum = check_float("optimum", optimum)
    if optimum == 0:
        raise ValueError("optimum must not be 0: the gap is relative to |optimum|")
    return (value - optimum) / abs(optimum)


def soft_threshold(z: torch.Tensor, a: float) -> torch.Tensor:
    """``sign(z) max(|z| - a, 0)``, elementwise: the proximal map of ``a |.|``."""
    check_tensor("z", z, floating=True)
    a = check_float("a", a, lo=0)
    return torch.sign(z) * torch.clamp(z.abs() - a, min=0.0)


def sklearn_lasso(x: torch.Tensor, y: torch.Tensor, alpha: float, *, max_iter: int = 100_000,
                  tol: float = 1e-12) -> tuple[torch.Tensor, float]:
    """scikit-learn's ``Lasso(alpha, fit_intercept=False)`` (cyclic coordinate descent,
    compiled): the serial engine a user would call. Returns ``(w, F(w))``. With ``tol=0``
    it runs exactly ``max_iter`` epochs (its non-convergence warning is silenced here)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import Lasso

    x, y, alpha = check_problem(x, y, alpha)
    max_iter = check_int("max_iter", max_iter, lo=1)
    tol = check_float("tol", tol, lo=0)
    model = Lasso(alpha=alpha, fit_intercept=False, max_iter=max_iter, tol=tol,
                  selection="cyclic")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(x.numpy(), y.numpy())
    w = torch.from_numpy(model.coef_.copy()).to(x.dtype)
    return w, objective(x, y, w, alpha)


# ---------------------------------------------------------------------------------------
# Schedules: which coordinates one round updates.

def column_correlations(gram: torch.Tensor) -> torch.Tensor:
    """``|x_j^T x_k| / (|x_j| |x_k|)`` from the Gram matrix ``X^T X``: the quantity the
    dependency filter compares with ``rho`` (for columns scaled to one length, as the
    paper assumes, it is ``|x_j^T x_k|`` up to that scale)."""
    gram = check_tensor("gram", gram, ndim=2, floating=True, finite=True)
    if gram.shape[0] != gram.shape[1]:
        raise ValueError(f"gram must be square (X^T X), got shape {tuple(gram.shape)}")
    if bool((gram.diagonal() <= 0).any()):
        raise ValueError("gram must have a positive diagonal (no all-zero column of X)")
    norm = gram.diagonal().sqrt()
    return (gram / norm[:, None] / norm[None, :]).abs()


def priorities(last_change: torch.Tensor, floor: float) -> torch.Tensor:
    """STRADS's sampling weights ``p_j = (delta w_j)^2 + floor``: coordinates that moved
    recently are likely to move again; the floor keeps every coordinate in play."""
    check_tensor("last_change", last_change, ndim=1, floating=True, finite=True)
    floor = check_float("floor", floor, lo=0, lo_open=True)
    return last_change.square() + floor


def dependency_filter(candidates: torch.Tensor, corr: torch.Tensor, rho: float,
                      workers: int) -> torch.Tensor:
    """Go through ``candidates`` in order and keep a coordinate when its correlation with
    every coordinate kept so far is below ``rho`` (``corr`` from
    :func:`column_correlations`); stop at ``workers`` kept. Greedy, so the first
    candidate (the highest-priority draw) is always kept. ``rho`` in (0, 1] (a correlation;
    at 1 only perfectly correlated pairs block each other), ``workers >= 1``."""
    corr = check_tensor("corr", corr, ndim=2, floating=True, finite=True)
    d = corr.shape[0]
    if corr.shape != (d, d):
        raise ValueError(f"corr must be square, got shape {tuple(corr.shape)}")
    _check_coordinates("candidates", candidates, d)
    rho = check_float("rho", rho, lo=0, hi=1, lo_open=True)
    workers = check_int("workers", workers, lo=1)
    kept: list[int] = []
    # blocked[k]: some kept coordinate has correlation >= rho with k. One row per keep
    # instead of one scalar per pair: the check is O(workers d), not O(candidates workers).
    blocked = torch.zeros(corr.shape[0], dtype=torch.bool)
    for j in candidates.tolist():
        if not blocked[j]:
            kept.append(j)
            if len(kept) == workers:
                break
            blocked |= corr[j] >= rho
    return torch.tensor(kept, dtype=torch.long)


def strads_schedule(last_change: torch.Tensor, corr: torch.Tensor, workers: int, *,
                    rho: float, floor: float, candidates: int,
                    gen: torch.Generator) -> torch.Tensor:
    """One STRADS round: draw ``candidates`` distinct coordinates with probability
    proportional to :func:`priorities`, then :func:`dependency_filter` them to at most
    ``workers`` with pairwise correlation below ``rho``.
    RECONSTRUCTION of Lee et al. (2014) from the paper's description of its Lasso
    scheduler: the greedy order of the check and the default number of candidates are
    ours."""
    priorities(last_change, floor)  # checks both
    d = last_change.shape[0]
    corr = check_tensor("corr", corr, shape=(d, d), floating=True, finite=True)
    workers = check_int("workers", workers, lo=1)
    rho = check_float("rho", rho, lo=0, hi=1, lo_open=True)
    candidates = check_int("candidates", candidates, lo=1)
    if candidates < workers:
        raise ValueError(f"candidates={candidates} must be at least workers={workers}")
    if not isinstance(gen, torch.Generator):
        raise TypeError(f"gen must be a torch.Generator, got {type(gen).__name__}")
    drawn = torch.multinomial(priorities(last_change, floor), min(candidates, d),
                              replacement=False, generator=gen)
    return dependency_filter(drawn, corr, rho, workers)


def shotgun_schedule(d: int, workers: int, gen: torch.Generator) -> torch.Tensor:
    """``workers`` distinct coordinates, uniformly: Shotgun's unscheduled parallel round
    (``1 <= workers <= d``: asking for more than ``d`` distinct ones is refused)."""
    d = check_int("d", d, lo=1)
    workers = check_int("workers", workers, lo=1, hi=d)
    if not isinstance(gen, torch.Generator):
        raise TypeError(f"gen must be a torch.Generator, got {type(gen).__name__}")
    return torch.randperm(d, generator=gen)[:workers]


def cyclic_schedule(step: int, d: int) -> torch.Tensor:
    """Round ``step`` of cyclic coordinate descent updates coordinate ``step % d`` alone."""
    step = check_int("step", step, lo=0)
    d = check_int("d", d, lo=1)
    return torch.tensor([step % d], dtype=torch.long)


# ---------------------------------------------------------------------------------------
# The solver in one process.

@dataclass
class LassoRun:
    """What :func:`solve` (or the ranks) did. ``objective[t]`` is ``F(w)`` before round
    ``t`` (one more entry at the end: after the last round); ``updates[t]`` the number of
    coordinate updates done before it; ``seconds[t]`` the wall time since the start;
    ``schedule[t]`` the coordinates of round ``t``. ``diverged`` is True when the run was
    stopped because ``F`` grew past ``1e6`` times its start (or became non-finite)."""

    w: torch.Tensor
    objective: list[float] = field(default_factory=list)
    updates: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    schedule: list[list[int]] = field(default_factory=list)
    diverged: bool = False

    def record(self, f: float, done: int, start: float) -> bool:
        """Note the objective ``f`` before a round, the updates ``done`` so far and the time
        since ``start``; True (and ``diverged`` set) when ``f`` is non-finite or past
        ``1e6`` times the first objective recorded."""
        self.objective.append(f)
        self.updates.append(done)
        self.seconds.append(time.perf_counter() - start)
        self.diverged = not math.isfinite(f) or f > 1e6 * self.objective[0]
        return self.diverged


def _blocks(n: int, shards: int) -> list[tuple[int, int]]:
    """Row ranges of ``shards`` near-equal contiguous blocks (rank ``p`` holds block ``p``)."""
    edges = [round(p * n / shards) for p in range(shards + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def round_update(z_sum: torch.Tensor, w_s: torch.Tensor, c_s: torch.Tensor, n: int,
                 alpha: float) -> torch.Tensor:
    """New values of the round's coordinates from ``z_sum = X_S^T r`` (summed over every
    row): ``S(X_S^T r / n + c_S w_S, alpha) / c_S``, each as if it were the only one."""
    z_sum = check_tensor("z_sum", z_sum, ndim=1, floating=True)
    check_tensor("w_s", w_s, shape=tuple(z_sum.shape), floating=True)
    check_tensor("c_s", c_s, shape=tuple(z_sum.shape), floating=True, finite=True)
    if bool((c_s <= 0).any()):
        raise ValueError("c_s must be positive (|x_j|^2 / n of a non-zero column)")
    n = check_int("n", n, lo=1)
    alpha = check_float("alpha", alpha, lo=0, lo_open=True)
    return soft_threshold(z_sum / n + c_s * w_s, alpha) / c_s


def _check_coordinates(name: str, coords, d: int) -> torch.Tensor:
    """A 1-D integer tensor of distinct coordinates in ``[0, d)`` (no negative index wraps)."""
    coords = check_tensor(name, coords, ndim=1, floating=False)
    if coords.numel() and (int(coords.min()) < 0 or int(coords.max()) >= d):
        raise ValueError(f"{name} must lie in [0, {d - 1}], got {coords.tolist()}")
    if coords.unique().numel() != coords.numel():
        raise ValueError(f"{name} must be distinct coordinates, got {coords.tolist()}")
    return coords


def _check_plan(workers: int, rounds: int, replay, d: int) -> None:
    """``workers <= d`` (distinct coordinates), and ``replay``, when given, lists at least
    ``rounds`` rounds of distinct coordinates in ``[0, d)``: a negative one would wrap."""
    if workers > d:
        raise ValueError(f"workers must be at most d={d} (one coordinate each), got {workers}")
    if replay is not None:
        if len(replay) < rounds:
            raise ValueError(f"replay must list at least rounds={rounds} rounds, got "
                             f"{len(replay)}")
        for t in range(rounds):
            try:
                coords = torch.as_tensor(replay[t], dtype=torch.long)
            except (TypeError, ValueError, RuntimeError) as err:
                raise TypeError(f"replay[{t}] must be a list of coordinates, got "
                                f"{replay[t]!r}") from err
            if any(isinstance(c, bool) or not isinstance(c, numbers.Integral)
                   for c in replay[t]):
                raise TypeError(f"replay[{t}] must hold ints, got {replay[t]!r}")
            _check_coordinates(f"replay[{t}]", coords, d)
            if coords.numel() == 0:
                raise ValueError(f"replay[{t}] must name at least one coordinate")


def _check_common(workers, rounds, schedule, rho, floor, candidates):
    workers = check_int("workers", workers, lo=1)
    rounds = check_int("rounds", rounds, lo=0)
    check_choice("schedule", schedule, SCHEDULES)
    if schedule == "cyclic" and workers != 1:
        raise ValueError(f"schedule='cyclic' updates one coordinate a round: workers must be "
                         f"1, got {workers}")
    rho = check_float("rho", rho, lo=0, hi=1, lo_open=True)
    floor = check_float("floor", floor, lo=0, lo_open=True)
    if candidates is None:
        candidates = workers * 4
    elif check_int("candidates", candidates, lo=1) < workers:
        raise ValueError(f"candidates={candidates} must be at least workers={workers}")
    return workers, rounds, rho, floor, candidates


class _Scheduler:
    """The round-by-round choice of coordinates, shared by :func:`solve` and the ranks."""

    def __init__(self, schedule, d, workers, corr, rho, floor, candidates, seed, replay):
        self.kind, self.d, self.workers, self.corr = schedule, d, workers, corr
        self.rho, self.floor, self.candidates, self.replay = rho, floor, candidates, replay
        self.gen = seed if isinstance(seed, torch.Generator) else \
            torch.Generator().manual_seed(seed)
        # Before any round every coordinate counts as having just moved by 1: equal weights.
        self.last_change = torch.ones(d, dtype=torch.float64)

    def next(self, t: int) -> torch.Tensor:
        if self.replay is not None:
            return torch.tensor(self.replay[t], dtype=torch.long)
        if self.kind == "cyclic":
            return cyclic_schedule(t, self.d)
        if self.kind == "shotgun":
            return shotgun_schedule(self.d, self.workers, self.gen)
        return strads_schedule(self.last_change, self.corr, self.workers, rho=self.rho,
                               floor=self.floor, candidates=self.candidates, gen=self.gen)

    def moved(self, s: torch.Tensor, delta: torch.Tensor) -> None:
        self.last_change[s] = delta.abs().to(torch.float64)


def solve(x: torch.Tensor, y: torch.Tensor, alpha: float, *, workers: int = 1,
          rounds: int = 1000, schedule: str = "strads", rho: float = 0.5,
          floor: float = 1e-6, candidates: int | None = None, seed: int | torch.Generator = 0,
          shards: int = 1, replay: list[list[int]] | None = None,
          w0: torch.Tensor | None = None) -> LassoRun:
    """Run ``rounds`` rounds of parallel coordinate descent in one process.

    Each round takes the coordinates ``S`` the ``schedule`` picks (``workers`` of them;
    STRADS may keep fewer when the candidates are too correlated), computes
    ``X_S^T r`` as the sum over ``shards`` row blocks of their partial sums, updates every
    ``w_j, j in S`` by :func:`round_update` from the same residual, then subtracts
    ``X_S delta_S`` from the residual. ``replay`` (a list of coordinate lists, e.g. a
    previous run's ``schedule``) replaces the schedule round by round. STRADS keeps
    ``candidates`` (default ``4 workers``) draws before the filter at ``rho``. ``w0``
    (default zeros) is the starting point. Stops early when the objective has diverged.
    Returns a :class:`LassoRun`."""
    x, y, alpha = check_problem(x, y, alpha)
    workers, rounds, rho, floor, candidates = _check_common(workers, rounds, schedule, rho,
                                                            floor, candidates)
    shards = check_int("shards", shards, lo=1, hi=x.shape[0])
    seed = check_seed("seed", seed)
    n, d = x.shape
    _check_plan(workers, rounds, replay, d)
    w = torch.zeros(d, dtype=x.dtype) if w0 is None else \
        check_tensor("w0", w0, shape=(d,), dtype=x.dtype, finite=True).clone()
    c = x.square().sum(0) / n
    corr = column_correlations(x.T @ x) if schedule == "strads" and replay is None else None
    sched = _Scheduler(schedule, d, workers, corr, rho, floor, candidates, seed, replay)
    blocks = _blocks(n, shards)
    xs = [x[a:b] for a, b in blocks]
    rs = [y[a:b] - xp @ w for (a, b), xp in zip(blocks, xs, strict=True)]
    out = LassoRun(w)
    start, done = time.perf_counter(), 0
    for t in range(rounds + 1):
        rr = sum(float(r @ r) for r in rs)
        if out.record(rr / (2 * n) + alpha * float(w.abs().sum()), done, start) or t == rounds:
            break
        s = sched.next(t)
        z = xs[0][:, s].T @ rs[0]
        for xp, r in zip(xs[1:], rs[1:], strict=True):
            z = z + xp[:, s].T @ r   # in rank order, as the gloo sum of two ranks adds them
        new = round_update(z, w[s], c[s], n, alpha)
        delta = new - w[s]
        w[s] = new
        for xp, r in zip(xs, rs, strict=True):
            r -= xp[:, s] @ delta
        sched.moved(s, delta)
        out.schedule.append(s.tolist())
        done += len(s)
    return out
