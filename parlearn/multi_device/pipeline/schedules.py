"""Pipeline schedules: the order of operations on each rank.

One source of truth. :func:`schedule` lists, for every rank, the order of its operations;
the real ranks (:func:`parlearn.multi_device.pipeline.runtime.run_pipeline`, through
:func:`parlearn.dist.run`) execute exactly that list, and the simulator
(:func:`parlearn.multi_device.pipeline.simulator.simulate`) draws the timeline of the same
list from per-stage costs (modeled). Schedules:

- ``"gpipe"``: all forwards, then all backwards (Huang et al. 2019). Every stage holds
  the activations of all ``M`` micro-batches.
- ``"1f1b"``: ``P-s-1`` warm-up forwards, then one-forward-one-backward, then the
  remaining backwards (PipeDream-Flush, Narayanan et al. 2021). Same bubble as GPipe,
  at most ``P-s`` micro-batches in flight on stage ``s``.
- ``"zb"``: zero-bubble in the style of ZB-H1 (Qi et al. 2024): each backward is split into
  ``B`` (input gradient, the delta chain, which the previous stage waits for) and ``W``
  (weight gradient ``G = delta x activation``, which nobody waits for) -- the delta/G split
  of lesson 20. ``W`` fills the idle slots. Built by our own greedy list scheduler under
  unit costs (see :func:`_zero_bubble`), not copied from the paper's figure.

For equal stage costs GPipe and 1F1B idle a fraction ``(P-1)/(M+P-1)`` of the time
(:func:`bubble_formula`): the pipeline fills for ``P-1`` slots and drains for ``P-1``.
"""

from __future__ import annotations

from typing import NamedTuple

from parlearn.core.checks import check_choice, check_int

__all__ = ["SCHEDULES", "PLACEMENTS", "Op", "Schedule", "schedule", "bubble_formula"]


SCHEDULES = ("gpipe", "1f1b", "zb")


class Op(NamedTuple):
    """One operation of a rank: ``kind`` is ``"F"`` (forward), ``"B"`` (backward; in the
    zero-bubble schedules only its input-gradient part) or ``"W"`` (weight gradient, those
    schedules only); ``mb`` is the micro-batch; ``chunk`` which of the rank's model chunks
    (virtual stages, :class:`Schedule`) it runs, 0 when a rank holds one stage."""

    kind: str
    mb: int
    chunk: int = 0

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
    and a B of other micro-batches) form one overlapped F&B pair (DualPipe-V)."""

    def __init__(self, orders, kind: str, stages: int, micro_batches: int, chunks: int = 1,
                 placement: str = "loop", overlap=()):
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


def _zero_bubble(stages: int, m: int) -> list[list[Op]]:
    """Greedy list scheduling at unit cost F = B = W = 1 and free communication: at each
    time step every idle stage runs the first ready op by priority

    1. ``B`` (its input gradient unblocks the stage before),
    2. ``W`` if more than ``P-1`` weight gradients are pending (bounds their memory),
    3. ``F`` if fewer than ``P-s`` micro-batches await their ``B`` (1F1B's bound),
    4. ``W`` (needed by nobody, so it fills what would be idle time).

    For ``M >= P`` this reaches ZB-H1's makespan ``3M + P - 1`` (bubble ``(P-1)/(3M+P-1)``,
    a third of 1F1B's at equal F, B, W)."""
    orders: list[list[Op]] = [[] for _ in range(stages)]
    f_end = [[None] * m for _ in range(stages)]   # time each F / B finishes
    b_end = [[None] * m for _ in range(stages)]
    nf, nb, nw = [0] * stages, [0] * stages, [0] * stages
    t = 0

    def arrived(end: int | None) -> bool:
        return end is not None and end <= t

    while any(n < m for n in nw):
        for s in range(stages):
            # B m needs the output gradient: from stage s+1, or the loss on the last stage.
            source = f_end[s] if s == stages - 1 else b_end[s + 1]
            ready_b = nb[s] < nf[s] and arrived(source[nb[s]])
            ready_f = nf[s] < m and nf[s] - nb[s] < stages - s and (
                s == 0 or arrived(f_end[s - 1][nf[s]]))
            if ready_b:
                b_end[s][nb[s]] = t + 1
                orders[s].append(Op("B", nb[s]))
                nb[s] += 1
            elif nb[s] - nw[s] > stages - 1 or (not ready_f and nw[s] < nb[s]):
                orders[s].append(Op("W", nw[s]))
                nw[s] += 1
            elif ready_f:
                f_end[s][nf[s]] = t + 1
                orders[s].append(Op("F", nf[s]))
                nf[s] += 1
        t += 1
    return orders


def schedule(kind: str, stages: int, micro_batches: int) -> Schedule:
    """The order of operations of each rank: ``schedule(kind, P, M)[s]`` is stage ``s``'s
    list of :class:`Op`. ``kind`` is one of :data:`SCHEDULES` (the schedules with virtual
    stages are :func:`parlearn.multi_device.pipeline.zoo.zoo_schedule`)."""
    check_choice("kind", kind, SCHEDULES)
    stages = check_int("stages", stages, lo=1)
    micro_batches = check_int("micro_batches", micro_batches, lo=1)
    if kind == "zb":
        return Schedule(_zero_bubble(stages, micro_batches), kind, stages, micro_batches)
    make = _gpipe if kind == "gpipe" else _one_f_one_b
    return Schedule([make(s, stages, micro_batches) for s in range(stages)], kind, stages,
                    micro_batches)


def bubble_formula(stages: int, micro_batches: int) -> float:
    """Idle fraction of GPipe and 1F1B with equal stage costs and free communication:
    ``(P-1)/(M+P-1)``. Each stage is busy ``M(F+B)`` out of a makespan ``(M+P-1)(F+B)``."""
    stages = check_int("stages", stages, lo=1)
    micro_batches = check_int("micro_batches", micro_batches, lo=1)
    return (stages - 1) / (micro_batches + stages - 1)
