"""Two backward passes with the same gradients (the reference, and the one that skips
frozen rows), their FLOPs and the all-reduce bytes they save."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parlearn.core.checks import (
    check_bool,
    check_int,
    check_ints,
    check_tensor,
)
from parlearn.serial_chain.neq.equilibrium import _check_xy, _effective, linear_layers

__all__ = ["masked_backward", "reference_backward", "backward_flops", "count_backward_flops",
           "allreduce_bytes"]


# ---------------------------------------------------------------------------------------
# Two backward passes with the same gradients: the reference, and the one that skips work.

def _check_active(model: nn.Sequential, active: Sequence[torch.Tensor]) -> list[nn.Linear]:
    layers = linear_layers(model)
    if len(active) != len(layers):
        raise ValueError(f"active must have one mask per Linear layer ({len(layers)}), "
                         f"got {len(active)}")
    for i, (m, a) in enumerate(zip(layers, active, strict=True)):
        check_tensor(f"active[{i}]", a, shape=(m.out_features,), dtype=torch.bool)
    return layers


def _zero_grads(m: nn.Linear) -> list[torch.Tensor | None]:
    return [torch.zeros_like(m.weight), None if m.bias is None else torch.zeros_like(m.bias)]


def reference_backward(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor,
                       active: Sequence[torch.Tensor]) -> tuple[float, list[torch.Tensor | None]]:
    """Cross-entropy loss and the gradients ``[dW_0, db_0, dW_1, ...]`` by full autograd,
    the frozen rows then set to zero: the baseline. A bias-free layer's ``db`` is None; a
    wholly frozen layer (``requires_grad=False``) gets zeros. ``.grad`` is not touched."""
    layers = _check_active(model, active)
    _check_xy(layers, x, y)
    active = _effective(layers, active)
    params = [p for m in layers if m.weight.requires_grad
              for p in (m.weight, m.bias) if p is not None]
    loss = F.cross_entropy(model(x), y)
    got = iter(torch.autograd.grad(loss, params)) if params else iter(())
    grads: list[torch.Tensor | None] = []
    for m, a in zip(layers, active, strict=True):
        if not m.weight.requires_grad:
            grads += _zero_grads(m)
            continue
        mine = [next(got), None if m.bias is None else next(got)]
        for g in mine:
            if g is not None:
                g[~a] = 0
        grads += mine
    return loss.item(), grads


class _RowMaskedLinear(torch.autograd.Function):
    """``x W^T + b`` forward (as ``F.linear``); backward computes the weight and bias
    gradients of the rows ``rows`` only (the others stay zero) and ``dx`` only if asked."""

    @staticmethod
    def forward(x, weight, bias, rows):
        return F.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, _, rows = inputs
        ctx.save_for_backward(x, weight, rows)

    @staticmethod
    def backward(ctx, g):
        x, weight, rows = ctx.saved_tensors
        dx = g @ weight if ctx.needs_input_grad[0] else None
        g_rows = g.index_select(1, rows)
        dw = weight.new_zeros(weight.shape).index_copy_(0, rows, g_rows.T @ x)
        db = (weight.new_zeros(weight.shape[0]).index_copy_(0, rows, g_rows.sum(0))
              if ctx.needs_input_grad[2] else None)  # None for a bias-free layer
        return dx, dw, db, None


def _masked_forward(model: nn.Sequential, x: torch.Tensor, active: Sequence[torch.Tensor]
                    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward whose backward skips frozen work; returns the output and, per layer, the
    leaves that carry its gradient (``[]`` for a wholly frozen layer)."""
    h, leaves, k = x, [], 0
    for m in model:
        if not isinstance(m, nn.Linear):
            h = m(h)
            continue
        a = active[k] if m.weight.requires_grad else torch.zeros_like(active[k])
        k += 1
        bias = None if m.bias is None else m.bias.detach()
        if bool(a.any()):
            w = m.weight.detach().requires_grad_()
            b = None if bias is None else bias.requires_grad_()
            mine = [w] if b is None else [w, b]
            if bool(a.all()):  # nothing to skip: plain autograd, bit for bit torch's
                h = F.linear(h, w, b)
            else:
                h = _RowMaskedLinear.apply(h, w, b, a.nonzero().flatten())
        else:
            # Wholly frozen: constants to autograd. If every layer below is frozen too, h
            # needs no gradient, and autograd skips this layer's input gradient as well.
            h, mine = F.linear(h, m.weight.detach(), bias), []
        leaves.append(mine)
    return h, leaves


def masked_backward(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor,
                    active: Sequence[torch.Tensor]) -> tuple[float, list[torch.Tensor | None]]:
    """The same loss and gradients as :func:`reference_backward`, computing only active
    rows' weight gradients (``g[:, rows]^T x``) and each layer's input gradient only when a
    layer below still has an active neuron. ``.grad`` is not touched."""
    layers = _check_active(model, active)
    _check_xy(layers, x, y)
    out, leaves = _masked_forward(model, x, active)
    loss = F.cross_entropy(out, y)
    flat = [p for ls in leaves for p in ls]
    got = iter(torch.autograd.grad(loss, flat)) if flat else iter(())
    grads: list[torch.Tensor | None] = []
    for m, ls in zip(layers, leaves, strict=True):
        grads += ([next(got), None if m.bias is None else next(got)] if ls else
                  _zero_grads(m))
    return loss.item(), grads


def _check_widths(widths: Sequence[int]) -> list[int]:
    return check_ints("widths", widths, lo=1, min_len=2)   # an input and an output width


def backward_flops(widths: Sequence[int], batch: int, active: Sequence[int]) -> int:
    """Modeled matmul FLOPs of :func:`masked_backward` on an MLP ``widths`` (Linear layer
    ``l`` maps ``widths[l]`` to ``widths[l+1]``) for a minibatch of ``batch``, with
    ``active[l]`` active neurons in layer ``l``: per layer ``2 B a_l n_l`` for the weight
    gradient plus ``2 B m_l n_l`` for the input gradient if some layer below has an active
    neuron (never for the first layer). Bias gradients are sums, not matmuls: not counted.
    All active gives plain backprop's ``sum_l 2 B m_l n_l (1 + [l > 0])``."""
    widths = _check_widths(widths)
    batch = check_int("batch", batch, lo=1)
    if len(active) != len(widths) - 1:
        raise ValueError(f"active needs {len(widths) - 1} counts, got {len(active)}")
    total, below = 0, False
    for n, m, a in zip(widths[:-1], widths[1:], active, strict=True):
        a = check_int("active[i]", a, lo=0, hi=m)
        total += 2 * batch * a * n + (2 * batch * m * n if below else 0)
        below = below or a > 0
    return total


def count_backward_flops(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor,
                         active: Sequence[torch.Tensor], *, skip: bool = True) -> int:
    """FLOPs ``torch.utils.flop_counter`` counts in the backward alone (the forward runs
    outside the counter) of :func:`masked_backward` (``skip=True``) or of the reference."""
    from torch.utils.flop_counter import FlopCounterMode

    _check_xy(_check_active(model, active), x, y)
    if check_bool("skip", skip):
        out, leaves = _masked_forward(model, x, active)
        flat = [p for ls in leaves for p in ls]
    else:
        out, flat = model(x), [p for p in model.parameters() if p.requires_grad]
    loss = F.cross_entropy(out, y)
    with FlopCounterMode(display=False) as counter:
        if flat:
            torch.autograd.grad(loss, flat)
    return int(counter.get_total_flops())


def allreduce_bytes(widths: Sequence[int], active: Sequence[int], *, world_size: int = 8,
                    element_size: int = 4) -> dict[str, float]:
    """Modeled gradient all-reduce of one data-parallel step: ``payload`` bytes (active rows'
    weights and biases, ``a_l (n_l + 1)`` elements per layer) and ``wire`` bytes each rank
    sends in a ring all-reduce, ``2 (N-1)/N payload``; ``full_*`` the same with every
    neuron active. Every rank computes the same masks (same weights, same validation
    subset), so the ranks agree on which rows to send without a message."""
    from parlearn.distributed.cost import ring_bytes

    widths = _check_widths(widths)
    if len(active) != len(widths) - 1:
        raise ValueError(f"active needs {len(widths) - 1} counts, got {len(active)}")
    world_size = check_int("world_size", world_size, lo=2)
    element_size = check_int("element_size", element_size, lo=1)
    pay = sum(check_int("active[i]", a, lo=0, hi=m) * (n + 1)
              for n, m, a in zip(widths[:-1], widths[1:], active, strict=True)) * element_size
    full = sum(m * (n + 1) for n, m in zip(widths[:-1], widths[1:], strict=True)) * element_size
    return {"payload": pay, "wire": ring_bytes("all_reduce", pay, world_size),
            "full_payload": full, "full_wire": ring_bytes("all_reduce", full, world_size)}
