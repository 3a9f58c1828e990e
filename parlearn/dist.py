"""Run k ranks of a real ``torch.distributed`` group from a notebook; record what they send.

    from parlearn import dist
    sums = dist.run(parlearn.collectives.all_reduce_rank_ids, world_size=2)

:func:`run` starts ``world_size`` processes, joins them into one process group (gloo on
CPU; NCCL with one GPU per rank when ``torch.cuda.device_count() >= world_size``), calls
``fn(rank, world_size, *args)`` in each, and returns the ranks' return values in rank order.
What can go wrong is turned into an error in the caller, never a hang:

- an exception in any rank raises :class:`RankError` naming the rank, with its traceback;
- a rank that is hung (or dead) makes its peers' next collective fail after ``timeout``
  seconds (the process group's own timeout), which surfaces as a :class:`RankError`;
- every process ``run`` started is gone when it returns, after errors too.

Start method. ``"fork"`` (the default on Linux) copies the caller, so a launch costs
tens of milliseconds and ``fn`` may even be defined in a notebook cell; the child sets
``torch.set_num_threads(1)`` first, because a forked child that inherits the parent's
OpenMP pool hangs at its first multi-threaded op. ``"spawn"`` starts fresh interpreters
(seconds: each imports torch) and is the default when the caller has already initialised
CUDA (CUDA does not survive a fork); a spawned ``fn`` must be importable by module and
name, so a function from ``__main__`` or a notebook is refused before anything starts.

Rendezvous needs no fixed port: the caller holds a ``TCPStore`` bound to a free port
(port 0) for the length of one run, and the ranks meet in a ``PrefixStore`` unique to it.

The same workers run unchanged under ``torchrun`` on real GPUs (one process per GPU,
NCCL), through this module's entry point::

    torchrun --standalone --nproc_per_node 8 -m parlearn.dist parlearn.collectives:ring_check 1000

Inside a worker, :func:`ledger` records every collective issued through
``torch.distributed``'s Python API (kind, payload bytes, wall time, group size), and the
cost model (:mod:`parlearn.dist_model`, re-exported here) turns payloads into wire bytes
and seconds.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import functools
import importlib
import itertools
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

from .checks import check_callable, check_choice, check_float, check_int
from .dist_model import AlphaBeta, collective_time, fit_alpha_beta, ring_bytes

__all__ = ["run", "RankError", "device_for", "default_backend", "ledger", "Ledger", "Record",
           "AlphaBeta", "collective_time", "fit_alpha_beta", "ring_bytes", "main"]

_HOST = "127.0.0.1"
_run_ids = itertools.count()
# Seconds the caller waits for a process to exit on its own before killing it.
_EXIT_GRACE = 2.0
# Seconds the other ranks get to report once one has failed.
_FAILURE_GRACE = 0.5


class RankError(RuntimeError):
    """A rank of :func:`run` failed. ``rank`` is the first rank that failed, ``traceback``
    its traceback text, ``failures`` maps every rank that failed to its text, and
    ``unfinished`` lists ranks still running when the run was stopped."""

    def __init__(self, rank: int, failures: dict[int, str], unfinished: Sequence[int]):
        self.rank = rank
        self.traceback = failures[rank]
        self.failures = dict(failures)
        self.unfinished = list(unfinished)
        lines = [f"rank {rank} failed:", self.traceback.rstrip()]
        for other, text in failures.items():
            if other != rank:
                last = text.strip().splitlines()[-1] if text.strip() else "?"
                lines.append(f"(rank {other} failed too: {last})")
        if self.unfinished:
            lines.append(f"(ranks {self.unfinished} were still running and were stopped)")
        super().__init__("\n".join(lines))


def default_backend(world_size: int) -> str:
    """``"nccl"`` when NCCL exists and there is one GPU per rank, else ``"gloo"``."""
    if (torch.cuda.is_available() and tdist.is_nccl_available()
            and torch.cuda.device_count() >= world_size):
        return "nccl"
    return "gloo"


def device_for(rank: int) -> torch.device:
    """The device rank ``rank`` of the current group should compute on: its own GPU under
    NCCL (by ``LOCAL_RANK`` when ``torchrun`` set it), else the CPU."""
    rank = check_int("rank", rank, lo=0)
    if tdist.is_initialized() and tdist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


def _importable(fn: Callable) -> str | None:
    """Why a spawned child could not import ``fn`` (None when it can)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module in (None, "__main__", "__mp_main__") or "<" in qualname:
        return (f"{qualname or fn!r} is defined in {module or 'no module'}"
                f"{' (a local function or lambda)' if '<' in qualname else ''}")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        return f"{module}.{qualname} cannot be imported ({err})"
    if obj is not fn:
        return f"{module}.{qualname} names a different object"
    return None


# Last lines of errors torch.distributed raises in a rank because a PEER failed or hung.
_PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting",
                "timed out", "DistNetworkError", "Broken pipe")


def _root_cause(failures: dict[int, str]) -> int:
    """The rank to blame: the first (in order of arrival) whose error is not a symptom of
    another rank's failure; else the first to fail."""
    for rank, text in failures.items():
        last = text.strip().splitlines()[-1] if text.strip() else ""
        if not any(p in last for p in _PEER_ERRORS):
            return rank
    return next(iter(failures))


def _child(fn: Callable, rank: int, world_size: int, args: tuple, backend: str,
           timeout: float, port: int, prefix: str, conn) -> None:
    # One intra-op thread first: a forked child that touches the parent's OpenMP pool hangs.
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = tdist.TCPStore(_HOST, port, world_size + 1, is_master=False,
                               timeout=datetime.timedelta(seconds=timeout))
        tdist.init_process_group(backend, store=tdist.PrefixStore(prefix, store), rank=rank,
                                 world_size=world_size,
                                 timeout=datetime.timedelta(seconds=timeout))
        payload = ("ok", fn(rank, world_size, *args))
        try:
            data = pickle.dumps(payload)
        except Exception:
            raise TypeError(f"rank {rank}: the value fn returned cannot be pickled") from None
    except BaseException:
        data = pickle.dumps(("err", traceback.format_exc()))
    # Report before tearing the group down: destroying it can block on a dead peer.
    conn.send_bytes(data)
    conn.close()
    if tdist.is_initialized():
        tdist.destroy_process_group()


def _stop(procs: Sequence[mp.process.BaseProcess]) -> None:
    """Make sure every process is gone: wait briefly, then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + _EXIT_GRACE
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join()
    for p in procs:
        p.close()


def _exit_text(p: mp.process.BaseProcess) -> str:
    p.join(_EXIT_GRACE)  # its pipe closes a moment before its exit code is known
    code = p.exitcode
    how = f"was killed by signal {-code}" if code is not None and code < 0 else \
        f"exited with code {code}"
    return f"{how} without returning a value\n"


def _collect(procs: list, conns: dict, results: dict, failures: dict,
             deadline: float | None) -> None:
    """Read each rank's report as it arrives until all are in or one failed. After a
    failure the others get a short grace to report too (their own errors, usually a peer
    closing), so the error can show them; whoever is still running is then stopped."""
    stop_at = None if deadline is None else time.monotonic() + deadline
    grace_at = None
    while conns:
        limits = [t for t in (stop_at, grace_at) if t is not None]
        left = None if not limits else max(0.0, min(limits) - time.monotonic())
        ready = mp.connection.wait(list(conns), timeout=left)
        if not ready:
            if not failures:
                waiting = sorted(conns.values())
                failures[waiting[0]] = (f"still running after deadline={deadline} s "
                                        f"(ranks {waiting} had not returned)\n")
            return
        for conn in ready:
            rank = conns.pop(conn)
            try:
                status, value = pickle.loads(conn.recv_bytes())
            except EOFError:
                status, value = "err", _exit_text(procs[rank])
            conn.close()
            if status == "ok":
                results[rank] = value
            else:
                failures[rank] = value
        if failures and grace_at is None:
            grace_at = time.monotonic() + _FAILURE_GRACE


def run(fn: Callable, world_size: int = 2, *, args: Sequence = (), backend: str | None = None,
        timeout: float = 30, start: str | None = None, deadline: float | None = None,
        pids: list | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their values.

    The group is initialised before ``fn`` starts (``torch.distributed.get_rank()`` works)
    with ``timeout`` seconds as its collective timeout. ``backend`` None picks
    :func:`default_backend`. ``start`` None picks ``"fork"`` on Linux unless the caller
    has initialised CUDA, else ``"spawn"`` (which needs an importable ``fn`` and picklable
    ``args``). Return values must be picklable (return tensors detached, on the CPU).
    ``deadline`` (seconds, optional) bounds the whole run, for ranks that hang outside any
    collective. ``pids``, when given a list, receives the children's process ids.

    Raises :class:`RankError` when any rank raises, exits without returning, or is still
    running at ``deadline``; the other ranks are then stopped.
    """
    check_callable("fn", fn)
    world_size = check_int("world_size", world_size, lo=1)
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    if deadline is not None:
        deadline = check_float("deadline", deadline, lo=0, lo_open=True)
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list, got {type(args).__name__}")
    backend = default_backend(world_size) if backend is None else backend
    check_choice("backend", backend, ("gloo", "nccl"))
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size}, "
                         f"GPUs={torch.cuda.device_count()}")
    if start is None:
        fork_ok = sys.platform.startswith("linux") and not torch.cuda.is_initialized()
        start = "fork" if fork_ok else "spawn"
    check_choice("start", start, mp.get_all_start_methods())
    if start != "fork":
        why = _importable(fn)
        if why:
            raise ValueError(f"start={start!r} needs a worker the child can import, but {why}."
                             " Put the worker in an importable module, or use start='fork'.")
        try:
            pickle.dumps(tuple(args))
        except Exception as err:
            raise TypeError(f"args must be picklable with start={start!r}: {err}") from None
    if start == "fork" and torch.cuda.is_initialized():
        raise ValueError("start='fork' after CUDA was initialised in this process breaks the "
                         "children's CUDA; use start='spawn'")

    ctx = mp.get_context(start)
    # The caller holds the rendezvous store on a free port; the prefix keeps runs apart.
    store = tdist.TCPStore(_HOST, 0, world_size + 1, is_master=True,
                           timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    prefix = f"parlearn-run-{os.getpid()}-{next(_run_ids)}"
    procs, conns = [], {}
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"parlearn-rank{rank}", daemon=True,
                            args=(fn, rank, world_size, tuple(args), backend, timeout,
                                  store.port, prefix, send))
            p.start()
            send.close()
            procs.append(p)
            conns[recv] = rank
            if pids is not None:
                pids.append(p.pid)
        _collect(procs, conns, results, failures, deadline)
    finally:
        unfinished = sorted(conns.values())
        for c in conns:
            c.close()
        _stop(procs)
        del store
    if failures:
        raise RankError(_root_cause(failures), failures,
                        [r for r in unfinished if r not in failures])
    return [results[r] for r in range(world_size)]


# ---------------------------------------------------------------------------------------
# The ledger: what each collective sent, per rank.

@dataclass(frozen=True)
class Record:
    """One collective call on this rank: ``bytes`` is its payload as passed (see
    :func:`ledger`), ``seconds`` its wall time (issue time only for async calls),
    ``ranks`` the size of the group it ran on."""

    kind: str
    bytes: int
    seconds: float
    ranks: int


class Ledger:
    """The records of one ``with ledger():`` block (on one rank)."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def record(self, kind: str, nbytes: int, seconds: float, ranks: int) -> None:
        """Add a record by hand, e.g. from a DDP communication hook that torch calls from C++."""
        self.records.append(Record(kind, int(nbytes), float(seconds), int(ranks)))

    def _of(self, kind: str | None) -> list[Record]:
        return [r for r in self.records if kind is None or r.kind == kind]

    def bytes(self, kind: str | None = None) -> int:
        """Total payload bytes of the records (of one ``kind`` when given)."""
        return sum(r.bytes for r in self._of(kind))

    def count(self, kind: str | None = None) -> int:
        """Number of records (of one ``kind`` when given)."""
        return len(self._of(kind))

    def seconds(self, kind: str | None = None) -> float:
        """Total wall time of the records (of one ``kind`` when given)."""
        return sum(r.seconds for r in self._of(kind))

    def summary(self) -> dict[str, tuple[int, int, float]]:
        """``{kind: (count, bytes, seconds)}`` in order of first appearance."""
        return {k: (self.count(k), self.bytes(k), self.seconds(k))
                for k in dict.fromkeys(r.kind for r in self.records)}


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


# kind -> which positional argument is the payload (see ledger's docstring for the rule).
_PAYLOAD = {
    "all_reduce": 0, "broadcast": 0, "reduce": 0, "send": 0, "recv": 0, "isend": 0,
    "irecv": 0, "gather": 0, "scatter": 0, "all_gather": 0, "all_gather_into_tensor": 0,
    "all_gather_single": 0, "reduce_scatter": 1, "reduce_scatter_tensor": 1,
    "reduce_scatter_single": 1, "all_to_all": 1, "all_to_all_single": 1,
    "all_reduce_coalesced": 0, "barrier": None, "batch_isend_irecv": 0,
}
_KEYWORD = {"all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor",
            "send": "tensor", "recv": "tensor", "isend": "tensor", "irecv": "tensor",
            "gather": "tensor", "scatter": "tensor", "all_gather": "tensor_list",
            "all_gather_into_tensor": "output_tensor", "all_gather_single": "output",
            "reduce_scatter": "input_list", "reduce_scatter_tensor": "input",
            "reduce_scatter_single": "input", "all_to_all": "input_tensor_list",
            "all_to_all_single": "input", "all_reduce_coalesced": "tensors",
            "batch_isend_irecv": "p2p_op_list"}

_active: list[Ledger] = []
_originals: dict[str, Callable] = {}
_inside = threading.local()


def _payload(kind: str, args: tuple, kwargs: dict) -> int:
    pos = _PAYLOAD[kind]
    if pos is None:
        return 0
    value = args[pos] if len(args) > pos else kwargs.get(_KEYWORD[kind])
    if kind == "batch_isend_irecv":
        return sum(_nbytes(op.tensor) for op in value)
    return _nbytes(value)


def _recording(kind: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if getattr(_inside, "depth", 0):  # a collective called by another is not counted twice
            return original(*args, **kwargs)
        nbytes = _payload(kind, args, kwargs)
        group = kwargs.get("group")
        _inside.depth = 1
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - t0
            _inside.depth = 0
            ranks = tdist.get_world_size(group) if tdist.is_initialized() else 1
            for led in _active:
                led.record(kind, nbytes, seconds, ranks)
    return wrapper


@contextlib.contextmanager
def ledger() -> Iterator[Ledger]:
    """Record every collective this process issues through ``torch.distributed``'s Python
    API inside the block (module attributes are wrapped on entry and restored on exit;
    nested ledgers each see every call).

    ``bytes`` is the payload as passed: the tensor for all_reduce, broadcast, reduce,
    send/recv/isend/irecv; the OUTPUT for all_gather(_into_tensor, _single) (the whole
    gathered tensor); the INPUT for reduce_scatter(_tensor, _single) and all_to_all(_single);
    what this rank contributes for gather and receives for scatter; 0 for barrier. Wire
    traffic under a given algorithm is :func:`ring_bytes`. Calls ``torch`` makes from C++
    (DDP's gradient buckets) and functional collectives (DTensor) are not seen: count
    those with ``torch.distributed.tensor.debug.CommDebugMode`` or :meth:`Ledger.record`.
    Async calls (``async_op=True``, isend, irecv) are timed at issue only.
    """
    led = Ledger()
    if not _active:
        c10d = tdist.distributed_c10d
        for kind in _PAYLOAD:
            if hasattr(c10d, kind):
                _originals[kind] = getattr(c10d, kind)
                wrapped = _recording(kind, _originals[kind])
                for mod in (tdist, c10d):
                    if getattr(mod, kind, None) is _originals[kind]:
                        setattr(mod, kind, wrapped)
    _active.append(led)
    try:
        yield led
    finally:
        _active.remove(led)
        if not _active:
            for kind, original in _originals.items():
                for mod in (tdist, tdist.distributed_c10d):
                    if getattr(getattr(mod, kind, None), "__wrapped__", None) is original:
                        setattr(mod, kind, original)
            _originals.clear()


# ---------------------------------------------------------------------------------------
# torchrun entry point: ``torchrun ... -m parlearn.dist module:function [args...]``.

def _resolve(spec: str) -> Callable:
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"worker must be 'module:function', got {spec!r}")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return check_callable("worker", obj)


def main(argv: list[str] | None = None) -> int:
    """Under ``torchrun`` (RANK/WORLD_SIZE/MASTER_ADDR set): join the group and call the
    worker with ``(rank, world_size, *args)``, each arg read as a Python literal; print
    ``rank R: value``. Without ``torchrun``: run the worker on ``--nproc`` ranks with
    :func:`run`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m parlearn.dist", description=main.__doc__)
    parser.add_argument("worker", help="module:function, e.g. parlearn.collectives:ring_check")
    parser.add_argument("args", nargs="*", help="extra arguments (Python literals)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks when not under torchrun")
    parser.add_argument("--timeout", type=float, default=60, help="group timeout, seconds")
    opts = parser.parse_args(argv)
    fn = _resolve(opts.worker)
    extra = []
    for a in opts.args:
        try:
            extra.append(ast.literal_eval(a))
        except (ValueError, SyntaxError):
            extra.append(a)
    if "RANK" not in os.environ:
        for rank, value in enumerate(run(fn, opts.nproc, args=extra, timeout=opts.timeout)):
            print(f"rank {rank}: {value!r}")
        return 0
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=opts.timeout))
    try:
        value = fn(rank, world_size, *extra)
        print(f"rank {rank}: {value!r}", flush=True)
    finally:
        tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
