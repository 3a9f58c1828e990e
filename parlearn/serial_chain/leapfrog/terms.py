"""The two terms of backprop, and the forward pass whose tape they read.

Backprop through layers ``l = L..1`` does two things per layer:

* the error chain ``delta_{l-1} = J_l^T delta_l`` (:func:`chain_step`): serial,
  each step needs the last;
* the weight gradient ``G_l = f(delta_l, a_{l-1})`` (:func:`weight_grads`):
  independent across layers once ``delta_l`` is known.

:func:`forward` runs the model module by module and keeps, in a :class:`Tape`, each
module's input and output graph: what the schedules of
:mod:`parlearn.serial_chain.leapfrog.schedules` read. Layers: the schedules work on the
*modules* of the flattened ``nn.Sequential`` (a tanh is a module with a chain step and no
weight gradient).
"""


from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from parlearn.core.checks import check_callable, check_int, check_module, check_tensor

__all__ = ["Tape", "forward", "chain_step", "weight_grads"]

_PARAM_FREE = (nn.ReLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU, nn.ELU,
               nn.Softplus, nn.Identity, nn.Flatten, nn.Dropout, nn.MaxPool1d, nn.MaxPool2d,
               nn.AvgPool1d, nn.AvgPool2d)
_NORMS = (nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d)
_SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d, *_NORMS, *_PARAM_FREE)


# --- the two terms of backprop ----------------------------------------------------------


def _flatten(model: nn.Module) -> list[nn.Module]:
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model must be an nn.Sequential, got {type(model).__name__}: leapfrog "
                        "schedules need the layers as a chain")
    layers = []
    for i, layer in enumerate(model):
        if isinstance(layer, nn.Sequential):
            layers.extend(_flatten(layer))
        else:
            _check_supported(f"layer {i}", layer)
            layers.append(layer)
    if not layers:
        raise ValueError("model must have at least one layer, got an empty nn.Sequential")
    return layers


def _check_supported(name: str, layer: nn.Module) -> None:
    if not isinstance(layer, _SUPPORTED):
        raise ValueError(f"{name} ({type(layer).__name__}) is not supported: its input and "
                         "weight gradients are not separated here. Supported: "
                         + ", ".join(t.__name__ for t in _SUPPORTED))
    if isinstance(layer, (nn.Conv1d, nn.Conv2d)) and (
            isinstance(layer.padding, str) or layer.padding_mode != "zeros"):
        raise ValueError(f"{name} ({layer}): only numeric zero padding is supported")


def chain_step(tape: Tape, l: int, delta: torch.Tensor) -> torch.Tensor:
    """``delta_{l-1} = J_l^T delta_l``: the input gradient of module ``l`` (0-based)."""
    if not isinstance(tape, Tape):
        raise TypeError(f"tape must be a leapfrog.Tape (from leapfrog.forward), got "
                        f"{type(tape).__name__}")
    l = check_int("l", l, lo=0, hi=len(tape.layers) - 1)
    check_tensor("delta", delta, shape=tuple(tape.outs[l].shape), floating=True)
    (g,) = torch.autograd.grad(tape.outs[l], tape.ins[l], delta, retain_graph=True)
    return g


def _batch_stats(layer: nn.Module, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance the norm layer used in its forward pass, shaped to broadcast."""
    if isinstance(layer, nn.LayerNorm):
        dims = tuple(range(a.ndim - len(layer.normalized_shape), a.ndim))
        return a.mean(dims, keepdim=True), a.var(dims, unbiased=False, keepdim=True)
    shape = (1, -1) + (1,) * (a.ndim - 2)
    # BatchNorm normalises with the batch's statistics in train mode (and whenever it
    # keeps no running statistics), with its running statistics in eval mode.
    if layer.training or not layer.track_running_stats:
        dims = (0, *range(2, a.ndim))
        return a.mean(dims, keepdim=True), a.var(dims, unbiased=False, keepdim=True)
    return layer.running_mean.view(shape), layer.running_var.view(shape)


def _conv_out(n: int, k: int, s: int, p: int, d: int) -> int:
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def _check_layer_io(layer: nn.Module, a: torch.Tensor, delta: torch.Tensor) -> None:
    """Refuse an input ``a`` / output gradient ``delta`` pair the layer cannot have made."""
    check_tensor("a", a, floating=True)
    check_tensor("delta", delta, floating=True)
    if a.dtype != delta.dtype or a.device != delta.device:
        raise ValueError(f"a and delta must share dtype and device, got {a.dtype} on {a.device} "
                         f"and {delta.dtype} on {delta.device}")
    name = type(layer).__name__
    if isinstance(layer, nn.Linear):
        if a.ndim < 1 or a.shape[-1] != layer.in_features:
            raise ValueError(f"a must end in {name}.in_features={layer.in_features}, got shape "
                             f"{tuple(a.shape)}")
        want = (*a.shape[:-1], layer.out_features)
    elif isinstance(layer, (nn.Conv1d, nn.Conv2d)):
        spatial = 1 if isinstance(layer, nn.Conv1d) else 2
        if a.ndim != 2 + spatial or a.shape[1] != layer.in_channels:
            dims = ", ".join(["batch", str(layer.in_channels)] + ["*"] * spatial)
            raise ValueError(f"a must be ({dims}) for {name}, got shape {tuple(a.shape)}")
        want = (a.shape[0], layer.out_channels, *(
            _conv_out(a.shape[2 + i], layer.kernel_size[i], layer.stride[i], layer.padding[i],
                      layer.dilation[i]) for i in range(spatial)))
    elif isinstance(layer, nn.LayerNorm):
        ns = tuple(layer.normalized_shape)
        if tuple(a.shape[a.ndim - len(ns):]) != ns or a.ndim <= len(ns):
            raise ValueError(f"a must end in {name}.normalized_shape={ns} after a batch "
                             f"dimension, got shape {tuple(a.shape)}")
        want = tuple(a.shape)
    elif isinstance(layer, (nn.BatchNorm1d, nn.BatchNorm2d)):
        ndims = (2, 3) if isinstance(layer, nn.BatchNorm1d) else (4,)
        if a.ndim not in ndims or a.shape[1] != layer.num_features:
            raise ValueError(f"a must have {' or '.join(map(str, ndims))} dimensions with "
                             f"{layer.num_features} channels for {name}, got shape "
                             f"{tuple(a.shape)}")
        want = tuple(a.shape)
    else:
        return
    if tuple(delta.shape) != tuple(want):
        raise ValueError(f"delta must have the shape of {name}'s output {tuple(want)} for an "
                         f"input of shape {tuple(a.shape)}, got {tuple(delta.shape)}")


def weight_grads(layer: nn.Module, a: torch.Tensor,
                 delta: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """``G_l = f(delta_l, a_{l-1})``: the parameter gradients of one layer, explicitly.

    Linear: ``dW = delta^T a``, ``db = sum delta``. Conv: the weight-gradient
    convolution of ``a`` with ``delta``. LayerNorm/BatchNorm: ``dgamma = sum delta*xhat``,
    ``dbeta = sum delta``, with ``xhat`` normalised by the statistics the layer's forward
    used (the batch's in train mode, the running ones in eval mode). Parameter-free
    layers give ``[]``; parameters with ``requires_grad=False`` are left out. Needs no
    autograd graph, so it runs on any worker or stream. ``a`` is the layer's input and
    ``delta`` the loss gradient at its output; a pair of the wrong shapes is refused.
    """
    check_module("layer", layer)
    _check_supported("layer", layer)
    _check_layer_io(layer, a, delta)
    if isinstance(layer, nn.Linear):
        a2, d2 = a.reshape(-1, a.shape[-1]), delta.reshape(-1, delta.shape[-1])
        out = [(layer.weight, d2.T @ a2)]
        bias_dims: tuple[int, ...] = (0,)
        d_for_bias = d2
    elif isinstance(layer, (nn.Conv1d, nn.Conv2d)):
        conv_w = nn.grad.conv1d_weight if isinstance(layer, nn.Conv1d) else nn.grad.conv2d_weight
        gw = conv_w(a, layer.weight.shape, delta, layer.stride, layer.padding, layer.dilation,
                    layer.groups)
        out = [(layer.weight, gw)]
        bias_dims, d_for_bias = (0, *range(2, delta.ndim)), delta
    elif isinstance(layer, _NORMS):
        mean, var = _batch_stats(layer, a)
        xhat = (a - mean) / torch.sqrt(var + layer.eps)
        if isinstance(layer, nn.LayerNorm):
            bias_dims = tuple(range(a.ndim - len(layer.normalized_shape)))
        else:
            bias_dims = (0, *range(2, a.ndim))
        out = [(layer.weight, (delta * xhat).sum(bias_dims))] if layer.weight is not None else []
        d_for_bias = delta
    else:
        return []
    if layer.bias is not None:
        out.append((layer.bias, d_for_bias.sum(bias_dims)))
    return [(p, g) for p, g in out if p.requires_grad]


# --- forward, and the tape the backward schedules read ----------------------------------


@dataclass
class Tape:
    """What the forward pass stored: each module's input ``a_{l-1}`` and output graph."""

    layers: list[nn.Module]
    ins: list[torch.Tensor]
    outs: list[torch.Tensor]
    loss: torch.Tensor
    delta_top: torch.Tensor
    events: list[tuple[str, str, float, float]] | None = None
    grads: dict[int, list] = field(default_factory=dict)


def _check_input(layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor) -> None:
    check_tensor("x", x, floating=True)
    if x.ndim < 1 or x.shape[0] == 0:
        raise ValueError(f"x must have a non-empty batch dimension, got shape {tuple(x.shape)}")
    check_tensor("y", y)
    if y.ndim < 1 or y.shape[0] != x.shape[0]:
        raise ValueError(f"y must have x's batch size {x.shape[0]} as its first dimension, got "
                         f"shape {tuple(y.shape)}")
    params = [p for m in layers for p in m.parameters(recurse=False)]
    if params and (x.dtype != params[0].dtype or x.device != params[0].device):
        raise ValueError(f"x must have the model's dtype and device ({params[0].dtype} on "
                         f"{params[0].device}), got {x.dtype} on {x.device}")
    first = layers[0]
    if isinstance(first, nn.Linear) and x.shape[-1] != first.in_features:
        raise ValueError(f"x must end in the first layer's in_features={first.in_features}, "
                         f"got shape {tuple(x.shape)}")
    if isinstance(first, (nn.Conv1d, nn.Conv2d)) and (x.ndim < 2
                                                     or x.shape[1] != first.in_channels):
        raise ValueError(f"x must have the first layer's in_channels={first.in_channels} as "
                         f"dimension 1, got shape {tuple(x.shape)}")


def forward(model: nn.Sequential, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor) -> Tape:
    """Run the forward pass module by module, keeping each one's graph for the backward.

    ``y`` is whatever ``loss_fn(output, y)`` takes, with ``x``'s batch size first.
    Like any forward, it updates BatchNorm running statistics in train mode.
    """
    layers = _flatten(model)
    check_callable("loss_fn", loss_fn)
    _check_input(layers, x, y)
    ins, outs = [], []
    a = x.detach()
    for layer in layers:
        a_in = a.detach().requires_grad_(True)
        a = layer(a_in)
        ins.append(a_in)
        outs.append(a)
    top = outs[-1].detach().requires_grad_(True)
    loss = loss_fn(top, y)
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        raise ValueError(f"loss_fn must return a scalar tensor, got "
                         f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else loss!r}")
    (delta_top,) = torch.autograd.grad(loss, top)
    return Tape(layers, ins, outs, loss.detach(), delta_top)
