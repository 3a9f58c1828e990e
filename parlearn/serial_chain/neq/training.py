"""NEq training (plain SGD whose frozen rows keep weights and optimizer state bit for
bit), accuracy, and the bench."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from parlearn.core.checks import (
    check_bool,
    check_float,
    check_int,
    check_module,
    check_seed,
    check_tensor,
)
from parlearn.serial_chain.neq.backward import (
    _masked_forward,
    backward_flops,
    count_backward_flops,
    masked_backward,
    reference_backward,
)
from parlearn.serial_chain.neq.equilibrium import (
    Equilibrium,
    _check_xy,
    _effective,
    _layer_outputs,
    linear_layers,
)

__all__ = ["NEqRun", "train", "accuracy", "measure_backward", "bench"]


# ---------------------------------------------------------------------------------------
# Training: plain SGD whose frozen rows keep their weights and optimizer state bit for bit.

@dataclass
class NEqRun:
    """What :func:`train` did, one entry per epoch. ``frozen[e][l]``: fraction of layer
    ``l``'s neurons frozen during epoch ``e``; ``flops``: backward FLOPs counted by
    ``torch.utils.flop_counter`` over the epoch (once per minibatch size: the count
    depends only on the masks and that size), ``flops_full`` those of plain backprop on
    the same minibatches (from :func:`backward_flops`); ``velocity[e]``: per layer, after
    epoch ``e``; ``accuracy``: of ``evaluate`` after each epoch (empty without it);
    ``momentum``: the SGD momentum buffers at the end, ``[W_0, b_0, W_1, ...]`` (None for a
    missing bias and for a wholly frozen layer, which never steps)."""

    model: nn.Sequential
    frozen: list[list[float]] = field(default_factory=list)
    frozen_total: list[float] = field(default_factory=list)
    flops: list[int] = field(default_factory=list)
    flops_full: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    velocity: list[list[torch.Tensor]] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    momentum: list[torch.Tensor | None] = field(default_factory=list)


def _sgd_rows(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None, a: torch.Tensor,
              *, lr: float, momentum: float, weight_decay: float) -> torch.Tensor | None:
    """torch.optim.SGD's step on ``p`` in place (single-tensor path, dampening 0), with the
    frozen rows (``a`` False) of the weights and of the momentum buffer kept bit for bit."""
    rows = a.view(-1, *[1] * (p.dim() - 1))
    d = g.add(p, alpha=weight_decay) if weight_decay else g
    if momentum:
        if buf is None:
            # torch starts the buffer at the first gradient; a frozen row's stays zero.
            buf = torch.where(rows, d, 0.0)
        else:
            buf = torch.where(rows, buf.mul(momentum).add(d), buf)
        d = buf
    p.copy_(torch.where(rows, p.add(d, alpha=-lr), p))
    return buf


def train(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, x_val: torch.Tensor, *,
          epochs: int, eps: float, mu: float = 0.5, lr: float = 0.1, momentum: float = 0.0,
          weight_decay: float = 0.0, batch: int = 32, seed: int = 0, skip: bool = True,
          evaluate: Callable[[nn.Module], float] | None = None,
          progress: Callable[[float, str], None] | None = None) -> NEqRun:
    """Train a copy of ``model`` (the argument is not changed) with NEq on ``(x, y)``:
    minibatches of ``batch`` in an order drawn from ``seed`` (a private generator), plain
    SGD (``lr``, ``momentum``, ``weight_decay``, as torch.optim.SGD with dampening 0), and
    after every epoch the equilibrium test on the validation inputs ``x_val``. Epoch 1
    trains every neuron. ``skip`` picks :func:`masked_backward` (True) or
    :func:`reference_backward`. ``eps = 0`` freezes nothing: plain training."""
    _check_xy(linear_layers(model), x, y)  # checks the model before any work
    x_val = check_tensor("x_val", x_val, shape=(None, x.shape[1]), floating=True)
    if x_val.shape[0] == 0:
        # No validation outputs: every phi would be 1 and every neuron frozen from epoch 2.
        raise ValueError("x_val must hold at least one example, got 0 rows")
    epochs = check_int("epochs", epochs, lo=1)
    eps, mu = check_float("eps", eps, lo=0), check_float("mu", mu, lo=0, hi=1)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    momentum = check_float("momentum", momentum, lo=0, hi=1, hi_open=True)
    weight_decay = check_float("weight_decay", weight_decay, lo=0)
    batch, seed, skip = check_int("batch", batch, lo=1), check_seed("seed", seed), \
        check_bool("skip", skip)
    net = copy.deepcopy(model)
    layers = linear_layers(net)
    widths = [layers[0].in_features] + [m.out_features for m in layers]
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    state = Equilibrium.start(_layer_outputs(net, x_val), eps, mu)
    bufs: list[torch.Tensor | None] = [None] * (2 * len(layers))
    run = NEqRun(net)
    backward = masked_backward if skip else reference_backward
    for epoch in range(epochs):
        active = _effective(layers, state.active)
        run.frozen.append([1 - a.double().mean().item() for a in active])
        run.frozen_total.append(1 - sum(int(a.sum()) for a in active) / sum(widths[1:]))
        flops = full = 0
        losses = []
        counted: dict[int, int] = {}  # minibatch size -> FLOPs counted this epoch
        for idx in torch.randperm(x.shape[0], generator=gen).split(batch):
            xb, yb = x[idx], y[idx]
            # The count depends only on the masks (fixed for the epoch) and the minibatch's
            # size, so the counter runs once per size per epoch: it is slow.
            if len(idx) not in counted:
                counted[len(idx)] = count_backward_flops(net, xb, yb, active, skip=skip)
            flops += counted[len(idx)]
            full += backward_flops(widths, len(idx), widths[1:])
            loss, grads = backward(net, xb, yb, active)
            losses.append(loss)
            with torch.no_grad():
                params = [p for m in layers for p in (m.weight, m.bias)]
                for j, (p, g) in enumerate(zip(params, grads, strict=True)):
                    if p is None or not p.requires_grad:  # no bias; a frozen layer
                        continue
                    bufs[j] = _sgd_rows(p, g, bufs[j], active[j // 2], lr=lr,
                                        momentum=momentum, weight_decay=weight_decay)
        state.update(_layer_outputs(net, x_val))
        run.flops.append(flops)
        run.flops_full.append(full)
        run.loss.append(sum(losses) / len(losses))
        run.velocity.append([v.clone() for v in state.velocity])
        if evaluate is not None:
            run.accuracy.append(float(evaluate(net)))
        if progress is not None:
            progress((epoch + 1) / epochs, f"epoch {epoch + 1} of {epochs}")
    run.momentum = bufs
    return run


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of ``x`` that ``model`` classifies as ``y``."""
    check_module("model", model)
    check_tensor("x", x, floating=True)
    if x.dim() == 0 or x.shape[0] == 0:
        raise ValueError(f"x must hold at least one example, got shape {tuple(x.shape)}")
    check_tensor("y", y, shape=(x.shape[0],), floating=False)
    return (model(x).argmax(1) == y).double().mean().item()


# ---------------------------------------------------------------------------------------
# Bench: the backward that really skips frozen rows vs plain autograd's backward.

def measure_backward(widths: Sequence[int], batch: int, frozen: float, *, repeat: int = 7,
                     seed: int = 0, device: str | torch.device = "cpu"):
    """Time :func:`masked_backward`'s backward against plain autograd's full backward on
    :func:`parlearn.models.mlp` ``(widths)`` (float32, a random minibatch of ``batch``),
    with the fraction ``frozen`` of every hidden layer's rows frozen (drawn from ``seed``;
    the output layer learns). Each backward runs alone on a retained graph, the two
    interleaved, one intra-op thread (:func:`parlearn.timing.compare`). Returns
    ``(comparison, modeled)``: the :class:`~parlearn.timing.Comparison` (``"full"``,
    ``"masked"``) and the modeled ratio of :func:`backward_flops`."""
    from parlearn.core.models import mlp
    from parlearn.core.timing import compare

    widths = [check_int("widths[i]", w, lo=1) for w in widths]
    batch = check_int("batch", batch, lo=1)
    frozen = check_float("frozen", frozen, lo=0, hi=1)
    net = mlp(widths, seed=seed).to(device)
    gen = torch.Generator().manual_seed(check_int("seed", seed, lo=0))
    x = torch.randn(batch, widths[0], generator=gen).to(device)
    y = torch.randint(0, widths[-1], (batch,), generator=gen).to(device)
    active = []
    for i, m in enumerate(linear_layers(net)):
        a = torch.ones(m.out_features, dtype=torch.bool)
        if i < len(widths) - 2:
            a[torch.randperm(m.out_features, generator=gen)[:round(frozen * m.out_features)]] = 0
        active.append(a.to(device))
    full_loss = F.cross_entropy(net(x), y)
    params = list(net.parameters())
    out, leaves = _masked_forward(net, x, active)
    masked_loss = F.cross_entropy(out, y)
    flat = [p for ls in leaves for p in ls]
    cmp = compare({"full": lambda: torch.autograd.grad(full_loss, params, retain_graph=True),
                   "masked": lambda: torch.autograd.grad(masked_loss, flat, retain_graph=True)
                   if flat else None}, warmup=2, repeat=check_int("repeat", repeat, lo=1),
                  device=device, threads=1)
    counts = [int(a.sum()) for a in active]
    return cmp, backward_flops(widths, batch, widths[1:]) / backward_flops(widths, batch, counts)


def bench(device: torch.device, quick: bool) -> list:
    """Rows for ``python -m parlearn.bench neq``: :func:`measure_backward` on an MLP
    1024-1024-1024-1024-10 (512 wide with ``quick``), float32, minibatch 128, one intra-op
    thread, 75% of every hidden layer's rows frozen: the backward that really skips them
    against plain autograd's full backward. The target is the modeled ratio of the FLOPs
    :func:`backward_flops` gives (equal to what ``torch.utils.flop_counter`` counts, which
    the tests check)."""
    from parlearn.core.bench import Row
    from parlearn.core.timing import UNRELIABLE

    width, b, frac = (512 if quick else 1024), 128, 0.75
    widths = [width] * 4 + [10]
    cmp, model = measure_backward(widths, b, frac, repeat=5 if quick else 15, device=device)
    lo, hi = cmp.speedup_range("masked")
    t = cmp.timings
    return [Row("neq", "full autograd backward", f"NEq backward, {frac:.0%} of hidden rows "
                "frozen (really skipped)", cmp.speedup("masked"), str(device),
                target=f"modeled {model:.2f}x (counted FLOPs)",
                detail=f"MLP {widths}, batch {b}, float32, {cmp.threads} thread(s): full "
                       f"{t['full'].median * 1e3:.2f} ms, masked {t['masked'].median * 1e3:.2f}"
                       f" ms (ratio IQR {lo:.2f}-{hi:.2f}"
                       f"{'' if cmp.reliable else '; WARNING: ' + UNRELIABLE}); the input "
                       f"gradients of frozen layers are still needed below, so the saving is "
                       f"at most the weight-gradient half")]
