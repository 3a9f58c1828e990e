"""Lesson 11's timelines from a DP wrapper's event log: :func:`step_spans` (all measured)."""

from __future__ import annotations

from collections.abc import Sequence

from parlearn.core.checks import check_float, check_str

__all__ = ["step_spans"]


def _check_events(events) -> None:
    if isinstance(events, str) or not isinstance(events, Sequence) or not all(
            isinstance(e, tuple | list) and len(e) == 3 and isinstance(e[0], str)
            and isinstance(e[1], str) for e in events):
        raise TypeError(f"events must be a sequence of (what, label, seconds), got {events!r}")
    for i, e in enumerate(events):
        check_float(f"events[{i}] seconds", e[2])


def step_spans(events: Sequence[tuple[str, str, float]], lane: str
               ) -> list[tuple[str, str, float, float]]:
    """Turn one step's events (from :func:`worker_step_time`) into
    :func:`parlearn.viz.timeline` bars: ``forward``, ``backward`` (to the last gradient)
    on lane ``lane + " compute"``, and each all-reduce on ``lane + " comm"``: a bucket
    from launch to done (bucketed), a gradient from the end of backward (or the previous
    gradient's reduction) to its reduction (naive). All measured times."""
    _check_events(events)
    check_str("lane", lane)
    at = {}
    for what, label, t in events:
        at.setdefault((what, label), t)
    grads = [t for what, _, t in events if what == "grad"]
    spans = []
    if ("forward", "") in at and ("backward", "") in at:
        spans.append((lane + " compute", "forward", at["forward", ""], at["backward", ""]))
    if ("backward", "") in at and grads:
        spans.append((lane + " compute", "backward", at["backward", ""], max(grads)))
    for what, label, t in events:
        if what == "launch" and ("done", label) in at:
            spans.append((lane + " comm", f"all-reduce bucket {label}", t, at["done", label]))
    prev = max(grads) if grads else None
    for what, label, t in events:
        if what == "reduced" and prev is not None:
            spans.append((lane + " comm", f"all-reduce {label}", prev, t))
            prev = t
    return spans
