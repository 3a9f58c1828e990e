"""Leapfrogging backprop: take the weight gradients off the critical path.

Reconstruction. Saraiya, "Leapfrogging for parallelism in deep neural networks"
(arXiv 1801.04928) could only be read as an abstract ("a savings of 1-1/k of a
dominant term in backpropagation, where k is the number of threads (or gpus)").
parlearn implements two readings of it and says so in the lesson.

Backprop through layers ``l = L..1`` does two things per layer:

* the error chain ``delta_{l-1} = J_l^T delta_l`` (:func:`chain_step`): serial,
  each step needs the last;
* the weight gradient ``G_l = f(delta_l, a_{l-1})`` (:func:`weight_grads`):
  independent across layers once ``delta_l`` is known.

Schedules (``mode``):

``"serial"``
    the reference: chain step, then weight gradient, layer by layer.
``"leapfrog"``
    the chain worker runs ahead down the network and hands every weight gradient
    to a pool, so the weight-gradient term costs about 1/k of its serial time.
    ``workers=k`` counts *all* threads (the chain thread joins the pool when the
    chain is done); on CPU each uses ``max(1, n // k)`` intra-op threads, where ``n``
    is the caller's torch thread count, so the total equals what the serial schedule
    uses (``threads_per_worker`` pins it instead). On CUDA the workers are streams.
    The chain is still serial: for square Linear layers it is half the work, so by
    Amdahl's law leapfrog cannot beat ``2 - 1/L`` whatever ``k`` (:func:`cost_model`).
``"segments"``
    chain splitting: cut the layers into k segments; each forms its transfer
    operator ``T_s = J_first^T ... J_last^T`` (per example: matrix-matrix work);
    a serial pass over the k boundaries; then every segment fills in its interior
    deltas and weight gradients in parallel. Chain depth ``L/k + k`` instead of
    ``L``; taken to ``k = L`` it is a parallel prefix over Jacobian products
    (Naumov, arXiv 1712.06577).

:func:`grad` leaves ``.grad`` on every parameter exactly as
``loss_fn(model(x), y).backward()`` would (to round-off), accumulating like autograd
(in place into an existing ``.grad``). Nothing here touches torch's global RNG, and the
thread count and the worker threads are restored and joined before a call returns.

Layers: the schedules work on the *modules* of the flattened ``nn.Sequential`` (a tanh is
a module with a chain step and no weight gradient); :func:`cost_model`, :func:`deep_mlp`
and the lesson count *Linear layers* (each followed by its activation).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from parlearn.core.bench import Row
from parlearn.core.checks import (
    check_bool,
    check_callable,
    check_choice,
    check_int,
    check_module,
    check_seed,
    check_tensor,
)
from parlearn.core.device import threads as _threads
from parlearn.core.timing import UNRELIABLE, compare

__all__ = ["MODES", "Tape", "forward", "backward", "grad", "chain_step", "weight_grads",
           "timeline", "cost_model", "deep_mlp", "WORKER_THREAD_PREFIX"]

MODES = ("serial", "leapfrog", "segments")

# Every helper thread the schedules start carries this name prefix, so a test (or a
# curious user) can see in threading.enumerate() that none outlives its call.
WORKER_THREAD_PREFIX = "parlearn-leapfrog-worker"

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


@contextmanager
def _record(tape: Tape, lane: str, label: str):
    if tape.events is None:
        yield
        return
    start = time.perf_counter()
    yield
    tape.events.append((lane, label, start, time.perf_counter()))


def _has_params(layer: nn.Module) -> bool:
    return any(p.requires_grad for p in layer.parameters(recurse=False))


def _wgrad(tape: Tape, l: int, delta: torch.Tensor, lane: str) -> None:
    with _record(tape, lane, f"wgrad {l + 1}"):
        tape.grads[l] = weight_grads(tape.layers[l], tape.ins[l].detach(), delta)


def _chain(tape: Tape, l: int, delta: torch.Tensor, lane: str) -> torch.Tensor:
    with _record(tape, lane, f"chain {l + 1}"):
        (g,) = torch.autograd.grad(tape.outs[l], tape.ins[l], delta, retain_graph=True)
        return g


def _serial(tape: Tape) -> None:
    delta = tape.delta_top
    for l in reversed(range(len(tape.layers))):
        if _has_params(tape.layers[l]):
            _wgrad(tape, l, delta, "worker 0")
        if l > 0:
            delta = _chain(tape, l, delta, "worker 0")


class _Pool:
    """k-1 helper threads and a task queue the caller's thread joins (:meth:`wait`).

    Use it as a context manager: leaving the block stops and joins every helper thread,
    also after an error.
    """

    def __init__(self, k: int, threads: int | None, device: torch.device | None = None):
        self.tasks: queue.Queue = queue.Queue()
        self.errors: list[BaseException] = []
        self.intra_op = threads
        self.device = device
        self.threads = [threading.Thread(target=self._loop, args=(f"worker {i}",), daemon=True,
                                         name=f"{WORKER_THREAD_PREFIX}-{i}")
                        for i in range(1, k)]
        for t in self.threads:
            t.start()

    def __enter__(self) -> _Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, fn: Callable[[str], None], lane: str) -> None:
        try:
            fn(lane)
        except BaseException as err:  # re-raised by wait()
            self.errors.append(err)
        finally:
            self.tasks.task_done()

    def _loop(self, lane: str) -> None:
        # torch's intra-op thread count is per thread: each helper sets its own.
        if self.intra_op is not None:
            torch.set_num_threads(self.intra_op)
        # A new thread has no current CUDA context, and cuBLAS warns and sets one at its first
        # matmul. Any runtime call that needs a context binds the device's primary context to
        # this thread (torch.cuda.set_device would not: it is skipped for the current index).
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        while (fn := self.tasks.get()) is not None:
            self._run(fn, lane)
        self.tasks.task_done()

    def submit(self, fn: Callable[[str], None]) -> None:
        self.tasks.put(fn)

    def wait(self, lane: str) -> None:
        """The calling thread works through queued tasks, then waits for the rest to finish."""
        while True:
            try:
                fn = self.tasks.get_nowait()
            except queue.Empty:
                break
            self._run(fn, lane)
        self.tasks.join()
        if self.errors:
            raise self.errors[0]

    def close(self) -> None:
        for _ in self.threads:
            self.tasks.put(None)
        for t in self.threads:
            t.join()


def _leapfrog_threads(tape: Tape, k: int, per: int | None) -> None:
    with _Pool(k, per, tape.delta_top.device) as pool:
        delta = tape.delta_top
        for l in reversed(range(len(tape.layers))):
            if _has_params(tape.layers[l]):  # parameter-free layers have no weight gradient
                pool.submit(partial(_wgrad, tape, l, delta))
            if l > 0:
                delta = _chain(tape, l, delta, "worker 0 (chain)")
        pool.wait("worker 0 (chain)")


def _leapfrog_streams(tape: Tape, k: int) -> None:
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in range(k)]
    delta = tape.delta_top
    # Weight gradients go round-robin over the streams; counting tasks, not layers, so that
    # parameter-free layers (every other module of an MLP) do not leave streams idle.
    tasks = 0
    for l in reversed(range(len(tape.layers))):
        if _has_params(tape.layers[l]):  # parameter-free layers have no weight gradient
            ready = torch.cuda.Event()
            ready.record(main)
            s = streams[tasks % k]
            s.wait_event(ready)
            with torch.cuda.stream(s):
                _wgrad(tape, l, delta, f"stream {tasks % k}")
                delta.record_stream(s)
            tasks += 1
        if l > 0:
            delta = _chain(tape, l, delta, "chain")
    for s in streams:
        main.wait_stream(s)


def _segment_bounds(n_layers: int, k: int) -> list[tuple[int, int]]:
    k = min(k, n_layers)
    edges = [round(i * n_layers / k) for i in range(k + 1)]
    return [(edges[i], edges[i + 1]) for i in range(k)]


def _transfer(tape: Tape, lo: int, hi: int, lane: str) -> torch.Tensor:
    """Rows ``e_j^T J_{hi-1} ... J_lo`` per example: maps a delta at the segment's top
    (output of layer hi-1) to the delta at its bottom (input of layer lo)."""
    with _record(tape, lane, f"transfer {lo + 1}-{hi}"):
        top = tape.outs[hi - 1]
        width = top[0].numel()
        basis = torch.eye(width, dtype=top.dtype, device=top.device)
        rows = basis.reshape(width, 1, *top.shape[1:]).expand(width, *top.shape).contiguous()
        for l in reversed(range(lo, hi)):
            (rows,) = torch.autograd.grad(tape.outs[l], tape.ins[l], rows, retain_graph=True,
                                          is_grads_batched=True)
        return rows  # (width_top, batch, *shape_bottom)


def _apply_transfer(rows: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    w = rows.shape[0]
    coeff = delta.reshape(delta.shape[0], w).T  # (w, batch)
    return torch.einsum("jb,jb...->b...", coeff, rows)


def _segments(tape: Tape, k: int, per: int | None) -> None:
    for layer in tape.layers:
        if isinstance(layer, (nn.BatchNorm1d, nn.BatchNorm2d)) and layer.training:
            raise ValueError(f"mode='segments' cannot use {layer} in train mode: it mixes the "
                             "examples of the batch, so per-example transfer operators do not "
                             "exist. Use mode='leapfrog' or put the layer in eval mode.")
    bounds = _segment_bounds(len(tape.layers), k)
    transfers: dict[int, torch.Tensor] = {}
    tops: dict[int, torch.Tensor] = {len(bounds) - 1: tape.delta_top}
    with _Pool(len(bounds), per, tape.delta_top.device) as pool:
        # Phase 1, parallel: every segment but the lowest forms its transfer operator.
        for s, (lo, hi) in enumerate(bounds):
            if s > 0:
                pool.submit(partial(_store_transfer, tape, lo, hi, transfers, s))
        pool.wait("worker 0")
        # Phase 2, serial: k boundary steps carry the delta down the segment tops.
        for s in range(len(bounds) - 1, 0, -1):
            with _record(tape, "worker 0", f"boundary {s}"):
                tops[s - 1] = _apply_transfer(transfers[s], tops[s])
        # Phase 3, parallel: each segment runs its own short chain and weight gradients.
        for s, (lo, hi) in enumerate(bounds):
            pool.submit(partial(_segment_interior, tape, lo, hi, tops[s]))
        pool.wait("worker 0")


def _store_transfer(tape: Tape, lo: int, hi: int, out: dict, s: int, lane: str) -> None:
    out[s] = _transfer(tape, lo, hi, lane)


def _segment_interior(tape: Tape, lo: int, hi: int, delta: torch.Tensor, lane: str) -> None:
    for l in reversed(range(lo, hi)):
        if _has_params(tape.layers[l]):
            _wgrad(tape, l, delta, lane)
        if l > lo:
            delta = _chain(tape, l, delta, lane)


def _check_schedule(workers, mode, threads_per_worker=None) -> tuple[int, str, int | None]:
    workers = check_int("workers", workers, lo=1)
    mode = check_choice("mode", mode, MODES)
    if threads_per_worker is not None:
        threads_per_worker = check_int("threads_per_worker", threads_per_worker, lo=1)
    return workers, mode, threads_per_worker


def backward(tape: Tape, *, workers: int = 2, mode: str = "leapfrog", accumulate: bool = True,
             threads_per_worker: int | None = None) -> None:
    """Run one backward schedule over ``tape`` and add the gradients to ``.grad``.

    ``workers=k`` threads in all on CPU (CUDA streams for ``mode="leapfrog"`` on CUDA).
    ``threads_per_worker``: torch intra-op threads for each worker; ``None`` gives each of
    the k workers ``max(1, n // k)`` of the caller's ``n = torch.get_num_threads()``, so
    every schedule uses the same total. An int pins every worker to it, the serial
    schedule's one worker included, so schedules can be compared thread for thread
    (CPU tapes only). The caller's thread count is restored before returning.
    With ``accumulate`` the gradients are added to ``.grad`` like autograd does (in place
    when a ``.grad`` exists); without, ``.grad`` is left alone (for timing).
    The tape keeps its graphs, so the same tape can be run again.
    """
    if not isinstance(tape, Tape):
        raise TypeError(f"tape must be a leapfrog.Tape (from leapfrog.forward), got "
                        f"{type(tape).__name__}")
    workers, mode, per = _check_schedule(workers, mode, threads_per_worker)
    check_bool("accumulate", accumulate)
    on_cuda = tape.delta_top.is_cuda
    if on_cuda and per is not None:
        raise ValueError("threads_per_worker applies to CPU tapes only; this tape is on "
                         f"{tape.delta_top.device}")
    tape.grads = {}
    if mode == "serial" or workers == 1:
        if per is None:
            _serial(tape)
        else:
            with _threads(per):
                _serial(tape)
    elif mode == "leapfrog" and on_cuda:
        _leapfrog_streams(tape, workers)
    else:
        if on_cuda:  # the helper threads only launch kernels
            (_leapfrog_threads if mode == "leapfrog" else _segments)(tape, workers, None)
        else:
            per = max(1, torch.get_num_threads() // workers) if per is None else per
            with _threads(per):  # the calling thread is worker 0
                (_leapfrog_threads if mode == "leapfrog" else _segments)(tape, workers, per)
    if on_cuda:
        torch.cuda.synchronize(tape.delta_top.device)
    if accumulate:
        with torch.no_grad():
            for pairs in tape.grads.values():
                for p, g in pairs:
                    if p.grad is None:
                        p.grad = g.detach().clone()
                    else:
                        p.grad.add_(g)


def grad(model: nn.Sequential, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, *,
         workers: int = 2, mode: str = "leapfrog",
         threads_per_worker: int | None = None) -> torch.Tensor:
    """Forward, then the ``mode`` backward schedule; ``.grad`` as ``backward()`` would leave it.

    Returns the loss (detached). ``threads_per_worker`` as in :func:`backward`.
    """
    _check_schedule(workers, mode, threads_per_worker)
    tape = forward(model, loss_fn, x, y)
    backward(tape, workers=workers, mode=mode, threads_per_worker=threads_per_worker)
    return tape.loss


def timeline(model: nn.Sequential, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, *,
             workers: int = 2, mode: str = "leapfrog", warmup: int = 1,
             threads_per_worker: int | None = None) -> list[tuple[str, str, float, float]]:
    """``(lane, task, start_s, end_s)`` of every task of one backward, sorted by start.

    Times are ``time.perf_counter()`` on the host around each task, after ``warmup``
    unrecorded backwards (so allocation noise is not drawn); no ``.grad`` is left. Tasks
    are named by the 1-based index of their module in the flattened model
    (``"chain 4"``, ``"wgrad 3"``). On CPU a task's bar is its run time on that worker.
    On CUDA kernels run asynchronously, so the times are when the host *enqueued* each
    task's kernels, not when the GPU ran them: every lane name then ends in
    ``"(host enqueue)"`` to say so.
    """
    workers, mode, _ = _check_schedule(workers, mode, threads_per_worker)
    warmup = check_int("warmup", warmup, lo=0)
    tape = forward(model, loss_fn, x, y)
    for _ in range(warmup):
        backward(tape, workers=workers, mode=mode, accumulate=False,
                 threads_per_worker=threads_per_worker)
    tape.events = []
    backward(tape, workers=workers, mode=mode, accumulate=False,
             threads_per_worker=threads_per_worker)
    events = tape.events
    if tape.delta_top.is_cuda:
        events = [(f"{lane} (host enqueue)", *rest) for lane, *rest in events]
    return sorted(events, key=lambda e: e[2])


# --- cost model ---------------------------------------------------------------------


def cost_model(layers: int, width: int, batch: int, workers: int, mode: str) -> dict:
    """Work and span of one backward through ``layers`` square Linear layers (modeled).

    ``layers`` counts Linear layers (as :func:`deep_mlp` does); the activations'
    elementwise steps are not counted. Per layer a chain step costs ``c = 2 B w^2``
    flops and a weight gradient ``g = 2 B w^2``; the chain stops at the lowest layer's
    input, so ``L`` layers take ``L - 1`` chain steps. With ``k`` workers:

    * serial:   work ``W = (L-1)c + Lg``; span (depth) ``D = W``.
    * leapfrog: work ``W``; span ``D = (L-1)c + g`` (the chain, then the last weight
      gradient). The chain is half the work, so no ``k`` beats ``W/D = 2 - 1/L``.
    * segments: ``S = min(k, L)`` segments of ``n_s`` layers (split as the schedule does);
      every segment but the lowest forms its transfer operator, ``n_s`` steps of
      ``t = 2 B w^3`` (per-example Jacobian products); ``S - 1`` boundary steps of
      ``c`` each; then each segment its ``n_s`` weight gradients and ``n_s - 1`` chain
      steps. Work ``W + (L - n_0) t``; span ``max n_s t + (S-1) c + max (n_s g + (n_s-1) c)``.

    Returns ``work``, ``depth`` (the span), ``chain_steps`` (chain steps on the span),
    ``wgrad_term`` (weight-gradient flops on one worker when spread over k),
    ``lower_bound = max(depth, work / k)`` (the work/span lower bound on the time: no
    schedule on k workers does better; Brent's theorem bounds a greedy one from above by
    ``work / k + depth``), ``speedup = serial work / lower_bound``, ``speedup_limit =
    serial work / depth`` (what infinitely many workers would give this schedule), all
    in flops or flop ratios: divide by a flop rate to get seconds.
    """
    L = check_int("layers", layers, lo=1)
    w = check_int("width", width, lo=1)
    B = check_int("batch", batch, lo=1)
    k, mode, _ = _check_schedule(workers, mode)
    c = g = 2.0 * B * w**2
    serial_work = (L - 1) * c + L * g
    if mode == "serial" or k == 1:
        work = depth = serial_work
        out = {"chain_steps": L - 1, "wgrad_term": L * g}
    elif mode == "leapfrog":
        work, depth = serial_work, (L - 1) * c + g
        out = {"chain_steps": L - 1, "wgrad_term": L * g / k}
    else:
        sizes = [hi - lo for lo, hi in _segment_bounds(L, k)]
        S, t = len(sizes), 2.0 * B * w**3
        work = serial_work + (L - sizes[0]) * t
        depth = (max(sizes[1:], default=0) * t + (S - 1) * c
                 + max(n * g + (n - 1) * c for n in sizes))
        out = {"chain_steps": (S - 1) + max(sizes) - 1, "wgrad_term": max(sizes) * g}
    bound = max(depth, work / k)
    out.update(work=work, depth=depth, lower_bound=bound, speedup=serial_work / bound,
               speedup_limit=serial_work / depth, mode=mode, workers=k)
    return out


# --- bench --------------------------------------------------------------------------


def deep_mlp(layers: int, width: int, *, activation: type[nn.Module] = nn.Tanh,
             dtype: torch.dtype = torch.float32,
             seed: int | torch.Generator = 0) -> nn.Sequential:
    """``layers`` blocks of Linear(width, width) + activation: deep and narrow.

    Initialised like ``nn.Linear`` (uniform in ``+-1/sqrt(width)``), drawn from ``seed``
    (an int or a ``torch.Generator``), never from torch's global RNG.
    """
    layers = check_int("layers", layers, lo=1)
    width = check_int("width", width, lo=1)
    if not (isinstance(activation, type) and issubclass(activation, nn.Module)):
        raise TypeError(f"activation must be an nn.Module class such as nn.Tanh, got "
                        f"{activation!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    seed = check_seed("seed", seed)
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(width)
    mods: list[nn.Module] = []
    for _ in range(layers):
        # Built on the meta device so nn.Linear's own init does not draw from the global RNG.
        lin = nn.Linear(width, width, device="meta").to_empty(device="cpu")
        with torch.no_grad():
            lin.weight.uniform_(-bound, bound, generator=gen)
            lin.bias.uniform_(-bound, bound, generator=gen)
        mods += [lin, activation()]
    return nn.Sequential(*mods).to(dtype)


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _all_deltas(tape: Tape) -> list[torch.Tensor]:
    deltas = [tape.delta_top] * len(tape.layers)
    for l in reversed(range(1, len(tape.layers))):
        deltas[l - 1] = chain_step(tape, l, deltas[l])
    return deltas


def _wgrad_term(tape: Tape, deltas: list[torch.Tensor], workers: int, threads: int) -> None:
    """All weight gradients, deltas given, on ``workers`` workers of ``threads`` threads each."""
    with _threads(threads), _Pool(workers, threads, tape.delta_top.device) as pool:
        for l in range(len(tape.layers)):
            if _has_params(tape.layers[l]):
                pool.submit(partial(_wgrad, tape, l, deltas[l]))
        pool.wait("worker 0")


def _detail(cmp, name: str, text: str, over: str | None = None) -> str:
    lo, hi = cmp.speedup_range(name, over)
    note = f"{text}; IQR {lo:.2f}-{hi:.2f}"
    return note if cmp.reliable else f"{note}; WARNING: {UNRELIABLE}"


def bench(device: torch.device, quick: bool) -> list[Row]:
    """Measured rows; as the thread policy asks, every worker of the schedules compared
    (and autograd) runs one intra-op thread on CPU, except in the rows that study how
    the threads are split (their labels say so)."""
    L, w, B = (8, 128, 64) if quick else (32, 256, 256)
    k = 2 if device.type == "cpu" else 4
    cores = torch.get_num_threads()
    one = 1 if device.type == "cpu" else None
    repeat = 5 if quick else 11
    dev, size = str(device), f"L={L} w={w} B={B}"
    gen = torch.Generator().manual_seed(0)
    model = deep_mlp(L, w, seed=gen).to(device)
    x = torch.randn(B, w, generator=gen).to(device)
    y = torch.randn(B, w, generator=gen).to(device)
    tape = forward(model, _mse, x, y)
    out = model(x)

    def autograd_backward():
        if one is None:
            torch.autograd.grad(_mse(out, y), list(model.parameters()), retain_graph=True)
            return
        with _threads(one):
            torch.autograd.grad(_mse(out, y), list(model.parameters()), retain_graph=True)

    cmp = compare({
        "serial": partial(backward, tape, mode="serial", accumulate=False,
                          threads_per_worker=one),
        "leapfrog": partial(backward, tape, workers=k, mode="leapfrog", accumulate=False,
                            threads_per_worker=one),
        "autograd": autograd_backward,
    }, warmup=2, repeat=repeat, device=device)
    deltas = _all_deltas(tape)
    per = max(1, cores // k)
    cmp_w = compare({
        "all threads, 1 worker": partial(_wgrad_term, tape, deltas, 1, cores),
        "1 thread": partial(_wgrad_term, tape, deltas, 1, per),
        "k workers": partial(_wgrad_term, tape, deltas, k, per),
    }, warmup=2, repeat=repeat, device=device)
    # Chain splitting only has a chance when layers are very narrow: its transfer
    # operators cost w times a chain step (see cost_model).
    Ls, ws, Bs = (16, 8, 32) if quick else (64, 16, 64)
    narrow = forward(deep_mlp(Ls, ws, seed=gen).to(device), _mse,
                     torch.randn(Bs, ws, generator=gen).to(device),
                     torch.randn(Bs, ws, generator=gen).to(device))
    cmp_s = compare({
        "serial": partial(backward, narrow, mode="serial", accumulate=False,
                          threads_per_worker=one),
        "segments": partial(backward, narrow, workers=k, mode="segments", accumulate=False,
                            threads_per_worker=one),
    }, warmup=2, repeat=repeat, device=device)
    lf, w_same, w_one, seg = (cmp.speedup("leapfrog"), cmp_w.speedup("k workers"),
                              cmp_w.speedup("k workers", over="1 thread"),
                              cmp_s.speedup("segments"))
    cap = cost_model(L, w, B, k, "leapfrog")["speedup_limit"]
    seg_model = cost_model(Ls, ws, Bs, k, "segments")["speedup"]
    thr = "1 thread per worker" if one else "streams"
    return [
        Row(f"leapfrog {size}", "serial schedule", f"leapfrog k={k}", lf, dev,
            f">= 1.3x, <= modeled limit {cap:.2f}x", 1.3 <= lf <= cap,
            _detail(cmp, "leapfrog", f"backward only, {thr}; above the limit is a bug until "
                    "explained")),
        Row(f"leapfrog {size}", "torch autograd", f"leapfrog k={k}",
            cmp.speedup("leapfrog", over="autograd"), dev, "", None,
            _detail(cmp, "leapfrog", f"{thr}; autograd's backward, one thread", "autograd")),
        Row(f"leapfrog {size}", f"wgrad term, 1 worker x {cores} thr",
            f"wgrad term, {k} workers x {per} thr", w_same, dev, f">= {k / 1.25:.2f}x",
            w_same >= k / 1.25,
            _detail(cmp_w, "k workers", "weight gradients alone (deltas given), same total "
                    "threads", "all threads, 1 worker")),
        Row(f"leapfrog {size}", f"wgrad term, 1 worker x {per} thr",
            f"wgrad term, {k} workers x {per} thr", w_one, dev, f">= {k / 1.25:.2f}x",
            w_one >= k / 1.25,
            _detail(cmp_w, "k workers", "weight gradients alone, k workers vs one, same "
                    "threads each", "1 thread")),
        Row(f"leapfrog L={Ls} w={ws} B={Bs}", "serial schedule", f"segments k={k}", seg, dev,
            f"modeled {seg_model:.2f}x", None,
            _detail(cmp_s, "segments", f"chain splitting on a very narrow net, {thr}"
                    + ("; ABOVE the modeled speedup: a bug until explained"
                       if seg > seg_model else ""))),
    ]
