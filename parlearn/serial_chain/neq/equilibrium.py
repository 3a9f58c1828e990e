"""NEq's equilibrium test: the layers it watches, similarity, its change, its velocity."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from parlearn.core.checks import (
    check_float,
    check_module,
    check_tensor,
)

__all__ = ["linear_layers", "phi", "velocity_step", "Equilibrium"]


def linear_layers(model: nn.Module) -> list[nn.Linear]:
    """The Linear layers of ``model``, an ``nn.Sequential`` of Linear layers (with or
    without bias, trainable or wholly frozen) and modules with neither parameters nor
    buffers (activations). Refused up front, naming the module: any other module with
    parameters (TypeError) or buffers (ValueError: running statistics would move while the
    validation outputs are taken), one Linear used twice (a tied layer: its neurons would
    be watched and stepped twice), a Linear whose weight and bias differ in
    ``requires_grad``."""
    check_module("model", model)
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model must be an nn.Sequential, got {type(model).__name__}")
    out: list[nn.Linear] = []
    for i, m in enumerate(model):
        if isinstance(m, nn.Linear):
            if any(m is o for o in out):
                raise ValueError(f"model[{i}] is a Linear already used earlier (tied "
                                 "weights): NEq watches and steps each neuron once")
            if m.bias is not None and m.bias.requires_grad != m.weight.requires_grad:
                raise ValueError(f"model[{i}]'s weight and bias differ in requires_grad: "
                                 "NEq freezes a neuron's weight row and bias together")
            out.append(m)
        elif any(True for _ in m.parameters()):
            raise TypeError(f"model[{i}] ({type(m).__name__}) has parameters but is not "
                            f"nn.Linear: NEq here watches Linear neurons only")
        elif any(True for _ in m.buffers()):
            raise ValueError(f"model[{i}] ({type(m).__name__}) has buffers: NEq here takes "
                             "Linear layers and stateless modules only")
    if not out:
        raise ValueError("model has no nn.Linear layer")
    return out


def _effective(layers: Sequence[nn.Linear], active: Sequence[torch.Tensor]
               ) -> list[torch.Tensor]:
    """The masks with a wholly frozen layer (``requires_grad=False``) never active."""
    return [a if m.weight.requires_grad else torch.zeros_like(a)
            for m, a in zip(layers, active, strict=True)]


def _check_xy(layers: Sequence[nn.Linear], x: torch.Tensor, y: torch.Tensor) -> None:
    check_tensor("x", x, ndim=2, floating=True)
    if x.shape[0] == 0:
        raise ValueError("x must hold at least one example, got 0 rows")
    check_tensor("y", y, shape=(x.shape[0],), floating=False)
    if x.shape[1] != layers[0].in_features:
        raise ValueError(f"x must have {layers[0].in_features} features (the first Linear's "
                         f"in_features), got {x.shape[1]}")


# ---------------------------------------------------------------------------------------
# The equilibrium test: similarity, its change, its velocity.

def phi(previous: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """Per neuron (column), the cosine similarity of its outputs ``previous[:, i]`` and
    ``current[:, i]`` over the validation samples (rows), in float64. As in the authors'
    code, a neuron silent (all zeros) in both is similarity 1, in only one of them 0."""
    previous = check_tensor("previous", previous, ndim=2, floating=True)
    current = check_tensor("current", current, shape=tuple(previous.shape), floating=True)
    a, b = previous.double(), current.double()
    na, nb = a.norm(dim=0), b.norm(dim=0)
    cos = (a * b).sum(0) / (na * nb).clamp_min(torch.finfo(torch.float64).tiny)
    both_silent, one_silent = (na == 0) & (nb == 0), (na == 0) ^ (nb == 0)
    return torch.where(both_silent, 1.0, torch.where(one_silent, 0.0, cos))


def velocity_step(v_prev: torch.Tensor, dphi: torch.Tensor, mu: float) -> torch.Tensor:
    """The paper's velocity of the similarity's change: ``v^t = dphi^t - mu v^{t-1}``."""
    v_prev = check_tensor("v_prev", v_prev, floating=True)
    dphi = check_tensor("dphi", dphi, shape=tuple(v_prev.shape), floating=True)
    mu = check_float("mu", mu, lo=0, hi=1)
    return dphi - mu * v_prev


def _check_outputs(outputs, like: list[torch.Tensor] | None = None) -> None:
    """A non-empty list of 2-D (examples, neurons) float tensors, shaped as ``like``."""
    if not isinstance(outputs, list | tuple) or not outputs:
        raise TypeError(f"outputs must be a non-empty list of (examples, neurons) tensors, "
                        f"got {type(outputs).__name__}")
    if like is not None and len(outputs) != len(like):
        raise ValueError(f"outputs must hold {len(like)} layers, got {len(outputs)}")
    for i, o in enumerate(outputs):
        shape = (None, None) if like is None else tuple(like[i].shape)
        check_tensor(f"outputs[{i}]", o, shape=shape, floating=True)


@dataclass
class Equilibrium:
    """The per-neuron state NEq carries from epoch to epoch, for every watched layer:
    last validation outputs, ``phi``, velocity ``v``, and the mask of *active* neurons."""

    outputs: list[torch.Tensor]
    phi: list[torch.Tensor]
    velocity: list[torch.Tensor]
    active: list[torch.Tensor]
    eps: float
    mu: float

    @classmethod
    def start(cls, outputs: list[torch.Tensor], eps: float, mu: float) -> Equilibrium:
        """State before training: ``phi^0 = 1``, ``v^0 = 0``, every neuron active."""
        _check_outputs(outputs)
        eps = check_float("eps", eps, lo=0)
        mu = check_float("mu", mu, lo=0, hi=1)
        ones = [torch.ones(o.shape[1], dtype=torch.float64) for o in outputs]
        return cls(outputs, ones, [torch.zeros_like(p) for p in ones],
                   [torch.ones(o.shape[1], dtype=torch.bool) for o in outputs], eps, mu)

    def update(self, outputs: list[torch.Tensor]) -> None:
        """One epoch's check: new ``phi``, ``dphi``, velocity, and the new active mask
        ``|v| >= eps`` (frozen iff ``|v| < eps``, so ``eps = 0`` freezes nothing)."""
        _check_outputs(outputs, self.outputs)
        new_phi = [phi(a, b) for a, b in zip(self.outputs, outputs, strict=True)]
        self.velocity = [velocity_step(v, p - q, self.mu)
                         for v, p, q in zip(self.velocity, new_phi, self.phi, strict=True)]
        self.phi, self.outputs = new_phi, outputs
        self.active = [~(v.abs() < self.eps) for v in self.velocity]


@torch.no_grad()
def _layer_outputs(model: nn.Sequential, x: torch.Tensor) -> list[torch.Tensor]:
    """Each Linear layer's output (pre-activation) on ``x``: the neurons' outputs."""
    out, h = [], x
    for m in model:
        h = m(h)
        if isinstance(m, nn.Linear):
            out.append(h.clone())
    return out
