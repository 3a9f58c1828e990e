"""The network local learning trains: blocks with heads, and feedback weights.

:class:`LocalNet` is a chain of blocks of ordinary modules with one head per block
(:func:`make_net` builds one from widths; :func:`as_sequential` gives the same network as
one ``nn.Sequential`` for pipelined backprop).

**Hebbian feedback** (``rule="hebbian"``; Amit 2019, arXiv 1812.07965): global error
propagation, but each Linear layer's backward uses separate feedback weights ``R`` instead
of ``W^T`` (:class:`FeedbackLinear`). ``R`` is updated by the same local product of the
activities it connects as ``W``: ``dW = -lr (delta x^T + wd W)``, ``dR = -lr (x delta^T +
wd R)``, so ``R - W^T`` shrinks by ``(1 - lr wd)`` every step and ``R = W^T`` stays
backprop exactly. ``rule="fixed"`` keeps a random ``R`` fixed (feedback alignment,
Lillicrap et al. 2016), the comparison Amit makes. RECONSTRUCTION from the abstract
("the feedback weights are also updated with a local rule, the same as the feedforward
weights"); his cost function for the last layer is not implemented (cross-entropy is).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from torch import nn

from parlearn.core.checks import check_choice, check_int, check_module

__all__ = ["FeedbackLinear", "feedback_angle", "LocalNet", "make_net", "as_sequential"]


# ---------------------------------------------------------------------------------------
# Feedback weights: a Linear layer whose backward uses R instead of W^T.

class _FeedbackFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, feedback):
        ctx.save_for_backward(x, feedback)
        return x @ weight.T + bias

    @staticmethod
    def backward(ctx, grad):
        x, feedback = ctx.saved_tensors
        grad_w = grad.T @ x                     # the Hebbian product delta x^T, as in backprop
        grad_x = grad @ feedback.T              # R carries the error down, not W^T
        # R's increment is the same product, transposed: the activity of the two units it
        # connects. None when R is fixed (feedback alignment).
        grad_r = grad_w.T if ctx.needs_input_grad[3] else None
        return grad_x, grad_w, grad.sum(0), grad_r


class FeedbackLinear(nn.Module):
    """``y = x W^T + b`` whose backward sends ``delta R^T`` down instead of ``delta W``.

    ``feedback="hebbian"``: ``R`` (shape ``(in, out)``) is a parameter whose gradient is
    ``(delta^T x)^T``, so any SGD step (with the same weight decay) moves ``R`` by the
    transpose of ``W``'s move (Amit 2019, reconstructed; see the module docstring).
    ``feedback="fixed"``: ``R`` is a buffer, never updated (feedback alignment).
    ``init="random"`` draws ``R`` independently of ``W`` (same scale); ``"transpose"``
    starts from ``R = W^T``, which makes the layer's gradients autograd's exactly."""

    def __init__(self, in_features: int, out_features: int, *, feedback: str = "hebbian",
                 init: str = "random", seed: int = 0, dtype: torch.dtype = torch.float64):
        super().__init__()
        check_choice("feedback", feedback, ("hebbian", "fixed"))
        check_choice("init", init, ("random", "transpose"))
        n_in, n_out = check_int("in_features", in_features, lo=1), check_int(
            "out_features", out_features, lo=1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        gen = torch.Generator().manual_seed(check_int("seed", seed, lo=0))
        w = torch.randn(n_out, n_in, generator=gen, dtype=dtype) / n_in ** 0.5
        b = 0.1 * torch.randn(n_out, generator=gen, dtype=dtype)
        r = w.T.clone() if init == "transpose" else \
            torch.randn(n_in, n_out, generator=gen, dtype=dtype) / n_in ** 0.5
        self.in_features, self.out_features, self.feedback = n_in, n_out, feedback
        self.weight, self.bias = nn.Parameter(w), nn.Parameter(b)
        if feedback == "hebbian":
            self.R = nn.Parameter(r)
        else:
            self.register_buffer("R", r)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FeedbackFn.apply(x, self.weight, self.bias, self.R)

    @classmethod
    def from_linear(cls, lin: nn.Linear, *, feedback: str = "hebbian", init: str = "random",
                    seed: int = 0) -> FeedbackLinear:
        """A copy of ``lin``'s weights and bias with feedback weights ``R``."""
        check_module("lin", lin)
        check_choice("init", init, ("random", "transpose"))
        new = cls(lin.in_features, lin.out_features, feedback=feedback, init="random",
                  seed=seed, dtype=lin.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(lin.weight)
            new.bias.copy_(lin.bias)
            if init == "transpose":
                new.R.copy_(lin.weight.T)
        return new


def feedback_angle(layer: FeedbackLinear) -> float:
    """Angle in degrees between ``R`` and ``W^T`` (as vectors): 0 means backprop."""
    if not isinstance(layer, FeedbackLinear):
        raise TypeError(f"layer must be a FeedbackLinear, got {type(layer).__name__}")
    r, wt = layer.R.detach().flatten(), layer.weight.detach().T.flatten()
    cos = float(r @ wt / (r.norm() * wt.norm()))
    return math.degrees(math.acos(max(-1.0, min(1.0, cos))))


# ---------------------------------------------------------------------------------------
# The network: blocks of ordinary modules, each with a head.

class LocalNet(nn.Module):
    """A chain of ``blocks`` (ordinary modules) with one head per block.

    The network's output is ``heads[-1](blocks[-1](...blocks[0](x)))``: the last head is
    the real classifier, heads ``0..K-2`` are auxiliary (local heads or critics) and are not
    used at test time. Global backprop trains the blocks and the last head; a local rule
    trains block ``k`` with head ``k`` on block ``k-1``'s detached output."""

    def __init__(self, blocks: Sequence[nn.Module], heads: Sequence[nn.Module]):
        super().__init__()
        if not isinstance(blocks, (list, tuple)) or not blocks:
            raise TypeError("blocks must be a non-empty list of nn.Module")
        for b in blocks:
            check_module("blocks", b)
        if not isinstance(heads, (list, tuple)) or len(heads) != len(blocks):
            raise ValueError(f"heads must be a list with one head per block ({len(blocks)})")
        for h in heads:
            check_module("heads", h)
        self.blocks, self.heads = nn.ModuleList(blocks), nn.ModuleList(heads)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads[-1](self.features(x))

    def global_params(self) -> list[nn.Parameter]:
        """What global backprop trains: every block and the last head, each parameter once
        (a weight shared by two blocks is one parameter, stepped once)."""
        ps = [p for b in self.blocks for p in b.parameters()] + list(self.heads[-1].parameters())
        return list({id(p): p for p in ps}.values())


def _linear(a: int, b: int, gen: torch.Generator, dtype) -> nn.Linear:
    # skip_init: nn.Linear's own initialisation would draw from the global RNG.
    lin = nn.utils.skip_init(nn.Linear, a, b, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(b, a, generator=gen, dtype=dtype) / a ** 0.5)
        lin.bias.copy_(0.1 * torch.randn(b, generator=gen, dtype=dtype))
    return lin


def make_net(widths: Sequence[int], blocks: int, classes: int = 10, *, seed: int = 0,
             dtype: torch.dtype = torch.float64, feedback: str | None = None) -> LocalNet:
    """``len(widths) - 1`` layers ``Linear(widths[i], widths[i+1]) + Tanh`` cut into
    ``blocks`` contiguous blocks (:func:`parlearn.pipeline.partition_equal`), each with a
    ``Linear(width, classes)`` head. ``feedback`` ``"hebbian"`` or ``"fixed"`` makes every
    Linear a :class:`FeedbackLinear` with random ``R``. The same ``seed`` gives the same
    forward weights whatever ``feedback`` is. The global RNG is untouched."""
    from parlearn.multi_device.pipeline import partition_equal, split_layers

    if len(widths) < 2:
        raise ValueError(f"widths needs at least 2 entries, got {list(widths)}")
    widths = [check_int("widths", w, lo=1) for w in widths]
    classes = check_int("classes", classes, lo=2)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    blocks = check_int("blocks", blocks, lo=1, hi=len(widths) - 1)
    if feedback is not None:
        check_choice("feedback", feedback, ("hebbian", "fixed"))
    seed = check_int("seed", seed, lo=0)
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        lin = _linear(a, b, gen, dtype)
        if feedback is not None:
            lin = FeedbackLinear.from_linear(lin, feedback=feedback, seed=seed * 1000 + i)
        layers.append(nn.Sequential(lin, nn.Tanh()))
    out = []
    for a, b in split_layers(len(layers), partition_equal(len(layers), blocks)):
        out.append(nn.Sequential(*[m for layer in layers[a:b] for m in layer]))
    heads = []
    for k, block in enumerate(out):
        width = [m for m in block.modules() if isinstance(m, (nn.Linear, FeedbackLinear))][-1]
        head = _linear(width.out_features, classes, gen, dtype)
        if feedback is not None and k == len(out) - 1:
            head = FeedbackLinear.from_linear(head, feedback=feedback, seed=seed * 1000 + 999)
        heads.append(head)
    return LocalNet(out, heads)


def as_sequential(net: LocalNet) -> nn.Sequential:
    """The network as ``nn.Sequential(block_0, ..., block_{K-2}, block_{K-1} + last head)``
    (deep copies), one element per rank: what :func:`parlearn.pipeline.run_pipeline` cuts
    with ``counts=[1] * K`` for pipelined backprop on the same ranks as :func:`run_local`."""
    if not isinstance(net, LocalNet):
        raise TypeError(f"net must be a LocalNet, got {type(net).__name__}")
    parts = [copy.deepcopy(b) for b in net.blocks]
    parts[-1] = nn.Sequential(*copy.deepcopy(list(net.blocks[-1])), copy.deepcopy(net.heads[-1]))
    return nn.Sequential(*parts)
