"""Pipeline schedules: the order of operations on each rank.

One source of truth. :func:`schedule` lists, for every rank, the order of its operations;
the real ranks (:func:`parlearn.multi_device.pipeline.runtime.run_pipeline`, through
:func:`parlearn.distributed.run`) execute exactly that list, and the simulator
(:func:`parlearn.multi_device.pipeline.simulator.simulate`) draws the timeline of the same
list from per-stage costs (modeled). Schedules:

- ``"gpipe"``: all forwards, then all backwards (Huang et al. 2019). Every stage holds
  the activations of all ``M`` micro-batches.
- ``"1f1b"``: ``P-s-1`` warm-up forwards, then one-forward-one-backward, then the
  remaining backwards (PipeDream-Flush, Narayanan et al. 2021). Same bubble as GPipe,
  at most ``P-s`` micro-batches in flight on stage ``s``.
- ``"zb"``: zero-bubble ZB-H1 (Qi et al. 2024): each backward is split into ``B`` (input
  gradient, the delta chain, which the previous stage waits for) and ``W`` (weight gradient
  ``G = delta x activation``, which nobody waits for) -- the delta/G split of lesson 20.
  Built as the paper describes it (see :func:`_zero_bubble`): 1F1B's order with stage ``s``
  holding back its first ``s`` ``W``\\ s, which then fill the drain; every stage holds at most
  ``P`` micro-batches (1F1B's first stage). At equal ``F``, ``B``, ``W`` its idle *time*
  is a third of 1F1B's (``P-1`` op slots against ``3(P-1)``, since 1F1B's backward is
  ``B + W``); its idle *fraction* ``(P-1)/(3M+P-1)`` is more than a third of 1F1B's
  ``(P-1)/(M+P-1)`` (0.111 against 0.273 at ``P = 4, M = 8``).

For equal stage costs GPipe and 1F1B idle a fraction ``(P-1)/(M+P-1)`` of the time
(:func:`bubble_formula`): the pipeline fills for ``P-1`` slots and drains for ``P-1``.
"""

from __future__ import annotations

from typing import NamedTuple

from parlearn.core.checks import check_choice, check_int

__all__ = ["SCHEDULES", "PLACEMENTS", "Op", "Schedule", "schedule", "bubble_formula"]


SCHEDULES = ("gpipe", "1f1b", "zb")


class _OpFields(NamedTuple):
    kind: str
    mb: int
    chunk: int = 0


class Op(_OpFields):
    """One operation of a rank: ``kind`` is ``"F"`` (forward), ``"B"`` (backward; in the
    zero-bubble schedules only its input-gradient part) or ``"W"`` (weight gradient, those
    schedules only); ``mb`` is the micro-batch; ``chunk`` which of the rank's model chunks
    (virtual stages, :class:`Schedule`) it runs, 0 when a rank holds one stage.

    A user's own schedule is built from these, so each one is checked as it is made: an
    unknown kind or a negative (or bool) index is refused naming the field."""

    __slots__ = ()

    def __new__(cls, kind: str, mb: int, chunk: int = 0):
        check_choice("kind", kind, ("F", "B", "W"))
        check_int("mb", mb, lo=0)
        check_int("chunk", chunk, lo=0)
        return super().__new__(cls, kind, mb, chunk)

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f"c{self.chunk}" if self.chunk else "")


PLACEMENTS = ("loop", "v")


class Schedule(list):
    """The one schedule object: a list with one list of :class:`Op` per rank (what the
    ranks execute and :func:`parlearn.multi_device.pipeline.simulator.simulate` times), and
    where each rank's chunks sit in the model. The model is cut into ``stages * chunks``
    virtual stages; chunk ``c`` of rank ``r`` is virtual stage :meth:`stage_of` ``(r, c)``:
    ``"loop"`` places them round-robin (``c P + r``, Megatron's interleaving), ``"v"``
    (``chunks == 2``) down then back up (``r``, then ``2P-1-r``: the last stage, and the
    loss, sit on rank 0). ``overlap`` holds ``(rank, i)`` where ops ``i`` and ``i+1`` (an F
    and a B of other micro-batches), with op ``i+2`` when it is that B's W, form one
    overlapped F&B group (DualPipe-V: a forward overlapped with a whole backward)."""

    def __init__(self, orders, kind: str, stages: int, micro_batches: int, chunks: int = 1,
                 placement: str = "loop", overlap=()):
        if isinstance(orders, (str, bytes)) or not isinstance(orders, (list, tuple)):
            raise TypeError(f"orders must be a list of op lists (one per rank), got {orders!r}")
        if not isinstance(kind, str):
            raise TypeError(f"kind must be a str (a label), got {kind!r}")
        stages = check_int("stages", stages, lo=1)
        micro_batches = check_int("micro_batches", micro_batches, lo=1)
        if len(orders) != stages:
            raise ValueError(f"orders must hold one op list per rank: stages={stages}, got "
                             f"{len(orders)}")
        super().__init__([list(ops) for ops in orders])
        self.kind, self.stages, self.micro_batches = kind, stages, micro_batches
        self.chunks = check_int("chunks", chunks, lo=1)
        self.placement = check_choice("placement", placement, PLACEMENTS)
        if placement == "v" and chunks != 2:
            raise ValueError(f"chunks must be 2 for the V placement, got {chunks}")
        self.overlap = frozenset(overlap)

    @property
    def split(self) -> bool:
        """Whether backward is split into B (input gradient) and W (weight gradient)."""
        return any(op.kind == "W" for ops in self for op in ops)

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def stage_of(self, rank: int, chunk: int) -> int:
        """The virtual stage that chunk ``chunk`` of rank ``rank`` holds."""
        if self.placement == "v" and chunk == 1:
            return 2 * self.stages - 1 - rank
        return chunk * self.stages + rank

    def where(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` holding virtual stage ``stage``."""
        if self.placement == "v" and stage >= self.stages:
            return 2 * self.stages - 1 - stage, 1
        return stage % self.stages, stage // self.stages


# ---------------------------------------------------------------------------------------
# Schedules: the order of operations on each rank.

def _gpipe(stage: int, stages: int, m: int) -> list[Op]:
    # All forwards (fill), then all backwards (drain), in micro-batch order.
    return [Op("F", i) for i in range(m)] + [Op("B", i) for i in range(m)]


def _one_f_one_b(stage: int, stages: int, m: int) -> list[Op]:
    warmup = min(stages - stage - 1, m)
    ops = [Op("F", i) for i in range(warmup)]                # warm-up: fill the pipe
    for i in range(warmup, m):                               # steady: one F, one B
        ops += [Op("F", i), Op("B", i - warmup)]
    ops += [Op("B", i) for i in range(m - warmup, m)]        # cool-down: drain
    return ops


def _zero_bubble(stage: int, stages: int, m: int) -> list[Op]:
    """ZB-H1 as the paper builds it: 1F1B's ``P-s-1`` warm-up forwards, then one forward one
    ``B``, with the ``W`` of each micro-batch right after the ``B`` of the ``s``-th next one
    (stage ``s`` holds back ``s`` weight gradients), then the held-back ``W``\\ s at the end.
    So ``B`` reaches the stage before as early as in a 1F1B whose backward costs ``T_B``, and
    the ``W``\\ s fill the drain. Stage ``s`` holds ``P-s`` micro-batches awaiting ``B`` plus
    ``s`` awaiting ``W``: ``min(P, M)`` on every stage, 1F1B's first-stage peak. For
    ``M >= P`` and ``T_W <= T_F`` its bubble as the paper counts it (each stage's idle time
    in its span) is ``(P-1)(T_F+T_B-T_W)``; at equal costs the makespan is ``3M + P - 1``,
    ``(P-1)/(3M+P-1)`` of a synchronous step idle: a third of 1F1B's idle time, not of its
    idle fraction (tested)."""
    warmup = min(stages - stage - 1, m)
    ops = [Op("F", i) for i in range(warmup)]                # warm-up: as 1F1B
    w = 0
    for i in range(m):
        if warmup + i < m:
            ops.append(Op("F", warmup + i))
        ops.append(Op("B", i))
        if i >= stage or warmup + i >= m:      # W s micro-batches late; in the drain, at once
            ops.append(Op("W", w))
            w += 1
    return ops + [Op("W", i) for i in range(w, m)]           # the held-back Ws fill the drain


def schedule(kind: str, stages: int, micro_batches: int) -> Schedule:
    """The order of operations of each rank: ``schedule(kind, P, M)[s]`` is stage ``s``'s
    list of :class:`Op`. ``kind`` is one of :data:`SCHEDULES` (the schedules with virtual
    stages are :func:`parlearn.multi_device.pipeline.zoo.zoo_schedule`)."""
    check_choice("kind", kind, SCHEDULES)
    stages = check_int("stages", stages, lo=1)
    micro_batches = check_int("micro_batches", micro_batches, lo=1)
    make = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zb": _zero_bubble}[kind]
    return Schedule([make(s, stages, micro_batches) for s in range(stages)], kind, stages,
                    micro_batches)


def bubble_formula(stages: int, micro_batches: int) -> float:
    """Idle fraction of GPipe and 1F1B with equal stage costs and free communication:
    ``(P-1)/(M+P-1)``. Each stage is busy ``M(F+B)`` out of a makespan ``(M+P-1)(F+B)``."""
    stages = check_int("stages", stages, lo=1)
    micro_batches = check_int("micro_batches", micro_batches, lo=1)
    return (stages - 1) / (micro_batches + stages - 1)
