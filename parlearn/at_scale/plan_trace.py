"""The planner's predicted step beside the measured trace of the same plan, part by part.

Lesson 19's planner (:func:`parlearn.planner.predict`) splits a step of the tiny GPT into
compute, tensor-parallel communication, pipeline sends, data-parallel communication and the
pipeline bubble, all exposed (it credits no overlap). :func:`plan_vs_trace` runs the same
plan on real gloo ranks under ``torch.profiler`` (:func:`parlearn.at_scale.traces.
profile_ranks`; :class:`parlearn.mesh.MeshRank` labels each step ``step``, its pipeline
work ``forward``/``backward`` and its update ``optimizer``) and splits every rank's
median step (by step time, after the first, which warms up) into the parts both can name:

- ``compute``: time covered by ``aten::`` operators;
- ``dp``: communication inside the ``optimizer`` phase (ZeRO's reduce-scatter and
  all-gather) not under compute;
- ``tp``: every other collective (Megatron's all-reduces, SP's all-gathers and
  reduce-scatters) not under compute, ``dp`` or the ``embedding`` label;
- ``pipeline``: the rest of the step: point-to-point sends and receives, the time a stage
  waits for its neighbour, and the tied embedding's all-reduce between the first and the
  last stage (labelled ``embedding``: a cost of the pipeline split, whose span also holds
  the wait for the other stage; the planner does not price it). A blocking receive's span
  covers its waiting, so a trace cannot split a transfer from the bubble: it is set
  beside the planner's pp + bubble.

The four parts add up to the measured step; the predicted parts add up to the planner's.
"""

from __future__ import annotations

import os
import statistics

from parlearn.core.checks import check_int

__all__ = ["PARTS", "P2P", "split_step", "plan_vs_trace"]

PARTS = ("compute", "tp", "dp", "pipeline")


# Point-to-point events in a trace: the pipeline's, not a collective's.
P2P = ("gloo:send", "gloo:recv", "nccl:send", "nccl:recv")


def split_step(trace, window: tuple[float, float]) -> dict[str, float]:
    """One rank's ``window`` (a step) of ``trace`` split into :data:`PARTS` (module
    docstring), plus ``"step"``: the window's length, which the parts add up to."""
    from parlearn.at_scale.traces import (
        COMM_PREFIXES,
        COMPUTE_PREFIXES,
        _intersect,
        _length,
        _load,
        _union,
        _window,
        spans,
    )

    w = _window(window)
    events = _load(trace)
    collective_names = {e["name"] for e in events if isinstance(e.get("name"), str)
                        and e["name"].startswith(COMM_PREFIXES) and e["name"] not in P2P}
    comp = _intersect(_union(spans(events, (), COMPUTE_PREFIXES)), w)
    comm = _intersect(_union(spans(events, collective_names)), w)
    opt = _intersect(_union(spans(events, ("optimizer",))), w)
    dp = _minus(_intersect(comm, opt), comp)
    emb = _intersect(_union(spans(events, ("embedding",))), w)
    tp = _minus(comm, _union(comp + dp + emb))
    step = w[0][1] - w[0][0]
    out = {"compute": _length(comp), "tp": _length(tp), "dp": _length(dp)}
    out["pipeline"] = step - sum(out.values())
    out["step"] = step
    return out


def _minus(xs, ys) -> list[tuple[float, float]]:
    """The parts of the sorted disjoint intervals ``xs`` outside the sorted disjoint ``ys``."""
    out = []
    for a, b in xs:
        cur = a
        for c, d in ys:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
        if cur < b:
            out.append((cur, b))
    return out


def plan_vs_trace(cfg, pred, *, batch: int, seq: int, steps: int = 4, out_dir: str,
                  timeout: float = 120) -> dict:
    """Run ``pred.plan`` (a :class:`parlearn.planner.Prediction` of the tiny GPT ``cfg``,
    ``batch`` sequences of ``seq`` tokens) on real gloo ranks under the profiler, traces in
    ``out_dir``. Returns ``{"predicted": {part: seconds}, "measured": {part: seconds} of
    the slowest rank's median step, "ranks": every rank's median-step split, "traces":
    paths, "median_step": the median over ranks of their median step}``;
    ``predicted["pipeline"]`` is the planner's pp + bubble (and cp, 0 here). The ranks run
    :func:`parlearn.mesh.mesh_train_worker`, the worker :func:`parlearn.mesh.grading.
    measure_plan` times."""
    from parlearn.at_scale.traces import profile_ranks, step_windows
    from parlearn.multi_device.mesh.composed import check_train_args, mesh_train_worker
    from parlearn.multi_device.mesh.grading import plan_mesh

    shape, micro_batches = plan_mesh(pred, batch)
    steps = check_int("steps", steps, lo=2)     # the first step warms up and is left out
    if not isinstance(out_dir, str | os.PathLike):
        raise TypeError(f"out_dir must be a path, got {out_dir!r}")
    plan = pred.plan
    # mesh_train's own defaults (lr 1e-2, seed 0, SP, 1F1B), as measure_plan runs it.
    args = (cfg, shape, steps, batch, seq, micro_batches, 1e-2, 0, True, plan.zero,
            plan.recompute, "1f1b")
    check_train_args(*args)
    runs = profile_ranks(mesh_train_worker, shape.world, args=args, out_dir=str(out_dir),
                         timeout=timeout)
    ranks = []
    for _, path in runs:
        parts = sorted((split_step(path, w) for w in step_windows(path, "step", "step")[1:]),
                       key=lambda p: p["step"])
        ranks.append(parts[(len(parts) - 1) // 2])
    t = pred.time
    predicted = {"compute": t["compute"], "tp": t["tp"], "dp": t["dp"],
                 "pipeline": t["pp"] + t["bubble"] + t["cp"]}
    predicted["step"] = sum(predicted.values())
    slowest = max(ranks, key=lambda p: p["step"])
    return {"predicted": predicted, "measured": slowest, "ranks": ranks,
            "traces": [path for _, path in runs],
            "median_step": statistics.median(p["step"] for p in ranks)}
