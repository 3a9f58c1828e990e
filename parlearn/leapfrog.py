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
    chain is done); on CPU each uses ``max(1, cores // k)`` intra-op threads, so the
    total equals the cores. On CUDA the workers are streams.
``"segments"``
    chain splitting: cut the layers into k segments; each forms its transfer
    operator ``T_s = J_first^T ... J_last^T`` (per example: matrix-matrix work);
    a serial pass over the k boundaries; then every segment fills in its interior
    deltas and weight gradients in parallel. Chain depth ``L/k + k`` instead of
    ``L``; taken to ``k = L`` it is a parallel prefix over Jacobian products
    (Naumov, arXiv 1712.06577).

:func:`grad` leaves ``.grad`` on every parameter exactly as
``loss_fn(model(x), y).backward()`` would (to round-off), accumulating like autograd.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from .bench import Row
from .timing import compare

__all__ = ["MODES", "Tape", "forward", "backward", "grad", "chain_step", "weight_grads",
           "timeline", "cost_model", "deep_mlp"]

MODES = ("serial", "leapfrog", "segments")

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
        elif not isinstance(layer, _SUPPORTED):
            raise ValueError(f"layer {i} ({type(layer).__name__}) is not supported: its input and "
                             "weight gradients are not separated here. Supported: "
                             + ", ".join(t.__name__ for t in _SUPPORTED))
        elif isinstance(layer, (nn.Conv1d, nn.Conv2d)) and (
                isinstance(layer.padding, str) or layer.padding_mode != "zeros"):
            raise ValueError(f"layer {i} ({layer}): only numeric zero padding is supported")
        else:
            layers.append(layer)
    return layers


def chain_step(tape: Tape, l: int, delta: torch.Tensor) -> torch.Tensor:
    """``delta_{l-1} = J_l^T delta_l``: the input gradient of layer ``l`` (0-based)."""
    (g,) = torch.autograd.grad(tape.outs[l], tape.ins[l], delta, retain_graph=True)
    return g


def _batch_stats(layer: nn.Module, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance the norm layer used in its forward pass, shaped to broadcast."""
    if isinstance(layer, nn.LayerNorm):
        dims = tuple(range(a.ndim - len(layer.normalized_shape), a.ndim))
        return a.mean(dims, keepdim=True), a.var(dims, unbiased=False, keepdim=True)
    shape = (1, -1) + (1,) * (a.ndim - 2)
    if layer.training or not layer.track_running_stats:
        dims = (0, *range(2, a.ndim))
        return a.mean(dims, keepdim=True), a.var(dims, unbiased=False, keepdim=True)
    return layer.running_mean.view(shape), layer.running_var.view(shape)


def weight_grads(layer: nn.Module, a: torch.Tensor,
                 delta: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """``G_l = f(delta_l, a_{l-1})``: the parameter gradients of one layer, explicitly.

    Linear: ``dW = delta^T a``, ``db = sum delta``. Conv: the weight-gradient
    convolution of ``a`` with ``delta``. LayerNorm/BatchNorm: ``dgamma = sum delta*xhat``,
    ``dbeta = sum delta``. Needs no autograd graph, so it runs on any worker or stream.
    """
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
    """What the forward pass stored: each layer's input ``a_{l-1}`` and output graph."""

    layers: list[nn.Module]
    ins: list[torch.Tensor]
    outs: list[torch.Tensor]
    loss: torch.Tensor
    delta_top: torch.Tensor
    events: list[tuple[str, str, float, float]] | None = None
    grads: dict[int, list] = field(default_factory=dict)


def forward(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor) -> Tape:
    """Run the forward pass layer by layer, keeping each layer's graph for the backward."""
    layers = _flatten(model)
    if not isinstance(x, torch.Tensor) or x.ndim < 1 or x.shape[0] == 0:
        raise ValueError(f"x must be a tensor with a non-empty batch dimension, got {x!r:.60}")
    ins, outs = [], []
    a = x.detach()
    for layer in layers:
        a_in = a.detach().requires_grad_(True)
        a = layer(a_in)
        ins.append(a_in)
        outs.append(a)
    top = outs[-1].detach().requires_grad_(True)
    loss = loss_fn(top, y)
    if loss.ndim != 0:
        raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
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
        return chain_step(tape, l, delta)


def _serial(tape: Tape) -> None:
    delta = tape.delta_top
    for l in reversed(range(len(tape.layers))):
        if _has_params(tape.layers[l]):
            _wgrad(tape, l, delta, "worker 0")
        if l > 0:
            delta = _chain(tape, l, delta, "worker 0")


class _Pool:
    """k-1 helper threads and a task queue the caller's thread joins (:meth:`wait`)."""

    def __init__(self, k: int):
        self.tasks: queue.Queue = queue.Queue()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._loop, args=(f"worker {i}",), daemon=True)
                        for i in range(1, k)]
        for t in self.threads:
            t.start()

    def _run(self, fn: Callable[[str], None], lane: str) -> None:
        try:
            fn(lane)
        except BaseException as err:  # re-raised by wait()
            self.errors.append(err)
        finally:
            self.tasks.task_done()

    def _loop(self, lane: str) -> None:
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


@contextmanager
def _intra_op_threads(k: int):
    """Give each of k workers ``cores // k`` intra-op threads, so the total equals the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // k))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _leapfrog_threads(tape: Tape, k: int) -> None:
    pool = _Pool(k)
    try:
        delta = tape.delta_top
        for l in reversed(range(len(tape.layers))):
            if _has_params(tape.layers[l]):  # parameter-free layers have no weight gradient
                pool.submit(partial(_wgrad, tape, l, delta))
            if l > 0:
                delta = _chain(tape, l, delta, "worker 0 (chain)")
        pool.wait("worker 0 (chain)")
    finally:
        pool.close()


def _leapfrog_streams(tape: Tape, k: int) -> None:
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in range(k)]
    delta = tape.delta_top
    for l in reversed(range(len(tape.layers))):
        ready = torch.cuda.Event()
        ready.record(main)
        s = streams[l % k]
        s.wait_event(ready)
        with torch.cuda.stream(s):
            _wgrad(tape, l, delta, f"stream {l % k}")
            delta.record_stream(s)
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


def _segments(tape: Tape, k: int) -> None:
    for layer in tape.layers:
        if isinstance(layer, (nn.BatchNorm1d, nn.BatchNorm2d)) and layer.training:
            raise ValueError(f"mode='segments' cannot use {layer} in train mode: it mixes the "
                             "examples of the batch, so per-example transfer operators do not "
                             "exist. Use mode='leapfrog' or put the layer in eval mode.")
    bounds = _segment_bounds(len(tape.layers), k)
    pool = _Pool(len(bounds))
    transfers: dict[int, torch.Tensor] = {}
    tops: dict[int, torch.Tensor] = {len(bounds) - 1: tape.delta_top}
    try:
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
    finally:
        pool.close()


def _store_transfer(tape: Tape, lo: int, hi: int, out: dict, s: int, lane: str) -> None:
    out[s] = _transfer(tape, lo, hi, lane)


def _segment_interior(tape: Tape, lo: int, hi: int, delta: torch.Tensor, lane: str) -> None:
    for l in reversed(range(lo, hi)):
        if _has_params(tape.layers[l]):
            _wgrad(tape, l, delta, lane)
        if l > lo:
            delta = _chain(tape, l, delta, lane)


def _check_mode(workers: int, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")


def backward(tape: Tape, *, workers: int = 2, mode: str = "leapfrog",
             accumulate: bool = True) -> None:
    """Run one backward schedule over ``tape`` and add the gradients to ``.grad``.

    The tape keeps its graphs, so the same tape can be run again (for timing).
    """
    _check_mode(workers, mode)
    tape.grads = {}
    on_cuda = tape.delta_top.is_cuda
    if mode == "serial" or workers == 1:
        _serial(tape)
    elif mode == "leapfrog" and on_cuda:
        _leapfrog_streams(tape, workers)
    else:
        with _intra_op_threads(1 if on_cuda else workers):
            (_leapfrog_threads if mode == "leapfrog" else _segments)(tape, workers)
    if on_cuda:
        torch.cuda.synchronize(tape.delta_top.device)
    if accumulate:
        for pairs in tape.grads.values():
            for p, g in pairs:
                p.grad = g.detach().clone() if p.grad is None else p.grad + g


def grad(model: nn.Sequential, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, *,
         workers: int = 2, mode: str = "leapfrog") -> torch.Tensor:
    """Forward, then the ``mode`` backward schedule; ``.grad`` as ``backward()`` would leave it.

    Returns the loss (detached).
    """
    _check_mode(workers, mode)
    tape = forward(model, loss_fn, x, y)
    backward(tape, workers=workers, mode=mode)
    return tape.loss


def timeline(model: nn.Sequential, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, *,
             workers: int = 2, mode: str = "leapfrog",
             warmup: int = 1) -> list[tuple[str, str, float, float]]:
    """Measured ``(worker, task, start_s, end_s)`` events of one backward (no ``.grad`` left).

    Runs ``warmup`` unrecorded backwards first so allocation noise is not drawn.
    """
    tape = forward(model, loss_fn, x, y)
    for _ in range(warmup):
        backward(tape, workers=workers, mode=mode, accumulate=False)
    tape.events = []
    backward(tape, workers=workers, mode=mode, accumulate=False)
    return sorted(tape.events, key=lambda e: e[2])


# --- cost model ---------------------------------------------------------------------


def cost_model(layers: int, width: int, batch: int, workers: int, mode: str) -> dict:
    """Work and depth of one backward through ``layers`` square Linear layers (modeled).

    Per layer a chain step costs ``c = 2 B w^2`` flops and a weight gradient
    ``g = 2 B w^2``. With ``L`` layers, ``k`` workers, ``S = min(k, L)`` segments:

    * serial:   work ``L(c+g)``; depth ``L(c+g)``; chain steps ``L``.
    * leapfrog: work ``L(c+g)``; depth ``Lc + g`` (the chain, then the last weight
      gradient); weight-gradient term ``L g / k`` when spread over k workers.
    * segments: extra transfer work ``t = 2 B w^3`` per layer outside the lowest segment
      (per-example Jacobian products), boundary steps ``b = 2 B w^2`` each; depth
      ``(L/S) t + (S-1) b + (L/S)(c+g)``; chain steps ``L/S + S``.

    ``time`` is Brent's bound ``max(depth, work / k)`` in flops: divide by a measured
    flop rate to get seconds.
    """
    _check_mode(workers, mode)
    if layers < 1 or width < 1 or batch < 1:
        raise ValueError(f"layers, width and batch must be >= 1, got {layers}, {width}, {batch}")
    L, k = layers, workers
    c = g = 2.0 * batch * width**2
    if mode == "serial" or k == 1:
        work = depth = L * (c + g)
        out = {"chain_steps": L, "wgrad_term": L * g}
    elif mode == "leapfrog":
        work, depth = L * (c + g), L * c + g
        out = {"chain_steps": L, "wgrad_term": L * g / k}
    else:
        S = min(k, L)
        seg = math.ceil(L / S)
        t, b = 2.0 * batch * width**3, 2.0 * batch * width**2
        work = L * (c + g) + (L - seg) * t + (S - 1) * b
        depth = seg * t + (S - 1) * b + seg * (c + g)
        out = {"chain_steps": seg + S, "wgrad_term": seg * g}
    out.update(work=work, depth=depth, time=max(depth, work / k), mode=mode, workers=k)
    return out


# --- bench --------------------------------------------------------------------------


def deep_mlp(layers: int, width: int, *, activation: type[nn.Module] = nn.Tanh,
             dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Sequential:
    """``layers`` blocks of Linear(width, width) + activation: deep and narrow."""
    if layers < 1 or width < 1:
        raise ValueError(f"layers and width must be >= 1, got {layers}, {width}")
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), activation()]
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
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    pool = _Pool(workers)
    try:
        for l in range(len(tape.layers)):
            if _has_params(tape.layers[l]):
                pool.submit(partial(_wgrad, tape, l, deltas[l]))
        pool.wait("worker 0")
    finally:
        pool.close()
        torch.set_num_threads(before)


def bench(device: torch.device, quick: bool) -> list[Row]:
    L, w, B = (8, 128, 64) if quick else (32, 256, 256)
    k = 2 if device.type == "cpu" else 4
    cores = os.cpu_count() or 1
    repeat = 5 if quick else 11
    dev, size = str(device), f"L={L} w={w} B={B}"
    model = deep_mlp(L, w).to(device)
    x, y = torch.randn(B, w, device=device), torch.randn(B, w, device=device)
    tape = forward(model, _mse, x, y)
    out = model(x)

    def autograd_backward():
        torch.autograd.grad(_mse(out, y), list(model.parameters()), retain_graph=True)

    cmp = compare({
        "serial": partial(backward, tape, mode="serial", accumulate=False),
        "leapfrog": partial(backward, tape, workers=k, mode="leapfrog", accumulate=False),
        "autograd": autograd_backward,
    }, warmup=2, repeat=repeat, device=device)
    deltas = _all_deltas(tape)
    per = max(1, cores // k)
    cmp_w = compare({
        "all cores, 1 worker": partial(_wgrad_term, tape, deltas, 1, cores),
        "1 thread": partial(_wgrad_term, tape, deltas, 1, per),
        "k workers": partial(_wgrad_term, tape, deltas, k, per),
    }, warmup=2, repeat=repeat, device=device)
    # Chain splitting only has a chance when layers are very narrow: its transfer
    # operators cost w times a chain step (see cost_model).
    Ls, ws, Bs = (16, 8, 32) if quick else (64, 16, 64)
    narrow = forward(deep_mlp(Ls, ws).to(device), _mse, torch.randn(Bs, ws, device=device),
                     torch.randn(Bs, ws, device=device))
    cmp_s = compare({
        "serial": partial(backward, narrow, mode="serial", accumulate=False),
        "segments": partial(backward, narrow, workers=k, mode="segments", accumulate=False),
    }, warmup=2, repeat=repeat, device=device)
    lf, w_same, w_one = (cmp.speedup("leapfrog"), cmp_w.speedup("k workers"),
                         cmp_w.speedup("k workers", over="1 thread"))
    return [
        Row(f"leapfrog {size}", "serial schedule", f"leapfrog k={k}", lf, dev, ">= 1.3x",
            lf >= 1.3, f"backward only; both use {cores} threads in all"),
        Row(f"leapfrog {size}", "torch autograd", f"leapfrog k={k}",
            cmp.speedup("leapfrog", over="autograd"), dev),
        Row(f"leapfrog {size}", f"wgrad term, 1 worker x {cores} thr",
            f"wgrad term, {k} workers x {per} thr", w_same, dev, f">= {k / 1.25:.2f}x",
            w_same >= k / 1.25, "weight gradients alone (deltas given), same total threads"),
        Row(f"leapfrog {size}", f"wgrad term, 1 worker x {per} thr",
            f"wgrad term, {k} workers x {per} thr", w_one, dev, f">= {k / 1.25:.2f}x",
            w_one >= k / 1.25, "weight gradients alone, k single-threaded workers vs one"),
        Row(f"leapfrog L={Ls} w={ws} B={Bs}", "serial schedule", f"segments k={k}",
            cmp_s.speedup("segments"), dev, "", None,
            "chain splitting on a very narrow net; the cost model says where it could pay"),
    ]
