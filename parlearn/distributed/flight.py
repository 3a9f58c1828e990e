"""A flight recorder for ranks, and a doctor that reads it: where each rank waits, and why.

A job that hangs says nothing: every rank sits in a collective that will never complete,
until the group's timeout fires with "Timed out waiting" on every rank alike. The cause is
almost always that the ranks disagree about what comes next: one rank issued a different
collective, skipped one, passed a different size or dtype, sent to a peer that never
receives, or died. Recording every call each rank makes, before it starts, and comparing
the ranks' records position by position names the culprit::

    dist.run(worker, 3, timeout=5, doctor=True)
    # RankError: ranks 0 and 2 wait in all_reduce #4 (128 B float64); rank 1 skipped it
    #            and waits at the end of the run (its call #4)

:func:`recording` writes one line per call to a per-rank file before the call starts, and
one when it returns or raises, each flushed at once (a rank killed by SIGKILL leaves a
readable file); :func:`read_records` reads a folder of them back as :class:`Call` records;
:func:`diagnose` (the doctor, in :mod:`parlearn.distributed.diagnosis`, which also defines
:class:`Call`; both re-exported here) is a pure function of those records (and of how each
rank ended) that says in one line where each group of agreeing ranks waits and where they
first disagree. ``run(..., doctor=True)`` does all three and puts the line first in the
:class:`~parlearn.distributed.launch.RankError`.

This is the idea of the flight recorder torch keeps for NCCL (``TORCH_NCCL_TRACE_BUFFER_SIZE``,
analysed by ``torch.distributed.flight_recorder``; see torch's "Flight Recorder for
debugging stuck jobs" tutorial), written small enough to read, and working on gloo too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from parlearn.core.checks import check_int, check_str
from parlearn.distributed import traffic
from parlearn.distributed.diagnosis import END_OF_RUN, Call, diagnose

__all__ = ["Call", "FlightRecorder", "recording", "read_records", "diagnose",
           "END_OF_RUN"]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(getattr(v, "tensor", v))]
    return []


_SIGNATURES: dict[str, inspect.Signature] = {}


def _arguments(kind: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    if kind not in _SIGNATURES:
        _SIGNATURES[kind] = inspect.signature(getattr(tdist.distributed_c10d, kind))
    try:
        return _SIGNATURES[kind].bind_partial(*args, **kwargs).arguments
    except TypeError:  # a call torch itself will refuse: record what we can
        return dict(kwargs)


def _describe(seq: int, kind: str, args: tuple, kwargs: dict, note: str = "") -> Call:
    """The :class:`Call` record of ``torch.distributed.<kind>(*args, **kwargs)`` as the
    ``seq``-th call of this rank (its payload found as :func:`~parlearn.distributed.ledger`
    finds it)."""
    value = traffic._payload_value(kind, args, kwargs)
    tensors = _tensors(value)
    dtype, shape = "", ()
    if tensors:
        dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors}
        dtype = dtypes.pop() if len(dtypes) == 1 else "mixed"
        shape = tuple(tensors[0].shape)
        if not isinstance(value, torch.Tensor):
            shape = (len(tensors), *shape)
    bound = _arguments(kind, args, kwargs)
    group = bound.get("group")
    peer = None
    if kind in ("send", "isend", "recv", "irecv"):
        side = "dst" if kind in ("send", "isend") else "src"
        peer = bound.get(side)
        if peer is None and bound.get(f"group_{side}") is not None:
            peer = tdist.get_global_rank(group, bound[f"group_{side}"])
    size = tdist.get_world_size(group) if tdist.is_initialized() else 1
    return Call(seq, kind, traffic._payload(kind, args, kwargs), dtype, shape,
                None if peer is None else int(peer), size, note)


class FlightRecorder:
    """Writes each call of this rank to its file (see :func:`recording`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.calls = 0
        self._note = ""
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (closed by recording())

    def note(self, text: str) -> None:
        """Attach ``text`` to the next call recorded (e.g. :data:`END_OF_RUN`)."""
        self._note = check_str("text", text)

    def _write(self, line: dict) -> None:
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def watch(self, kind: str, args: tuple, kwargs: dict) -> Callable:
        self.calls += 1
        call = _describe(self.calls, kind, args, kwargs, self._note)
        self._note = ""
        self._write({"seq": call.seq, "kind": call.kind, "bytes": call.nbytes,
                     "dtype": call.dtype, "shape": list(call.shape), "peer": call.peer,
                     "group": call.group, "note": call.note})

        def end(seconds: float, error: BaseException | None) -> None:
            text = "ok" if error is None else _last_line(f"{type(error).__name__}: {error}")
            self._write({"seq": call.seq, "end": text, "seconds": seconds})
        return end


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "?"


def _file_for(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.jsonl"


def recording(folder: str | os.PathLike, rank: int
              ) -> contextlib.AbstractContextManager[FlightRecorder]:
    """Inside the block, every call this process makes through ``torch.distributed``'s Python
    API (the collectives the ledger sees, send/recv, barrier, monitored_barrier) is written
    to ``folder/rank<rank>.jsonl``: a line before it starts, a line when it ends.

    Calls count from 1 on each rank, every call of every group alike: ranks that run the
    same program number the same collective the same, and :func:`diagnose` compares them
    position by position. A program that runs collectives on sub-groups numbers them too,
    so ranks in different groups legitimately drift apart: compare the records of one group
    (filter by :attr:`Call.group`) when groups differ. Calls torch makes from C++ (DDP's
    buckets) and functional collectives (DTensor) are not seen, as for the ledger.
    ``folder`` must exist; ``rank`` names the file."""
    folder = Path(folder) if isinstance(folder, (str, os.PathLike)) else folder
    if not isinstance(folder, Path):
        raise TypeError(f"folder must be a path, got {folder!r}")
    if not folder.is_dir():
        raise ValueError(f"folder must be an existing folder, got {str(folder)!r}")
    rank = check_int("rank", rank, lo=0)
    return _recording(folder, rank)


@contextlib.contextmanager
def _recording(folder: Path, rank: int) -> Iterator[FlightRecorder]:
    rec = FlightRecorder(_file_for(folder, rank))
    try:
        with traffic._watching(rec.watch):
            yield rec
    finally:
        rec._file.close()


def read_records(folder: str | os.PathLike) -> dict[int, list[Call]]:
    """``{rank: [Call, ...]}`` from the files :func:`recording` wrote in ``folder``, in the
    order of each rank's calls. A last line cut short (a rank killed while writing) is
    skipped."""
    if not isinstance(folder, (str, os.PathLike)) or not Path(folder).is_dir():
        raise ValueError(f"folder must be an existing folder, got {folder!r}")
    out: dict[int, list[Call]] = {}
    for path in sorted(Path(folder).glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        calls: dict[int, Call] = {}
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "end" in row and row["seq"] in calls:
                calls[row["seq"]] = dataclasses.replace(calls[row["seq"]], outcome=row["end"])
            elif "kind" in row:
                calls[row["seq"]] = Call(row["seq"], row["kind"], row["bytes"], row["dtype"],
                                         tuple(row["shape"]), row["peer"], row["group"],
                                         row["note"])
        out[rank] = [calls[s] for s in sorted(calls)]
    return out
