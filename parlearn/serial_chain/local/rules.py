"""Local learning: layer groups that learn without waiting for the backward pass.

Backprop *locks* a network (Jaderberg et al. 2017): block ``k`` cannot run its forward
before block ``k-1`` has (forward locking), cannot update before the whole forward and the
backward down to it are done (update locking), and the backward itself is a serial chain
(backward locking; lesson 20). Local learning gives every block its own learning signal,
so block ``k`` updates as soon as its own forward is done. Three ways to make that signal:

- **Local heads** (``rule="heads"``; Laskin et al. 2020, arXiv 2012.03837): block ``k``
  computes on the *detached* output of block ``k-1`` and minimises the cross-entropy of its
  own small auxiliary head. No gradient crosses a block boundary.
- **Local critics** (``rule="critics"``; Lee, Hsieh, Lee, arXiv 2102.01963). Same wiring,
  but head ``k`` is a *critic* trained so that its loss ``l_k`` matches the next group's
  loss ``l_{k+1}`` (the last group's loss is the network's own): ``min (l_k - l_{k+1})^2``,
  a cascade down from the true loss. The group is updated with the gradient of ``l_k``.
  RECONSTRUCTION: only the abstract could be read. The critic is one Linear layer to the
  classes (the paper's critics are small conv/FC networks), its loss is the cross-entropy,
  and its objective is exactly ``(l_k - l_{k+1})^2`` per minibatch, ``l_{k+1}`` computed by
  group ``k+1`` on the same minibatch before its update.
- **Hebbian feedback** (``rule="hebbian"``; Amit 2019, arXiv 1812.07965): global error
  propagation, but each Linear layer's backward uses separate feedback weights ``R`` instead
  of ``W^T`` (:class:`FeedbackLinear`). ``R`` is updated by the same local product of the
  activities it connects as ``W``: ``dW = -lr (delta x^T + wd W)``, ``dR = -lr (x delta^T +
  wd R)``, so ``R - W^T`` shrinks by ``(1 - lr wd)`` every step and ``R = W^T`` stays
  backprop exactly. ``rule="fixed"`` keeps a random ``R`` fixed (feedback alignment,
  Lillicrap et al. 2016), the comparison Amit makes. RECONSTRUCTION from the abstract
  ("the feedback weights are also updated with a local rule, the same as the feedforward
  weights"); his cost function for the last layer is not implemented (cross-entropy is).

Serial references (one process): :func:`backprop_step` / :func:`train` with
``rule="backprop"`` (global backprop through the same blocks and the last head), and the
local rules run by :func:`train` in one of two explicit orders of updates
(:func:`update_order`): ``"sequential"`` (minibatch ``t`` through every block, then
``t+1``) or ``"wavefront"`` (tick ``s`` runs block ``k`` on minibatch ``s-k``, the
pipeline's order). For a local rule both give the same result to the last bit: block
``k``'s weights after minibatch ``t`` depend only on its own inputs, which block ``k-1``
computed with its weights after ``t-1`` in either order. That is why local learning can
run as a pipeline with **no staleness** and no flush.

The parallel version (:func:`run_local`) puts one block (and its head) on each real rank
(:func:`parlearn.dist.run`, gloo): rank ``k`` receives minibatch ``t``'s activation from
rank ``k-1``, runs its forward, sends the output on, then its local backward and update,
while rank ``k+1`` is busy with ``t-1``. No message goes backwards. It equals
:func:`train` (float64, to round-off) and records per-rank timelines. Pipelined backprop on
the same ranks is :func:`parlearn.pipeline.run_pipeline` on :func:`as_sequential` of the
same network; :func:`cost_model` gives step and idle time of all three (modeled, through
:func:`parlearn.pipeline.simulate`).
"""

from __future__ import annotations

import collections
import copy
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from parlearn.core.checks import check_choice, check_float, check_int, check_module, check_tensor
from parlearn.core.device import threads as _threads

__all__ = ["RULES", "LOCAL_RULES", "ORDERS", "FeedbackLinear", "LocalNet", "make_net",
           "as_sequential", "feedback_angle", "minibatches", "update_order", "backprop_step",
           "local_step", "train", "TrainResult", "accuracy", "LocalRun", "run_local",
           "local_orders", "block_costs", "cost_model", "compare_rules", "bench"]

RULES = ("backprop", "heads", "critics", "hebbian", "fixed")
LOCAL_RULES = ("heads", "critics")
ORDERS = ("sequential", "wavefront")


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
        if not isinstance(heads, (list, tuple)) or len(heads) != len(blocks):
            raise ValueError(f"heads must be a list with one head per block ({len(blocks)})")
        for b in blocks:
            check_module("blocks", b)
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
        """What global backprop trains: every block and the last head."""
        return [p for b in self.blocks for p in b.parameters()] + list(
            self.heads[-1].parameters())


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


# ---------------------------------------------------------------------------------------
# The steps: global backprop, and one block's local step.

def _sgd(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], lr: float,
         weight_decay: float) -> None:
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            p -= lr * (g + weight_decay * p) if weight_decay else lr * g


def _trainable(params):
    return [p for p in params if p.requires_grad]


def backprop_step(net: LocalNet, x: torch.Tensor, y: torch.Tensor, lr: float,
                  weight_decay: float = 0.0) -> float:
    """One SGD step of global backprop on the cross-entropy of ``net(x)``: every block and
    the last head (and ``R`` of hebbian :class:`FeedbackLinear` layers, which then take the
    Hebbian step). Returns the loss. ``.grad`` is not touched."""
    params = _trainable(net.global_params())
    loss = F.cross_entropy(net(x), y)
    _sgd(params, torch.autograd.grad(loss, params), lr, weight_decay)
    return float(loss.detach())


def local_step(block: nn.Module, head: nn.Module, x: torch.Tensor, y: torch.Tensor,
               lr: float, weight_decay: float = 0.0, *, critic: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Block ``k``'s step on its input ``x`` (detached here: no gradient leaves the block).

    Returns ``(h, loss, head_grads)``: the block's output (detached, for block ``k+1``),
    its local loss ``l_k = CE(head(h), y)`` and ``d l_k / d head``. The block is updated at
    once with ``d l_k / d block``. A local head (``critic=False``) is updated with its
    gradient too; a critic's update waits for the next group's loss, which :func:`train`
    applies when block ``k+1`` has reported it.
    """
    h = block(x.detach())
    loss = F.cross_entropy(head(h), y)
    bp, hp = _trainable(block.parameters()), _trainable(head.parameters())
    grads = torch.autograd.grad(loss, bp + hp)
    _sgd(bp, grads[:len(bp)], lr, weight_decay)
    head_grads = list(grads[len(bp):])
    if not critic:
        _sgd(hp, head_grads, lr, weight_decay)
    return h.detach(), loss.detach(), head_grads


def _critic_update(head: nn.Module, loss: torch.Tensor, head_grads: list, target: torch.Tensor,
                   lr: float, weight_decay: float) -> None:
    # d/dphi (l_k - l_{k+1})^2 = 2 (l_k - l_{k+1}) dl_k/dphi; l_{k+1} is a constant here.
    scale = 2.0 * (loss - target)
    _sgd(_trainable(head.parameters()), [scale * g for g in head_grads], lr, weight_decay)


# ---------------------------------------------------------------------------------------
# The serial reference: the local rules in one process, in an explicit order of updates.

def minibatches(n: int, batch: int, epochs: int, seed: int = 0) -> list[torch.Tensor]:
    """Index tensors of the minibatches of ``epochs`` passes over ``n`` examples, each pass
    a fresh permutation from ``seed`` (a private generator) cut into ``batch``-sized pieces
    (the last may be smaller)."""
    n, batch = check_int("n", n, lo=1), check_int("batch", batch, lo=1)
    epochs = check_int("epochs", epochs, lo=1)
    gen = torch.Generator().manual_seed(check_int("seed", seed, lo=0))
    return [idx for _ in range(epochs) for idx in torch.randperm(n, generator=gen).split(batch)]


def update_order(order: str, blocks: int, steps: int) -> list[tuple[int, int]]:
    """The order of ``(block, minibatch)`` updates of the serial reference.

    ``"sequential"``: ``(0,0), (1,0), ..., (K-1,0), (0,1), ...``: one minibatch through
    every block, then the next. ``"wavefront"``: tick ``s`` runs block ``k`` on minibatch
    ``s - k`` for ``k = K-1, ..., 0`` (last block first, so a critic's target ``l_{k+1}(t)``
    is in before block ``k`` starts ``t+1``): the order the pipeline's ranks work in, block
    ``k`` on ``t`` while block ``k+1`` is on ``t-1``."""
    check_choice("order", order, ORDERS)
    blocks, steps = check_int("blocks", blocks, lo=1), check_int("steps", steps, lo=0)
    if order == "sequential":
        return [(k, t) for t in range(steps) for k in range(blocks)]
    return [(k, s - k) for s in range(steps + blocks - 1) for k in reversed(range(blocks))
            if 0 <= s - k < steps]


@dataclass
class TrainResult:
    """What :func:`train` did: the trained ``net`` (a copy), ``losses[k][t]`` block ``k``'s
    local loss on minibatch ``t`` (global rules: one list, the network's loss), and
    ``test_acc`` the test accuracy after each epoch (empty without test data)."""

    net: LocalNet
    losses: list[list[float]]
    test_acc: list[float] = field(default_factory=list)


def _check_train(net, x, y, rule, lr, weight_decay):
    if not isinstance(net, LocalNet):
        raise TypeError(f"net must be a LocalNet, got {type(net).__name__}")
    check_tensor("x", x, ndim=2, floating=True)
    check_tensor("y", y, ndim=1, floating=False)
    if len(x) != len(y):
        raise ValueError(f"x and y must have the same rows, got {len(x)} and {len(y)}")
    check_choice("rule", rule, RULES)
    needs = "FeedbackLinear" if rule in ("hebbian", "fixed") else None
    has = [m.feedback for m in net.modules() if isinstance(m, FeedbackLinear)]
    if needs and (not has or any(f != rule for f in has)):
        raise ValueError(f"rule={rule!r} needs a net whose Linear layers are FeedbackLinear("
                         f"feedback={rule!r}): make_net(..., feedback={rule!r})")
    if not needs and has:
        raise ValueError(f"rule={rule!r} needs plain Linear layers; this net has "
                         f"FeedbackLinear layers (use rule='hebbian' or 'fixed')")
    return (check_float("lr", lr, lo=0, lo_open=True),
            check_float("weight_decay", weight_decay, lo=0))


def accuracy(net: LocalNet, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of ``x`` whose arg-max output is ``y`` (the network's own, last head)."""
    with torch.no_grad():
        return float((net(x).argmax(1) == y).double().mean())


def train(net: LocalNet, x: torch.Tensor, y: torch.Tensor, rule: str, *, epochs: int = 5,
          batch: int = 32, lr: float = 0.1, weight_decay: float = 0.0, seed: int = 0,
          order: str = "sequential", test: tuple[torch.Tensor, torch.Tensor] | None = None
          ) -> TrainResult:
    """Train a copy of ``net`` on ``(x, y)`` (labels) with ``rule`` (:data:`RULES`), plain SGD
    of rate ``lr`` with ``weight_decay``, on :func:`minibatches` ``(len(x), batch, epochs,
    seed)``. Global rules take one :func:`backprop_step` per minibatch; local rules run
    :func:`local_step` in :func:`update_order` ``(order, K, steps)``. ``test=(x, y)`` records
    the test accuracy after every epoch (for the local rules, when the last block has finished
    the epoch; in ``"wavefront"`` order the blocks below are then already further on, so
    the two orders give the same trained net but not the same accuracy history)."""
    lr, weight_decay = _check_train(net, x, y, rule, lr, weight_decay)
    check_choice("order", order, ORDERS)
    net = copy.deepcopy(net)
    batches = minibatches(len(x), batch, epochs, seed)
    per_epoch = len(batches) // epochs
    out = TrainResult(net, [])
    done_epochs = 0

    def after(k: int, t: int) -> None:
        nonlocal done_epochs
        if test is not None and k == len(net.blocks) - 1 and (t + 1) % per_epoch == 0:
            out.test_acc.append(accuracy(net, *test))
            done_epochs += 1

    if rule not in LOCAL_RULES:
        out.losses.append([])
        for t, idx in enumerate(batches):
            out.losses[0].append(backprop_step(net, x[idx], y[idx], lr, weight_decay))
            after(len(net.blocks) - 1, t)
        return out
    blocks = len(net.blocks)
    critic = rule == "critics"
    out.losses = [[] for _ in range(blocks)]
    acts: dict[tuple[int, int], torch.Tensor] = {}   # (block, t) -> output for block+1
    waiting: dict[tuple[int, int], tuple] = {}       # (block, t) -> critic's pending update
    for k, t in update_order(order, blocks, len(batches)):
        idx = batches[t]
        inp = x[idx] if k == 0 else acts.pop((k - 1, t))
        h, loss, head_grads = local_step(net.blocks[k], net.heads[k], inp, y[idx], lr,
                                         weight_decay, critic=critic and k < blocks - 1)
        if k < blocks - 1:
            acts[(k, t)] = h
        out.losses[k].append(float(loss))
        if critic and k < blocks - 1:
            waiting[(k, t)] = (loss, head_grads)
        if critic and k > 0:   # l_k(t) is critic k-1's target: the cascade
            prev_loss, prev_grads = waiting.pop((k - 1, t))
            _critic_update(net.heads[k - 1], prev_loss, prev_grads, loss, lr, weight_decay)
        after(k, t)
    return out


# ---------------------------------------------------------------------------------------
# The parallel version: one block per real rank, an asynchronous pipeline.

# Sends a rank may have in flight before it waits for the oldest: bounds the activations
# queued between two ranks (rank k runs at most this far ahead of rank k+1).
_SEND_DEPTH = 2


def _worker_local(rank: int, world: int, block: nn.Module, head: nn.Module, x: torch.Tensor,
                  y: torch.Tensor, batches: list[torch.Tensor], width_in: int, lr: float,
                  weight_decay: float) -> dict:
    """Rank ``rank``: for every minibatch t, in order, receive block ``rank-1``'s output
    (rank 0: the data), forward, send the output on (nothing ever comes back), then the
    local backward and update. Events: ``F t`` (forward) and ``B t`` (local backward and
    update), in seconds since a common barrier."""
    first, last = rank == 0, rank == world - 1
    sends: collections.deque = collections.deque()
    events, losses = [], []
    tdist.barrier()   # a common start, so the ranks' clocks line up in the timeline
    t0 = time.perf_counter()
    for t, idx in enumerate(batches):
        if first:
            inp = x[idx]
        else:
            inp = torch.empty(len(idx), width_in, dtype=x.dtype)
            tdist.recv(inp, rank - 1, tag=t)
        start = time.perf_counter()
        h = block(inp)
        mid = time.perf_counter()
        if not last:
            # Outside the timed bars: waiting for the oldest send blocks until rank+1 has
            # posted its receive (gloo), which is waiting, not compute. Timed inside B, it
            # made rank 0's B bars several times longer than rank 1's.
            if len(sends) >= _SEND_DEPTH:
                sends.popleft()[0].wait()
            out = h.detach().clone()
            sends.append((tdist.isend(out, rank + 1, tag=t), out))
        back = time.perf_counter()
        # The local backward: head loss, gradients of block and head, SGD: the same
        # arithmetic as local_step, in the same order, so the result is the same to the bit.
        loss = F.cross_entropy(head(h), y[idx])
        bp, hp = _trainable(block.parameters()), _trainable(head.parameters())
        grads = torch.autograd.grad(loss, bp + hp)
        _sgd(bp + hp, grads, lr, weight_decay)
        end = time.perf_counter()
        losses.append(float(loss.detach()))
        events.append((f"rank {rank}", f"F {t}", start - t0, mid - t0))
        events.append((f"rank {rank}", f"B {t}", back - t0, end - t0))
    for work, _ in sends:
        work.wait()
    return {"params": [p.detach().clone() for p in [*block.parameters(), *head.parameters()]],
            "events": events, "losses": losses}


@dataclass
class LocalRun:
    """What :func:`run_local` did: the trained ``net``, ``losses[k][t]`` as in
    :class:`TrainResult`, the measured timeline ``events`` ``(lane, label, start_s, end_s)``
    (``F t``: block forward; ``B t``: local backward and update) and its idle fraction
    ``bubble`` (:func:`parlearn.pipeline.measured_bubble`) and ``makespan`` in seconds."""

    net: LocalNet
    losses: list[list[float]]
    events: list[tuple[str, str, float, float]]
    bubble: float
    makespan: float


def run_local(net: LocalNet, x: torch.Tensor, y: torch.Tensor, *, epochs: int = 1,
              batch: int = 32, lr: float = 0.1, weight_decay: float = 0.0, seed: int = 0,
              timeout: float = 30) -> LocalRun:
    """Train ``net`` with local heads (``rule="heads"``) as an asynchronous pipeline on
    ``K = len(net.blocks)`` real gloo ranks, one block and its head per rank; returns a
    trained copy. Same minibatches and arithmetic as ``train(net, x, y, "heads", ...)``,
    which it equals to round-off. ``timeout`` is the group's per-message timeout; the run
    is stopped after ``4 * timeout + 60`` seconds (:class:`parlearn.dist.RankError`)."""
    from parlearn import dist
    from parlearn.multi_device.pipeline import _preimport, measured_bubble

    lr, weight_decay = _check_train(net, x, y, "heads", lr, weight_decay)
    blocks = check_int("blocks", len(net.blocks), lo=2)
    widths = [_out_width(b) for b in net.blocks]
    batches = minibatches(len(x), batch, epochs, seed)
    _preimport()
    per_rank = dist.run(_run_rank, blocks,
                        args=(net, x, y, batches, widths, lr, weight_decay),
                        backend="gloo", timeout=timeout, deadline=4 * timeout + 60)
    new = copy.deepcopy(net)
    with torch.no_grad():
        for k, r in enumerate(per_rank):
            params = [*new.blocks[k].parameters(), *new.heads[k].parameters()]
            for p, value in zip(params, r["params"], strict=True):
                p.copy_(value)
    events = [e for r in per_rank for e in r["events"]]
    span = max(e[3] for e in events) - min(e[2] for e in events)
    return LocalRun(new, [r["losses"] for r in per_rank], events, measured_bubble(events), span)


def _run_rank(rank, world, net, x, y, batches, widths, lr, weight_decay):
    width_in = x.shape[1] if rank == 0 else widths[rank - 1]
    return _worker_local(rank, world, copy.deepcopy(net.blocks[rank]),
                         copy.deepcopy(net.heads[rank]), x, y, batches, width_in, lr,
                         weight_decay)


def _out_width(block: nn.Module) -> int:
    found = [m for m in block.modules() if isinstance(m, (nn.Linear, FeedbackLinear))]
    if not found:
        raise ValueError("every block needs a Linear layer (its output width)")
    return found[-1].out_features


# ---------------------------------------------------------------------------------------
# The cost model (modeled): step and idle time of backprop, pipelined backprop, local.

def local_orders(blocks: int, steps: int) -> list[list]:
    """The asynchronous local pipeline as :func:`parlearn.pipeline.simulate` orders: every
    rank runs ``F t`` (its forward, local backward and update of minibatch ``t``) for
    ``t = 0..steps-1``; ``F t`` on rank ``k`` needs ``F t`` of rank ``k-1``, nothing else."""
    from parlearn.multi_device.pipeline import Op

    blocks, steps = check_int("blocks", blocks, lo=1), check_int("steps", steps, lo=1)
    return [[Op("F", t) for t in range(steps)] for _ in range(blocks)]


def block_costs(net: LocalNet, x: torch.Tensor, y: torch.Tensor, *, repeat: int = 5
                ) -> dict[str, float]:
    """Measured seconds (median of ``repeat``, one intra-op thread, the caller's count
    restored) of the slowest block's ``"forward"``, its ``"backward"`` (block gradients from
    the output gradient) and its local ``"head"`` (head forward and backward), on a minibatch
    ``(x, y)``: the costs to feed :func:`cost_model`."""
    from parlearn.core.timing import measure

    if not isinstance(net, LocalNet):
        raise TypeError(f"net must be a LocalNet, got {type(net).__name__}")
    repeat = check_int("repeat", repeat, lo=1)
    out = {"forward": 0.0, "backward": 0.0, "head": 0.0}
    h = x.detach()
    for block, head in zip(net.blocks, net.heads, strict=True):
        params = _trainable(block.parameters())
        out_h = block(h)
        g = torch.ones_like(out_h)
        o = out_h.detach().requires_grad_(True)

        def fwd(block=block, h=h):
            with torch.no_grad():
                block(h)

        def bwd(block=block, h=h, g=g, params=params):
            torch.autograd.grad(block(h), params, g)

        def hd(head=head, o=o):
            torch.autograd.grad(F.cross_entropy(head(o), y), [o, *head.parameters()])

        t_f = measure(fwd, repeat=repeat, threads=1).median
        # backward = forward-with-graph + backward, less the forward alone.
        t_b = max(measure(bwd, repeat=repeat, threads=1).median - t_f, 0.0)
        t_h = measure(hd, repeat=repeat, threads=1).median
        out = {"forward": max(out["forward"], t_f), "backward": max(out["backward"], t_b),
               "head": max(out["head"], t_h)}
        h = out_h.detach()
    return out


def cost_model(blocks: int, forward: float = 1.0, *, backward: float = 2.0,
               head: float = 0.3, micro_batches: int = 4, steps: int = 64,
               comm: float = 0.0) -> dict[str, dict[str, float]]:
    """Modeled time per minibatch and idle fraction of three ways to train ``K = blocks``
    equal blocks, each costing ``forward`` and ``backward`` per minibatch (a local head's
    forward + backward adds ``head``), messages taking ``comm``:

    - ``"backprop"``: one device runs everything, ``K (f + b)`` per minibatch, never idle;
    - ``"pipelined"``: 1F1B on ``K`` devices, ``M = micro_batches`` minibatches per update and
      a flush after each: ``(M + K - 1)(f + b) / M`` per minibatch, idle ``(K-1)/(M+K-1)``;
    - ``"local"``: the asynchronous local pipeline on ``K`` devices for ``T = steps``
      minibatches, filled once: ``(T + K - 1)(f + b + h) / T``, idle ``(K-1)/(T+K-1)``.

    The formulas hold for ``comm = 0``; the numbers come from
    :func:`parlearn.pipeline.simulate` of the schedules, so ``comm`` is counted too.
    ``speedup`` is the backprop time over each one's."""
    from parlearn.multi_device.pipeline import schedule, simulate

    blocks = check_int("blocks", blocks, lo=1)
    f = check_float("forward", forward, lo=0, lo_open=True)
    b = check_float("backward", backward, lo=0)
    h = check_float("head", head, lo=0)
    m = check_int("micro_batches", micro_batches, lo=1)
    steps = check_int("steps", steps, lo=1)
    comm = check_float("comm", comm, lo=0)
    out = {"backprop": {"step": blocks * (f + b), "idle": 0.0}}
    pipe = simulate(schedule("1f1b", blocks, m), f, b, comm=comm)
    out["pipelined"] = {"step": pipe.makespan / m, "idle": pipe.bubble}
    # Local: every op is one block's forward + local backward + update; nothing comes back.
    local = simulate(local_orders(blocks, steps), f + b + h, 0.0, comm=comm)
    out["local"] = {"step": local.makespan / steps, "idle": local.bubble}
    for v in out.values():
        v["speedup"] = out["backprop"]["step"] / v["step"]
    return out


# ---------------------------------------------------------------------------------------
# Accuracy of every rule on the same data, over seeds.

def compare_rules(x: torch.Tensor, y: torch.Tensor, test: tuple[torch.Tensor, torch.Tensor],
                  *, widths: Sequence[int], blocks: int, rules: Sequence[str] = RULES,
                  seeds: Sequence[int] = (0, 1, 2), epochs: int = 5, batch: int = 32,
                  lr: float = 0.1, weight_decay: float = 0.0,
                  dtype: torch.dtype = torch.float32, progress=None
                  ) -> dict[str, list[list[float]]]:
    """Test accuracy after each epoch, ``{rule: [[acc per epoch] per seed]}``, for every rule
    trained from the same initial forward weights (``seed``) on the same minibatches, with the
    same ``lr`` and ``weight_decay``. ``progress(fraction, text)`` is called after each run.
    Runs with one intra-op thread (the caller's count is restored)."""
    rules = [check_choice("rules", r, RULES) for r in rules]
    if not seeds:
        raise ValueError("seeds must hold at least one seed")
    seeds = [check_int("seeds", s, lo=0) for s in seeds]
    out: dict[str, list[list[float]]] = {r: [] for r in rules}
    total, done = len(rules) * len(seeds), 0
    with _threads(1):   # small matmuls: one thread is fastest, and steady on a busy machine
        for seed in seeds:
            for rule in rules:
                fb = rule if rule in ("hebbian", "fixed") else None
                net = make_net(widths, blocks, int(y.max()) + 1, seed=seed, dtype=dtype,
                               feedback=fb)
                res = train(net, x.to(dtype), y, rule, epochs=epochs, batch=batch, lr=lr,
                            weight_decay=weight_decay, seed=seed,
                            test=(test[0].to(dtype), test[1]))
                out[rule].append(res.test_acc)
                done += 1
                if progress is not None:
                    progress(done / total, f"{rule}, seed {seed}")
    return out


# ---------------------------------------------------------------------------------------
# Bench: the asynchronous local pipeline vs pipelined backprop on the same ranks.

def bench(device: torch.device, quick: bool) -> list:
    """Rows for ``python -m parlearn.bench local``, on 2 real gloo ranks on the CPU
    (``device`` is not used: the ranks are CPU processes). One block per rank; the same
    blocks trained (1) by pipelined backprop, :func:`parlearn.pipeline.run_pipeline` 1F1B
    with ``M`` micro-batches per update (one launch, several steps; the first discarded)
    and (2) by :func:`run_local` over the same number of minibatches. Ratio = measured time
    per minibatch of pipelined backprop over local; the modeled ratio comes from
    :func:`cost_model` fed with the op costs measured in these runs (median F, B of the
    slowest rank; the head's cost is what the local op takes beyond them) and one message
    cost, fitted so that the simulated 1F1B step equals the measured one. The ratio is a
    ratio of medians, not of interleaved pairs: each local run is a launch of its own."""
    from parlearn.core.bench import Row
    from parlearn.core.timing import Timing
    from parlearn.multi_device.pipeline import run_pipeline, stage_op_costs

    del device
    repeat, m, width, batch = (3 if quick else 7), 4, 256, (64 if quick else 128)
    where = f"2 gloo ranks on CPU ({__import__('os').cpu_count()} cores)"
    net = make_net([width] * 5, 2, 10, seed=0)
    gen = torch.Generator().manual_seed(1)
    n = batch * m * repeat
    x = torch.randn(n, width, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (n,), generator=gen)
    onehot = F.one_hot(y[:batch * m], 10).to(torch.float64)
    seq = as_sequential(net)
    runs = run_pipeline("1f1b", seq, x[:batch * m], onehot, 2, [m] * (repeat + 1),
                        counts=[1, 1])[1:]
    spans = Timing(tuple((max(e[3] for e in r.events) - min(e[2] for e in r.events)) / m
                         for r in runs), where, threads=1)
    locals_ = [run_local(net, x, y, batch=batch, epochs=1, seed=s) for s in range(repeat + 1)][1:]
    local_t = Timing(tuple(r.makespan / (n // batch) for r in locals_), where, threads=1)
    local = sorted(locals_, key=lambda r: r.makespan)[len(locals_) // 2]
    t_local = local_t.median
    costs = stage_op_costs(runs[len(runs) // 2])
    f_, b_ = max(costs["F"]), max(costs["B"])
    # The local op (forward + head + backward + update) of the slowest rank, medians.
    local_op = max(sum(statistics.median(e[3] - e[2] for e in local.events
                                         if e[0] == f"rank {k}" and e[1][0] == kind)
                       for kind in "FB") for k in range(2))
    head = max(0.0, local_op - f_ - b_)
    # The model's free messages are not free here: fit one message cost so that the 1F1B
    # schedule, simulated with the measured op costs, takes the measured step (bisection).
    lo_c, hi_c = 0.0, spans.median * m
    for _ in range(40):
        comm = (lo_c + hi_c) / 2
        step = cost_model(2, f_, backward=b_, head=head, micro_batches=m, steps=1,
                          comm=comm)["pipelined"]["step"]
        lo_c, hi_c = (comm, hi_c) if step < spans.median else (lo_c, comm)
    model = cost_model(2, f_, backward=b_, head=head, micro_batches=m, steps=n // batch,
                       comm=comm)
    modeled = _ratio(model)
    free = _ratio(cost_model(2, f_, backward=b_, head=head, micro_batches=m, steps=n // batch))
    ratio = spans.median / t_local
    return [Row("local", f"pipelined backprop 1F1B (M={m}, flush per update)",
                "asynchronous local heads", ratio, where,
                target=f"modeled {modeled:.2f}x",
                detail=f"per minibatch of {batch}: pipelined {spans.median * 1e3:.2f} ms "
                       f"(spread {spans.spread:.2f}, "
                       f"{'reliable' if spans.reliable else 'UNRELIABLE (busy machine)'}), "
                       f"local {t_local * 1e3:.2f} ms (median of {repeat} launches of "
                       f"{n // batch} minibatches, spread {local_t.spread:.2f}, bubble "
                       f"{local.bubble:.2f}); ratio of medians, not interleaved (each local "
                       f"run is its own launch); modeled from measured op costs "
                       f"F {f_ * 1e3:.2f} ms, B {b_ * 1e3:.2f} ms, head {head * 1e3:.2f} ms "
                       f"and a message cost {comm * 1e3:.2f} ms fitted to the pipelined step "
                       f"(free messages would give {free:.2f}x); modeled local "
                       f"{model['local']['step'] * 1e3:.2f} ms vs measured {t_local * 1e3:.2f}"
                       f" ms per minibatch: the model overlaps every hand-over with compute, "
                       f"so a measured local step above it is hand-over latency (large on "
                       f"shared cores, under a millisecond on a quiet machine)")]


def _ratio(model: dict) -> float:
    return model["pipelined"]["step"] / model["local"]["step"]
