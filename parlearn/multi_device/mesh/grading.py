"""The planner graded by reality: run its picks of the tiny GPT on real ranks, compare.

:func:`grade` ranks every plan of the tiny GPT on ``world`` gloo ranks with
:func:`parlearn.mesh.planner.rank_plans` (this machine's hardware card), runs the best
plan of each of the predicted top ``top`` meshes ``(dp, tp, pp)`` and the predicted worst
plan with :func:`parlearn.mesh.mesh_train`,
and reports, per plan, the predicted and measured step time and per-rank memory, the
Kendall rank correlation between predicted and measured step times (1: the planner orders
them as reality does; 0: no better than chance; -1: backwards) and the largest relative
memory error. Measured step time: the slowest rank's, median over the steps after the
first. Measured memory: the largest, over ranks, of the bytes the optimizer holds plus the
peak of saved activations (saved-tensor hooks). Timings on a machine whose cores the
ranks share are noisy: the report says how many ranks shared how many cores.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence

from parlearn.core.checks import check_bool, check_float, check_int
from parlearn.multi_device.mesh.composed import mesh_train, mesh_train_worker
from parlearn.multi_device.mesh.layout import MeshShape
from parlearn.multi_device.mesh.planner import Cluster, Prediction, TinyGPT, rank_plans
from parlearn.multi_device.transformer.model import GPTConfig

__all__ = ["kendall_tau", "plan_mesh", "measure_plan", "grade"]


def kendall_tau(xs, ys) -> float:
    """Kendall's tau-b of two equally long sequences (ties counted as neither)."""
    for name, seq in (("xs", xs), ("ys", ys)):
        if isinstance(seq, str) or not isinstance(seq, Sequence):
            raise TypeError(f"{name} must be a sequence of numbers, got {seq!r}")
        for v in seq:
            check_float(name, v)
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"xs and ys need the same length >= 2, got {len(xs)} and {len(ys)}")
    conc = disc = tx = ty = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            a, b = xs[i] - xs[j], ys[i] - ys[j]
            if a == 0 and b == 0:
                continue
            if a == 0:
                tx += 1
            elif b == 0:
                ty += 1
            elif (a > 0) == (b > 0):
                conc += 1
            else:
                disc += 1
    denom = ((conc + disc + tx) * (conc + disc + ty)) ** 0.5
    return (conc - disc) / denom if denom else 0.0


def plan_mesh(pred: Prediction, batch: int) -> tuple[MeshShape, int]:
    """The mesh and the micro-batches per step that run ``pred.plan`` with ``batch``
    sequences on :func:`mesh_train` (or its worker); refuses a plan the mesh cannot run
    as planned (``cp > 1``: the mesh has no cp axis) or a batch it does not divide."""
    if not isinstance(pred, Prediction):
        raise TypeError(f"pred must be a Prediction (from parlearn.mesh.predict or rank_plans), "
                        f"got {type(pred).__name__}")
    batch = check_int("batch", batch, lo=1)
    plan = pred.plan
    if plan.cp != 1:
        raise ValueError(f"plan {plan} has cp={plan.cp}: the mesh trainer has no cp axis")
    if batch % (plan.dp * plan.micro_batch):
        raise ValueError(f"batch={batch} must be a multiple of the plan's dp * micro_batch = "
                         f"{plan.dp} * {plan.micro_batch}")
    return MeshShape(plan.dp, plan.tp, plan.pp), batch // (plan.dp * plan.micro_batch)


def measure_plan(cfg: GPTConfig, pred: Prediction, batch: int, seq: int, steps: int = 4,
                 timeout: float = 120) -> dict:
    """Run ``pred.plan`` with :func:`mesh_train`; ``{"step_s", "memory", "spread"}``
    (the median of the slowest rank's step times after the first, which warms up, so
    ``steps`` is at least 2)."""
    shape, micro_batches = plan_mesh(pred, batch)
    check_int("steps", steps, lo=2)
    res = mesh_train(cfg, shape, steps=steps, batch=batch, seq=seq, micro_batches=micro_batches,
                     zero=pred.plan.zero, recompute=pred.plan.recompute, timeout=timeout)
    return _summarise(res, steps)


def _summarise(res: list[dict], steps: int) -> dict:
    """One plan's ranks' results: ``{"step_s", "memory", "spread", "min_s", "max_s"}``
    (:func:`measure_plan`; ``min_s``/``max_s``: the slowest rank's fastest and slowest step)."""
    slowest = [max(r["step_s"][i] for r in res) for i in range(1, steps)]
    med = statistics.median(slowest)
    memory = max(r["held"]["params"] + r["held"]["grads"] + r["held"]["optimizer"]
                 + r["act_peak"] for r in res)
    return {"step_s": med, "memory": memory, "min_s": min(slowest), "max_s": max(slowest),
            "spread": (max(slowest) - min(slowest)) / med if med else 0.0}


def _plan_worker(rank: int, world_size: int, cfg: GPTConfig, shape, micro: int, zero: int,
                 recompute: str, steps: int, batch: int, seq: int) -> dict:
    """Worker: :func:`mesh_train_worker` for one plan, returning only what :func:`_summarise`
    reads (step times, held bytes, activation peak): the trained weights stay on the ranks."""
    r = mesh_train_worker(rank, world_size, cfg, shape, steps, batch, seq, micro, 1e-2, 0,
                          True, zero, recompute, "1f1b")
    return {"step_s": r["step_s"], "held": r["held"], "act_peak": r["act_peak"]}


def grade(cfg: GPTConfig, card, *, world: int = 4, batch: int = 8, seq: int = 16,
          top: int = 3, steps: int = 4, worst_steps: int | None = None, progress: bool = True,
          timeout: float = 120) -> dict:
    """Rank the tiny GPT's plans on ``world`` ranks with ``card`` (its ``flops`` measured
    with one thread: each rank runs one), run the best plan of each of the top ``top``
    meshes and the worst plan, and compare.
    Returns ``{"rows": [...], "tau", "memory_error", "ranks", "cores", "card"}``; each row
    has the plan, predicted and measured step time and memory, the prediction's parts (and
    the :class:`Prediction` itself, ``"prediction"``), and the measured run's MFU: model
    FLOPs ``3 F`` per step over the step time and the cores' rate (the card's one-thread
    matmul rate times the cores the ranks share). ``worst_steps`` (default ``steps``, at
    least 2) runs the worst plan, far the slowest, for fewer steps."""
    world = check_int("world", world, lo=1)
    top = check_int("top", top, lo=1)
    steps = check_int("steps", steps, lo=2)
    worst_steps = steps if worst_steps is None else check_int("worst_steps", worst_steps, lo=2)
    for name, v in (("batch", batch), ("seq", seq)):
        check_int(name, v, lo=1)
    check_bool("progress", progress)
    check_float("timeout", timeout, lo=0, lo_open=True)
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
    cores = os.cpu_count() or 1
    cluster = Cluster(card, gpus_per_node=world, share=min(1.0, cores / world))
    work = TinyGPT(cfg, batch, seq)
    ranked = [p for p in rank_plans(work, cluster, world, zero=(1,), recompute=("none",))
              if p.fits]
    # The best plan of each of the top ``top`` meshes (micro-batch sizes of one mesh differ
    # too little to grade an order), and the predicted worst plan of all.
    best_of: dict[tuple[int, int, int], Prediction] = {}
    for p in ranked:
        best_of.setdefault((p.plan.dp, p.plan.tp, p.plan.pp), p)
    picks = list(best_of.values())[:top]
    if ranked[-1] not in picks:
        picks.append(ranked[-1])
    # MFU's denominator: each core at the card's (one-thread) matmul rate.
    peak = card.flops[work.dtype] * min(world, cores)
    # All picks in one launch of the ranks (starting them costs seconds each time), in turn;
    # each plan's first step, which warms up, is left out of its median as in measure_plan.
    from parlearn.distributed import run_many

    runs = [(cfg, *plan_mesh(p, batch), p.plan.zero, p.plan.recompute,
             worst_steps if p is ranked[-1] else steps, batch, seq) for p in picks]
    if progress:
        print(f"running the planner's {len(picks)} picks on {world} ranks, one launch")
    res = run_many(_plan_worker, world, runs, backend="gloo", timeout=timeout)
    rows = []
    for i, pred in enumerate(picks):
        got = _summarise(res[i], runs[i][-3])
        rows.append({"plan": str(pred.plan), "predicted rank": ranked.index(pred) + 1,
                     "pick": "worst" if pred is ranked[-1] else f"top {i + 1}",
                     "predicted_s": pred.step_s, "measured_s": got["step_s"],
                     "spread": got["spread"], "min_s": got["min_s"], "max_s": got["max_s"],
                     "predicted_bytes": pred.memory["total"],
                     "measured_bytes": got["memory"], "parts": pred.time,
                     "mfu": 3 * work.forward_flops() / got["step_s"] / peak,
                     "prediction": pred})
    tau = (kendall_tau([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
           if len(rows) > 1 else float("nan"))
    mem_err = max(abs(r["predicted_bytes"] - r["measured_bytes"]) / r["measured_bytes"]
                  for r in rows)
    return {"rows": rows, "tau": tau, "memory_error": mem_err, "ranks": world,
            "cores": cores, "plans_ranked": len(ranked), "card": getattr(card, "name", "")}
