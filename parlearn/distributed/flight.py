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
:func:`diagnose` is a pure function of those records (and of how each rank ended) that
says in one line where each group of agreeing ranks waits and where they first disagree.
``run(..., doctor=True)`` does all three and puts the line first in the
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from parlearn.core.checks import check_int, check_str
from parlearn.distributed import traffic

__all__ = ["Call", "FlightRecorder", "recording", "read_records", "diagnose",
           "END_OF_RUN"]

# The note on the barrier ``run`` issues after a worker returns.
END_OF_RUN = "end of run"
# Point-to-point calls: they pair a rank with one peer instead of involving the group.
P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
# Last lines of errors torch.distributed raises in a rank because a PEER failed or hung.
PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting",
               "timed out", "DistNetworkError", "Broken pipe")


@dataclass(frozen=True)
class Call:
    """One call a rank issued: ``seq`` counts this rank's calls from 1; ``nbytes``, ``dtype``
    and ``shape`` describe its payload as the ledger counts it (for a list of tensors, the
    list's length then the first tensor's shape); ``peer`` is the other rank of a
    send/recv (None: any source, or not point-to-point); ``group`` the size of the group it
    ran on; ``note`` says what issued it (:data:`END_OF_RUN` for ``run``'s last barrier);
    ``outcome`` is ``"ok"`` once it returned, the last line of its error when it raised,
    and ``""`` while it has not ended (the rank still waits there, or died inside it)."""

    seq: int
    kind: str
    nbytes: int = 0
    dtype: str = ""
    shape: tuple[int, ...] = ()
    peer: int | None = None
    group: int = 1
    note: str = ""
    outcome: str = ""


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


# ---- the diagnosis --------------------------------------------------------------------------

def _ranks(ranks: Sequence[int]) -> str:
    """``rank 2``, ``ranks 0 and 1``, ``ranks 0-3 and 6``."""
    rs = sorted(ranks)
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts += [f"{rs[i]}-{rs[j]}"] if j - i >= 2 else [str(r) for r in rs[i:j + 1]]
        i = j + 1
    words = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"rank{'s' if len(rs) > 1 else ''} {words}"


def _verb(ranks: Sequence[int], one: str, many: str) -> str:
    return f"{_ranks(ranks)} {one if len(ranks) == 1 else many}"


def _payload_text(c: Call) -> str:
    if c.kind in ("barrier", "monitored_barrier"):
        return ""
    return f" ({c.nbytes:,} B{' ' + c.dtype if c.dtype else ''})"


def _call_text(c: Call) -> str:
    if c.note == END_OF_RUN:
        return f"the end of the run (its call #{c.seq})"
    peer = ""
    if c.peer is not None:
        peer = f" to rank {c.peer}" if c.kind in ("send", "isend") else f" from rank {c.peer}"
    return f"{c.kind} #{c.seq}{peer}{_payload_text(c)}"


def _where(c: Call) -> str:
    return ("waits at " if c.note == END_OF_RUN else "waits in ") + _call_text(c)


def _group_by(items: Mapping[int, Any]) -> list[tuple[Any, list[int]]]:
    """(value, ranks) groups, the smallest group first (ties: the lowest rank first)."""
    groups: dict[Any, list[int]] = {}
    for rank in sorted(items):
        groups.setdefault(items[rank], []).append(rank)
    return sorted(groups.items(), key=lambda g: (len(g[1]), g[1][0]))


def _died(how: str) -> bool:
    return how.startswith(("killed", "exited"))


def _ended(rank: int, calls: Sequence[Call], how: str) -> str:
    """``rank 2 died (killed by signal 9) after its call #5``."""
    last = calls[-1] if calls else None
    when = ("before its first call" if last is None
            else f"inside its call #{last.seq} ({last.kind})" if not last.outcome
            else f"after its call #{last.seq}")
    return f"rank {rank} died ({how}) {when}" if _died(how) else f"rank {rank} {how}, {when}"


def _signature(c: Call) -> tuple:
    return (c.kind, c.nbytes, c.dtype, c.shape, c.group, c.note == END_OF_RUN)


def _mismatch(at: dict[int, Call]) -> str:
    """One position where the ranks' calls differ (all present)."""
    ends = [r for r, c in at.items() if c.note == END_OF_RUN]
    working = {r: c for r, c in at.items() if c.note != END_OF_RUN}
    if ends and working:
        (kind, ranks), = _group_by({r: c.kind for r, c in working.items()})[-1:]
        first = working[ranks[0]]
        return (f"{_verb(ranks, 'waits', 'wait')} in {_call_text(first)}; "
                f"{_verb(ends, 'skipped it and waits', 'skipped them and wait')} at "
                + " / ".join(sorted({_call_text(at[r]) for r in ends})))
    kinds = _group_by({r: c.kind for r, c in at.items()})
    if len(kinds) > 1:
        parts = [f"{_verb(rs, 'waits', 'wait')} in {_call_text(at[rs[0]])}"
                 for _, rs in kinds]
        seqs = {c.seq for c in at.values()}
        pos = f"#{seqs.pop()}" if len(seqs) == 1 else "the same position"
        return " while ".join(parts) + f": the ranks issued different collectives at {pos}"
    one = next(iter(at.values()))
    fields = [("nbytes", lambda c: f"{c.nbytes:,} B", "sizes"),
              ("dtype", lambda c: c.dtype or "no dtype", "dtypes"),
              ("shape", lambda c: f"shape {c.shape}", "shapes"),
              ("group", lambda c: f"a group of {c.group}", "groups")]
    differ = [(f, text, word) for f, text, word in fields
              if len({getattr(c, f) for c in at.values()}) > 1]
    if [f for f, _, _ in differ] == ["nbytes", "shape"]:
        differ = differ[:1]   # the size says it; the shape adds nothing
    groups = _group_by({r: " ".join(text(c) for _, text, _ in differ) for r, c in at.items()})
    sides = [f"{value} on {_ranks(rs)}" for value, rs in groups]
    said = ", ".join(sides[:-1]) + " but " + sides[-1]
    words = " and ".join(word for _, _, word in differ)
    seqs = sorted({c.seq for c in at.values()})
    text = f"{one.kind} #{'/'.join(map(str, seqs))} with {said}: the ranks passed different {words}"
    if all(c.outcome == "ok" for c in at.values()):
        text += ("; it returned on every rank, so nothing hung and the result is silently "
                 "wrong")
    return text


def _p2p(rank: int, c: Call, calls: Mapping[int, Sequence[Call]],
         exits: Mapping[int, str]) -> str | None:
    """Why ``rank`` waits in the send/recv ``c``: its peer never posted the matching call."""
    sending = c.kind in ("send", "isend")
    mine = ("send", "isend") if sending else ("recv", "irecv")
    theirs = ("recv", "irecv") if sending else ("send", "isend")
    peer = c.peer
    nth = sum(1 for x in calls[rank] if x.kind in mine and x.peer == peer and x.seq <= c.seq)
    posted = sum(1 for x in calls.get(peer, ()) if x.kind in theirs
                 and (x.peer == rank or (not sending and x.peer is None)))
    if posted >= nth:
        return None
    verb = "recv from" if sending else "send to"
    if posted == 0:
        told = f"rank {peer} never posted a {verb} rank {rank}"
    else:
        told = (f"rank {peer} posted {posted} {verb} rank {rank}, this is number {nth}")
    waiting = _waiting(calls.get(peer, ()))
    how = exits.get(peer, "")
    if _died(how):
        where = _ended(peer, calls.get(peer, ()), how).removeprefix(f"rank {peer} ")
    elif waiting is not None:
        where = _where(waiting)
    else:
        where = how or "it finished its calls"
    return f"rank {rank} waits in {_call_text(c)}; {told}: it {where}"


def _waiting(calls: Sequence[Call]) -> Call | None:
    return next((c for c in calls if c.outcome != "ok"), None)


def _is_peer_error(outcome: str) -> bool:
    return any(p in outcome for p in PEER_ERRORS)


def diagnose(records_by_rank: Mapping[int, Sequence[Call]],
             exits: Mapping[int, str] | None = None) -> str:
    """One line saying where each rank waits and why the ranks disagree.

    ``records_by_rank`` maps each rank to its :class:`Call` records (from
    :func:`read_records`); ``exits`` (optional) maps a rank to how it ended, as a phrase:
    ``"killed by signal 9"``, ``"exited with code 1"`` (both mean it died), ``"raised
    ValueError: ..."``, ``"returned"``. In order, the diagnosis looks for:

    1. a rank waiting in a send (recv) whose peer never posted the matching recv (send);
    2. the first position where the ranks' collectives differ (the point-to-point calls left
       out): a different collective, one skipped (the rank waits at the end of the run),
       different sizes, dtypes, shapes or group sizes, or a rank with no call there (it
       died, raised or stopped after its previous call). A difference found in calls that
       all returned is a silent mismatch: gloo moved the bytes it was given;
    3. a rank that died or failed on its own while the records agree;
    4. else where each group of ranks waits (the records agree: look outside
       ``torch.distributed``, e.g. a rank stuck in its own code).
    """
    records, exits = _checked(records_by_rank, exits)
    calls = {r: sorted(cs, key=lambda c: c.seq) for r, cs in records.items()}
    waiting = {r: _waiting(cs) for r, cs in calls.items()}
    dead = [r for r in calls if _died(exits.get(r, ""))]
    deaths = "".join(f"; {_ended(r, calls[r], exits[r])}" for r in dead)

    for r, c in waiting.items():
        if c is not None and c.kind in ("send", "recv") and c.peer is not None:
            text = _p2p(r, c, calls, exits)
            if text:
                return text

    coll = {r: [c for c in cs if c.kind not in P2P] for r, cs in calls.items()}
    for i in range(max((len(cs) for cs in coll.values()), default=0)):
        at = {r: cs[i] for r, cs in coll.items() if i < len(cs)}
        missing = [r for r in coll if i >= len(coll[r])]
        if missing:
            stuck = _group_by({r: _call_text(c) for r, c in at.items()})
            told = "; ".join(f"{_verb(rs, 'waits', 'wait')} "
                             f"{'at' if at[rs[0]].note == END_OF_RUN else 'in'} {text}"
                             for text, rs in stuck)
            gone = "; ".join(
                _ended(r, calls[r], exits.get(r, "issued no further call"))
                if r in exits or not waiting[r] else
                f"rank {r} {_where(waiting[r])}" for r in missing)
            return f"{gone}; {told}"
        if len({_signature(c) for c in at.values()}) > 1:
            return _mismatch(at) + deaths

    own = {r: c for r, c in waiting.items()
           if c is not None and c.outcome and not _is_peer_error(c.outcome)}
    if dead or own:
        first = ([_ended(r, calls[r], exits[r]) for r in dead]
                 + [f"rank {r}'s {_call_text(c)} failed: {c.outcome}" for r, c in own.items()
                    if r not in dead])
        rest = {r: c for r, c in waiting.items() if c is not None and r not in dead
                and r not in own}
        tail = "".join(f"; {_verb(rs, 'waits', 'wait')} {'at' if 'end of' in t else 'in'} {t}"
                       for t, rs in _group_by({r: _call_text(c) for r, c in rest.items()}))
        return "; ".join(first) + tail
    stuck = {r: c for r, c in waiting.items() if c is not None}
    if not stuck:
        n = {len(cs) for cs in calls.values()}
        count = f"all {n.pop()}" if len(n) == 1 else "all their"
        return f"the {len(calls)} ranks agree on {count} calls, and every call returned"
    told = "; ".join(f"{_verb(rs, 'waits', 'wait')} {'at' if 'end of' in t else 'in'} {t}"
                     for t, rs in _group_by({r: _call_text(c) for r, c in stuck.items()}))
    return (f"{told}: the records agree, so look outside torch.distributed (a rank slow or "
            "stuck in its own code)")


def _checked(records: Any, exits: Any) -> tuple[dict[int, list[Call]], dict[int, str]]:
    if not isinstance(records, Mapping) or not records:
        raise TypeError(f"records_by_rank must be a non-empty dict rank -> calls, got "
                        f"{type(records).__name__}")
    out = {}
    for rank, calls in records.items():
        check_int("records_by_rank's rank", rank, lo=0)
        if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence) or not all(
                isinstance(c, Call) for c in calls):
            raise TypeError(f"records_by_rank[{rank}] must be a list of Call records")
        out[rank] = list(calls)
    exits = {} if exits is None else exits
    if not isinstance(exits, Mapping):
        raise TypeError(f"exits must be a dict rank -> str or None, got {exits!r}")
    for rank, how in exits.items():
        if rank not in out:
            raise ValueError(f"exits names rank {rank!r}, which has no records")
        check_str(f"exits[{rank}]", how)
    return out, dict(exits)
