"""Run k ranks of a real ``torch.distributed`` group from a notebook; record what they send.

    from parlearn import collectives, dist
    dist.run(collectives.hello, world_size=2)      # [(0, 2, 'gloo'), (1, 2, 'gloo')]

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
import datetime
import importlib
import itertools
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as tdist

from .checks import check_callable, check_choice, check_float, check_int
from .dist_ledger import Ledger, Record, ledger
from .dist_model import AlphaBeta, collective_time, fit_alpha_beta, ring_bytes

__all__ = ["run", "RankError", "device_for", "default_backend", "ledger", "Ledger", "Record",
           "AlphaBeta", "collective_time", "fit_alpha_beta", "ring_bytes", "sweep_collective",
           "measure_alpha_beta", "DEFAULT_SIZES", "bench", "main"]

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
           timeout: float, port_conn, prefix: str, conn) -> None:
    # One intra-op thread first: a forked child that touches the parent's OpenMP pool hangs.
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        port = port_conn.recv()
        port_conn.close()
        store = tdist.TCPStore(_HOST, port, world_size + 1, is_master=False,
                               timeout=datetime.timedelta(seconds=timeout))
        # Binding NCCL to the rank's GPU up front lets barrier() know its device.
        tdist.init_process_group(backend, store=tdist.PrefixStore(prefix, store), rank=rank,
                                 world_size=world_size,
                                 timeout=datetime.timedelta(seconds=timeout),
                                 device_id=torch.device("cuda", rank) if backend == "nccl"
                                 else None)
        payload = ("ok", fn(rank, world_size, *args))
        if tdist.is_initialized():
            # No rank leaves before all are done with the group: a rank that exits while a
            # peer is still connecting to it (gloo builds its mesh lazily) fails that peer.
            tdist.barrier()
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
    ``run`` does not reseed anything: forked ranks start with a copy of the caller's RNG
    state (the same on every rank), so a worker that wants different draws per rank seeds
    its own ``torch.Generator`` from its rank.

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
    prefix = f"parlearn-run-{os.getpid()}-{next(_run_ids)}"
    procs, conns, ports = [], {}, []
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    store = None
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            port_recv, port_send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"parlearn-rank{rank}", daemon=True,
                            args=(fn, rank, world_size, tuple(args), backend, timeout,
                                  port_recv, prefix, send))
            with warnings.catch_warnings():
                # Python >= 3.12 warns on fork from a threaded process; the child's first act
                # (one intra-op thread) is what makes it safe for torch (module docstring).
                warnings.filterwarnings("ignore", "This process .* is multi-threaded",
                                        DeprecationWarning)
                p.start()
            send.close()
            port_recv.close()
            procs.append(p)
            conns[recv] = rank
            ports.append(port_send)
            if pids is not None:
                pids.append(p.pid)
        # The rendezvous store (on a free port; the prefix keeps runs apart) starts only
        # after the last fork: a child forked while the store's server thread holds a lock
        # can deadlock in its first call.
        store = tdist.TCPStore(_HOST, 0, world_size + 1, is_master=True,
                               timeout=datetime.timedelta(seconds=timeout),
                               wait_for_workers=False)
        for c in ports:
            c.send(store.port)
            c.close()
        _collect(procs, conns, results, failures, deadline)
    finally:
        unfinished = sorted(conns.values())
        for c in [*conns, *ports]:
            c.close()
        _stop(procs)
        del store
    if failures:
        raise RankError(_root_cause(failures), failures,
                        [r for r in unfinished if r not in failures])
    return [results[r] for r in range(world_size)]


# ---------------------------------------------------------------------------------------
# Measuring collectives on real ranks, and fitting the alpha-beta model to them.

# Payload sizes (bytes) of the default sweep: 64 B to 4 MiB, four per decade or so.
DEFAULT_SIZES = tuple(int(2 ** (k / 2)) // 4 * 4 for k in range(12, 45))


def _label(backend: str, world_size: int) -> str:
    where = "GPUs" if backend == "nccl" else f"CPU, {os.cpu_count()} cores"
    return f"{world_size} {backend} ranks on {where}"


def sweep_collective(kinds: Sequence[str] = ("all_reduce",), sizes: Sequence[int] = DEFAULT_SIZES,
                     world_size: int = 2, *, repeat: int = 5, warmup: int = 1,
                     backend: str | None = None, timeout: float = 30) -> dict:
    """Measure ``kinds`` (each of :data:`parlearn.collectives.TIMED_KINDS`) at payload
    ``sizes`` (bytes of float32) on ``world_size`` real ranks, interleaved repeat by repeat.

    A repeat's time is the slowest rank's (a collective is done when its last rank is).
    Returns ``{"sizes", "world_size", "device", "reliable", "median_s": {kind: [...]},
    "q1_s", "q3_s", "spread": {kind: [...]}}``; ``spread`` is the interquartile range over
    the median, and ``reliable`` is False when any spread exceeds
    :data:`parlearn.timing.SPREAD_LIMIT`.
    """
    from . import collectives
    from .timing import SPREAD_LIMIT, Timing

    kinds = [check_choice("kinds", k, collectives.TIMED_KINDS) for k in kinds]
    sizes = [check_int("sizes", n, lo=4) for n in sizes]
    world_size = check_int("world_size", world_size, lo=2)
    repeat, warmup = check_int("repeat", repeat, lo=1), check_int("warmup", warmup, lo=0)
    backend = default_backend(world_size) if backend is None else backend
    per_rank = run(collectives.time_collectives, world_size, backend=backend, timeout=timeout,
                   args=(tuple(kinds), tuple(sizes), repeat, warmup))
    out: dict = {"sizes": [n // 4 * 4 for n in sizes], "world_size": world_size,
                 "device": _label(backend, world_size), "median_s": {}, "q1_s": {}, "q3_s": {},
                 "spread": {}}
    for kind in kinds:
        for n in out["sizes"]:
            slowest = [max(ts) for ts in zip(*(r[kind][n] for r in per_rank), strict=True)]
            t = Timing(tuple(slowest), out["device"], threads=1)
            q = sorted(slowest)
            out["median_s"].setdefault(kind, []).append(t.median)
            out["q1_s"].setdefault(kind, []).append(q[len(q) // 4])
            out["q3_s"].setdefault(kind, []).append(q[(3 * len(q)) // 4])
            out["spread"].setdefault(kind, []).append(t.spread)
    out["reliable"] = all(s <= SPREAD_LIMIT for v in out["spread"].values() for s in v)
    return out


def _model_kind(kind: str) -> str:
    return "all_reduce" if kind == "ring_all_reduce" else kind


def measure_alpha_beta(world_size: int = 2, sizes: Sequence[int] = DEFAULT_SIZES,
                       repeat: int = 5, *, kind: str = "all_reduce", backend: str | None = None,
                       timeout: float = 30) -> AlphaBeta:
    """This machine's alpha and beta: :func:`sweep_collective` of ``kind`` on real ranks,
    then :func:`fit_alpha_beta` of the medians to the ring formula of ``kind``."""
    sweep = sweep_collective((kind,), sizes, world_size, repeat=repeat, backend=backend,
                             timeout=timeout)
    return fit_alpha_beta(sweep["sizes"], sweep["median_s"][kind], kind=_model_kind(kind),
                          world_size=world_size)


def _trust(reliable: bool) -> str:
    return "spread ok" if reliable else "UNRELIABLE: another program is using the cores"


def bench(device: torch.device, quick: bool) -> list:
    """Rows for ``python -m parlearn.bench dist``, all on 2 real ranks (NCCL when ``device``
    is CUDA and there are 2 GPUs, else gloo on the CPU): the ring all-reduce written from
    send/recv against ``torch.distributed.all_reduce`` (4 MiB, interleaved), and measured
    all-reduce time against the alpha-beta model fitted on a separate sweep, at 3 sizes
    between the fitted ones (ratio measured/modeled)."""
    from .bench import Row

    backend = "nccl" if device.type == "cuda" and default_backend(2) == "nccl" else "gloo"
    repeat = 3 if quick else 9
    big = 1 << 20 if quick else 1 << 22
    cmp = sweep_collective(("all_reduce", "ring_all_reduce"), [big], 2, repeat=repeat,
                           backend=backend)
    t_torch, t_ring = cmp["median_s"]["all_reduce"][0], cmp["median_s"]["ring_all_reduce"][0]
    rows = [Row("dist", f"all_reduce {big >> 20} MiB", "ring from send/recv (parlearn)",
                t_torch / t_ring, cmp["device"],
                detail=f"torch {t_torch * 1e3:.2f} ms, ring {t_ring * 1e3:.2f} ms; "
                       f"{_trust(cmp['reliable'])}")]
    fit_sizes = DEFAULT_SIZES[::4] if quick else DEFAULT_SIZES[::2]
    sw = sweep_collective(("all_reduce",), fit_sizes, 2, repeat=repeat, backend=backend)
    model = fit_alpha_beta(sw["sizes"], sw["median_s"]["all_reduce"], kind="all_reduce",
                           world_size=2)
    check = [3 * 1024 // 4 * 4, 96 * 1024, 3 * 1024 * 1024]
    at = sweep_collective(("all_reduce",), check, 2, repeat=repeat, backend=backend)
    for n, t in zip(at["sizes"], at["median_s"]["all_reduce"], strict=True):
        modeled = collective_time("all_reduce", n, 2, model)
        rows.append(Row("dist", f"measured all_reduce {n / 1024:.0f} KiB",
                        "alpha-beta model (fitted here)", t / modeled, at["device"],
                        detail=f"ratio = measured/modeled; {model}; measured "
                               f"{t * 1e6:.0f} us, modeled {modeled * 1e6:.0f} us; "
                               f"{_trust(sw['reliable'] and at['reliable'])}"))
    return rows


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


def _report(rank: int, value: Any) -> None:
    # One write call per line: torchrun's ranks share one stdout, and print() (two writes when
    # stdout is unbuffered, e.g. PYTHONUNBUFFERED=1) let two ranks' lines interleave.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"rank {rank}: {value!r}\n".encode())


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
            _report(rank, value)
        return 0
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    device = None
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=opts.timeout),
                             device_id=device)
    try:
        _report(rank, fn(rank, world_size, *extra))
    finally:
        tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
