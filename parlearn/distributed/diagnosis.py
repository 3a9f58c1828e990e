"""The doctor: where each rank of a hung run waits, and why (:func:`diagnose`).

The flight recorder (:mod:`parlearn.distributed.flight`) writes every call each rank makes
as a :class:`Call` record; :func:`diagnose` is a pure function of those records (and of how
each rank ended) that compares the ranks' records position by position and says in one line
where each group of agreeing ranks waits and where they first disagree: a collective
issued by some ranks and skipped by others, different sizes, dtypes, shapes or groups, a
send whose peer never posted the receive, a rank that died. ``run(..., doctor=True)``
records, reads the records back and puts the line first in the
:class:`~parlearn.distributed.launch.RankError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from parlearn.core.checks import check_int, check_str

__all__ = ["Call", "diagnose", "END_OF_RUN"]

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
