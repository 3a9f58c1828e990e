"""NEq: train only the neurons that are not at equilibrium (lesson 23).

Bragagnolo, Tartaglione & Grangetto, "To update or not to update? Neurons at equilibrium
in deep models", NeurIPS 2022 (arXiv 2207.09455). After every epoch, for each neuron ``i``
(one output row of a Linear layer: its weight row and its bias):

- ``phi_i^t``: the cosine similarity of the neuron's outputs on a fixed validation subset
  after epoch ``t`` and after epoch ``t-1`` (:func:`phi`);
- ``dphi_i^t = phi_i^t - phi_i^{t-1}``, with ``phi^0 = 1``: before any training a neuron is
  taken as perfectly similar to itself (the authors' code starts its buffer the same way);
- the velocity ``v_i^t = dphi_i^t - mu v_i^{t-1}``, ``v^0 = 0`` (:func:`velocity_step`, the
  paper's equation with its ``mu`` in [0, 0.5]);
- during epoch ``t+1`` neuron ``i`` is *frozen* (no gradient, no update, its optimizer state
  untouched) iff ``|v_i^t| < eps``. The test is re-run after every epoch: a frozen neuron is
  still watched, and thaws when its inputs move it.

Two backward passes give the same gradients (tested to round-off in float64):
:func:`reference_backward` is what a user would write first (full autograd, then zero the
frozen rows); :func:`masked_backward` really skips the work: a frozen row's weight gradient
is never computed, and a layer's input gradient only when some layer below still learns.
:func:`backward_flops` is its cost model, which ``torch.utils.flop_counter`` counts exactly
(:func:`count_backward_flops`). :func:`allreduce_bytes` models what a data-parallel step
would save: frozen rows have no gradient to all-reduce. The authors' code is EIDOSLAB/NEq
(read for its conventions, not copied).
"""

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

__all__ = ["linear_layers", "phi", "velocity_step", "Equilibrium", "masked_backward",
           "reference_backward", "backward_flops", "count_backward_flops", "allreduce_bytes",
           "NEqRun", "train", "accuracy", "measure_backward", "bench"]


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
        eps = check_float("eps", eps, lo=0)
        mu = check_float("mu", mu, lo=0, hi=1)
        ones = [torch.ones(o.shape[1], dtype=torch.float64) for o in outputs]
        return cls(outputs, ones, [torch.zeros_like(p) for p in ones],
                   [torch.ones(o.shape[1], dtype=torch.bool) for o in outputs], eps, mu)

    def update(self, outputs: list[torch.Tensor]) -> None:
        """One epoch's check: new ``phi``, ``dphi``, velocity, and the new active mask
        ``|v| >= eps`` (frozen iff ``|v| < eps``, so ``eps = 0`` freezes nothing)."""
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
    if isinstance(widths, str) or not isinstance(widths, Sequence):
        raise TypeError(f"widths must be a sequence of ints, got {widths!r}")
    if len(widths) < 2:
        raise ValueError(f"widths must list at least an input and an output width, got "
                         f"{list(widths)}")
    return [check_int("widths[i]", w, lo=1) for w in widths]


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
