"""When it breaks: a zoo of the classic distributed hangs, each diagnosed in one line.

    from parlearn import dist, hangs
    dist.run(hangs.skipped_collective, 3, timeout=5, doctor=True)
    # RankError: ranks 0 and 2 wait in all_reduce #4 (128 B float64); rank 1 skipped it and
    #            waits at the end of the run (its call #4)
    hangs.hang_zoo()   # every hang: the doctor's line, seconds to the error, what torch says

Each worker below is a few lines of an ordinary training loop with one classic mistake. A
hang ends only when the group's ``timeout`` fires, with the same "Timed out waiting" on
every rank; the flight recorder of :mod:`parlearn.distributed.flight`
(``run(..., doctor=True)``) reads what each rank was doing and names the culprit.

What gloo does with a mismatch (measured, torch 2.13, 3 ranks on one machine):

- different collectives, or one skipped: every rank waits until the timeout;
- different byte counts (a size, or a dtype of another width): a receiving rank finds
  more bytes than it expects and aborts at once (SIGABRT: "Received data size doesn't
  match expected size"); its peers see "Connection closed by peer". No hang, but no
  message that says which tensor;
- the same byte count (float16 on one rank, bfloat16 on another; int32 vs float32), or a
  broadcast into buffers longer than the root's: no error, no hang, a silently wrong
  result. Only a check finds it: :func:`doctor` (the records of a run that returned) or
  torch's own ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (see :data:`SILENT`);
- a send whose receive is never posted waits until the timeout; a rank killed mid-run
  closes its sockets, so its peers fail within a fraction of a second.

Torch's own tools, beside the doctor. ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps the group in
a checker that, before every collective, gathers each rank's fingerprint (sequence number,
op, shapes, dtypes) and raises "Detected mismatch between collectives" on every rank: it
catches a different or skipped collective and mismatched shapes or dtypes (the silent ones
too) at once, instead of after the timeout. It does not fingerprint send/recv, so a send
without a receive still waits for the timeout; a dead rank shows in its logs as "failed to
pass monitoredBarrier". See torch's "Distributed communication package" documentation,
"Debugging torch.distributed applications". :func:`late_rank` shows
``torch.distributed.monitored_barrier(wait_all_ranks=True)``, which makes rank 0 name every
rank that did not arrive; after it fails the group is broken and must be rebuilt.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as tdist

from parlearn.at_scale.traces import _QuietStderr
from parlearn.core.checks import check_bool, check_float, check_int
from parlearn.distributed import RankError, diagnose, run

__all__ = ["wrong_order", "skipped_collective", "size_mismatch", "dtype_mismatch",
           "send_without_recv", "dead_rank", "late_rank", "silent_dtype", "silent_broadcast",
           "HANGS", "SILENT", "hang_zoo", "doctor"]


def _need_peers(world_size: int) -> None:
    # Every rank makes the same check on the same value: all refuse together, none hangs.
    check_int("world_size", world_size, lo=2)


def wrong_order(rank: int, world_size: int) -> None:
    """Two agreeing steps, then the last rank all-reduces before it all-gathers while the
    others all-gather first (e.g. a metric logged in a different place on one rank)."""
    _need_peers(world_size)
    x = torch.ones(1024)
    for _ in range(2):
        tdist.all_reduce(x)
    parts = [torch.empty(1024) for _ in range(world_size)]
    if rank == world_size - 1:
        tdist.all_reduce(x)
        tdist.all_gather(parts, x)
    else:
        tdist.all_gather(parts, x)
        tdist.all_reduce(x)


def skipped_collective(rank: int, world_size: int) -> None:
    """A data-dependent ``if``: each step all-reduces the gradient only when the loss is
    finite, and at step 4 the loss is NaN on rank 1 alone, so rank 1 skips the collective
    the others wait in."""
    _need_peers(world_size)
    grad = torch.ones(16, dtype=torch.float64)
    for step in range(4):
        loss = torch.tensor(float("nan") if (rank == 1 and step == 3) else 1.0)
        if torch.isfinite(loss):
            tdist.all_reduce(grad)


def size_mismatch(rank: int, world_size: int) -> None:
    """Two agreeing steps, then rank 1 all-reduces a tensor of half the length (a last
    batch, a parameter list built from a rank-dependent config)."""
    _need_peers(world_size)
    for _ in range(2):
        tdist.all_reduce(torch.ones(16))
    tdist.all_reduce(torch.ones(8 if rank == 1 else 16))


def dtype_mismatch(rank: int, world_size: int) -> None:
    """Two agreeing steps, then rank 1 all-reduces float64 where the others use float32
    (a model cast with ``.double()`` on one rank only)."""
    _need_peers(world_size)
    for _ in range(2):
        tdist.all_reduce(torch.ones(16))
    tdist.all_reduce(torch.ones(16, dtype=torch.float64 if rank == 1 else torch.float32))


def send_without_recv(rank: int, world_size: int) -> None:
    """One agreeing all-reduce, then rank 0 sends 200 floats to rank 1, which never posts
    the receive (a pipeline schedule that differs between two stages)."""
    _need_peers(world_size)
    tdist.all_reduce(torch.ones(4))
    if rank == 0:
        tdist.send(torch.ones(200), 1)


def dead_rank(rank: int, world_size: int) -> None:
    """Five agreeing all-reduces, then the last rank is killed (SIGKILL, as the kernel's
    out-of-memory killer or a preempted node would), and the others all-reduce again."""
    _need_peers(world_size)
    x = torch.ones(4)
    for _ in range(5):
        tdist.all_reduce(x)
    if rank == world_size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    tdist.all_reduce(x)


def late_rank(rank: int, world_size: int, seconds: float = 1.0) -> None:
    """Every rank calls ``monitored_barrier(timeout=seconds, wait_all_ranks=True)``, but
    the last one is stuck in its own code (a slow data loader) for ``4 * seconds`` first:
    rank 0's error names it ("Ranks 2 failed to pass monitoredBarrier")."""
    _need_peers(world_size)
    seconds = check_float("seconds", seconds, lo=0, lo_open=True)
    if rank == world_size - 1:
        time.sleep(4 * seconds)
    tdist.monitored_barrier(timeout=datetime.timedelta(seconds=seconds), wait_all_ranks=True)


def silent_dtype(rank: int, world_size: int) -> list[float]:
    """Rank 1 all-reduces bfloat16 where the others use float16 (the same 2 bytes a value):
    gloo adds the bit patterns as it finds them and every rank returns a wrong sum."""
    _need_peers(world_size)
    x = torch.ones(16, dtype=torch.bfloat16 if rank == 1 else torch.float16)
    tdist.all_reduce(x)
    return x[:4].float().tolist()


def silent_broadcast(rank: int, world_size: int) -> list[float]:
    """Rank 0 broadcasts 16 floats into the others' buffers of 32: they receive the first
    16 and keep their own values in the rest, with no error."""
    _need_peers(world_size)
    x = torch.full((16 if rank == 0 else 32,), float(rank + 1))
    tdist.broadcast(x, 0)
    return x.tolist()


HANGS: dict[str, tuple[Callable, str]] = {
    "wrong_order": (wrong_order, "collectives in a different order on one rank"),
    "skipped_collective": (skipped_collective,
                           "a rank skips a collective (its loss is NaN, an if skips the step)"),
    "size_mismatch": (size_mismatch, "one rank all-reduces a tensor of another size"),
    "dtype_mismatch": (dtype_mismatch, "one rank all-reduces float64, the others float32"),
    "send_without_recv": (send_without_recv, "a send whose receive is never posted"),
    "dead_rank": (dead_rank, "a rank is killed (SIGKILL) mid-run"),
    "late_rank": (late_rank, "a rank stuck in its own code misses a monitored_barrier"),
}
SILENT: dict[str, tuple[Callable, str]] = {
    "silent_dtype": (silent_dtype, "float16 on some ranks, bfloat16 on one: same bytes"),
    "silent_broadcast": (silent_broadcast, "a broadcast into longer buffers than the root's"),
}


def doctor(fn: Callable, world_size: int = 2, *, args: Sequence = (),
           timeout: float = 30.0) -> tuple[list, str]:
    """The doctor on demand: run ``fn`` (as :func:`~parlearn.distributed.run` does) with
    the flight recorder on and return
    ``(values, diagnosis)`` even when it succeeds, so a mismatch that did not hang (see
    :data:`SILENT`) is named too. A run that fails raises :class:`RankError` with its
    diagnosis, as ``run(..., doctor=True)`` does."""
    records: dict[int, list] = {}
    values = run(fn, world_size, args=args, timeout=timeout, doctor=True, records=records)
    return values, diagnose(records)


def _torch_says(err: RankError) -> str:
    """The gist of torch's own error under TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    for text in err.failures.values():
        m = re.search(r"Rank (\d+) is running collective.*?but Rank (\d+) is running.*?"
                      r"aspects:(.*)", text, re.S)
        if m:
            aspects = [" ".join(a.replace("vs", " vs ").replace("Tensor Tensor", "tensor")
                                .split()) for a in re.split(r"\t|\s{2,}", m.group(3))]
            # (an aspect with nothing after "vs": the other rank's op has no tensor)
            aspects = "; ".join(a for a in aspects
                                if a and "devices" not in a and not a.endswith("vs"))
            return (f"Detected mismatch between collectives (rank {m.group(1)} vs rank "
                    f"{m.group(2)}): {aspects}")
    last = err.traceback.strip().splitlines()[-1] if err.traceback.strip() else "?"
    last = re.sub(r"\[/\S+\] ", "", last)   # the gloo source path
    return f"rank {err.rank}: " + (last if len(last) <= 160 else last[:157] + "...")


_DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


def hang_zoo(names: Sequence[str] | None = None, world_size: int = 3, timeout: float = 5.0,
             *, torch_says: bool = True, quiet: bool = True) -> list[dict[str, Any]]:
    """Run each hang of :data:`HANGS` and :data:`SILENT` (``names`` None: all) on
    ``world_size`` ranks with the group timeout ``timeout`` (seconds) and the doctor on;
    return one row per hang: ``name``, ``what`` it is, how it ``ended`` ("RankError" or
    "returned"), the doctor's ``diagnosis``, ``seconds`` (measured, wall clock from start to
    the error or the return, launch included), and, with ``torch_says``, the gist of torch's
    own error when the same worker runs again under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
    (``"returned"`` if it caught nothing) and ``torch_seconds``, that run's wall time.
    Hangs that wait for the timeout cost about ``timeout`` seconds each: keep it a few
    seconds (measured on 2 shared CPU cores: about 17 s for the whole zoo at
    ``timeout=2``, 30 s at 5, both runs of each hang included). ``quiet`` sends what the
    ranks' C++ code prints (gloo's aborts, torch's monitored-barrier lines) to /dev/null:
    every rank's error still reaches the rows, through :class:`RankError`."""
    zoo = {**HANGS, **SILENT}
    if names is None:
        names = list(zoo)
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        raise TypeError(f"names must be a non-empty list of hang names or None, got {names!r}")
    unknown = [n for n in names if not isinstance(n, str) or n not in zoo]
    if unknown:
        raise ValueError(f"names must be among {list(zoo)}, got {unknown}")
    world_size = check_int("world_size", world_size, lo=2, hi=16)
    torch_says = check_bool("torch_says", torch_says)
    timeout = check_float("timeout", timeout, lo=0.5, hi=60)
    quiet = check_bool("quiet", quiet)
    if quiet:
        with _QuietStderr():   # the ranks are forked inside: they inherit the quiet stderr
            return hang_zoo(names, world_size, timeout, torch_says=torch_says, quiet=False)
    rows = []
    for name in names:
        worker, what = zoo[name]
        t0 = time.perf_counter()
        try:
            _, diagnosis = doctor(worker, world_size, timeout=timeout)
            ended = "returned"
        except RankError as err:
            diagnosis, ended = err.diagnosis or "?", "RankError"
        row = {"name": name, "what": what, "ended": ended, "diagnosis": diagnosis,
               "seconds": time.perf_counter() - t0}
        if torch_says:
            t0 = time.perf_counter()
            try:
                run(worker, world_size, timeout=timeout, env=_DETAIL)
                row["torch_says"] = "returned"
            except RankError as err:
                row["torch_says"] = _torch_says(err)
            row["torch_seconds"] = time.perf_counter() - t0
        rows.append(row)
    return rows
