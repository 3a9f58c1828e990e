"""Run k ranks of a real ``torch.distributed`` group from a notebook.

    from parlearn.distributed import collectives, run
    run(collectives.hello, world_size=2)      # [(0, 2, 'gloo'), (1, 2, 'gloo')]

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
NCCL), through :mod:`parlearn.distributed.__main__`::

    torchrun --standalone --nproc_per_node 8 -m parlearn.dist parlearn.collectives:ring_check 1000
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import importlib
import itertools
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import re
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as tdist

from parlearn.core.checks import check_bool, check_callable, check_choice, check_float, check_int
from parlearn.distributed import diagnosis, flight

__all__ = ["run", "run_many", "RankError", "device_for", "default_backend", "MAX_LOCAL_RANKS"]

_HOST = "127.0.0.1"
_run_ids = itertools.count()
# Seconds the caller waits for a process to exit on its own before killing it.
_EXIT_GRACE = 2.0
# Seconds the other ranks get to report once one has failed.
_FAILURE_GRACE = 0.5


class RankError(RuntimeError):
    """A rank of :func:`run` failed. ``rank`` is the first rank that failed, ``traceback``
    its traceback text, ``failures`` maps every rank that failed to its text, and
    ``unfinished`` lists ranks still running when the run was stopped. Under
    ``run(..., doctor=True)``, ``diagnosis`` is the doctor's one line (also the first line of
    the message; see :func:`parlearn.distributed.diagnosis.diagnose`) and ``records`` each
    rank's :class:`~parlearn.distributed.diagnosis.Call` records; both are None otherwise."""

    def __init__(self, rank: int, failures: dict[int, str], unfinished: Sequence[int],
                 diagnosis: str | None = None, records: dict[int, list] | None = None):
        self.rank = rank
        self.traceback = failures[rank]
        self.failures = dict(failures)
        self.unfinished = list(unfinished)
        self.diagnosis = diagnosis
        self.records = records
        lines = [diagnosis] if diagnosis else []
        lines += [f"rank {rank} failed:", self.traceback.rstrip()]
        for other, text in failures.items():
            if other != rank:
                last = text.strip().splitlines()[-1] if text.strip() else "?"
                lines.append(f"(rank {other} failed too: {last})")
        if self.unfinished:
            lines.append(f"(ranks {self.unfinished} were still running and were stopped)")
        super().__init__("\n".join(lines))


def default_backend(world_size: int) -> str:
    """``"nccl"`` when NCCL exists and there is one GPU per rank, else ``"gloo"``."""
    world_size = check_int("world_size", world_size, lo=1)
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


def _root_cause(failures: dict[int, str]) -> int:
    """The rank to blame: the first (in order of arrival) whose error is not a symptom of
    another rank's failure; else the first to fail."""
    for rank, text in failures.items():
        last = text.strip().splitlines()[-1] if text.strip() else ""
        if not any(p in last for p in diagnosis.PEER_ERRORS):
            return rank
    return next(iter(failures))


def _child(fn: Callable, rank: int, world_size: int, args: tuple, backend: str,
           timeout: float, port_conn, prefix: str, conn, folder: str | None,
           env: dict[str, str]) -> None:
    # One intra-op thread first: a forked child that touches the parent's OpenMP pool hangs.
    torch.set_num_threads(1)
    try:
        os.environ.update(env)
        if "TORCH_DISTRIBUTED_DEBUG" in env:
            tdist.set_debug_level_from_env()  # torch read it once, at import (in the parent)
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
        # Every rank has its connections before any rank runs fn: a rank whose fn fails at
        # once (a bad argument) must not leave while a peer is still connecting, or that
        # peer reports a broken connection instead of its own refusal.
        tdist.barrier()
        with (flight.recording(folder, rank) if folder else contextlib.nullcontext()) as rec:
            payload = ("ok", fn(rank, world_size, *args))
            if tdist.is_initialized():
                if rec is not None:
                    rec.note(diagnosis.END_OF_RUN)
                # No rank leaves before all are done with the group: a rank that exits while
                # a peer is still connecting to it (gloo builds its mesh lazily) fails that peer.
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


def _how_it_ended(rank: int, failures: dict[int, str], unfinished: Sequence[int]) -> str:
    """How a rank ended, in the words :func:`diagnosis.diagnose` reads."""
    if rank in unfinished:
        return "was still running when the run was stopped"
    if rank not in failures:
        return "returned"
    text = failures[rank].strip()
    died = re.match(r"(?:was )?(killed by signal \d+|exited with code -?\d+) without", text)
    if died:
        return died.group(1)
    if text.startswith("still running after deadline"):
        return "was still running at the deadline"
    last = text.splitlines()[-1] if text else "?"
    return "raised " + (last if len(last) <= 160 else last[:157] + "...")


def _check_env(env: Any) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and k and "=" not in k and isinstance(v, str)
            for k, v in env.items()):
        raise TypeError(f"env must be a dict of environment variable names to str values, "
                        f"got {env!r}")
    level = env.get("TORCH_DISTRIBUTED_DEBUG")
    if level is not None and level not in ("OFF", "INFO", "DETAIL"):
        raise ValueError(f"env's TORCH_DISTRIBUTED_DEBUG must be OFF, INFO or DETAIL, "
                         f"got {level!r}")
    return dict(env)


def _doctor(folder: str, world_size: int, failures: dict[int, str],
            unfinished: Sequence[int]) -> tuple[str, dict[int, list]]:
    records = {r: [] for r in range(world_size)}
    try:
        records.update(flight.read_records(folder))
        exits = {r: _how_it_ended(r, failures, unfinished) for r in range(world_size)}
        return diagnosis.diagnose(records, exits), records
    except Exception as err:  # the doctor must never hide the error it reports on
        return f"the doctor could not read the records ({type(err).__name__}: {err})", records


MAX_LOCAL_RANKS = 64


def run(fn: Callable, world_size: int = 2, *, args: Sequence = (), backend: str | None = None,
        timeout: float = 30, start: str | None = None, deadline: float | None = None,
        pids: list | None = None, doctor: bool = False, env: dict[str, str] | None = None,
        records: dict | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their values.

    The group is initialised before ``fn`` starts (``torch.distributed.get_rank()`` works)
    with ``timeout`` seconds as its collective timeout. ``backend`` None picks
    :func:`default_backend`. ``start`` None picks ``"fork"`` on Linux unless the caller
    has initialised CUDA, else ``"spawn"`` (which needs an importable ``fn`` and picklable
    ``args``). Return values must be picklable (return tensors detached, on the CPU).
    ``deadline`` (seconds, optional) bounds the whole run, for ranks that hang outside any
    collective. ``pids``, when given a list, receives the children's process ids.
    ``doctor=True`` records every call each rank makes through ``torch.distributed``'s
    Python API (:func:`parlearn.distributed.flight.recording`, from just before ``fn`` to
    the barrier ``run`` issues after it) into a temporary folder, removed afterwards; on
    failure the :class:`RankError` carries the doctor's one-line ``diagnosis`` of where each
    rank waits and why (:func:`~parlearn.distributed.diagnosis.diagnose`). ``records``, when
    given a dict (and ``doctor=True``), receives each rank's records after a successful run
    too: ``diagnose(records)`` then finds mismatches that did not hang. ``env`` (a dict of
    str) is set in each child's environment before the group starts, e.g.
    ``{"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}`` for torch's own checks of collectives.
    ``run`` does not reseed anything: forked ranks start with a copy of the caller's RNG
    state (the same on every rank), so a worker that wants different draws per rank seeds
    its own ``torch.Generator`` from its rank.

    Raises :class:`RankError` when any rank raises, exits without returning, or is still
    running at ``deadline``; the other ranks are then stopped.
    """
    check_callable("fn", fn)
    # Every rank is a process on this machine: past a few dozen they only share its cores,
    # and thousands exhaust its memory and ports. torchrun on a cluster is for more.
    world_size = check_int("world_size", world_size, lo=1, hi=MAX_LOCAL_RANKS)
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    if deadline is not None:
        deadline = check_float("deadline", deadline, lo=0, lo_open=True)
    doctor = check_bool("doctor", doctor)
    env = _check_env(env)
    if records is not None:
        if not isinstance(records, dict):
            raise TypeError(f"records must be a dict to fill or None, got {records!r}")
        if not doctor:
            raise ValueError("records needs doctor=True (only the doctor records calls)")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list, got {type(args).__name__}")
    backend = default_backend(world_size) if backend is None else backend
    check_choice("backend", backend, ("gloo", "nccl"))
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size}, "
                         f"GPUs={torch.cuda.device_count()}")
    start = _start_method(start, fn)
    if start != "fork":
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
    folder = tempfile.mkdtemp(prefix="parlearn-flight-") if doctor else None
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            port_recv, port_send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"parlearn-rank{rank}", daemon=True,
                            args=(fn, rank, world_size, tuple(args), backend, timeout,
                                  port_recv, prefix, send, folder, env))
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
        found = None
        if folder is not None:
            found = _doctor(folder, world_size, failures, unfinished)
            shutil.rmtree(folder, ignore_errors=True)
    if found is not None and records is not None:
        records.update(found[1])
    if failures:
        raise RankError(_root_cause(failures), failures,
                        [r for r in unfinished if r not in failures],
                        *(found or (None, None)))
    return [results[r] for r in range(world_size)]


def _start_method(start: str | None, fn: Callable) -> str:
    """The start method ``run`` uses (None: fork on Linux unless CUDA is initialised),
    checked, and ``fn`` checked importable when the children do not fork."""
    if start is None:
        fork_ok = sys.platform.startswith("linux") and not torch.cuda.is_initialized()
        start = "fork" if fork_ok else "spawn"
    check_choice("start", start, mp.get_all_start_methods())
    if start != "fork":
        why = _importable(fn)
        if why:
            raise ValueError(f"start={start!r} needs a worker the child can import, but {why}."
                             " Put the worker in an importable module, or use start='fork'.")
    return start


def _many(rank: int, world_size: int, fn: Callable, calls: list) -> list:
    # each call gets its own copy of its arguments, as it would in a launch of its own
    return [fn(rank, world_size, *copy.deepcopy(args)) for args in calls]


def run_many(fn: Callable, world_size: int = 2, calls: Sequence = (), **run_kwargs) -> list:
    """Run ``fn(rank, world_size, *args)`` for each ``args`` of ``calls``, one call after the
    other, in one launch of ``world_size`` ranks: starting the processes costs seconds, a
    small call milliseconds. Each call gets its own copy of its arguments (a model trained
    by one call does not carry over to the next), as separate :func:`run` launches would.
    ``run_kwargs`` (``backend``, ``timeout``, ``start``...) go to :func:`run`; its timeout
    bounds each collective, so it need not grow with the number of calls.

    Returns ``result[i][rank]``: what ``run(fn, world_size, args=calls[i])[rank]`` returns.
    Callers check every call's arguments before this (a bad third call should fail before
    the first one runs); here ``calls`` must be a non-empty list of argument tuples."""
    check_callable("fn", fn)
    if isinstance(calls, str) or not isinstance(calls, Sequence) or not calls:
        raise TypeError(f"calls must be a non-empty list of argument tuples, got {calls!r:.80}")
    for i, args in enumerate(calls):
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"calls[{i}] must be a tuple of arguments, got {args!r:.80}")
    if "args" in run_kwargs:
        raise TypeError("run_many takes each call's arguments in calls, not args")
    _start_method(run_kwargs.get("start"), fn)   # fn itself travels to spawned children
    per_rank = run(_many, world_size, args=(fn, [tuple(a) for a in calls]), **run_kwargs)
    return [[r[i] for r in per_rank] for i in range(len(calls))]
