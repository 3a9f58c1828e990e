"""The argument contract of lessons 15-17's diagrams and the interleaved layout timing
(see harness.py). Drawing functions take a matplotlib axis they draw on; their sizes are
checked before anything is drawn."""

from __future__ import annotations

from harness import Case, contract_tests

CP = "parlearn.multi_device.context_parallel."

_AXES = {"ax": "a matplotlib axis, drawn on"}

CASES = [
    Case("parlearn.multi_device.memory.diagram.draw_block",
         lambda: dict(ax=None, recompute="none"), bad={"recompute": ["some", "", None]},
         skip=_AXES, run_good=False),
    Case("parlearn.multi_device.batching.diagram.draw_probe", lambda: dict(ax=None, world_size=4),
         ranges={"world_size": (2, None)}, bad={"world_size": [3, 5]}, skip=_AXES,
         run_good=False),
    Case(CP + "diagrams.draw_ring", lambda: dict(ax=None, world_size=4),
         ranges={"world_size": (2, None)}, skip=_AXES, run_good=False),
    Case(CP + "diagrams.draw_ulysses", lambda: dict(ax=None, world_size=2, heads=4),
         ranges={"world_size": (2, 2)}, bad={"heads": [0, 3, 5]}, legal={"heads": [None]},
         skip=_AXES, run_good=False),
    Case(CP + "diagrams.draw_zigzag", lambda: dict(ax=None, world_size=4),
         ranges={"world_size": (2, None)}, skip=_AXES, run_good=False),
    Case(CP + "workers.layout_timing",
         lambda: dict(world_size=2, seq=8, heads=1, head_dim=2, repeat=1, timeout=30.0),
         ranges={"world_size": (2, None), "heads": (1, None), "head_dim": (1, None),
                 "repeat": (1, None)},
         bad={"seq": [0, 3], "timeout": [0.0, -1.0]}, run_good=False),
    Case(CP + "workers.layout_timing_worker",
         lambda: dict(rank=1, world_size=2, seq=8, heads=1, head_dim=2, repeat=1),
         bad={"rank": [2, -1], "world_size": [0, 1], "seq": [0, 3], "heads": [0],
              "head_dim": [0], "repeat": [0]}, run_good=False),
]

test_refuses, test_accepts, test_accepts_range = contract_tests(CASES)

COVERED_ELSEWHERE: dict[str, str] = {}
EXEMPT: dict[str, str] = {}
