"""Layer-parallel ResNets by nonlinear multigrid (MGRIT with FAS).

A ResNet is forward Euler on an ODE: ``x_{n+1} = x_n + h F(x_n, theta_n)``, n = 0..N-1.
The serial forward pass (:class:`SerialResNet`, the baseline) is a sweep of N dependent
steps. Multigrid reduction in time (MGRIT) solves the same N+1 equations
iteratively, with most of its work batched across layers:

* grid: all N+1 states; every m-th state is a C-point, the rest F-points;
* F-relaxation: from each C-point, step across its interval; all intervals at once,
  so m-1 batched calls instead of N sequential ones;
* C-relaxation: each C-point from the F-point before it (one batched call); FCF = F, C, F;
* coarse grid: the C-points, stepped by ``x + m h F(x, theta_{m i})`` (weights by injection);
* FAS two-grid cycle: relax, restrict by injection, form the coarse right-hand side
  with the tau correction, solve the coarse system (serially, or recursively: a
  V-cycle), correct the C-points, F-relax.

The backward pass is the adjoint recursion ``lambda_n = lambda_{n+1} + h J_n^T lambda_{n+1}``
(``J_n = dF/dx`` at ``x_n``): linear, running backward in layers, and solved with
the same MGRIT code in reverse; all parameter gradients ``h (dF/dtheta_n)^T lambda_{n+1}``
then come from one batched call. :class:`LayerParallelResNet` wraps both in an
autograd Function. Every batched call stacks the per-layer parameters and uses
``torch.func.vmap`` (or a hand-batched ``bmm`` for :func:`dense_tanh`), the
single-device analogue of one CUDA stream per layer block (Kirby et al. 2020).

Sources: Gunther et al., "Layer-parallel training of deep residual neural networks"
(SIMODS 2020); Kirby et al., "Layer-parallel training with GPU concurrency of deep
residual neural networks via nonlinear multigrid" (HPEC 2020); Falgout et al.,
"Parallel time integration with multigrid" (SISC 2014); XBraid and TorchBraid.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.func import vjp, vmap

from parlearn.core.bench import Row
from parlearn.core.checks import (
    check_bool,
    check_callable,
    check_choice,
    check_float,
    check_int,
    check_seed,
    check_tensor,
)
from parlearn.core.timing import compare

__all__ = ["ResidualStack", "dense_tanh", "conv_tanh", "random_stack", "MGRITResult",
           "ConvergenceWarning", "mgrit", "residual", "exact_iterations", "mgrit_forward",
           "mgrit_adjoint", "serial_adjoint", "parameter_grads", "LayerParallelResNet",
           "SerialResNet", "train_digits", "cost_model", "bench", "RELAX"]

RELAX = ("F", "FCF")


# --- residual functions: one layer, unbatched ----------------------------------------
# These run in every inner loop (and in the serial baseline), so they check nothing:
# ResidualStack checks the parameter shapes once and mgrit_forward checks the input.


def dense_tanh(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """``F(x) = tanh(W x + b)`` for ``x`` of shape ``(B, d)`` (one ``addmm``, as nn.Linear)."""
    return torch.tanh(nn.functional.linear(x, p["W"], p["b"]))


def dense_tanh_batched(X: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """:func:`dense_tanh` for many layers at once: ``X`` (P, B, d), ``p`` stacked (P, ...).

    The same maths as ``vmap(dense_tanh)`` as one ``baddbmm`` call, without vmap's
    per-call overhead, which dominates when layers are small (the regime MGRIT targets).
    """
    return torch.tanh(torch.baddbmm(p["b"].unsqueeze(1), X, p["W"].transpose(1, 2)))


def dense_tanh_vjp(X: torch.Tensor, p: dict[str, torch.Tensor], V: torch.Tensor):
    """Batched vector-Jacobian products of :func:`dense_tanh`: ``(J_x^T V, J_theta^T V)``.

    With ``A = tanh(W x + b)`` and ``D = V (1 - A^2)``: ``J_x^T V = D W``,
    ``dW = D^T x`` and ``db = sum D``, each one batched call over layers.
    """
    A = dense_tanh_batched(X, p)
    D = V * (1 - A * A)
    return torch.bmm(D, p["W"]), {"W": torch.bmm(D.transpose(1, 2), X), "b": D.sum(1)}


_BATCHED = {dense_tanh: dense_tanh_batched}
_BATCHED_VJP = {dense_tanh: dense_tanh_vjp}


def conv_tanh(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """``F(x) = tanh(conv(x, W) + b)`` (same padding) for ``x`` of shape ``(B, C, H, W)``."""
    k = p["W"].shape[-1]
    return torch.tanh(nn.functional.conv2d(x, p["W"], p["b"], padding=k // 2))


# --- the stack ------------------------------------------------------------------------


def _check_dtype(name: str, dtype: Any) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating torch.dtype, got {dtype!r}")
    return dtype


class ResidualStack(nn.Module):
    """N residual layers with stacked parameters ``{name: (N, ...)}`` and step size ``h``.

    ``fn(x, params_of_one_layer) -> F`` is applied to one layer; :meth:`step` applies
    it to many layers at once with ``vmap`` (or with a hand-batched version where one
    is known, as for :func:`dense_tanh`). The stacked layout is what MGRIT's batched
    calls need; the serial baseline is :class:`SerialResNet` (per-layer parameters).
    """

    def __init__(self, params: dict[str, torch.Tensor], h: float,
                 fn: Callable[[torch.Tensor, dict], torch.Tensor] = dense_tanh):
        super().__init__()
        if not isinstance(params, dict) or not params:
            raise ValueError("params must be a dict holding at least one stacked tensor")
        for name, t in params.items():
            if not isinstance(name, str):
                raise TypeError(f"params keys must be str, got {name!r}")
            check_tensor(f"params[{name!r}]", t, floating=True)
            if t.dim() < 1 or t.shape[0] < 1:
                raise ValueError(f"params[{name!r}] needs a leading layer dimension N >= 1, "
                                 f"got shape {tuple(t.shape)}")
        sizes = {name: t.shape[0] for name, t in params.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"every stacked parameter needs the same leading size N, got {sizes}")
        kinds = {(t.dtype, t.device) for t in params.values()}
        if len(kinds) != 1:
            raise ValueError(f"params must share one dtype and device, got {kinds}")
        h = check_float("h", h, lo=0, lo_open=True)
        check_callable("fn", fn)
        if fn is dense_tanh or fn is conv_tanh:
            _check_known_params(fn, params)
        self.params = nn.ParameterDict({k: nn.Parameter(v) for k, v in params.items()})
        self.h, self.fn = h, fn
        self.batched_fn = _BATCHED.get(fn) or vmap(fn)
        self.batched_vjp = _BATCHED_VJP.get(fn) or vmap(self._vjp_one)

    def _vjp_one(self, x, p, v):
        _, pull = vjp(self.fn, x, p)
        return pull(v)

    @property
    def n_layers(self) -> int:
        return next(iter(self.params.values())).shape[0]

    def check_input(self, name: str, x: Any) -> torch.Tensor:
        """``x`` if it is a batch this stack can take (dtype, device, and for the known
        residual functions the feature shape); a ValueError/TypeError naming ``name``."""
        p = next(iter(self.params.values()))
        check_tensor(name, x, floating=True)
        if x.dtype != p.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, the stack's parameters {p.dtype}")
        if x.device != p.device:
            raise ValueError(f"{name} is on {x.device}, the stack's parameters on {p.device}")
        if self.fn is dense_tanh:
            check_tensor(name, x, shape=(None, self.params["W"].shape[-1]))
        elif self.fn is conv_tanh:
            check_tensor(name, x, shape=(None, self.params["W"].shape[1], None, None))
        elif x.dim() < 1:
            raise ValueError(f"{name} must have a batch dimension, got a 0-d tensor")
        return x

    def layer_params(self, idx: slice | torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v[idx] for k, v in self.params.items()}

    def F(self, X: torch.Tensor, idx: slice | torch.Tensor) -> torch.Tensor:
        """``F(X[j], theta_{idx[j]})`` for every j, in one batched call (``idx``: a slice
        of layers, a strided view, or an index tensor)."""
        return self.batched_fn(X, self.layer_params(idx))

    def step(self, X: torch.Tensor, idx: slice | torch.Tensor, dt: float) -> torch.Tensor:
        """``X[j] + dt F(X[j], theta_{idx[j]})``: one Euler step per interval, batched."""
        return X + dt * self.F(X, idx)

    def serial(self, x0: torch.Tensor) -> torch.Tensor:
        """Reference forward: all N+1 states, shape ``(N+1, *x0.shape)``, one layer at a time.

        Layers read their parameters through ``unbind`` (whose backward is one ``stack``),
        so differentiating this costs O(N) parameter memory, not N scatters into (N, ...).
        """
        self.check_input("x0", x0)
        names = list(self.params)
        states = [x0]
        for vals in zip(*(self.params[k].unbind(0) for k in names), strict=True):
            states.append(states[-1] + self.h * self.fn(states[-1], dict(zip(names, vals,
                                                                            strict=True))))
        return torch.stack(states)


def _check_known_params(fn: Callable, params: dict[str, torch.Tensor]) -> None:
    if set(params) != {"W", "b"}:
        raise ValueError(f"{fn.__name__} needs params 'W' and 'b', got {sorted(params)}")
    W, b = params["W"], params["b"]
    if fn is dense_tanh:
        if W.dim() != 3 or W.shape[1] != W.shape[2]:
            raise ValueError(f"params['W'] for dense_tanh must have shape (N, w, w), got "
                             f"{tuple(W.shape)}")
        check_tensor("params['b']", b, shape=(None, W.shape[-1]))
    else:
        if W.dim() != 5 or W.shape[1] != W.shape[2] or W.shape[-1] % 2 == 0:
            raise ValueError(f"params['W'] for conv_tanh must have shape (N, C, C, k, k) with "
                             f"odd k, got {tuple(W.shape)}")
        check_tensor("params['b']", b, shape=(None, W.shape[1]))


def random_stack(n_layers: int, width: int, *, h: float | None = None, smoothness: float = 1.0,
                 scale: float = 1.0, conv: bool = False, channels: int = 2, kernel: int = 3,
                 dtype: torch.dtype = torch.float64,
                 seed: int | torch.Generator = 0) -> ResidualStack:
    """A random stack whose weights vary smoothly with depth (``smoothness=1``) or are
    independent per layer (``smoothness=0``), or a blend. ``h`` defaults to ``1/N``
    (an ODE on [0, 1]). ``conv=True`` makes a :func:`conv_tanh` stack (``width`` is then
    unused by the weights: they are ``(channels, channels, kernel, kernel)``).
    Draws only from its own generator (``seed``), never from torch's global RNG."""
    n_layers = check_int("n_layers", n_layers, lo=1)
    width = check_int("width", width, lo=1)
    if h is not None:
        h = check_float("h", h, lo=0, lo_open=True)
    smoothness = check_float("smoothness", smoothness, lo=0, hi=1)
    scale = check_float("scale", scale, lo=0, lo_open=True)
    check_bool("conv", conv)
    channels = check_int("channels", channels, lo=1)
    kernel = check_int("kernel", kernel, lo=1)
    if kernel % 2 == 0:
        raise ValueError(f"kernel must be odd (same padding), got {kernel}")
    _check_dtype("dtype", dtype)
    seed = check_seed("seed", seed)
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    t = torch.linspace(0, 1, n_layers, dtype=dtype)
    shape = (channels, channels, kernel, kernel) if conv else (width, width)
    fan_in = channels * kernel * kernel if conv else width

    def field_of_weights(*s):
        modes = [torch.randn(*s, generator=g, dtype=dtype) for _ in range(3)]
        smooth = (modes[0] + modes[1] * torch.cos(2 * math.pi * t).view(-1, *[1] * len(s))
                  + modes[2] * torch.sin(2 * math.pi * t).view(-1, *[1] * len(s))) / math.sqrt(3)
        indep = torch.randn(n_layers, *s, generator=g, dtype=dtype)
        return scale / math.sqrt(fan_in) * (smoothness * smooth + (1 - smoothness) * indep)

    bias_size = channels if conv else width
    params = {"W": field_of_weights(*shape), "b": 0.1 * field_of_weights(bias_size)}
    return ResidualStack(params, h if h is not None else 1.0 / n_layers,
                         conv_tanh if conv else dense_tanh)


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
        u[first + 1::m] = step(level, slice(first, n, m), u[first:n:m]) + g[first + 1::m]
        return
    for i in range(first, n, m):
        u[i + 1] = step(level, slice(i, i + 1), u[i:i + 1])[0] + g[i + 1]


def _f_relax(step: StepFn, u, g, level: int, m: int, batched: bool) -> None:
    for j in range(m - 1):  # m - 1 batched calls, each over every interval
        _sweep(step, u, g, level, j, m, batched)


def _c_relax(step: StepFn, u, g, level: int, m: int, batched: bool) -> None:
    _sweep(step, u, g, level, m - 1, m, batched)  # each C-point from the F-point before it


def _serial_solve(step: StepFn, u, g, level: int) -> None:
    u[0] = g[0]
    for i in range(u.shape[0] - 1):
        u[i + 1] = step(level, slice(i, i + 1), u[i:i + 1])[0] + g[i + 1]


def _cycle(step: StepFn, u, g, level: int, levels: int, m: int, relax: str,
           batched: bool) -> None:
    if level == levels - 1:
        _serial_solve(step, u, g, level)
        return
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
            _cycle(step, u, g, 0, levels, cfactor, relax, batched)
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


# --- forward and adjoint of a stack -------------------------------------------------------


def _scaled(steps: slice, s: int) -> slice:
    """Step indices at a level with spacing ``s`` -> fine layer indices (injection)."""
    return slice(steps.start * s, steps.stop * s, (steps.step or 1) * s)


def _forward_step(stack: ResidualStack, m: int, level: int, steps: slice,
                  X: torch.Tensor) -> torch.Tensor:
    s = m**level
    return stack.step(X, _scaled(steps, s), stack.h * s)


def mgrit_forward(stack: ResidualStack, x0: torch.Tensor, *, cfactor: int, levels: int = 2,
                  iters: int | None = None, tol: float | None = None, relax: str = "FCF",
                  warm_start: torch.Tensor | None = None, batched: bool = True,
                  record: bool = True) -> MGRITResult:
    """All N+1 states of ``stack`` from ``x0`` by :func:`mgrit` (no autograd graph).

    ``levels=1`` is the serial solve (exact after one iteration, whatever ``cfactor``
    and ``warm_start``). ``warm_start`` (N+1, ...) is the first guess; its state 0 is
    replaced by ``x0``.
    """
    if not isinstance(stack, ResidualStack):
        raise TypeError(f"stack must be a ResidualStack, got {type(stack).__name__}")
    stack.check_input("x0", x0)
    _check_solver_args(stack.n_layers, cfactor, levels, iters, tol, relax)
    g = torch.zeros(stack.n_layers + 1, *x0.shape, dtype=x0.dtype, device=x0.device)
    g[0] = x0.detach()
    with torch.no_grad():
        return mgrit(partial(_forward_step, stack, cfactor), g, cfactor=cfactor, levels=levels,
                     iters=iters, tol=tol, relax=relax, warm_start=warm_start, batched=batched,
                     record=record)


def _jt(stack: ResidualStack, X: torch.Tensor, idx: slice | torch.Tensor,
        V: torch.Tensor) -> torch.Tensor:
    """``J(X[j], theta_idx[j])^T V[j]`` for every j: batched vector-Jacobian products."""
    return stack.batched_vjp(X, stack.layer_params(idx), V)[0]


def _adjoint_step(stack: ResidualStack, states: torch.Tensor, m: int, level: int,
                  steps: slice, M: torch.Tensor) -> torch.Tensor:
    # reversed time: step i at this level covers layers [N - s(i+1), N - s i), s = m**level;
    # the coarse step uses the Jacobian at the interval's first layer (injection).
    s = m**level
    i = torch.arange(steps.start, steps.stop, steps.step or 1, device=M.device)
    n = stack.n_layers - s * (i + 1)
    return M + stack.h * s * _jt(stack, states[n], n, M)


def _check_states(stack: Any, states: Any, name2: str, other: Any) -> None:
    if not isinstance(stack, ResidualStack):
        raise TypeError(f"stack must be a ResidualStack, got {type(stack).__name__}")
    check_tensor("states", states, floating=True)
    if states.dim() < 2 or states.shape[0] != stack.n_layers + 1:
        raise ValueError(f"states must have shape (N+1, ...) = ({stack.n_layers + 1}, ...), "
                         f"got {tuple(states.shape)}")
    stack.check_input("states[0]", states[0])
    check_tensor(name2, other, floating=True)
    if other.shape != states.shape[1:] and other.shape != states.shape:
        raise ValueError(f"{name2} has shape {tuple(other.shape)}, expected "
                         f"{tuple(states.shape[1:])} (one state)")
    if other.dtype != states.dtype or other.device != states.device:
        raise ValueError(f"{name2} must match states' dtype and device ({states.dtype}, "
                         f"{states.device}), got {other.dtype}, {other.device}")


def serial_adjoint(stack: ResidualStack, states: torch.Tensor,
                   lam_out: torch.Tensor) -> torch.Tensor:
    """Reference adjoint: ``lambda_n`` for n = 0..N, one layer at a time, backward."""
    _check_states(stack, states, "lam_out", lam_out)
    if lam_out.shape != states.shape[1:]:
        raise ValueError(f"lam_out must have shape {tuple(states.shape[1:])}, got "
                         f"{tuple(lam_out.shape)}")
    lams = [lam_out]
    for n in reversed(range(stack.n_layers)):
        lams.append(lams[-1] + stack.h * _jt(stack, states[n:n + 1], slice(n, n + 1),
                                             lams[-1][None])[0])
    return torch.stack(lams[::-1])


def mgrit_adjoint(stack: ResidualStack, states: torch.Tensor, lam_out: torch.Tensor, *,
                  cfactor: int, levels: int = 2, iters: int | None = None,
                  tol: float | None = None, relax: str = "FCF", batched: bool = True,
                  record: bool = True) -> MGRITResult:
    """``lambda_0..lambda_N`` by MGRIT on the reversed adjoint recursion (states in layer
    order); ``levels=1`` is the serial adjoint sweep."""
    _check_states(stack, states, "lam_out", lam_out)
    if lam_out.shape != states.shape[1:]:
        raise ValueError(f"lam_out must have shape {tuple(states.shape[1:])}, got "
                         f"{tuple(lam_out.shape)}")
    _check_solver_args(stack.n_layers, cfactor, levels, iters, tol, relax)
    g = torch.zeros(stack.n_layers + 1, *lam_out.shape, dtype=lam_out.dtype,
                    device=lam_out.device)
    g[0] = lam_out
    with torch.no_grad():
        res = mgrit(partial(_adjoint_step, stack, states.detach(), cfactor), g, cfactor=cfactor,
                    levels=levels, iters=iters, tol=tol, relax=relax, batched=batched,
                    record=record)
    res.states = res.states.flip(0)
    return res


def parameter_grads(stack: ResidualStack, states: torch.Tensor,
                    lams: torch.Tensor) -> dict[str, torch.Tensor]:
    """``h (dF/dtheta_n)^T lambda_{n+1}`` for every layer n, in one batched call."""
    _check_states(stack, states, "lams", lams)
    if lams.shape != states.shape:
        raise ValueError(f"lams must have the states' shape {tuple(states.shape)}, got "
                         f"{tuple(lams.shape)}")
    g = stack.batched_vjp(states[:-1], dict(stack.params), lams[1:])[1]
    return {k: stack.h * v for k, v in g.items()}


# --- an nn.Module whose forward and backward are both layer-parallel -------------------


class _MGRITFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x0, module, *flat_params):
        key = (tuple(x0.shape), x0.dtype, x0.device)
        res = mgrit_forward(module.stack, x0.detach(), cfactor=module.cfactor,
                            levels=module.levels, iters=module.fwd_iters, tol=module.fwd_tol,
                            relax=module.relax, warm_start=module._warm.get(key),
                            record=module.record)
        module.last_forward = res
        if module.warm_start:
            module._warm[key] = res.states.detach()
        ctx.module = module
        ctx.save_for_backward(res.states)
        return res.output.clone()

    @staticmethod
    def backward(ctx, grad_out):
        module = ctx.module
        (states,) = ctx.saved_tensors
        res = mgrit_adjoint(module.stack, states, grad_out.contiguous(), cfactor=module.cfactor,
                            levels=module.levels, iters=module.bwd_iters, tol=module.bwd_tol,
                            relax=module.relax, record=module.record)
        module.last_backward = res
        grads = parameter_grads(module.stack, states, res.states)
        return (res.states[0], None, *(grads[k] for k in module.stack.params))


class LayerParallelResNet(nn.Module):
    """A residual block of N layers whose forward and backward run MGRIT.

    ``fwd_iters``/``bwd_iters`` cap the iterations (fewer gives inexact outputs and
    gradients, as in Gunther et al. and TorchBraid); ``fwd_tol``/``bwd_tol`` stop early
    (see :func:`mgrit`). ``levels=1`` runs the serial solve (exact).
    With ``warm_start=True`` the last forward's states for an input of the same shape,
    dtype and device seed the next forward (as in Kirby et al.), which pays off across
    training steps when weights and inputs change slowly. The new input always replaces
    state 0, so the output is that of the new input after the given iterations: exact
    with a converged ``fwd_tol`` or ``fwd_iters >= exact_iterations(...)``, approximate
    otherwise (as a cold start is). :meth:`reset_warm_start` forgets the stored states.
    ``last_forward`` and ``last_backward`` keep the last results (residual histories
    with ``record=True``; recording costs one extra sweep of work per iteration).
    """

    def __init__(self, stack: ResidualStack, *, cfactor: int = 4, levels: int = 2,
                 fwd_iters: int | None = 2, bwd_iters: int | None = 2,
                 fwd_tol: float | None = None, bwd_tol: float | None = None,
                 relax: str = "FCF", warm_start: bool = True, record: bool = True):
        super().__init__()
        if not isinstance(stack, ResidualStack):
            raise TypeError(f"stack must be a ResidualStack, got {type(stack).__name__}")
        for name, it, tol in (("fwd", fwd_iters, fwd_tol), ("bwd", bwd_iters, bwd_tol)):
            if it is None and tol is None:
                raise ValueError(f"{name}_iters and {name}_tol cannot both be None")
            if it is not None:
                check_int(f"{name}_iters", it, lo=1)
            if tol is not None:
                check_float(f"{name}_tol", tol, lo=0)
        self.cfactor, self.levels = _check_grid(stack.n_layers, cfactor, levels)
        self.relax = check_choice("relax", relax, RELAX)
        self.stack = stack
        self.fwd_iters, self.bwd_iters, self.fwd_tol, self.bwd_tol = (fwd_iters, bwd_iters,
                                                                      fwd_tol, bwd_tol)
        self.warm_start = check_bool("warm_start", warm_start)
        self.record = check_bool("record", record)
        self._warm: dict[tuple, torch.Tensor] = {}
        self.last_forward: MGRITResult | None = None
        self.last_backward: MGRITResult | None = None

    def reset_warm_start(self) -> None:
        """Forget every stored warm start (the next forward starts cold)."""
        self._warm.clear()

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        self.stack.check_input("x0", x0)
        return _MGRITFunction.apply(x0, self, *self.stack.params.values())


# --- the serial baseline ------------------------------------------------------------


class SerialResNet(nn.Module):
    """The best serial ResNet a user would write, with a stack's weights: the baseline.

    Every layer owns its parameters: per-layer leaf tensors ``W_n``, ``b_n`` (copies of
    the stack's weights, in one ``nn.ParameterList`` per name; later changes to one
    network do not reach the other). The forward is a plain loop
    ``x = x + h F(x, theta_n)``, differentiated by torch's autograd; with
    :func:`dense_tanh` each layer is ``tanh(F.linear(x, W_n, b_n))``, what ``nn.Linear``
    computes, without a module call per layer.
    """

    def __init__(self, stack: ResidualStack):
        super().__init__()
        if not isinstance(stack, ResidualStack):
            raise TypeError(f"stack must be a ResidualStack, got {type(stack).__name__}")
        self.h, self.fn = stack.h, stack.fn
        self._names = list(stack.params)
        self.layer_params = nn.ModuleDict({
            k: nn.ParameterList([nn.Parameter(t.clone()) for t in v.detach().unbind(0)])
            for k, v in stack.params.items()})

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x, h = x0, self.h
        if self.fn is dense_tanh:
            for W, b in zip(self.layer_params["W"], self.layer_params["b"], strict=True):
                x = x + h * torch.tanh(nn.functional.linear(x, W, b))
            return x
        names = self._names
        for vals in zip(*(self.layer_params[k] for k in names), strict=True):
            x = x + h * self.fn(x, dict(zip(names, vals, strict=True)))
        return x

    def stacked(self, what: str = "params") -> dict[str, torch.Tensor]:
        """The per-layer parameters (``"params"``) or their ``.grad`` (``"grads"``) stacked
        as ``{name: (N, ...)}``, the layout of :class:`ResidualStack` (a copy)."""
        check_choice("what", what, ("params", "grads"))
        out = {}
        for k in self._names:
            ts = list(self.layer_params[k])
            if what == "grads":
                if any(t.grad is None for t in ts):
                    raise ValueError("some layer has no .grad yet: run a backward first")
                ts = [t.grad for t in ts]
            out[k] = torch.stack([t.detach() for t in ts])
        return out


# --- a short training run ------------------------------------------------------------


def _linear(n_in: int, n_out: int, g: torch.Generator, dtype: torch.dtype) -> nn.Linear:
    """``nn.Linear`` with torch's default init distribution, drawn from ``g`` only."""
    lin = nn.utils.skip_init(nn.Linear, n_in, n_out, dtype=dtype)
    bound = 1 / math.sqrt(n_in)
    with torch.no_grad():
        lin.weight.uniform_(-bound, bound, generator=g)
        lin.bias.uniform_(-bound, bound, generator=g)
    return lin


def train_digits(parallel: bool, data, *, layers: int = 32, width: int = 32, steps: int = 150,
                 lr: float = 1e-2, cfactor: int = 4, levels: int = 2, iters: int = 2,
                 relax: str = "FCF", seed: int | torch.Generator = 0,
                 progress: bool = True) -> dict:
    """Full-batch Adam on digits: Linear(64, width) -> N residual layers -> Linear(width, 10).

    ``parallel=True`` runs the residual block as a :class:`LayerParallelResNet`
    (``iters`` forward and ``iters`` backward iterations, warm-started across steps);
    ``False`` runs the :class:`SerialResNet` baseline with autograd. Same initial weights
    either way, drawn from ``seed`` only (torch's global RNG is left untouched).
    Returns ``{"step", "loss", "test_acc", "fwd_iterations", "bwd_iterations",
    "seconds"}``; the iteration lists hold, per recorded step, the MGRIT iterations the
    block ran (empty for the serial network).
    """
    from tqdm.auto import tqdm

    from parlearn.core.timing import measure

    check_bool("parallel", parallel)
    for attr in ("x_train", "y_train", "x_test", "y_test", "n_features", "n_classes"):
        if not hasattr(data, attr):
            raise TypeError(f"data must be a datasets.Split (has no {attr!r})")
    layers = check_int("layers", layers, lo=1)
    width = check_int("width", width, lo=1)
    steps = check_int("steps", steps, lo=1)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    iters = check_int("iters", iters, lo=1)
    _check_solver_args(layers, cfactor, levels, iters, None, relax)
    seed = check_seed("seed", seed)
    check_bool("progress", progress)
    dtype = data.x_train.dtype
    _check_dtype("data.x_train.dtype", dtype)
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    stack = random_stack(layers, width, scale=0.5, dtype=dtype, seed=g)
    block = (LayerParallelResNet(stack, cfactor=cfactor, levels=levels, fwd_iters=iters,
                                 bwd_iters=iters, relax=relax, warm_start=True, record=False)
             if parallel else SerialResNet(stack))
    model = nn.Sequential(_linear(data.n_features, width, g, dtype), block,
                          _linear(width, data.n_classes, g, dtype))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    hist: dict = {"step": [], "loss": [], "test_acc": [], "fwd_iterations": [],
                  "bwd_iterations": []}
    last: dict = {}

    def train_step():
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(data.x_train), data.y_train)
        loss.backward()
        opt.step()
        last["loss"] = loss.item()
        if parallel:
            last["its"] = (block.last_forward.iterations, block.last_backward.iterations)

    bar = tqdm(range(steps), desc="layer-parallel" if parallel else "serial",
               disable=not progress, leave=False)
    seconds = 0.0
    for i in bar:
        seconds += measure(train_step, warmup=0, repeat=1).median
        if i % max(1, steps // 15) == 0 or i == steps - 1:
            hist["step"].append(i + 1)
            hist["loss"].append(last["loss"])
            if parallel:
                hist["fwd_iterations"].append(last["its"][0])
                hist["bwd_iterations"].append(last["its"][1])
            with torch.no_grad():
                acc = (model(data.x_test).argmax(1) == data.y_test).double().mean().item()
            hist["test_acc"].append(acc)
    hist["seconds"] = seconds
    return hist


# --- cost model ----------------------------------------------------------------------


def cost_model(N: int, cfactor: int, levels: int, iters: int, *, relax: str = "FCF",
               devices: int | None = None, record: bool = False,
               bwd_iters: int | None = None) -> dict:
    """Sequential batched calls (depth) and step evaluations (work) of serial vs MGRIT
    (modeled: every step evaluation costs the same, a batched call of k steps costs
    ``ceil(k/P)`` step times on ``devices=P``, one with ``devices=None``).

    It counts exactly the calls :func:`mgrit` makes to its step function. One V-cycle
    at level l with ``n`` steps and ``m = cfactor``: each F-relaxation is ``m-1`` calls
    of ``n/m`` steps (FCF: F, one C call of ``n/m``, F); the C-point residual is one
    call of ``n/m``; the FAS right-hand side one coarse call of ``n/m``; then the cycle
    at level l+1 on ``n/m`` steps; then an F-relaxation. The coarsest level is solved
    serially (``n`` calls of one step); ``levels=1`` is that serial solve on N steps.
    ``record=True`` adds the full residual (one call of N) before the first and after
    every iteration, as :func:`mgrit` evaluates it with ``record=True`` or a ``tol``
    (``iters`` is then the number of iterations the run took). With ``devices=1``,
    depth equals work.

    ``bwd_iters`` adds a backward pass: the adjoint solve (the same cycles, ``bwd_iters``
    iterations) plus one parameter-gradient call of N steps, against a serial backward
    of N steps (serial depth and work 2N); ``speedup`` is then that of forward+backward.

    Layer-wise model parallelism on P devices still runs the N layers in order: depth N
    for one batch (it only splits memory), which is the baseline Kirby et al. compare to.
    """
    N = check_int("N", N, lo=1)
    cfactor, levels = _check_grid(N, cfactor, levels)
    iters = check_int("iters", iters, lo=1)
    check_choice("relax", relax, RELAX)
    if devices is not None:
        devices = check_int("devices", devices, lo=1)
    check_bool("record", record)
    if bwd_iters is not None:
        bwd_iters = check_int("bwd_iters", bwd_iters, lo=1)
    m, P = cfactor, devices

    def t(k):  # time of one batched call of k steps
        return 1 if P is None else math.ceil(k / P)

    def cycle(n, level):  # (depth, work) of one cycle at `level` on n steps
        if level == levels - 1:
            return n * t(1), n
        k = n // m
        calls = [k] * (m - 1)  # F-relaxation
        if relax == "FCF":
            calls += [k] + [k] * (m - 1)  # C, F
        calls += [k, k]  # C-point residual; coarse operator in the FAS right-hand side
        calls += [k] * (m - 1)  # the final F-relaxation
        d, w = cycle(k, level + 1)
        return sum(t(c) for c in calls) + d, sum(calls) + w

    d, w = cycle(N, 0)
    res_d, res_w = (t(N), N) if record else (0, 0)

    def solve(its):
        return (its * (d + res_d) + res_d, its * (w + res_w) + res_w)

    depth, work = solve(iters)
    serial = N
    if bwd_iters is not None:
        bd, bw = solve(bwd_iters)
        depth, work, serial = depth + bd + t(N), work + bw + N, 2 * N
    return {"serial_depth": serial, "serial_work": serial, "mgrit_depth": depth,
            "mgrit_work": work, "model_parallel_depth": serial, "speedup": serial / depth}


# --- bench ------------------------------------------------------------------------------


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _fwd_bwd(net: nn.Module, x0: torch.Tensor) -> None:
    net.zero_grad(set_to_none=True)  # the bench's own networks only
    net(x0).square().sum().backward()


def _no_grad(fn: Callable, *args) -> Callable[[], Any]:
    def run():
        with torch.no_grad():
            return fn(*args)
    return run


def _ratio_row(name: str, baseline: str, variant: str, cmp, limit: float, device, extra: str,
               target: str = "", met: bool | None = None,
               formula: str = "N / MGRIT depth") -> Row:
    ratio = cmp.speedup("mgrit")
    lo, hi = cmp.speedup_range("mgrit")
    detail = (f"IQR {lo:.2f}-{hi:.2f}, {cmp.threads} thread(s); modeled limit {limit:.1f}x "
              f"({formula}, every batched call one step time); {extra}")
    if ratio > limit:
        detail += ("; MEASURED ABOVE THE MODELED LIMIT: a bug to explain (baseline or "
                   "model), not a result")
    if not cmp.reliable:
        detail += "; WARNING: another program is using the cores; this figure is not reliable"
    return Row(name, baseline, variant, ratio, str(device), target, met, detail)


def bench(device: torch.device, quick: bool) -> list[Row]:
    """MGRIT forward and forward+backward vs :class:`SerialResNet` (per-layer parameters,
    autograd) with the same weights, each next to its modeled limit. On CPU one intra-op
    thread (see :data:`parlearn.device.THREAD_POLICY`)."""
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, got {type(device).__name__}")
    check_bool("quick", quick)
    rows = []
    sizes = (64, 256) if quick else (256, 1024)
    width, batch = 32, 4
    target = 1.5 if device.type == "cpu" else 3.0
    threads = 1 if device.type == "cpu" else None
    g = torch.Generator().manual_seed(0)
    for N in sizes:
        stack = random_stack(N, width, dtype=torch.float32, seed=0).to(device)
        serial = SerialResNet(stack)
        x0 = torch.randn(batch, width, generator=g).to(device)
        with torch.no_grad():
            ref = serial(x0)
        best = None
        for m, levels, iters in ((8, 2, 2), (16, 2, 2), (4, 3, 2), (8, 3, 2), (16, 3, 1)):
            if N % m ** (levels - 1):
                continue
            res = mgrit_forward(stack, x0, cfactor=m, levels=levels, iters=iters, record=False)
            err = _rel_err(res.output, ref)
            if err < 1e-4:
                cost = cost_model(N, m, levels, iters)["mgrit_depth"]
                if best is None or cost < best[0]:
                    best = (cost, m, levels, iters, err)
        name = f"multigrid N={N} w={width} B={batch}"
        if best is None:
            rows.append(Row(name, "serial forward", "MGRIT forward", 0.0, str(device), "",
                            False, "no setting reached 1e-4"))
            continue
        _, m, levels, iters, err = best
        repeat = 3 if quick else 7
        cmp = compare({"serial": _no_grad(serial, x0),
                       "mgrit": _no_grad(partial(mgrit_forward, stack, x0, cfactor=m,
                                                 levels=levels, iters=iters, record=False))},
                      warmup=1, repeat=repeat, device=device, threads=threads)
        has_target = N >= 1024  # the target is stated at N = 1024
        ratio = cmp.speedup("mgrit")
        rows.append(_ratio_row(name, "serial ResNet forward (per-layer weights)",
                               f"MGRIT forward m={m} L={levels} it={iters}", cmp,
                               cost_model(N, m, levels, iters)["speedup"], device,
                               f"rel. error {err:.1e}",
                               f">= {target}x" if has_target else "",
                               ratio >= target if has_target else None))
        lp = LayerParallelResNet(stack, cfactor=m, levels=levels, fwd_iters=iters,
                                 bwd_iters=iters, warm_start=False, record=False)
        cmp2 = compare({"serial": partial(_fwd_bwd, serial, x0),
                        "mgrit": partial(_fwd_bwd, lp, x0)}, warmup=1,
                       repeat=3 if quick else 5, device=device, threads=threads)
        rows.append(_ratio_row(name, "serial ResNet fwd+bwd (autograd)",
                               f"MGRIT fwd+bwd m={m} L={levels} it={iters}", cmp2,
                               cost_model(N, m, levels, iters, bwd_iters=iters)["speedup"],
                               device, "same weights, gradients inexact at these iterations",
                               formula="2N / (forward + adjoint + gradient depth)"))
    return rows
