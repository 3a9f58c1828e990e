"""Layer-parallel ResNets by nonlinear multigrid (MGRIT with FAS).

A ResNet is forward Euler on an ODE: ``x_{n+1} = x_n + h F(x_n, theta_n)``, n = 0..N-1.
The serial forward pass (:meth:`ResidualStack.serial`) is a sweep of N dependent
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
``torch.func.vmap``, the single-device analogue of one CUDA stream per layer block
(Kirby et al. 2020).

Sources: Gunther et al., "Layer-parallel training of deep residual neural networks"
(SIMODS 2020); Kirby et al., "Layer-parallel training with GPU concurrency of deep
residual neural networks via nonlinear multigrid" (HPEC 2020); XBraid and TorchBraid.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.func import vjp, vmap

from .bench import Row
from .timing import compare

__all__ = ["ResidualStack", "dense_tanh", "conv_tanh", "random_stack", "MGRITResult",
           "mgrit_forward", "mgrit_adjoint", "serial_adjoint", "parameter_grads",
           "LayerParallelResNet", "SerialResNet", "train_digits", "cost_model", "RELAX"]

RELAX = ("F", "FCF")


# --- residual functions: one layer, unbatched ----------------------------------------


def dense_tanh(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """``F(x) = tanh(W x + b)`` for ``x`` of shape ``(B, d)``."""
    return torch.tanh(x @ p["W"].T + p["b"])


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


class ResidualStack(nn.Module):
    """N residual layers with stacked parameters ``{name: (N, ...)}`` and step size ``h``.

    ``fn(x, params_of_one_layer) -> F`` is applied to one layer; :meth:`step` applies
    it to many layers at once with ``vmap`` (or with a hand-batched version where one
    is known, as for :func:`dense_tanh`).
    """

    def __init__(self, params: dict[str, torch.Tensor], h: float,
                 fn: Callable[[torch.Tensor, dict], torch.Tensor] = dense_tanh):
        super().__init__()
        if not params:
            raise ValueError("params must hold at least one stacked tensor")
        sizes = {name: t.shape[0] for name, t in params.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"every stacked parameter needs the same leading size N, got {sizes}")
        if not (isinstance(h, (int, float)) and h > 0):
            raise ValueError(f"h must be a positive number, got {h!r}")
        self.params = nn.ParameterDict({k: nn.Parameter(v) for k, v in params.items()})
        self.h, self.fn = float(h), fn
        self.batched_fn = _BATCHED.get(fn) or vmap(fn)
        self.batched_vjp = _BATCHED_VJP.get(fn) or vmap(self._vjp_one)

    def _vjp_one(self, x, p, v):
        _, pull = vjp(self.fn, x, p)
        return pull(v)

    @property
    def n_layers(self) -> int:
        return next(iter(self.params.values())).shape[0]

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
        """Reference forward: all N+1 states, shape ``(N+1, *x0.shape)``, one layer at a time."""
        states = [x0]
        for n in range(self.n_layers):
            p = {k: v[n] for k, v in self.params.items()}
            states.append(states[-1] + self.h * self.fn(states[-1], p))
        return torch.stack(states)


def random_stack(n_layers: int, width: int, *, h: float | None = None, smoothness: float = 1.0,
                 scale: float = 1.0, conv: bool = False, channels: int = 2, kernel: int = 3,
                 dtype: torch.dtype = torch.float64, seed: int = 0) -> ResidualStack:
    """A random stack whose weights vary smoothly with depth (``smoothness=1``) or are
    independent per layer (``smoothness=0``), or a blend. ``h`` defaults to ``1/N``
    (an ODE on [0, 1])."""
    if not 0.0 <= smoothness <= 1.0:
        raise ValueError(f"smoothness must lie in [0, 1], got {smoothness}")
    if n_layers < 1 or width < 1:
        raise ValueError(f"n_layers and width must be >= 1, got {n_layers}, {width}")
    g = torch.Generator().manual_seed(seed)
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


@dataclass
class MGRITResult:
    """States (N+1, ...), iterations run, and the residual norm before the first and after
    every iteration (when recorded)."""

    states: torch.Tensor
    residuals: list[float] = field(default_factory=list)
    iterations: int = 0

    @property
    def output(self) -> torch.Tensor:
        return self.states[-1]


def _check_grid(n_steps: int, cfactor: int, levels: int) -> None:
    if not isinstance(cfactor, int) or cfactor < 2:
        raise ValueError(f"cfactor must be an int >= 2, got {cfactor!r}")
    if cfactor > n_steps:
        raise ValueError(f"cfactor={cfactor} exceeds the number of layers N={n_steps}")
    if not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels must be an int >= 1, got {levels!r}")
    if n_steps % cfactor ** (levels - 1):
        raise ValueError(f"N={n_steps} must be divisible by cfactor**(levels-1)="
                         f"{cfactor ** (levels - 1)} (short last intervals are not supported)")
    if levels > 1 and n_steps // cfactor ** (levels - 1) < 1:
        raise ValueError(f"levels={levels} is too deep for N={n_steps}, cfactor={cfactor}")


def residual(step: StepFn, u: torch.Tensor, g: torch.Tensor, level: int = 0) -> torch.Tensor:
    """``g - A(u)`` with ``A(u)_0 = u_0`` and ``A(u)_{i+1} = u_{i+1} - Phi_i(u_i)``."""
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
    g_coarse = r.clone()  # g_c = R r + A_c(v)
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
    """Solve ``A(u) = g`` (``n`` steps of ``step``) by MGRIT V-cycles.

    ``record=False`` skips the full residual after each iteration (a whole extra sweep of
    work) when no ``tol`` needs it; ``residuals`` then holds only the initial one.
    """
    n = g.shape[0] - 1
    _check_grid(n, cfactor, levels)
    if relax not in RELAX:
        raise ValueError(f"relax must be one of {RELAX}, got {relax!r}")
    if iters is None and tol is None:
        raise ValueError("give iters (an iteration cap), tol (a residual tolerance), or both")
    if iters is not None and (not isinstance(iters, int) or iters < 0):
        raise ValueError(f"iters must be an int >= 0, got {iters!r}")
    if warm_start is not None:
        if warm_start.shape != g.shape:
            raise ValueError(f"warm_start has shape {tuple(warm_start.shape)}, expected "
                             f"{tuple(g.shape)}")
        u = warm_start.clone()
        u[0] = g[0]
    else:
        u = g[:1].expand_as(g).clone()  # every state starts at the input
    cap = iters if iters is not None else 10 * n
    res = MGRITResult(u, [residual(step, u, g).norm().item()] if record or tol else [])
    for _ in range(cap):
        if tol is not None and res.residuals[-1] <= tol:
            break
        if levels == 1:
            _serial_solve(step, u, g, 0)
        else:
            _cycle(step, u, g, 0, levels, cfactor, relax, batched)
        res.iterations += 1
        if record or tol is not None:
            res.residuals.append(residual(step, u, g).norm().item())
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
    """All N+1 states of ``stack`` from ``x0`` by MGRIT; ``cfactor=1`` or ``levels=1``
    is the serial solve. ``record=False``: see :func:`mgrit`."""
    if cfactor == 1:
        levels = 1
        cfactor = 2 if stack.n_layers >= 2 else 1
    g = torch.zeros(stack.n_layers + 1, *x0.shape, dtype=x0.dtype, device=x0.device)
    g[0] = x0
    if levels == 1:
        u = stack.serial(x0).detach() if warm_start is None else warm_start
        step = partial(_forward_step, stack, 1)
        return MGRITResult(u, [residual(step, u, g).norm().item()])
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


def serial_adjoint(stack: ResidualStack, states: torch.Tensor,
                   lam_out: torch.Tensor) -> torch.Tensor:
    """Reference adjoint: ``lambda_n`` for n = 0..N, one layer at a time, backward."""
    lams = [lam_out]
    for n in reversed(range(stack.n_layers)):
        lams.append(lams[-1] + stack.h * _jt(stack, states[n:n + 1], slice(n, n + 1),
                                             lams[-1][None])[0])
    return torch.stack(lams[::-1])


def mgrit_adjoint(stack: ResidualStack, states: torch.Tensor, lam_out: torch.Tensor, *,
                  cfactor: int, levels: int = 2, iters: int | None = None,
                  tol: float | None = None, relax: str = "FCF", batched: bool = True,
                  record: bool = True) -> MGRITResult:
    """``lambda_0..lambda_N`` by MGRIT on the reversed adjoint recursion (states in layer order)."""
    g = torch.zeros(stack.n_layers + 1, *lam_out.shape, dtype=lam_out.dtype,
                    device=lam_out.device)
    g[0] = lam_out
    with torch.no_grad():
        res = mgrit(partial(_adjoint_step, stack, states, cfactor), g, cfactor=cfactor,
                    levels=levels, iters=iters, tol=tol, relax=relax, batched=batched,
                    record=record)
    res.states = res.states.flip(0)
    return res


def parameter_grads(stack: ResidualStack, states: torch.Tensor,
                    lams: torch.Tensor) -> dict[str, torch.Tensor]:
    """``h (dF/dtheta_n)^T lambda_{n+1}`` for every layer n, in one batched call."""
    g = stack.batched_vjp(states[:-1], dict(stack.params), lams[1:])[1]
    return {k: stack.h * v for k, v in g.items()}


# --- an nn.Module whose forward and backward are both layer-parallel -------------------


class _MGRITFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x0, module, *flat_params):
        res = mgrit_forward(module.stack, x0.detach(), cfactor=module.cfactor,
                            levels=module.levels, iters=module.fwd_iters, tol=module.fwd_tol,
                            relax=module.relax, warm_start=module._warm(x0),
                            record=module.record)
        module.last_forward = res
        if module.warm_start:
            module._warm_states = res.states.detach()
        ctx.module = module
        ctx.save_for_backward(res.states)
        return res.output.clone()

    @staticmethod
    def backward(ctx, grad_out):
        module = ctx.module
        (states,) = ctx.saved_tensors
        res = mgrit_adjoint(module.stack, states, grad_out, cfactor=module.cfactor,
                            levels=module.levels, iters=module.bwd_iters, tol=module.bwd_tol,
                            relax=module.relax, record=module.record)
        module.last_backward = res
        grads = parameter_grads(module.stack, states, res.states)
        return (res.states[0], None, *(grads[k] for k in module.stack.params))


class LayerParallelResNet(nn.Module):
    """A residual block of N layers whose forward and backward run MGRIT.

    ``fwd_iters``/``bwd_iters`` cap the iterations (fewer gives inexact gradients, as in
    Gunther et al. and TorchBraid); ``fwd_tol``/``bwd_tol`` stop early. With
    ``warm_start=True`` the last forward's states seed the next one (as in Kirby et
    al.), which pays off across training steps when weights change slowly.
    ``last_forward`` and ``last_backward`` keep the residual histories (with
    ``record=True``; recording costs one extra sweep of work per iteration).
    """

    def __init__(self, stack: ResidualStack, *, cfactor: int = 4, levels: int = 2,
                 fwd_iters: int | None = 2, bwd_iters: int | None = 2,
                 fwd_tol: float | None = None, bwd_tol: float | None = None,
                 relax: str = "FCF", warm_start: bool = True, record: bool = True):
        super().__init__()
        _check_grid(stack.n_layers, cfactor, levels)
        if relax not in RELAX:
            raise ValueError(f"relax must be one of {RELAX}, got {relax!r}")
        for name, it, tol in (("fwd", fwd_iters, fwd_tol), ("bwd", bwd_iters, bwd_tol)):
            if it is None and tol is None:
                raise ValueError(f"{name}_iters and {name}_tol cannot both be None")
        self.stack, self.cfactor, self.levels, self.relax = stack, cfactor, levels, relax
        self.fwd_iters, self.bwd_iters, self.fwd_tol, self.bwd_tol = (fwd_iters, bwd_iters,
                                                                      fwd_tol, bwd_tol)
        self.warm_start, self.record = warm_start, record
        self._warm_states: torch.Tensor | None = None
        self.last_forward: MGRITResult | None = None
        self.last_backward: MGRITResult | None = None

    def _warm(self, x0: torch.Tensor) -> torch.Tensor | None:
        w = self._warm_states
        if not self.warm_start or w is None or w.shape[1:] != x0.shape:
            return None
        return w

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        return _MGRITFunction.apply(x0, self, *self.stack.params.values())


# --- a short training run ------------------------------------------------------------


class SerialResNet(nn.Module):
    """The same stack run by the serial forward, differentiated by autograd: the reference."""

    def __init__(self, stack: ResidualStack):
        super().__init__()
        self.stack = stack

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        return self.stack.serial(x0)[-1]


def train_digits(parallel: bool, data, *, layers: int = 32, width: int = 32, steps: int = 150,
                 lr: float = 1e-2, cfactor: int = 4, levels: int = 2, iters: int = 2,
                 seed: int = 0, progress: bool = True) -> dict:
    """Full-batch Adam on digits: Linear(64, width) -> N residual layers -> Linear(width, 10).

    ``parallel=True`` runs the residual block as a :class:`LayerParallelResNet`
    (``iters`` forward and backward iterations, warm-started across steps); ``False``
    runs the serial forward with autograd. Same initial weights either way. Returns
    ``{"step", "loss", "test_acc", "seconds"}``.
    """
    from tqdm.auto import tqdm

    from .timing import measure

    torch.manual_seed(seed)
    dtype = data.x_train.dtype
    stack = random_stack(layers, width, scale=0.5, dtype=dtype, seed=seed)
    block = (LayerParallelResNet(stack, cfactor=cfactor, levels=levels, fwd_iters=iters,
                                 bwd_iters=iters, warm_start=True, record=False) if parallel
             else SerialResNet(stack))
    model = nn.Sequential(nn.Linear(data.n_features, width), block,
                          nn.Linear(width, data.n_classes)).to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    hist: dict = {"step": [], "loss": [], "test_acc": []}
    last: dict = {}

    def train_step():
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(data.x_train), data.y_train)
        loss.backward()
        opt.step()
        last["loss"] = loss.item()

    bar = tqdm(range(steps), desc="layer-parallel" if parallel else "serial",
               disable=not progress, leave=False)
    seconds = 0.0
    for i in bar:
        seconds += measure(train_step, warmup=0, repeat=1).median
        if i % max(1, steps // 15) == 0 or i == steps - 1:
            with torch.no_grad():
                acc = (model(data.x_test).argmax(1) == data.y_test).double().mean().item()
            hist["step"].append(i + 1)
            hist["loss"].append(last["loss"])
            hist["test_acc"].append(acc)
    hist["seconds"] = seconds
    return hist


# --- cost model ----------------------------------------------------------------------


def cost_model(N: int, cfactor: int, levels: int, iters: int, *, relax: str = "FCF",
               devices: int | None = None, record: bool = False) -> dict:
    """Sequential steps (depth) and step evaluations (work) of serial vs MGRIT (modeled).

    One V-cycle at level l with ``N_l`` steps (``m = cfactor``): relaxation costs depth
    ``m-1`` (F) or ``2(m-1)+1`` (FCF) and work ``N_l(m-1)/m`` per F sweep plus ``N_l/m``
    per C sweep; the coarse residual costs depth 1, work ``N_l/m``; then the coarse
    cycle; then a final F sweep. The coarsest level is solved serially (depth = work =
    its step count). With ``record=True`` each iteration also evaluates the fine residual
    (depth 1, work N).
    With ``devices=P`` every batched call of ``k`` steps costs ``ceil(k/P)`` step times;
    ``devices=None`` is unlimited (depth).

    Layer-wise model parallelism on P devices still runs the N layers in order: depth N
    for one batch (it only splits memory), which is the baseline Kirby et al. compare to.
    """
    _check_grid(N, cfactor, levels)
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    m, P = cfactor, devices

    def t(k):  # time of one batched call of k steps
        return k if P == 1 else (1 if P is None else math.ceil(k / P))

    def cycle(n_l, level):
        if level == levels - 1:
            return n_l, n_l
        f_work, c_work = n_l * (m - 1) // m, n_l // m
        sweeps = 1 if relax == "F" else 2
        depth = (m - 1) * t(n_l // m) * (sweeps + 1) + (t(n_l // m) if relax == "FCF" else 0)
        work = f_work * (sweeps + 1) + (c_work if relax == "FCF" else 0)
        depth += t(n_l // m)
        work += n_l // m
        d, w = cycle(n_l // m, level + 1)
        return depth + d, work + w

    d, w = cycle(N, 0) if levels > 1 else (N, N)
    depth = iters * (d + (t(N) if record else 0))
    work = iters * (w + (N if record else 0))
    return {"serial_depth": N, "serial_work": N, "mgrit_depth": depth, "mgrit_work": work,
            "model_parallel_depth": N, "speedup": N / depth if depth else math.inf}


# --- bench ------------------------------------------------------------------------------


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _last_state(stack: ResidualStack, x0: torch.Tensor) -> torch.Tensor:
    return stack.serial(x0)[-1]


def _fwd_bwd(stack: ResidualStack, net: Callable, x0: torch.Tensor) -> None:
    stack.zero_grad(set_to_none=True)
    net(x0).square().sum().backward()


def bench(device: torch.device, quick: bool) -> list[Row]:
    rows = []
    sizes = (64, 256) if quick else (256, 1024)
    width, batch = 32, 4
    target = 1.5 if device.type == "cpu" else 3.0
    for N in sizes:
        stack = random_stack(N, width, dtype=torch.float32, seed=0).to(device)
        x0 = torch.randn(batch, width, device=device)
        ref = stack.serial(x0)
        best = None
        for m, levels, iters in ((8, 2, 2), (16, 2, 2), (4, 3, 2), (8, 3, 2), (16, 3, 1)):
            if N % m ** (levels - 1):
                continue
            res = mgrit_forward(stack, x0, cfactor=m, levels=levels, iters=iters, record=False)
            err = _rel_err(res.output, ref[-1])
            if err < 1e-4:
                cost = cost_model(N, m, levels, iters)["mgrit_depth"]
                if best is None or cost < best[0]:
                    best = (cost, m, levels, iters, err)
        if best is None:
            rows.append(Row(f"multigrid N={N}", "serial forward", "MGRIT forward", 0.0,
                            str(device), "", False, "no setting reached 1e-4"))
            continue
        _, m, levels, iters, err = best
        with torch.no_grad():
            cmp = compare({
                "serial": partial(stack.serial, x0),
                "mgrit": partial(mgrit_forward, stack, x0, cfactor=m, levels=levels,
                                 iters=iters, record=False),
            }, warmup=1, repeat=3 if quick else 7, device=device)
        model = cost_model(N, m, levels, iters)
        ratio = cmp.speedup("mgrit")
        has_target = N >= 1024  # the target is stated at N = 1024
        rows.append(Row(f"multigrid N={N} w={width} B={batch}", "serial forward",
                        f"MGRIT m={m} L={levels} it={iters}", ratio, str(device),
                        f">= {target}x" if has_target else "",
                        ratio >= target if has_target else None,
                        f"rel. error {err:.1e}; modeled depth speedup {model['speedup']:.1f}x "
                        f"(N / {model['mgrit_depth']} sequential batched calls)"))
        # forward + backward through the autograd Function vs serial autograd
        lp = LayerParallelResNet(stack, cfactor=m, levels=levels, fwd_iters=iters,
                                 bwd_iters=iters, warm_start=False, record=False)

        serial_net = partial(_last_state, stack)
        cmp2 = compare({"serial": partial(_fwd_bwd, stack, serial_net, x0),
                        "mgrit": partial(_fwd_bwd, stack, lp, x0)}, warmup=1,
                       repeat=3 if quick else 5, device=device)
        rows.append(Row(f"multigrid N={N} w={width} B={batch}", "serial fwd+bwd (autograd)",
                        f"MGRIT fwd+bwd m={m} L={levels} it={iters}", cmp2.speedup("mgrit"),
                        str(device)))
    return rows
