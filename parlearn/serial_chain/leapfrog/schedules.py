"""The backward schedules: serial, leapfrog, segments (``mode``).

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
    Amdahl's law leapfrog cannot beat ``2 - 1/L`` whatever ``k`` (see the cost model).
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
"""


from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from parlearn.core.checks import check_bool, check_choice, check_int
from parlearn.core.device import threads as _threads
from parlearn.serial_chain.leapfrog.terms import Tape, forward, weight_grads

__all__ = ["MODES", "backward", "grad", "timeline", "WORKER_THREAD_PREFIX"]

MODES = ("serial", "leapfrog", "segments")

# Every helper thread the schedules start carries this name prefix, so a test (or a
# curious user) can see in threading.enumerate() that none outlives its call.
WORKER_THREAD_PREFIX = "parlearn-leapfrog-worker"


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
