"""The residual stack: one layer's function ``F`` and N layers' parameters, stacked.

A ResNet is forward Euler on an ODE: ``x_{n+1} = x_n + h F(x_n, theta_n)``, n = 0..N-1.
:class:`ResidualStack` holds the N layers' parameters stacked as ``{name: (N, ...)}``, the
layout MGRIT's batched calls need: every batched call stacks the per-layer parameters and
uses ``torch.func.vmap`` (or a hand-batched ``bmm`` for :func:`dense_tanh`), the
single-device analogue of one CUDA stream per layer block (Kirby et al. 2020).
:func:`random_stack` draws one with smooth weights across layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import vjp, vmap

from parlearn.core.checks import (
    check_bool,
    check_callable,
    check_float,
    check_int,
    check_seed,
    check_tensor,
)

__all__ = ["ResidualStack", "dense_tanh", "conv_tanh", "random_stack"]


# --- residual functions: one layer, unbatched ----------------------------------------
# These run in every inner loop (and in the serial baseline), so they check nothing:
# ResidualStack checks the parameter shapes once and mgrit_forward checks the input.


def _one_layer(p: Any, w_ndim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's ``W`` (``w_ndim`` dims) and ``b`` (its output size) from the dict ``p``."""
    if not isinstance(p, dict) or set(p) != {"W", "b"}:
        raise TypeError(f"p must be a dict of one layer's 'W' and 'b', got {p!r:.80}")
    W = check_tensor("p['W']", p["W"], ndim=w_ndim, floating=True)
    b = check_tensor("p['b']", p["b"], shape=(W.shape[0],), dtype=W.dtype)
    return W, b


def dense_tanh(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """``F(x) = tanh(W x + b)`` for ``x`` of shape ``(B, d)`` (one ``addmm``, as nn.Linear);
    ``p`` holds one layer's ``W`` (w, d) and ``b`` (w,)."""
    W, b = _one_layer(p, 2)
    check_tensor("x", x, shape=(None, W.shape[1]), dtype=W.dtype)
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
    W, b = _one_layer(p, 4)
    check_tensor("x", x, shape=(None, W.shape[1], None, None), dtype=W.dtype)
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
            raise ValueError(f"params: every stacked tensor needs the same leading size N, got "
                             f"{sizes}")
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
