"""A generic MGRIT/FAS solver: N+1 dependent equations solved with batched calls.

The serial forward pass of a ResNet is a sweep of N dependent steps. Multigrid reduction
in time (MGRIT) solves the same N+1 equations iteratively, with most of its work batched
across layers:

* grid: all N+1 states; every m-th state is a C-point, the rest F-points;
* F-relaxation: from each C-point, step across its interval; all intervals at once,
  so m-1 batched calls instead of N sequential ones;
* C-relaxation: each C-point from the F-point before it (one batched call); FCF = F, C, F;
* coarse grid: the C-points, stepped by ``x + m h F(x, theta_{m i})`` (weights by injection);
* FAS two-grid cycle: relax, restrict by injection, form the coarse right-hand side
  with the tau correction, solve the coarse system (serially, or recursively: a
  V-cycle), correct the C-points, F-relax.

:func:`mgrit` knows nothing of networks: it takes a step function ``step(level, steps,
X)``, so the forward and the adjoint of
:mod:`parlearn.serial_chain.multigrid.layer_parallel` are the same solver.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from parlearn.core.checks import (
    check_bool,
    check_callable,
    check_choice,
    check_float,
    check_int,
    check_tensor,
)

__all__ = ["RELAX", "MGRITResult", "ConvergenceWarning", "mgrit", "residual",
           "exact_iterations"]

RELAX = ("F", "FCF")


# --- a generic MGRIT/FAS solver ----------------------------------------------------------

# step(level, steps, X) applies the level's propagator Phi_i to X[j] for the j-th step
# index i in ``steps`` (a slice: start, stop, stride) in one batched call.
StepFn = Callable[[int, slice, torch.Tensor], torch.Tensor]


class ConvergenceWarning(RuntimeWarning):
    """MGRIT stopped at its iteration cap before the residual reached ``tol``."""


@dataclass
class MGRITResult:
    """States (N+1, ...), iterations run, and the residual norm before the first and after
    every iteration (when recorded).

    ``converged`` is None when no ``tol`` was given, else whether the last residual is
    ``<= tol``. A run that misses its ``tol`` also emits a :class:`ConvergenceWarning`.
    """

    states: torch.Tensor
    residuals: list[float] = field(default_factory=list)
    iterations: int = 0
    tol: float | None = None
    converged: bool | None = None

    @property
    def output(self) -> torch.Tensor:
        return self.states[-1]


def _check_grid(n_steps: int, cfactor: int, levels: int) -> tuple[int, int]:
    cfactor = check_int("cfactor", cfactor, lo=1)
    levels = check_int("levels", levels, lo=1)
    if levels == 1:  # one serial sweep per iteration: no coarse grid, cfactor plays no part
        return cfactor, levels
    if cfactor < 2:
        raise ValueError(f"cfactor={cfactor} gives no coarse grid: use cfactor >= 2, or "
                         f"levels=1 for the serial solve")
    if cfactor > n_steps:
        raise ValueError(f"cfactor={cfactor} exceeds the number of layers N={n_steps}")
    if n_steps % cfactor ** (levels - 1):
        raise ValueError(f"N={n_steps} must be divisible by cfactor**(levels-1)="
                         f"{cfactor ** (levels - 1)} (short last intervals are not supported)")
    return cfactor, levels


def _check_solver_args(n: int, cfactor, levels, iters, tol, relax, *, iters_lo: int = 0):
    cfactor, levels = _check_grid(n, cfactor, levels)
    check_choice("relax", relax, RELAX)
    if iters is None and tol is None:
        raise ValueError("give iters (an iteration cap), tol (a residual tolerance), or both")
    if iters is not None:
        iters = check_int("iters", iters, lo=iters_lo)
    if tol is not None:
        tol = check_float("tol", tol, lo=0)
    return cfactor, levels, iters, tol


def exact_iterations(n_layers: int, cfactor: int, levels: int = 2, relax: str = "FCF") -> int:
    """Iterations after which MGRIT returns the serial states whatever the weights:
    1 for ``levels=1``, else ``N/m`` with F-relaxation and ``ceil(N/(2m))`` with FCF.

    Each iteration makes at least one more coarse interval exact (two with FCF), so this
    is the worst case; well-approximated problems converge far earlier. Checked for
    two-level and multilevel V-cycles by the tests.
    """
    n_layers = check_int("n_layers", n_layers, lo=1)
    cfactor, levels = _check_grid(n_layers, cfactor, levels)
    check_choice("relax", relax, RELAX)
    if levels == 1:
        return 1
    intervals = n_layers // cfactor
    return intervals if relax == "F" else math.ceil(intervals / 2)


def residual(step: StepFn, u: torch.Tensor, g: torch.Tensor, level: int = 0) -> torch.Tensor:
    """``g - A(u)`` with ``A(u)_0 = u_0`` and ``A(u)_{i+1} = u_{i+1} - Phi_i(u_i)``:
    one batched call of ``step`` over all ``u.shape[0] - 1`` steps."""
    check_callable("step", step)
    check_tensor("u", u, floating=True)
    check_tensor("g", g, shape=tuple(u.shape), floating=True)
    level = check_int("level", level, lo=0)
    r = g.clone()
    r[0] -= u[0]
    r[1:] -= u[1:] - step(level, slice(0, u.shape[0] - 1, 1), u[:-1])
    return r


def _sweep(step: StepFn, u, g, level: int, first: int, m: int, batched: bool) -> None:
    """``u[i+1] = Phi_i(u[i]) + g[i+1]`` for i = first, first+m, ...: one batched call
    (or, with ``batched=False``, the same updates one interval at a time)."""
    n = u.shape[0] - 1
    if batched:
        y = step(level, slice(first, n, m), u[first:n:m])
        if y.requires_grad or g.requires_grad:
            u[first + 1::m] = y + g[first + 1::m]
        else:  # the sum written straight into u's strided view: no temporary to copy
            torch.add(y, g[first + 1::m], out=u[first + 1::m])
        return
    for i in range(first, n, m):
        u[i + 1] = step(level, slice(i, i + 1), u[i:i + 1])[0] + g[i + 1]


def _f_relax(step: StepFn, u, g, level: int, m: int, batched: bool) -> None:
    for j in range(m - 1):  # m - 1 batched calls, each over every interval
        _sweep(step, u, g, level, j, m, batched)


def _c_relax(step: StepFn, u, g, level: int, m: int, batched: bool) -> None:
    _sweep(step, u, g, level, m - 1, m, batched)  # each C-point from the F-point before it


def _serial_loop(step: StepFn, u, g, level: int) -> None:
    """``u[0] = g[0]``, ``u[i+1] = Phi_i(u[i]) + g[i+1]``: one call of ``step`` per step."""
    u[0] = g[0]
    for i in range(u.shape[0] - 1):
        u[i + 1] = step(level, slice(i, i + 1), u[i:i + 1])[0] + g[i + 1]


def _serial_solve(step: StepFn, u, g, level: int) -> None:
    fast = getattr(step, "serial_solve", None)  # a step function may bring its own loop
    if fast is not None:
        fast(level, u, g)
    else:
        _serial_loop(step, u, g, level)


def _cycle(step: StepFn, u, g, level: int, levels: int, m: int, relax: str,
           batched: bool, f_relaxed: bool = False) -> None:
    """One V-cycle from ``level``. ``f_relaxed=True`` says ``u``'s F-points are already
    the F-relaxation of its C-points (the previous cycle ended with one and nothing has
    moved the C-points since), so the first F-relaxation would recompute the same values
    and is skipped: m - 1 batched calls saved per iteration after the first."""
    if level == levels - 1:
        _serial_solve(step, u, g, level)
        return
    if not f_relaxed:
        _f_relax(step, u, g, level, m, batched)
    if relax == "FCF":
        _c_relax(step, u, g, level, m, batched)
        _f_relax(step, u, g, level, m, batched)
    # Restrict by injection; FAS right-hand side: restricted residual + coarse operator.
    # After F-relaxation only C-point residuals can be non-zero: evaluate just those.
    n = u.shape[0] - 1
    r = g[::m].clone()
    r[0] -= u[0]
    r[1:] -= u[m::m] - step(level, slice(m - 1, n, m), u[m - 1:n:m])
    v = u[::m].clone()
    g_coarse = r.clone()  # g_c = R r + A_c(v): the tau correction A_c(R u) - R A(u)
    g_coarse[0] += v[0]
    g_coarse[1:] += v[1:] - step(level + 1, slice(0, v.shape[0] - 1, 1), v[:-1])
    v_new = v.clone()
    _cycle(step, v_new, g_coarse, level + 1, levels, m, relax, batched)
    u[::m] += v_new - v  # coarse-grid correction at the C-points
    _f_relax(step, u, g, level, m, batched)


def mgrit(step: StepFn, g: torch.Tensor, *, cfactor: int, levels: int = 2,
          iters: int | None = None, tol: float | None = None, relax: str = "FCF",
          warm_start: torch.Tensor | None = None, batched: bool = True,
          record: bool = True) -> MGRITResult:
    """Solve ``A(u) = g`` (``n = g.shape[0] - 1`` steps of ``step``) by MGRIT V-cycles.

    ``levels=1`` is the serial solve: one iteration is one sweep of ``n`` steps, exact.
    Stops after ``iters`` iterations, or earlier once the residual norm is ``<= tol``.
    With only ``tol``, the cap is :func:`exact_iterations` (after it the states are the
    serial ones up to round-off, so more iterations cannot help). A ``tol`` not reached
    gives ``converged=False`` and a :class:`ConvergenceWarning`.
    ``record=False`` skips the full residual after each iteration (a whole extra sweep of
    work) when no ``tol`` needs it; ``residuals`` is then empty.
    """
    check_callable("step", step)
    check_tensor("g", g, floating=True)
    if g.dim() < 2 or g.shape[0] < 2:
        raise ValueError(f"g must have shape (n+1, ...) with n >= 1 steps, got {tuple(g.shape)}")
    n = g.shape[0] - 1
    cfactor, levels, iters, tol = _check_solver_args(n, cfactor, levels, iters, tol, relax)
    check_bool("batched", batched)
    check_bool("record", record)
    if warm_start is not None:
        check_tensor("warm_start", warm_start, shape=tuple(g.shape), floating=True)
        u = warm_start.clone()
        u[0] = g[0]
    else:
        u = g[:1].expand_as(g).clone()  # every state starts at the input
    cap = iters if iters is not None else exact_iterations(n, cfactor, levels, relax)
    track = record or tol is not None
    res = MGRITResult(u, [residual(step, u, g).norm().item()] if track else [], tol=tol)
    for _ in range(cap):
        if tol is not None and res.residuals[-1] <= tol:
            break
        if levels == 1:
            _serial_solve(step, u, g, 0)
        else:
            _cycle(step, u, g, 0, levels, cfactor, relax, batched,
                   f_relaxed=res.iterations > 0)
        res.iterations += 1
        if track:
            res.residuals.append(residual(step, u, g).norm().item())
    if tol is not None:
        res.converged = res.residuals[-1] <= tol
        if not res.converged:
            warnings.warn(f"MGRIT did not reach tol={tol:g} in {res.iterations} iteration(s) "
                          f"(residual {res.residuals[-1]:.3g}); the result has converged=False",
                          ConvergenceWarning, stacklevel=3)
    return res
