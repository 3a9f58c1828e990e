"""The critical path of one step across ranks, and who made the others wait.

:func:`parlearn.at_scale.traces.breakdown` reads one rank. A step of data parallelism ends
only when every rank has ended it, and each collective completes only when its *last*
rank has arrived, so the question "what would make this step shorter?" crosses ranks.
:func:`critical_path` answers it from one trace per rank (written on one machine, or
with synchronised clocks: torch.profiler's timestamps share the host's clock):

- The ``k``-th collective span of every rank is the same call (an SPMD program issues the
  same collectives in the same order; the counts and names are checked). It starts when
  its last rank arrives (``a_k``, that rank is the *straggler* of call ``k``) and ends at
  ``e_k`` (the latest end over ranks).
- Walking forward from the step's start, the path is the straggler's **work** up to its
  arrival (from the end of what the path already holds), then the call's
  **communication** from there to ``e_k``; after the last call, the work of the rank that
  ends the step last. The segments tile the step window exactly: their lengths add up to
  the step.
- ``waited`` charges each rank with the time the others spent inside a collective waiting
  for it (from each other rank's own start of call ``k`` to ``a_k``; a waiting rank's
  overlapping waits on the same straggler count once, so it never exceeds the step).

Work on the path is what to make faster (a slower rank's compute, its data loading, a
straggler); communication on the path is what overlap did not hide. Shortening anything
off the path does not shorten the step. This is the idea of Holistic Trace Analysis's
critical-path analysis (Meta's HTA), reduced to what CPU traces hold: collectives are the
only edges between ranks here, and each rank's work between two calls counts as one node.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from parlearn.at_scale.traces import (
    COMPUTE_PREFIXES,
    _intersect,
    _length,
    _load,
    _union,
    spans,
    step_windows,
)
from parlearn.core.checks import check_int

__all__ = ["critical_path"]

CALL_PREFIXES = ("gloo:", "nccl:")


def _calls(trace, window: tuple[float, float],
          prefixes: Iterable[str] = CALL_PREFIXES) -> list[tuple[str, float, float]]:
    """``(name, start, end)`` in seconds of the collective spans of one rank's ``trace``
    that start inside ``window``, in order of start."""
    prefixes = tuple(prefixes)
    lo, hi = window
    out = []
    for e in _load(trace):
        if e.get("ph") != "X" or not str(e.get("name", "")).startswith(prefixes):
            continue
        start = float(e["ts"]) * 1e-6
        if lo <= start <= hi:
            out.append((e["name"], start, start + float(e.get("dur", 0.0)) * 1e-6))
    return sorted(out, key=lambda c: c[1])


def critical_path(traces: Sequence, *, step: int = 0,
                  labels: tuple[str, str] = ("forward", "optimizer"),
                  prefixes: Iterable[str] = CALL_PREFIXES) -> dict:
    """The critical path of training step ``step`` (0-based, cut from each ``labels[0]``
    span's start to the end of the ``labels[1]`` span after it,
    :func:`~parlearn.at_scale.traces.step_windows`; the mesh trainer labels its whole step
    ``("step", "step")``) across ``traces``, one per rank in rank order (module docstring).
    Returns:

    - ``"segments"``: ``[(kind, rank, name, start, end)]`` in order, ``kind`` "work" (on
      ``rank``) or "comm" (the collective ``name``; ``rank`` its straggler);
    - ``"step"``: the window's length (first start to last end over ranks), which the
      segments add up to; ``"comm"``: seconds of communication on the path;
    - ``"work"`` / ``"compute"``: ``{rank: seconds}`` of work on the path, and the part of
      it that rank spent in operators;
    - ``"waited"``: ``{rank: seconds}`` the other ranks spent waiting for it (summed over
      the waiting ranks);
    - ``"calls"``: ``[(name, straggler, spread)]`` per collective, ``spread`` the time
      from its first rank's arrival to its last's."""
    if isinstance(traces, str | dict) or not isinstance(traces, Sequence) or len(traces) < 1:
        raise TypeError("traces must be a sequence of traces, one per rank, got "
                        f"{type(traces).__name__}")
    step = check_int("step", step, lo=0)
    traces = [_load(t) for t in traces]   # each file read once, then its events reused
    if (not isinstance(labels, tuple) or len(labels) != 2
            or not all(isinstance(x, str) for x in labels)):
        raise TypeError(f"labels must be a (first, last) pair of span names, got {labels!r}")
    windows = []
    for r, trace in enumerate(traces):
        ws = step_windows(trace, *labels)
        if step >= len(ws):
            raise ValueError(f"step={step} but traces[{r}] holds {len(ws)} steps")
        windows.append(ws[step])
    per_rank = [_calls(t, w, prefixes) for t, w in zip(traces, windows, strict=True)]
    names = [[c[0] for c in cs] for cs in per_rank]
    for r in range(1, len(traces)):
        if names[r] != names[0]:
            raise ValueError(f"ranks 0 and {r} issued different collectives in step {step} "
                             f"({len(names[0])} vs {len(names[r])} calls; first difference "
                             f"at call {_first_difference(names[0], names[r])}): not one "
                             "SPMD program, or traces of different runs")
    start = min(w[0] for w in windows)
    end = max(w[1] for w in windows)
    segments: list[tuple[str, int, str, float, float]] = []
    waits: dict[tuple[int, int], list[tuple[float, float]]] = {}   # (waiter, straggler)
    report = []
    at = start
    for k, name in enumerate(names[0]):
        arrivals = [cs[k][1] for cs in per_rank]
        last = max(range(len(traces)), key=lambda r: arrivals[r])
        a_k, e_k = arrivals[last], max(cs[k][2] for cs in per_rank)
        for r in range(len(traces)):
            if arrivals[r] < a_k:
                waits.setdefault((r, last), []).append((arrivals[r], a_k))
        report.append((name, last, a_k - min(arrivals)))
        if a_k > at:
            segments.append(("work", last, "", at, a_k))
            at = a_k
        if e_k > at:
            segments.append(("comm", last, name, at, e_k))
            at = e_k
    if end > at:
        final = max(range(len(traces)), key=lambda r: windows[r][1])
        segments.append(("work", final, "", at, end))
    waited = {r: 0.0 for r in range(len(traces))}
    for (_, last), intervals in waits.items():
        waited[last] += _length(_union(intervals))
    work = {r: 0.0 for r in range(len(traces))}
    compute = {r: 0.0 for r in range(len(traces))}
    ops = [_union(spans(t, (), COMPUTE_PREFIXES)) for t in traces]
    for kind, r, _, a, b in segments:
        if kind == "work":
            work[r] += b - a
            compute[r] += _length(_intersect(ops[r], [(a, b)]))
    return {"segments": segments, "step": end - start,
            "comm": sum(b - a for kind, _, _, a, b in segments if kind == "comm"),
            "work": work, "compute": compute, "waited": waited, "calls": report}


def _first_difference(xs: list, ys: list) -> int:
    pairs = zip(xs, ys, strict=False)   # the shorter list's end is a difference too
    return next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(xs), len(ys)))
