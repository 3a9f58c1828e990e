"""The local rules, their serial reference in one process, and the pipeline on real ranks.

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
- **Hebbian feedback** (``rule="hebbian"``, ``"fixed"``): global error propagation through
  the feedback weights of :mod:`parlearn.serial_chain.local.net`.

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
(:func:`parlearn.distributed.run`, gloo): rank ``k`` receives minibatch ``t``'s activation from
rank ``k-1``, runs its forward, sends the output on, then its local backward and update,
while rank ``k+1`` is busy with ``t-1``. No message goes backwards. It equals
:func:`train` (float64, to round-off) and records per-rank timelines.
:func:`compare_rules` trains every rule on the same data, over seeds.
"""

from __future__ import annotations

import collections
import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from parlearn.core.checks import (
    check_bool,
    check_callable,
    check_choice,
    check_float,
    check_int,
    check_module,
    check_tensor,
)
from parlearn.core.device import threads as _threads
from parlearn.serial_chain.local.net import FeedbackLinear, LocalNet, make_net

__all__ = ["RULES", "LOCAL_RULES", "ORDERS", "minibatches", "update_order", "backprop_step",
           "local_step", "train", "TrainResult", "accuracy", "LocalRun", "run_local",
           "compare_rules"]

RULES = ("backprop", "heads", "critics", "hebbian", "fixed")
LOCAL_RULES = ("heads", "critics")
ORDERS = ("sequential", "wavefront")


# ---------------------------------------------------------------------------------------
# The steps: global backprop, and one block's local step.

def _sgd(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], lr: float,
         weight_decay: float) -> None:
    """``p -= lr * (g + weight_decay * p)`` for every pair, in four batched (``_foreach``) ops:
    the same roundings as the per-tensor loop, bit for bit, with far fewer Python calls."""
    params, grads = list(params), list(grads)
    if len(params) != len(grads):
        raise ValueError(f"{len(params)} parameters but {len(grads)} gradients")
    with torch.no_grad():
        if weight_decay:
            step = torch._foreach_mul(params, weight_decay)
            torch._foreach_add_(step, grads)
            torch._foreach_mul_(step, lr)
        else:
            step = torch._foreach_mul(grads, lr)
        torch._foreach_sub_(params, step)


def _trainable(params):
    return [p for p in params if p.requires_grad]


def backprop_step(net: LocalNet, x: torch.Tensor, y: torch.Tensor, lr: float,
                  weight_decay: float = 0.0) -> float:
    """One SGD step of global backprop on the cross-entropy of ``net(x)``: every block and
    the last head (and ``R`` of hebbian :class:`FeedbackLinear` layers, which then take the
    Hebbian step). Returns the loss. ``.grad`` is not touched."""
    if not isinstance(net, LocalNet):
        raise TypeError(f"net must be a LocalNet, got {type(net).__name__}")
    check_tensor("x", x, ndim=2, floating=True)
    check_tensor("y", y, shape=(x.shape[0],), floating=False)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    weight_decay = check_float("weight_decay", weight_decay, lo=0)
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
    check_module("block", block)
    check_module("head", head)
    check_tensor("x", x, floating=True)
    if x.dim() < 1:
        raise ValueError("x must have a batch dimension, got a 0-d tensor")
    check_tensor("y", y, shape=(x.shape[0],), floating=False)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    weight_decay = check_float("weight_decay", weight_decay, lo=0)
    check_bool("critic", critic)
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


def _check_test(test, x: torch.Tensor) -> None:
    """``test`` a pair ``(x_test, y_test)``: rows of ``x``'s width and one label each."""
    if not isinstance(test, tuple | list) or len(test) != 2:
        raise TypeError(f"test must be a pair (x_test, y_test), got {type(test).__name__}")
    check_tensor("test[0]", test[0], shape=(None, x.shape[1]), floating=True)
    check_tensor("test[1]", test[1], shape=(test[0].shape[0],), floating=False)


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
    if not isinstance(net, LocalNet):
        raise TypeError(f"net must be a LocalNet, got {type(net).__name__}")
    check_tensor("x", x, ndim=2, floating=True)
    if x.shape[0] == 0:
        raise ValueError("x must hold at least one example, got 0 rows")
    check_tensor("y", y, shape=(x.shape[0],), floating=False)
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
    if test is not None:
        _check_test(test, x)
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
    is stopped after ``4 * timeout + 60`` seconds (:class:`parlearn.distributed.RankError`)."""
    from parlearn import distributed as dist
    from parlearn.multi_device.pipeline import _preimport, measured_bubble

    lr, weight_decay = _check_train(net, x, y, "heads", lr, weight_decay)
    blocks = check_int("blocks", len(net.blocks), lo=2)
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
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
    check_tensor("x", x, ndim=2, floating=True)
    check_tensor("y", y, shape=(x.shape[0],), floating=False)
    _check_test(test, x)
    if progress is not None:
        check_callable("progress", progress)
    if isinstance(rules, str):
        raise TypeError(f"rules must be a list of rules from {list(RULES)}, got {rules!r}")
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
