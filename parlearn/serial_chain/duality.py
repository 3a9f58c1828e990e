"""Parallel networks and convexity: weight decay, the nuclear norm, the duality gap (lesson 26).

Wang, Ergen & Pilanci (ICLR 2023, arXiv 2110.06482) ask when training a regularised deep
network is secretly a convex problem. This module is the computable core of that question for
**linear** networks fitted to a target matrix ``M`` (whitened data: ``X^T X = I``, so fitting
``X W ~ Y`` is fitting ``W ~ M = X^T Y``). Only the paper's abstract and introduction could be
read; what is below is our own derivation, and the regulariser of the parallel architecture is a
**reconstruction** (see :data:`REGULARISERS`).

* **Two layers** (``W = U V^T``): ``min_{U V^T = W} (|U|^2 + |V|^2) / 2 = |W|_*``, so weight-decayed
  training ``min 1/2 |U V^T - M|^2 + lam (|U|^2 + |V|^2) / 2`` has the value of the convex problem
  ``min_W 1/2 |W - M|^2 + lam |W|_*``, solved in closed form by singular-value thresholding
  (:func:`svt`, :func:`svt_value`); :func:`train` runs gradient descent on the factors.
* **Deeper, one branch** (``W = W_1 ... W_L``, weight decay): the least weight decay of a
  factorisation is ``(L/2) sum_i s_i^(2/L)`` (:func:`standard_min_norm`), a Schatten
  quasi-norm, not convex for ``L >= 3``; the dual of the rescaled problem gives
  ``(L/2) |W|_*^(2/L)`` (:func:`standard_dual`; reconstruction of the paper's closed forms).
* **Parallel** (``f = sum_k W_{1,k} ... W_{L,k}``, ``K`` branches summed *inside the network*;
  "parallel" is the architecture, not devices): with the regulariser ``(1/L) sum_{k,l}
  |W_{l,k}|_F^L`` the training value is at least the convex value for every ``K``, equals it
  once ``K >= rank(svt(M, lam))`` (:func:`rank_one_branches` builds the optimum), and stays
  strictly above it for fewer branches when ``L >= 3`` (proofs in lesson 26). The ``K``
  branches run in one batched call (:func:`end_to_end`), checked against a loop over branches
  (:func:`end_to_end_loop`).

All matrices are float64 by default; every random function takes a ``seed``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from parlearn.core.checks import (
    check_callable,
    check_choice,
    check_float,
    check_int,
    check_seed,
    check_tensor,
)

__all__ = ["REGULARISERS", "make_target", "singular_values", "numerical_rank", "nuclear_norm",
           "svt", "svt_value", "convex_objective", "balanced_factors", "standard_min_norm",
           "standard_dual", "init_branches", "end_to_end", "end_to_end_loop", "regulariser",
           "objective", "rank_one_branches", "branch_upper_bound", "TrainResult", "train",
           "gap_table"]

# "weight_decay": 1/2 sum_{k,l} |W_{l,k}|_F^2, the usual weight decay.
# "parallel": (1/L) sum_{k,l} |W_{l,k}|_F^L, our reconstruction of the paper's modified
# regulariser (its abstract says only "modifying the regularization"). By AM-GM its minimum over
# rescalings of one branch is prod_l |W_{l,k}|_F; products of unit-norm layers have the
# nuclear-norm ball as their convex hull, which is why the nuclear norm appears.
# For L = 2 the two are the same function.
REGULARISERS = ("weight_decay", "parallel")


def _matrix(name: str, value: object) -> torch.Tensor:
    return check_tensor(name, value, ndim=2, floating=True, finite=True)


def make_target(spectrum: Sequence[float], rows: int, cols: int, *, seed: int = 0,
                dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``M = U diag(spectrum) V^T`` with random orthonormal ``U`` (rows x r), ``V`` (cols x r)."""
    rows, cols = check_int("rows", rows, lo=1), check_int("cols", cols, lo=1)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    s = [check_float("spectrum", v, lo=0.0) for v in spectrum]
    if not 1 <= len(s) <= min(rows, cols):
        raise ValueError(f"spectrum must have 1..min(rows, cols) = {min(rows, cols)} values, "
                         f"got {len(s)}")
    g = torch.Generator().manual_seed(check_int("seed", seed, lo=0))
    u, _ = torch.linalg.qr(torch.randn(rows, len(s), generator=g, dtype=dtype))
    v, _ = torch.linalg.qr(torch.randn(cols, len(s), generator=g, dtype=dtype))
    return u @ torch.diag(torch.tensor(s, dtype=dtype)) @ v.T


def singular_values(w: torch.Tensor) -> torch.Tensor:
    """Singular values of ``w``, largest first."""
    return torch.linalg.svdvals(_matrix("w", w))


def numerical_rank(w: torch.Tensor, tol: float = 1e-6) -> int:
    """Number of singular values above ``tol`` times the largest (0 for the zero matrix)."""
    tol = check_float("tol", tol, lo=0.0, lo_open=True)
    s = singular_values(w)
    return 0 if s.numel() == 0 or s[0] == 0 else int((s > tol * s[0]).sum())


def nuclear_norm(w: torch.Tensor) -> float:
    """``|w|_*``: the sum of the singular values."""
    return float(singular_values(w).sum())


def svt(m: torch.Tensor, lam: float) -> torch.Tensor:
    """Singular-value thresholding: ``U diag(max(s - lam, 0)) V^T``, the unique minimiser of
    ``1/2 |W - m|_F^2 + lam |W|_*`` (the proximal operator of the nuclear norm)."""
    m, lam = _matrix("m", m), check_float("lam", lam, lo=0.0)
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    return u @ torch.diag((s - lam).clamp_min(0.0)) @ vh


def svt_value(m: torch.Tensor, lam: float) -> float:
    """The optimal value of ``min_W 1/2 |W - m|^2 + lam |W|_*`` in closed form: per singular
    value ``s``, ``s^2 / 2`` if ``s <= lam`` (thresholded to zero) else ``lam s - lam^2 / 2``."""
    m, lam = _matrix("m", m), check_float("lam", lam, lo=0.0)
    s = singular_values(m)
    return float(torch.where(s <= lam, 0.5 * s**2, lam * s - 0.5 * lam**2).sum())


def convex_objective(w: torch.Tensor, m: torch.Tensor, lam: float) -> float:
    """``1/2 |w - m|_F^2 + lam |w|_*``, the convex problem that SVT solves."""
    w, m, lam = _matrix("w", w), _matrix("m", m), check_float("lam", lam, lo=0.0)
    if w.shape != m.shape:
        raise ValueError(f"w must have m's shape {tuple(m.shape)}, got {tuple(w.shape)}")
    return float(0.5 * (w - m).pow(2).sum() + lam * singular_values(w).sum())


def _depth(depth: int) -> int:
    return check_int("depth", depth, lo=2)


def _above_roundoff(s: torch.Tensor) -> torch.Tensor:
    # s^(2/L) lifts round-off (1e-16 -> 2e-11 at L = 3), so singular values below the usual
    # numerical-rank tolerance (eps * min(shape) * s_max) count as the zeros they stand for
    tol = torch.finfo(s.dtype).eps * s.numel() * (s[0] if s.numel() else 0.0)
    return torch.where(s > tol, s, torch.zeros_like(s))


def balanced_factors(w: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """``depth`` matrices whose product is ``w``, each with ``|W_l|_F^2 = sum_i s_i^(2/L)``:
    ``U S^(1/L)``, then ``S^(1/L)`` (r x r) in the middle, then ``S^(1/L) V^T``; ``r`` is the
    number of singular values above round-off (at least 1). Their weight decay is
    :func:`standard_min_norm`, the least any factorisation reaches."""
    w, depth = _matrix("w", w), _depth(depth)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    r = max(1, int((_above_roundoff(s) > 0).sum()))
    root = torch.diag(s[:r] ** (1.0 / depth))
    return [u[:, :r] @ root] + [root.clone() for _ in range(depth - 2)] + [root @ vh[:r]]


def standard_min_norm(w: torch.Tensor, depth: int) -> float:
    """``min 1/2 sum_l |W_l|_F^2`` over ``W_1 ... W_L = w`` (wide enough layers):
    ``(L/2) sum_i s_i^(2/L)``, attained by :func:`balanced_factors`. For ``L = 2`` it is
    ``|w|_*``; for ``L >= 3`` a Schatten quasi-norm power, not convex. Singular values below
    round-off (``eps * min(shape) * s_max``) count as zero."""
    depth = _depth(depth)
    return float(depth / 2 * (_above_roundoff(singular_values(w)) ** (2.0 / depth)).sum())


def standard_dual(w: torch.Tensor, depth: int) -> float:
    """``(L/2) |w|_*^(2/L)``: the dual value of the same minimum-norm problem, from the convex
    hull of products of unit-norm layers (the nuclear-norm ball). Reconstruction of the paper's
    closed form for standard deep linear networks; never above :func:`standard_min_norm`, equal
    to it when ``L = 2`` or ``rank(w) <= 1``."""
    depth = _depth(depth)
    return float(depth / 2 * nuclear_norm(w) ** (2.0 / depth))


def _dims(rows: int, cols: int, depth: int, width: int) -> list[int]:
    return [rows] + [width] * (depth - 1) + [cols]


def init_branches(rows: int, cols: int, *, depth: int, branches: int, width: int,
                  scale: float = 0.5, seed: int | torch.Generator = 0,
                  dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """Random weights of ``branches`` parallel linear networks of ``depth`` layers, stacked:
    layer ``l`` is one tensor of shape ``(K, d_l, d_{l+1})`` with ``d = [rows, width, ...,
    width, cols]``. Entries are normal with standard deviation ``scale / sqrt(d_l)``."""
    rows, cols = check_int("rows", rows, lo=1), check_int("cols", cols, lo=1)
    depth, k = _depth(depth), check_int("branches", branches, lo=1)
    width, scale = check_int("width", width, lo=1), check_float("scale", scale, lo=0.0)
    seed = check_seed("seed", seed)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    d = _dims(rows, cols, depth, width)
    return [torch.randn(k, d[i], d[i + 1], generator=g, dtype=dtype) * (scale / d[i] ** 0.5)
            for i in range(depth)]


def _weights(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(weights, torch.Tensor) or len(weights) < 2:
        raise TypeError("weights must be a list of at least 2 tensors of shape (K, d_l, d_l+1)")
    ws = [check_tensor(f"weights[{i}]", w, ndim=3, floating=True) for i, w in enumerate(weights)]
    for i in range(len(ws) - 1):
        if ws[i].shape[0] != ws[i + 1].shape[0] or ws[i].shape[2] != ws[i + 1].shape[1]:
            raise ValueError(f"weights[{i}] {tuple(ws[i].shape)} and weights[{i + 1}] "
                             f"{tuple(ws[i + 1].shape)} do not chain (same K, matching inner size)")
    return ws


def end_to_end(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_k W_{1,k} ... W_{L,k}``: all ``K`` branches in one batched product (``torch.bmm``
    over the branch axis), then summed: the network's end-to-end matrix."""
    return _chain(_weights(weights)).sum(0)


def _chain(ws: list[torch.Tensor]) -> torch.Tensor:
    prod = ws[0]
    for w in ws[1:]:
        prod = torch.bmm(prod, w)
    return prod            # (K, rows, cols): each branch's product


def end_to_end_loop(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The serial reference of :func:`end_to_end`: one branch at a time, in a Python loop."""
    ws = _weights(weights)
    total = torch.zeros(ws[0].shape[1], ws[-1].shape[2], dtype=ws[0].dtype, device=ws[0].device)
    for k in range(ws[0].shape[0]):
        prod = ws[0][k]
        for w in ws[1:]:
            prod = prod @ w[k]
        total = total + prod
    return total


def regulariser(weights: Sequence[torch.Tensor], reg: str = "parallel") -> torch.Tensor:
    """``1/2 sum_{k,l} |W_{l,k}|_F^2`` (``reg="weight_decay"``) or ``(1/L) sum_{k,l}
    |W_{l,k}|_F^L`` (``reg="parallel"``, reconstruction), as a differentiable scalar."""
    return _reg(_weights(weights), check_choice("reg", reg, REGULARISERS))


def _reg(ws: list[torch.Tensor], reg: str) -> torch.Tensor:
    # one norm per branch and layer: flatten each (d_l, d_l+1) block, keep the branch axis
    norms = torch.stack([w.flatten(1).norm(dim=1) for w in ws])   # (L, K)
    if reg == "weight_decay":
        return 0.5 * norms.pow(2).sum()
    return norms.pow(len(ws)).sum() / len(ws)


def objective(weights: Sequence[torch.Tensor], m: torch.Tensor, lam: float,
              reg: str = "parallel") -> torch.Tensor:
    """Training objective ``1/2 |sum_k W_{1,k} ... W_{L,k} - m|_F^2 + lam * regulariser``."""
    m, lam = _matrix("m", m), check_float("lam", lam, lo=0.0)
    ws, reg = _weights(weights), check_choice("reg", reg, REGULARISERS)
    shape = (ws[0].shape[1], ws[-1].shape[2])
    if tuple(m.shape) != shape:
        raise ValueError(f"m must have shape {shape} (the network's), got {tuple(m.shape)}")
    return _objective(ws, m, lam, reg)


def _objective(ws: list[torch.Tensor], m: torch.Tensor, lam: float, reg: str) -> torch.Tensor:
    # unchecked: the callers check once, and the training loop calls this thousands of times
    return 0.5 * (_chain(ws).sum(0) - m).pow(2).sum() + lam * _reg(ws, reg)


def rank_one_branches(m: torch.Tensor, lam: float, *, depth: int, branches: int,
                      width: int) -> list[torch.Tensor]:
    """Weights built from ``svt(m, lam)``: branch ``i < K`` carries ``t_i u_i v_i^T``
    (``t_i = max(s_i - lam, 0)``) as a rank-1 chain whose every layer has Frobenius norm
    ``t_i^(1/L)``; other branches are zero. Its ``reg="parallel"`` objective is
    :func:`branch_upper_bound`, which is the convex optimum :func:`svt_value` once
    ``branches >= rank(svt(m, lam))``: then no weights can do better."""
    m, lam = _matrix("m", m), check_float("lam", lam, lo=0.0)
    depth, k = _depth(depth), check_int("branches", branches, lo=1)
    width = check_int("width", width, lo=1)
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    t = (s - lam).clamp_min(0.0)
    d = _dims(*m.shape, depth, width)
    ws = [torch.zeros(k, d[i], d[i + 1], dtype=m.dtype, device=m.device) for i in range(depth)]
    for i in range(min(k, int((t > 0).sum()))):
        root = t[i] ** (1.0 / depth)
        ws[0][i, :, 0] = u[:, i] * root
        for w in ws[1:-1]:
            w[i, 0, 0] = root
        ws[-1][i, 0, :] = vh[i] * root
    return ws


def branch_upper_bound(m: torch.Tensor, lam: float, branches: int) -> float:
    """Objective of :func:`rank_one_branches`: ``svt_value + 1/2 sum_{i > K} max(s_i - lam, 0)^2``
    (the thresholded singular values that ``K`` rank-1 branches cannot carry are left out).
    An upper bound on the ``K``-branch optimum at every depth; equal to ``svt_value`` for
    ``K >= rank(svt(m, lam))``."""
    k = check_int("branches", branches, lo=1)
    t = (singular_values(m) - check_float("lam", lam, lo=0.0)).clamp_min(0.0)
    return svt_value(m, lam) + float(0.5 * t[k:].pow(2).sum())


@dataclass
class TrainResult:
    """What :func:`train` returns: the weights, the objective every ``record_every`` steps
    (``steps`` and ``values``), and the final end-to-end matrix and objective."""

    weights: list[torch.Tensor]
    steps: list[int]
    values: list[float]
    matrix: torch.Tensor
    final: float


def train(m: torch.Tensor, lam: float, *, depth: int = 2, branches: int = 1,
          width: int | None = None, reg: str = "parallel", steps: int = 3000,
          lr: float = 0.05, scale: float = 0.5, seed: int = 0, record_every: int = 10,
          progress: Callable[[float], None] | None = None) -> TrainResult:
    """Plain full-batch gradient descent on :func:`objective` from :func:`init_branches`
    (``width`` defaults to ``min(m.shape)``), on ``m``'s device and dtype. Gradients come from
    ``torch.autograd.grad`` on weights of its own, so no ``.grad`` is touched. Stops early
    (``final`` is then non-finite) if the objective overflows: a step too large."""
    m, lam = _matrix("m", m), check_float("lam", lam, lo=0.0)
    reg = check_choice("reg", reg, REGULARISERS)
    steps, lr = check_int("steps", steps, lo=1), check_float("lr", lr, lo=0.0, lo_open=True)
    record_every = check_int("record_every", record_every, lo=1)
    if progress is not None:
        check_callable("progress", progress)
    width = min(m.shape) if width is None else width
    # drawn on the CPU (a CPU generator gives the same start on every device), then moved
    ws = [w.to(m.device).requires_grad_(True) for w in init_branches(
        *m.shape, depth=depth, branches=branches, width=width, scale=scale, seed=seed,
        dtype=m.dtype)]
    rec_steps, values = [], []
    with torch.enable_grad():
        for step in range(steps + 1):
            f = _objective(ws, m, lam, reg)
            finite = bool(torch.isfinite(f))
            if step % record_every == 0 or step == steps or not finite:
                rec_steps.append(step)
                values.append(float(f.detach()))
                if progress is not None:
                    progress(step / steps)
            if step == steps or not finite:
                break
            grads = torch.autograd.grad(f, ws)
            with torch.no_grad():
                for w, g in zip(ws, grads, strict=True):
                    w.sub_(lr * g)
    out = [w.detach() for w in ws]
    return TrainResult(out, rec_steps, values, end_to_end(out), values[-1])


def gap_table(m: torch.Tensor, lam: float, *, depths: Sequence[int], branch_counts: Sequence[int],
              seeds: Sequence[int] = (0, 1), steps: int = 3000, lr: float = 0.05,
              width: int | None = None, converged_tol: float = 1e-3,
              progress: Callable[[float, str], None] | None = None) -> list[dict]:
    """For each depth ``L`` and branch count ``K``: gradient descent (``reg="parallel"``) from
    each seed, and the best final objective beside the convex optimum :func:`svt_value`.

    Each row: ``depth``, ``branches``, ``trained`` (best over seeds, measured), ``convex``
    (closed form), ``gap = trained - convex`` (an upper bound on the true gap, since gradient
    descent may stop short of the global minimum; the lower bound 0 is proven), ``upper``
    (:func:`branch_upper_bound`, reached by rank-1 branches at every depth), ``rank``
    (numerical rank of the best run's end-to-end matrix) and ``rank_svt``; ``drop``, how much
    the best run's objective still fell over (about) the last tenth of its steps, and ``converged``,
    ``drop <= converged_tol * |gap| + 1e-12``. A run still falling that fast has not reached
    a stationary value: its ``gap`` says how far gradient descent got, not what the optimum
    is (e.g. a superfluous branch of a deep net shrinks only polynomially slowly)."""
    m, lam = _matrix("m", m), check_float("lam", lam, lo=0.0)
    for name, seq in (("depths", depths), ("branch_counts", branch_counts), ("seeds", seeds)):
        if not isinstance(seq, list | tuple | range):
            raise TypeError(f"{name} must be a list of ints, got {seq!r}")
    check_int("steps", steps, lo=1)
    check_float("lr", lr, lo=0.0, lo_open=True)
    converged_tol = check_float("converged_tol", converged_tol, lo=0.0)
    if width is not None:
        check_int("width", width, lo=1)
    if progress is not None:
        check_callable("progress", progress)
    depths = [check_int("depths", d, lo=2) for d in depths]
    counts = [check_int("branch_counts", k, lo=1) for k in branch_counts]
    seeds = [check_int("seeds", s, lo=0) for s in seeds]
    if not depths or not counts or not seeds:
        raise ValueError("depths, branch_counts and seeds must each be non-empty")
    convex, rank_svt = svt_value(m, lam), numerical_rank(svt(m, lam))
    rows, total, done = [], len(depths) * len(counts) * len(seeds), 0
    for depth in depths:
        for k in counts:
            runs = []
            for s in seeds:
                runs.append(train(m, lam, depth=depth, branches=k, width=width, steps=steps,
                                  lr=lr, seed=s, record_every=max(1, steps // 10)))
                done += 1
                if progress is not None:
                    progress(done / total, f"L={depth}, K={k}, seed {s}")
            best = min(runs, key=lambda r: r.final)
            gap = best.final - convex
            drop = best.values[-2] - best.values[-1] if len(best.values) > 1 else 0.0
            rows.append({"depth": depth, "branches": k, "trained": best.final, "convex": convex,
                         "upper": branch_upper_bound(m, lam, k),
                         "gap": gap, "rank": numerical_rank(best.matrix, 1e-4),
                         "rank_svt": rank_svt, "drop": drop,
                         "converged": bool(drop <= converged_tol * abs(gap) + 1e-12)})
    return rows
