"""The pipeline simulator (modeled): the timeline of each rank's orders under per-stage costs.

:func:`simulate` runs the orders of :func:`parlearn.multi_device.pipeline.schedules.schedule`
(or any others) on a model machine and returns a :class:`Simulation`: the timeline, the
makespan, the bubble and the activations each stage holds at once. Beside it, a
synchronous bidirectional pipeline (:func:`simulate_bidirectional`, modeled only): two
pipelines running in opposite directions over the same devices (Chimera's idea, which
AMDP's multi-directional pipelines build on). :func:`measured_beside_simulated`
puts a measured timeline and a simulated one on one time axis, rank by rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from parlearn.core.checks import check_float, check_int
from parlearn.multi_device.pipeline.schedules import Op, Schedule, schedule

__all__ = ["Simulation", "dependency", "simulate", "simulate_bidirectional",
           "measured_beside_simulated"]


# ---------------------------------------------------------------------------------------
# The simulator (modeled): the timeline of a list of orders under per-stage costs.

@dataclass
class Simulation:
    """A modeled timeline. ``events`` are ``(lane, label, start, end)`` in cost units
    (for :func:`parlearn.viz.timeline`); ``makespan`` is the last end; ``bubble`` the idle
    fraction ``1 - busy / (P * makespan)`` of a synchronous step; ``peak_in_flight[s]`` the
    most micro-batches whose activations rank ``s`` holds at once, in units of one whole
    stage's activations (a chunk of a rank with ``v`` chunks counts ``1/v``; held from the
    start of F until the end of the op that frees them: B, or W when backward is split);
    ``idle_in_span[s]`` rank ``s``'s idle time between its first start and its last end (the
    zero-bubble paper's "bubble size", which assumes no synchronisation between steps);
    ``messages`` the point-to-point messages of one step (activations and gradients that
    cross ranks)."""

    events: list[tuple[str, str, float, float]]
    makespan: float
    bubble: float
    busy: list[float]
    peak_in_flight: list[float]
    idle_in_span: list[float] = field(default_factory=list)
    messages: int = 0

    def __post_init__(self) -> None:
        # A record, but a public one: what it holds is checked like any argument.
        for name in ("events", "busy", "peak_in_flight", "idle_in_span"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise TypeError(f"{name} must be a list, got {value!r}")
        for name in ("busy", "peak_in_flight", "idle_in_span"):
            for v in getattr(self, name):
                check_float(name, v)
        check_float("makespan", self.makespan, lo=0)
        check_float("bubble", self.bubble)
        check_int("messages", self.messages, lo=0)


def _per_stage(name: str, value, stages: int) -> list[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * stages
    elif isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a number or one number per stage, got {value!r}")
    value = [check_float(name, v, lo=0) for v in value]
    if len(value) != stages:
        raise ValueError(f"{name} must have one cost per stage ({stages}), got {len(value)}")
    return value


def _group(ops: Sequence[Op], i: int) -> int:
    # An overlapped F&B group: ops i (F) and i+1 (B), and i+2 when it is that B's W.
    b = ops[i + 1]
    return 3 if i + 2 < len(ops) and ops[i + 2] == Op("W", b.mb, b.chunk) else 2


def dependency(orders: Sequence[Sequence[Op]], rank: int, op: Op) -> tuple[str, int, int] | None:
    """What ``op`` of ``rank`` waits for, as ``(kind, virtual stage, micro-batch)``: ``F`` on
    virtual stage ``g`` needs ``F`` of ``g-1``; ``B`` needs ``B`` of ``g+1`` (on the last
    stage: its own ``F``, the loss); ``W`` its own ``B``. None for the first forward."""
    if isinstance(orders, (str, bytes)) or not isinstance(orders, Sequence):
        raise TypeError(f"orders must be a list of op lists (one per rank), got {orders!r}")
    rank = check_int("rank", rank, lo=0, hi=len(orders) - 1)
    if not isinstance(op, Op):
        raise TypeError(f"op must be an Op, got {op!r}")
    place = orders if isinstance(orders, Schedule) else None
    last = (place.virtual_stages if place else len(orders)) - 1
    g = place.stage_of(rank, op.chunk) if place else rank
    if op.kind == "F":
        return ("F", g - 1, op.mb) if g > 0 else None
    if op.kind == "B":
        return ("B", g + 1, op.mb) if g < last else ("F", g, op.mb)
    if op.kind == "W":
        return ("B", g, op.mb)
    raise ValueError(f"op has unknown kind {op.kind!r} (orders[{rank}]); want F, B or W")


def simulate(orders: Sequence[Sequence[Op]], cost_f: float | Sequence[float] = 1.0,
             cost_b: float | Sequence[float] = 2.0, cost_w: float | Sequence[float] = 0.0,
             comm: float = 0.0, *, cost_fb: float | None = None,
             lanes: Sequence[str] | None = None) -> Simulation:
    """Run ``orders`` (one list of :class:`Op` per rank, e.g. a :class:`Schedule`) on a
    model machine: every op starts when its rank is free and its input has arrived
    (:func:`dependency`); a message between ranks takes ``comm``. Costs are those of one
    rank's whole share of the model (a number means equal ranks); a rank holding ``v``
    chunks spends ``1/v`` of them per op. When the orders contain ``W`` ops, ``cost_b`` is
    the input-gradient part only and ``cost_w`` the weight-gradient part; otherwise a ``B``
    costs ``cost_b`` and ``cost_w`` must be 0 (include it in ``cost_b``). ``cost_fb`` is the
    time of an overlapped F&B group (the schedule's ``overlap``: a forward and a whole
    backward, its ``W`` included when it follows at once, as DeepSeek count it; default:
    not overlapped, one op after the other). Raises ValueError if the orders deadlock."""
    if isinstance(orders, (str, bytes)) or not isinstance(orders, Sequence):
        raise TypeError(f"orders must be a list of op lists (one per rank), got {orders!r}")
    stages = len(orders)
    if stages < 1:
        raise ValueError("orders must list at least one stage")
    for r, ops in enumerate(orders):
        if isinstance(ops, (str, bytes)) or not isinstance(ops, Sequence) or not all(
                isinstance(op, Op) and op.kind in ("F", "B", "W") for op in ops):
            raise TypeError(f"orders[{r}] must be a list of Op (kind F, B or W), got {ops!r}")
    chunks = orders.chunks if isinstance(orders, Schedule) else 1
    cf, cb, cw = ([c / chunks for c in _per_stage(n, v, stages)] for n, v in
                  (("cost_f", cost_f), ("cost_b", cost_b), ("cost_w", cost_w)))
    comm = check_float("comm", comm, lo=0)
    fused = None if cost_fb is None else check_float("cost_fb", cost_fb, lo=0) / chunks
    pairs = orders.overlap if isinstance(orders, Schedule) and fused is not None else ()
    has_w = any(op.kind == "W" for ops in orders for op in ops)
    if not has_w and any(cw):
        raise ValueError("cost_w > 0 but the orders have no W ops: add it to cost_b")
    lanes = [f"stage {s}" for s in range(stages)] if lanes is None else list(lanes)
    cost = {"F": cf, "B": cb, "W": cw}
    done: dict[tuple[str, int, int], float] = {}
    where: dict[tuple[str, int, int], int] = {}
    free = [0.0] * stages
    pos = [0] * stages
    events = []
    messages = 0
    release = "W" if has_w else "B"
    held: list[list[tuple[float, int]]] = [[] for _ in range(stages)]   # (time, +-1 chunk)
    while any(pos[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while pos[s] < len(orders[s]):
                n = _group(orders[s], pos[s]) if (s, pos[s]) in pairs else 1
                ops = orders[s][pos[s]:pos[s] + n]
                deps = [dependency(orders, s, op) for op in ops if op.kind != "W" or n == 1]
                if any(d is not None and d not in done for d in deps):
                    break
                arrive = [0.0 if d is None else done[d] + (comm if where[d] != s else 0.0)
                          for d in deps]
                messages += sum(d is not None and where[d] != s for d in deps)
                start = max(free[s], *arrive)
                end = start + (fused if n > 1 else cost[ops[0].kind][s])
                for op in ops:
                    g = orders.stage_of(s, op.chunk) if isinstance(orders, Schedule) else s
                    done[(op.kind, g, op.mb)], where[(op.kind, g, op.mb)] = end, s
                    if op.kind == "F":
                        held[s].append((start, 1))
                    if op.kind == release:
                        held[s].append((end, -1))
                free[s] = end
                events.append((lanes[s], "&".join(f"{o.kind} {o.mb}" + (f"c{o.chunk}" if
                               o.chunk else "") for o in ops), start, end))
                pos[s] += n
                progressed = True
        if not progressed:
            stuck = {s: str(orders[s][pos[s]]) for s in range(stages) if pos[s] < len(orders[s])}
            raise ValueError(f"the orders deadlock: stages wait at {stuck}")
    peak = []
    for s in range(stages):
        # Frees before takes at the same instant: a slot reused at once is not two slots.
        level = top = 0
        for _, delta in sorted(held[s], key=lambda e: (e[0], e[1])):
            level += delta
            top = max(top, level)
        peak.append(top / chunks)
    makespan = max(free)
    busy = [sum(e[3] - e[2] for e in events if e[0] == lanes[s]) for s in range(stages)]
    bubble = 1.0 - sum(busy) / (stages * makespan) if makespan > 0 else 0.0
    span = [max((e[3] for e in events if e[0] == lanes[s]), default=0.0)
            - min((e[2] for e in events if e[0] == lanes[s]), default=0.0)
            for s in range(stages)]
    idle = [sp - b for sp, b in zip(span, busy, strict=True)]
    return Simulation(events, makespan, bubble, busy, peak, idle, messages)


# ---------------------------------------------------------------------------------------
# Bidirectional pipelines (Chimera-style): two pipelines in opposite directions, one set of devices.

def simulate_bidirectional(stages: int, micro_batches: int, cost_f: float = 1.0,
                           cost_b: float = 2.0) -> Simulation:
    """Modeled, synchronous bidirectional pipelines in the spirit of Chimera (Li & Hoefler
    2021). Not AMDP's algorithm (Chen, Wu & Yu, ICML 2026, arXiv:2605.29664): AMDP is
    asynchronous, caps each pipeline's first stage at two minibatches before their
    backward, adapts the number of concurrent pipelines to the depth and accumulates
    gradients so that the weight mismatch stays within one step; none of that is modeled
    here. Two replicas of the model run as two pipelines over the same ``P`` devices, one
    mapping stage ``s`` to device ``s`` ("down"), the other to device ``P-1-s`` ("up");
    each takes ``micro_batches / 2`` micro-batches in 1F1B order. Each device runs, among
    the next ops of its two stages, the one that can start first (ties: backward first):
    list scheduling with no global step. Equal stage costs; the gradient all-reduce between
    the replicas and their doubled weight memory are NOT modeled. Compare its ``bubble``
    with ``simulate(schedule("1f1b", P, M))``."""
    stages = check_int("stages", stages, lo=2)
    micro_batches = check_int("micro_batches", micro_batches, lo=2)
    if micro_batches % 2:
        raise ValueError(f"micro_batches must be even (half per direction), got {micro_batches}")
    cf, cb = check_float("cost_f", cost_f, lo=0), check_float("cost_b", cost_b, lo=0)
    half = micro_batches // 2
    one = schedule("1f1b", stages, half)
    dirs = ("down", "up")
    device = {("down", s): s for s in range(stages)} | {("up", s): stages - 1 - s
                                                      for s in range(stages)}
    pos = {key: 0 for key in device}
    done: dict[tuple[str, str, int, int], float] = {}
    free = [0.0] * stages
    events = []
    while any(pos[key] < len(one[key[1]]) for key in device):
        best = None
        for (d, s), dev in device.items():
            if pos[(d, s)] == len(one[s]):
                continue
            op = one[s][pos[(d, s)]]
            if op.kind == "F":
                dep = (d, "F", s - 1, op.mb) if s > 0 else None
            else:
                dep = (d, "B", s + 1, op.mb) if s < stages - 1 else (d, "F", s, op.mb)
            if dep is not None and dep not in done:
                continue
            start = max(free[dev], 0.0 if dep is None else done[dep])
            rank = (start, op.kind != "B", dirs.index(d))
            if best is None or rank < best[0]:
                best = (rank, d, s, dev, op)
        if best is None:
            raise AssertionError("bidirectional schedule deadlocked")  # cannot happen
        (start, _, _), d, s, dev, op = best
        end = start + (cf if op.kind == "F" else cb)
        done[(d, op.kind, s, op.mb)] = end
        free[dev] = end
        pos[(d, s)] += 1
        events.append((f"device {dev}", f"{op.kind}{d} {op.mb}", start, end))
    makespan = max(free)
    busy = [sum(e[3] - e[2] for e in events if e[0] == f"device {v}") for v in range(stages)]
    peak = []
    for v in range(stages):
        held = sorted([(e[2], 1) for e in events if e[0] == f"device {v}" and e[1][0] == "F"]
                      + [(e[3], -1) for e in events if e[0] == f"device {v}" and e[1][0] == "B"])
        level, top = 0, 0
        for _, delta in held:
            level += delta
            top = max(top, level)
        peak.append(top)
    return Simulation(events, makespan, 1.0 - sum(busy) / (stages * makespan), busy, peak)


def measured_beside_simulated(measured: Sequence[tuple], simulated: Sequence[tuple]) -> list:
    """One event list for one time axis (:func:`parlearn.viz.timeline`): each rank's measured
    ops on lane ``"rank s measured"``, right above its simulated ops on ``"rank s simulated"``.

    ``measured`` are a run's events (``(lane, label, start, end)``, seconds); they are shifted
    so that the step starts at 0, as a simulation does. ``simulated`` are a
    :class:`Simulation`'s events in the same unit (simulate with measured op costs); its
    ``"stage s"`` lanes are rank ``s``'s.
    """
    def check(name, events):
        if isinstance(events, (str, bytes)) or not isinstance(events, Sequence) or not events:
            raise TypeError(f"{name} must be a non-empty sequence of (lane, label, start, end)")
        for i, e in enumerate(events):
            if not (isinstance(e, tuple | list) and len(e) == 4 and isinstance(e[0], str)
                    and all(isinstance(t, int | float) and not isinstance(t, bool)
                            and math.isfinite(t) for t in e[2:]) and e[3] >= e[2]):
                raise ValueError(f"{name}[{i}] must be (lane, label, start, end) with finite "
                                 f"start <= end, got {e!r}")
        return [(e[0].replace("stage", "rank"), *e[1:]) for e in events]

    measured, simulated = check("measured", measured), check("simulated", simulated)
    t0 = min(e[2] for e in measured)
    lanes = list(dict.fromkeys([e[0] for e in measured] + [e[0] for e in simulated]))
    out = []
    for lane in lanes:
        out += [(f"{lane} measured", lab, a - t0, b - t0) for ln, lab, a, b in measured
                if ln == lane]
        out += [(f"{lane} simulated", lab, a, b) for ln, lab, a, b in simulated if ln == lane]
    return out
