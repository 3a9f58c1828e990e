"""Forward and backward of a ResNet by MGRIT, beside the serial ResNet it replaces.

The forward is :func:`~parlearn.serial_chain.multigrid.solver.mgrit` on the stack's steps
(:func:`mgrit_forward`). The backward pass is the adjoint recursion
``lambda_n = lambda_{n+1} + h J_n^T lambda_{n+1}`` (``J_n = dF/dx`` at ``x_n``): linear,
running backward in layers, and solved with the same MGRIT code in reverse
(:func:`mgrit_adjoint`; serial reference :func:`serial_adjoint`); all parameter gradients
``h (dF/dtheta_n)^T lambda_{n+1}`` then come from one batched call
(:func:`parameter_grads`). :class:`LayerParallelResNet` wraps both in an autograd
Function; :class:`SerialResNet` is the baseline with the same weights, and
:func:`train_digits` trains either on digits.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn

from parlearn.core.checks import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_seed,
    check_tensor,
)
from parlearn.serial_chain.multigrid.solver import (
    RELAX,
    MGRITResult,
    _check_grid,
    _check_solver_args,
    _serial_loop,
    mgrit,
)
from parlearn.serial_chain.multigrid.stack import (
    ResidualStack,
    _check_dtype,
    dense_tanh,
    random_stack,
)

__all__ = ["mgrit_forward", "mgrit_adjoint", "serial_adjoint", "parameter_grads",
           "LayerParallelResNet", "SerialResNet", "train_digits"]


# --- forward and adjoint of a stack -------------------------------------------------------


def _scaled(steps: slice, s: int) -> slice:
    """Step indices at a level with spacing ``s`` -> fine layer indices (injection)."""
    return slice(steps.start * s, steps.stop * s, (steps.step or 1) * s)


def _forward_step(stack: ResidualStack, m: int, level: int, steps: slice,
                  X: torch.Tensor) -> torch.Tensor:
    """The forward's step function, plainly: ``stack.step`` on the layers at the level's
    spacing (the reference of :class:`_ForwardSteps`)."""
    s = m**level
    return stack.step(X, _scaled(steps, s), stack.h * s)


class _ForwardSteps:
    """:func:`_forward_step` for one forward solve, without its per-call Python cost.

    MGRIT's calls are small, so their cost is mostly dispatch (a profile showed it): each
    call through ``stack.step`` sliced ``nn.Parameter`` objects (a tensor subclass, slow to
    index) and built a parameter dict. Here the parameters are detached once, each call's
    strided weight views are made once per solve and reused (a V-cycle repeats the same
    slices every iteration; views, not copies, since the weights may change between
    solves), :func:`dense_tanh` runs as ``baddbmm``, ``tanh_`` and ``X + dt F`` in place,
    and :meth:`serial_solve` runs the coarsest level's serial sweep as a plain loop of
    ``addmm`` on per-layer views, as :class:`SerialResNet` does. Same maths as
    :func:`_forward_step` (equal to round-off, tested).
    """

    def __init__(self, stack: ResidualStack, m: int):
        self.h, self.m, self.batched_fn = stack.h, m, stack.batched_fn
        self.params = {k: v.detach() for k, v in stack.params.items()}
        self.dense = stack.fn is dense_tanh
        self._views: dict[tuple, Any] = {}

    def _weights(self, level: int, steps: slice):
        key = (level, steps.start, steps.stop, steps.step)
        w = self._views.get(key)
        if w is None:
            idx = _scaled(steps, self.m**level)
            p = {k: v[idx] for k, v in self.params.items()}
            w = (p["b"].unsqueeze(1), p["W"].transpose(1, 2)) if self.dense else p
            self._views[key] = w
        return w

    def __call__(self, level: int, steps: slice, X: torch.Tensor) -> torch.Tensor:
        dt = self.h * self.m**level
        w = self._weights(level, steps)
        if self.dense:
            return torch.baddbmm(w[0], X, w[1]).tanh_().mul_(dt).add_(X)
        return X + dt * self.batched_fn(X, w)

    def serial_solve(self, level: int, u: torch.Tensor, g: torch.Tensor) -> None:
        """``u[0] = g[0]``, ``u[i+1] = Phi_i(u[i]) + g[i+1]``: the solver's serial sweep
        (the solver's own loop of single-step calls unless the stack is dense_tanh)."""
        if not self.dense:
            _serial_loop(self, u, g, level)
            return
        u[0] = g[0]
        s = self.m**level
        key = ("serial", level)
        layers = self._views.get(key)
        if layers is None:
            n = u.shape[0] - 1
            layers = list(zip(self.params["b"][:n * s:s].unbind(0),
                              self.params["W"][:n * s:s].transpose(1, 2).unbind(0),
                              strict=True))
            self._views[key] = layers
        dt = self.h * s
        for i, (b, Wt) in enumerate(layers):
            x = u[i]
            torch.add(torch.addmm(b, x, Wt).tanh_().mul_(dt).add_(x), g[i + 1], out=u[i + 1])


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
        return mgrit(_ForwardSteps(stack, cfactor), g, cfactor=cfactor, levels=levels,
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
