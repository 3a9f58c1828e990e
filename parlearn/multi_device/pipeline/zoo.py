"""The schedule zoo: interleaved 1F1B, ZB-H2 and ZB-V as :class:`Schedule` objects.

Each builder returns the one schedule object of
:mod:`parlearn.multi_device.pipeline.schedules`: the op list of every rank, and where its
model chunks (virtual stages) sit. The same object is validated (:func:`validate`), timed
(:func:`parlearn.multi_device.pipeline.simulator.simulate`), drawn and executed on real
ranks (:func:`parlearn.multi_device.pipeline.virtual.run_schedule`).

- ``"interleaved"``: interleaved 1F1B with ``v`` chunks per rank in the loop placement
  (Narayanan et al. 2021): the micro-batches go round the ranks ``v`` times, in groups of
  ``P``. The warm-up, ``2(P-r-1) + (v-1)P`` forwards on rank ``r``, then one forward one
  backward, then the drain. Bubble ``(P-1)/v`` slots of ``F+B`` instead of ``P-1``: a
  fraction ``(P-1)/(vM)`` of the ideal step, at ``v`` times the p2p messages. ``M`` must be
  a multiple of ``P`` (the groups).
- ``"zb-h2"``: zero bubble with split backward (Qi et al. 2024), one stage per rank: more
  warm-up forwards (up to ``2P-1`` in flight on every stage) fill the fill-in bubble and
  the ``W``\\ s fill the drain: bubble ``(P-1)(T_F + T_B - 2 T_W)``, 0 at equal costs, at
  about twice 1F1B's activation memory.
- ``"zb-v"``: zero bubble in the V placement (Qi et al. 2024, section 6): two chunks per
  rank, rank ``r`` holding virtual stages ``r`` and ``2P-1-r``, so the forward goes down the
  ranks and back up and the loss is on rank 0. Built by the paper's construction (see
  :func:`_zb_v`): a V-shaped warm-up, then forward, ``B``, ``W`` on each leg in turn, then
  the mirror-image drain. At ``T_F = T_B = T_W = T`` and ``M >= 2P-1`` no rank idles between
  its first and last op (the paper's bubble: zero) and every rank holds at most ``P`` whole
  stages' activations (1F1B's first stage); the synchronous step still pays its ramp,
  ``3MT + (P-1)T/2`` long. With ``M < 2P-1`` rank 0, the most idle, idles ``(2P-1-M) T``
  (all tested).

DeepSeek's DualPipe-V is reconstructed from the phases DeepSeek describe
(:func:`dualpipe_v`, labelled RECONSTRUCTION, not in :data:`ZOO`: it needs ``M >= 2P``):
its order equals torch's ``ScheduleDualPipeV``
(:func:`parlearn.multi_device.pipeline.torch_pipeline.dualpipe_v_order`), and simulated at
equal costs, with a forward overlapped with a whole backward (``W`` included) as DeepSeek
count ``F&B``, its step idles exactly DeepSeek's ``(PP/2-1)(F&B + B - 3W)``
(:func:`dualpipe_v_bubble`, ``PP = 2P`` stages). Our first reconstruction (ZB-V's order with
adjacent F, B pairs fused) made the step longer and was dropped.

ZB-H2 is ours: list scheduling at unit cost with the priorities the paper describes (see
:func:`_greedy`), not copied from the paper's figure or code. ZB-H1 (in
:mod:`parlearn.multi_device.pipeline.schedules`) and ZB-V follow the paper's constructions,
written here from its description. :func:`paper_bubble` gives each paper's bubble formula.
"""

from __future__ import annotations

from parlearn.core.checks import check_choice, check_float, check_int
from parlearn.multi_device.pipeline.schedules import Op, Schedule, schedule

__all__ = ["ZOO", "zoo_schedule", "validate", "paper_bubble", "in_flight_formula",
           "dualpipe_v", "dualpipe_v_bubble"]

ZOO = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v")


# ---------------------------------------------------------------------------------------
# Interleaved 1F1B: the Megatron-LM order, built directly.

def _interleaved(stages: int, m: int, v: int, group: int | None = None) -> Schedule:
    """Interleaved 1F1B with rounds of ``group`` micro-batches per chunk (Megatron's is
    ``group = P``, *depth-first*; ``group = M`` runs every micro-batch through a chunk before
    the next chunk, *breadth-first*, Lamy-Poirier 2023). Warm-up forwards of rank r:
    ``2 (P - r - 1) + (v - 1) group``, as Megatron-core counts them."""
    g = stages if group is None else group
    total = m * v

    def nth(k: int, backward: bool) -> tuple[int, int]:
        # The k-th forward (backward) of a rank: rounds of g micro-batches per chunk.
        chunk = (k // g) % v
        return (k // (g * v)) * g + k % g, (v - 1 - chunk if backward else chunk)

    orders = []
    for r in range(stages):
        warm = min(2 * (stages - r - 1) + (v - 1) * g if v > 1 else stages - r - 1, total)
        ops = [Op("F", *nth(k, False)) for k in range(warm)]
        for k in range(total - warm):
            ops += [Op("F", *nth(warm + k, False)), Op("B", *nth(k, True))]
        ops += [Op("B", *nth(k, True)) for k in range(total - warm, total)]
        orders.append(ops)
    return Schedule(orders, "interleaved", stages, m, chunks=v)


# ---------------------------------------------------------------------------------------
# List scheduling at unit cost: ZB-H2 and ZB-V.

def _greedy(stages: int, m: int, chunks: int, placement: str, caps: list[int],
            kind: str) -> Schedule:
    """Every time step (unit cost per op of a chunk, free communication) each rank that is
    free runs the first ready op by priority:

    1. ``B``, of the earliest virtual stage ready (it finishes a micro-batch's backward on
       this rank, and unblocks the rank before);
    2. ``F`` if fewer than ``caps[r]`` chunk activations are held (from F until W), the
       latest virtual stage first (it brings a micro-batch to the loss sooner);
    3. ``W`` (nobody waits for it, so it fills what would be idle)."""
    sched = Schedule([[] for _ in range(stages)], kind, stages, m, chunks, placement)
    last = stages * chunks - 1
    end: dict[tuple[str, int, int], int] = {}
    nxt = {(k, r, c): 0 for k in "FBW" for r in range(stages) for c in range(chunks)}
    held = [0] * stages
    t = 0

    def ready(kind_: str, r: int, c: int) -> int | None:
        i = nxt[(kind_, r, c)]
        if i >= m:
            return None
        g = sched.stage_of(r, c)
        dep = {"F": ("F", g - 1, i) if g > 0 else None,
               "B": ("B", g + 1, i) if g < last else ("F", g, i),
               "W": ("B", g, i)}[kind_]
        return i if dep is None or end.get(dep, t + 1) <= t else None

    while any(nxt[("W", r, c)] < m for r in range(stages) for c in range(chunks)):
        for r in range(stages):
            by_stage = sorted(range(chunks), key=lambda c: -sched.stage_of(r, c))
            b = next(((c, i) for c in by_stage[::-1] if (i := ready("B", r, c)) is not None),
                     None)
            f = next(((c, i) for c in by_stage if held[r] < caps[r]
                      and (i := ready("F", r, c)) is not None), None)
            w = next(((c, i) for c in range(chunks) if (i := ready("W", r, c)) is not None),
                     None)
            todo = [("B", *b)] if b else [("F", *f)] if f else [("W", *w)] if w else []
            for kind_, c, i in todo:
                sched[r].append(Op(kind_, i, c))
                end[(kind_, sched.stage_of(r, c), i)] = t + 1
                nxt[(kind_, r, c)] += 1
                held[r] += {"F": 1, "B": 0, "W": -1}[kind_]
        t += 1
        if t > 100 * (m * chunks * 3 + stages):
            raise AssertionError("list scheduling made no progress")   # cannot happen
    return sched


# ---------------------------------------------------------------------------------------
# ZB-V: the paper's construction, phase by phase.

def _zb_v(stages: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2024, section 6). Rank ``r``'s "down" chunk (0) is virtual stage
    ``r``, its "up" chunk (1) stage ``2P-1-r``. In chunk slots (an op of a chunk, ``T/2``):
    micro-batch 0 reaches the down chunk at slot ``r`` and the up chunk at ``2P-1-r``, so

    1. ``2(P-r)-1`` down forwards fill the wait for micro-batch 0 to come back up;
    2. ``r`` pairs (up forward, down forward) while the up leg fills;
    3. ``P-r`` rounds of up forward, ``B``, ``W``: rank 0 turns micro-batch 0 round at
       the loss at once, and each ``W`` frees a chunk as the next forward takes one;
    4. steady state: down ``F``, ``B``, ``W`` then up ``F``, ``B``, ``W``, six slots a
       micro-batch and no gap;
    5. the drain, the warm-up's mirror: ``r`` pairs (down ``B``, up ``B``), ``P-r`` pairs
       (down ``B``, down ``W``), then the remaining ``W``\\ s of the up chunk, then the down.

    After step 2 a rank holds ``2(P-r)-1 + 2r = 2P-1`` chunks, and each later round takes
    one and frees one: at most ``2P`` chunks, ``P`` whole stages. Step 1 needs ``2P-1``
    micro-batches; with fewer the order is built for ``2P-1`` and the ops of the missing
    ones are dropped (still a valid order: every op waits only on its own micro-batch).
    The same paper's ZB-V is torch's ``ScheduleZBVZeroBubble``; the tests check that both
    give every rank the same order."""
    n = max(m, 2 * stages - 1)
    orders = []
    for r in range(stages):
        ops: list[Op] = []
        count = {(k, c): 0 for k in "FBW" for c in (0, 1)}

        def run(steps, ops=ops, count=count):
            for k, c in steps:
                ops.append(Op(k, count[(k, c)], c))
                count[(k, c)] += 1

        run([("F", 0)] * (2 * (stages - r) - 1))                       # 1
        run([("F", 1), ("F", 0)] * r)                                  # 2
        run([("F", 1), ("B", 1), ("W", 1)] * (stages - r))             # 3
        while count[("F", 1)] < n:                                     # 4
            down_f = [("F", 0)] if count[("F", 0)] < n else []       # the last ones: none
            run(down_f + [("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1)])
        run([("B", 0), ("B", 1)] * r + [("B", 0), ("W", 0)] * (stages - r))   # 5
        run([("W", 1)] * (n - count[("W", 1)]))
        run([("W", 0)] * (n - count[("W", 0)]))
        orders.append([op for op in ops if op.mb < m])
    return Schedule(orders, "zb-v", stages, m, chunks=2, placement="v")


# ---------------------------------------------------------------------------------------
# DualPipe-V, reconstructed from DeepSeek's description of its phases.

def dualpipe_v(stages: int, micro_batches: int) -> Schedule:
    """RECONSTRUCTION of DeepSeek's DualPipe-V ("cut-in-half" DualPipe, 2025): the V
    placement of ZB-V, fed so that in the steady state every forward of one chunk runs
    overlapped with the whole backward (``B`` and its ``W``) of the other chunk, an
    ``overlap`` group of the :class:`Schedule`. Rank ``r``'s phases:

    1. ``2(P-r-1)`` down forwards; 2. ``r+1`` pairs (down ``F``, up ``F``);
    3. ``P-r-1`` rounds of up ``B``, ``W``, ``F``;
    4. ``M-2P+r+1`` rounds of two groups, (down ``F`` & up backward), (up ``F`` & down
       backward); the last rank runs the first group's two halves one after the other;
    5. ``P-r-1`` rounds of up backward, then (up ``F`` & down backward);
    6. ``r+1`` pairs of backwards (up, down), whole until half-way, then ``B`` alone with
       its ``W`` queued (odd ranks switch before the up one, even ranks before the down);
    7. ``P-r-1`` rounds of a queued ``W`` then a down ``B`` (its ``W`` queued);
    8. the ``r+1`` queued ``W``\\ s, oldest first.

    Needs ``M >= 2P``. Its order equals torch's ``ScheduleDualPipeV`` (tested, see
    :func:`parlearn.multi_device.pipeline.torch_pipeline.dualpipe_v_order`); its simulated
    step matches DeepSeek's bubble at equal costs (:func:`dualpipe_v_bubble`)."""
    p = check_int("stages", stages, lo=1)
    m = check_int("micro_batches", micro_batches, lo=1)
    if m < 2 * p:
        raise ValueError(f"micro_batches must be at least 2 * stages = {2 * p} for "
                         f"DualPipe-V, got {m}")
    orders, overlap = [], []
    for r in range(p):
        ops: list[Op] = []
        nf, nb, queue = [0, 0], [0, 0], []

        def f(c, ops=ops, nf=nf):
            ops.append(Op("F", nf[c], c))
            nf[c] += 1

        def b(c, whole=True, ops=ops, nb=nb, queue=queue):
            ops.append(Op("B", nb[c], c))
            (ops if whole else queue).append(Op("W", nb[c], c))   # W now, or queued
            nb[c] += 1

        def f_and_b(cf, cb, r=r, ops=ops):
            overlap.append((r, len(ops)))
            f(cf)
            b(cb)

        for _ in range(2 * (p - r - 1)):                                   # 1
            f(0)
        for _ in range(r + 1):                                             # 2
            f(0)
            f(1)
        for _ in range(p - r - 1):                                         # 3
            b(1)
            f(1)
        for i in range(m - 2 * p + r + 1):                                 # 4
            if i == 0 and r == p - 1:
                f(0)
                b(1)
            else:
                f_and_b(0, 1)
            f_and_b(1, 0)
        for _ in range(p - r - 1):                                         # 5
            b(1)
            f_and_b(1, 0)
        whole = True
        for i in range(r + 1):                                             # 6
            whole = whole and not (i == (r + 1) // 2 and r % 2 == 1)
            b(1, whole)
            whole = whole and not (i == (r + 1) // 2 and r % 2 == 0)
            b(0, whole)
        for _ in range(p - r - 1):                                         # 7
            ops.append(queue.pop(0))
            b(0, False)
        ops.extend(queue)                                                  # 8
        orders.append(ops)
    return Schedule(orders, "dualpipe-v", p, m, chunks=2, placement="v", overlap=overlap)


def dualpipe_v_bubble(stages: int, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0,
                      t_fb: float | None = None) -> float:
    """DeepSeek's DualPipe-V bubble ``(PP/2-1)(F&B + B - 3W)``, where ``PP = 2P`` is the
    number of stages (chunks), ``F`` a chunk's forward, ``B`` its whole backward (input and
    weight gradient), ``W`` its weight gradient and ``F&B`` a forward overlapped with a whole
    backward; here with whole-stage costs (a chunk costs half): ``(P-1)(t_fb + t_b - 2 t_w)/2``,
    ``t_fb`` defaulting to no overlap, ``t_f + t_b + t_w``. DeepSeek count the bubble as
    the idle time of a synchronous step on the most idle rank (``makespan - busy``); our
    simulator of :func:`dualpipe_v` gives exactly this at ``t_f = t_b = t_w`` (tested), not
    at unequal costs."""
    p = check_int("stages", stages, lo=1)
    t_f, t_b, t_w = (check_float(n, t, lo=0) for n, t in (("t_f", t_f), ("t_b", t_b),
                                                           ("t_w", t_w)))
    t_fb = t_f + t_b + t_w if t_fb is None else check_float("t_fb", t_fb, lo=0)
    return (p - 1) * (t_fb + t_b - 2 * t_w) / 2


def zoo_schedule(kind: str, stages: int, micro_batches: int, v: int = 2,
                 group: int | None = None) -> Schedule:
    """The schedule ``kind`` (one of :data:`ZOO`) for ``stages`` ranks and ``micro_batches``
    micro-batches; ``v`` is the chunks per rank of ``"interleaved"`` (``v = 1`` is 1F1B).
    ``group`` (``"interleaved"`` only, default P) is how many micro-batches go through a
    chunk before the rank moves to its next chunk: P is Megatron's depth-first order, M the
    breadth-first one (Lamy-Poirier 2023); Llama 3 tunes it. ``"zb-h1"`` is :func:`schedule`
    ``("zb", ...)``. Refuses an ``"interleaved"`` M that is not a multiple of the group, and
    a group below P."""
    check_choice("kind", kind, ZOO)
    stages = check_int("stages", stages, lo=1)
    m = check_int("micro_batches", micro_batches, lo=1)
    v = check_int("v", v, lo=1)
    if group is not None:
        if kind != "interleaved":
            raise ValueError(f"group is for kind 'interleaved' only, got kind {kind!r}")
        group = check_int("group", group, lo=1)
        if group < stages:
            raise ValueError(f"group must be >= stages={stages} (a round holds at least P "
                             f"micro-batches), got {group}")
        if m % group:
            raise ValueError(f"micro_batches must be a multiple of group={group}, got {m}")
    if kind in ("gpipe", "1f1b"):
        return schedule(kind, stages, m)
    if kind == "zb-h1":
        sched = schedule("zb", stages, m)
        sched.kind = "zb-h1"
        return sched
    if kind == "interleaved":
        if v > 1 and m % stages:
            raise ValueError(f"micro_batches must be a multiple of stages={stages} for "
                             f"interleaved 1F1B with v={v} (groups of P), got {m}")
        return _interleaved(stages, m, v, group)
    if kind == "zb-h2":
        return _greedy(stages, m, 1, "loop", [2 * stages - 1] * stages, "zb-h2")
    return _zb_v(stages, m)


# ---------------------------------------------------------------------------------------
# Validation and the papers' formulas.

def validate(sched: Schedule) -> list[int]:
    """Check that every rank runs each op of each of its chunks exactly once, each after
    the ops it needs on its own rank (F before B before W of a micro-batch), and that the
    whole schedule can run (no op waits forever for another rank: the simulator's
    dependency walk). Returns the peak count of chunk activations held per rank. Raises
    ValueError naming the first fault."""
    from parlearn.multi_device.pipeline.simulator import simulate

    if not isinstance(sched, Schedule):
        raise TypeError(f"sched must be a Schedule, got {type(sched).__name__}")
    check_int("sched.stages", sched.stages, lo=1)
    check_int("sched.micro_batches", sched.micro_batches, lo=1)
    if len(sched) != sched.stages:
        raise ValueError(f"sched must hold one op list per rank: {sched.stages} stages, got "
                         f"{len(sched)} lists")
    for r, ops in enumerate(sched):
        for op in ops:
            # An op of no chunk or kind the counts below look at would be silently ignored.
            if (not isinstance(op, Op) or op.kind not in ("F", "B", "W")
                    or isinstance(op.mb, bool) or not isinstance(op.mb, int)
                    or isinstance(op.chunk, bool) or not isinstance(op.chunk, int)
                    or not 0 <= op.chunk < sched.chunks):
                raise ValueError(f"sched: rank {r} holds {op!r}, not an Op(kind in F/B/W, "
                                 f"mb, chunk in 0..{sched.chunks - 1})")
    kinds = "FBW" if sched.split else "FB"
    peaks = []
    for r, ops in enumerate(sched):
        for c in range(sched.chunks):
            for k in kinds:
                got = sorted(op.mb for op in ops if op.kind == k and op.chunk == c)
                if got != list(range(sched.micro_batches)):
                    raise ValueError(f"sched: rank {r} chunk {c}: {k} ops of micro-batches {got}, "
                                     f"want each of 0..{sched.micro_batches - 1} once")
        seen, level, top = set(), 0, 0
        for op in ops:
            need = {"F": None, "B": "F", "W": "B"}[op.kind]
            if need and (need, op.mb, op.chunk) not in seen:
                raise ValueError(f"sched: rank {r}: {op} before its {need}")
            seen.add((op.kind, op.mb, op.chunk))
            level += {"F": 1, kinds[-1]: -1}.get(op.kind, 0)
            top = max(top, level)
        peaks.append(top)
    try:   # raises on a deadlock
        simulate(sched, 1, 1, 1) if sched.split else simulate(sched)
    except ValueError as e:
        raise ValueError(f"sched: {e}") from None
    return peaks


def paper_bubble(kind: str, stages: int, v: int = 1, t_f: float = 1.0, t_b: float = 1.0,
                 t_w: float = 1.0) -> float:
    """Each paper's bubble, in time units of one rank's whole stage (``t_b`` the input
    gradient, ``t_w`` the weight gradient; a non-split schedule's backward is
    ``t_b + t_w``): 1F1B and GPipe ``(P-1)(T_F+T_B+T_W)``, interleaved ``/v`` of that,
    ZB-H1 ``(P-1)(T_F+T_B-T_W)``, ZB-H2 ``(P-1)(T_F+T_B-2T_W)`` (Qi et al. 2024, Table 1,
    the idle time of a stage between its first and last op), ZB-V 0 (the paper's setting:
    equal costs and ``M >= 2P-1``; see :func:`_zb_v` for fewer micro-batches)."""
    check_choice("kind", kind, ZOO)
    p = check_int("stages", stages, lo=1)
    v = check_int("v", v, lo=1)   # checked for every kind: a bad value is never ignored
    t_f, t_b, t_w = (check_float(n, t, lo=0) for n, t in (("t_f", t_f), ("t_b", t_b),
                                                           ("t_w", t_w)))
    full = (p - 1) * (t_f + t_b + t_w)
    if kind in ("gpipe", "1f1b"):
        return full
    if kind == "interleaved":
        return full / v
    if kind == "zb-h1":
        return (p - 1) * (t_f + t_b - t_w)
    if kind == "zb-h2":
        return (p - 1) * (t_f + t_b - 2 * t_w)
    return 0.0


def in_flight_formula(kind: str, stages: int, micro_batches: int, v: int = 2) -> float:
    """The peak activations held by rank 0 in whole-stage units: GPipe ``M``, 1F1B ``P``,
    interleaved ``P + (P-1)/v`` (its deeper warm-up: ``2(P-1) + (v-1)P + 1`` chunks of
    ``1/v``), ZB-H2 ``2P-1``, ZB-H1 ``P`` (the paper's construction: ``P-s`` awaiting B
    plus ``s`` awaiting W on stage ``s``), all capped at ``M``; ZB-V ``min(P, (M+1)/2)``:
    ``P`` for ``M >= 2P-1``, and with fewer micro-batches rank 0, which turns them round at
    the loss first, holds less than the others (rank ``r``: ``min(P, M, (M+1+r)/2)``)."""
    check_choice("kind", kind, ZOO)
    p, m = check_int("stages", stages, lo=1), check_int("micro_batches", micro_batches, lo=1)
    v = check_int("v", v, lo=1)   # checked for every kind: a bad value is never ignored
    if kind == "gpipe":
        return float(m)
    if kind in ("1f1b", "zb-h1"):
        return float(min(p, m))
    if kind == "zb-v":
        return min(p, (m + 1) / 2)
    if kind == "zb-h2":
        return float(min(2 * p - 1, m))
    return min(p + (p - 1) / v, m) if v > 1 else float(min(p, m))   # interleaved
