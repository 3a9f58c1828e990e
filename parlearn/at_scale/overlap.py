"""Is my overlap real? Data-parallel steps profiled on real ranks beside lesson 11's model.

:func:`overlap_study` profiles the same MLP step under the naive wrapper (all-reduces after
backward: nothing can overlap), the bucketed one (each bucket's all-reduce launched during
backward) and torch's DDP, reads every rank's trace (:mod:`parlearn.at_scale.traces`), and
sets the measured compute, communication, hidden and exposed time beside
:func:`parlearn.data_parallel.dp_step_model`, fed the measured compute and this machine's
fitted all-reduce link. The measured part a schedule can save is ``hidden``; the model says
what it would hide if communication and computation did not share anything.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from parlearn.core.checks import check_int

__all__ = ["KINDS", "overlap_study"]

KINDS = ("naive", "bucketed", "ddp")


def overlap_study(out_dir: str, *, kinds: Sequence[str] = KINDS,
                  widths: Sequence[int] = (256, 1024, 1024, 10), steps: int = 4,
                  bucket_bytes: int = 2**20, world_size: int = 2, link=None,
                  progress: Callable[[float, str], None] | None = None) -> dict:
    """Profile ``steps`` steps of each of ``kinds`` on ``world_size`` gloo ranks (traces in
    ``out_dir/<kind>/rank<r>.json``). Returns ``{"link": the AlphaBeta used, kind: {"measured":
    per-rank median breakdowns after the first step, "modeled": the DPStepModel,
    "traces": paths}}``. ``link`` defaults to a fit of this machine's all-reduce."""
    from parlearn.at_scale.traces import dp_step_worker, median_breakdown, profile_ranks
    from parlearn.core.checks import check_choice
    from parlearn.core.models import mlp_param_bytes
    from parlearn.distributed import AlphaBeta, measure_alpha_beta
    from parlearn.multi_device.data_parallel.step_model import dp_step_model

    if not isinstance(out_dir, str | os.PathLike):
        raise TypeError(f"out_dir must be a path, got {out_dir!r}")
    if isinstance(kinds, str) or not list(kinds):
        raise ValueError(f"kinds must be a non-empty list of {list(KINDS)}, got {kinds!r}")
    for i, k in enumerate(kinds):
        check_choice(f"kinds[{i}]", k, KINDS)
    sizes = mlp_param_bytes(widths)
    steps = check_int("steps", steps, lo=2)      # the first step warms up and is skipped
    bucket_bytes = check_int("bucket_bytes", bucket_bytes, lo=1)
    world_size = check_int("world_size", world_size, lo=2)
    if link is not None and not isinstance(link, AlphaBeta):
        raise TypeError(f"link must be an AlphaBeta or None, got {link!r}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be callable or None, got {progress!r}")
    report = progress or (lambda f, text="": None)
    if link is None:
        report(0.0, "fitting this machine's all-reduce link")
        link = measure_alpha_beta(world_size, sizes=[2**k for k in range(10, 23, 3)],
                                  repeat=3, kind="all_reduce")
    out: dict = {"link": link}
    for i, kind in enumerate(kinds):
        report((i + 0.5) / (len(kinds) + 0.5), f"profiling {kind} on {world_size} ranks")
        runs = profile_ranks(dp_step_worker, world_size,
                             args=(kind, steps, tuple(widths), bucket_bytes),
                             out_dir=os.path.join(str(out_dir), kind))
        measured = [median_breakdown(path) for _, path in runs]
        compute = max(m["compute"] for m in measured)
        modeled = dp_step_model(sizes, world_size, link, compute_seconds=compute,
                                strategy="naive" if kind == "naive" else "bucketed",
                                bucket_bytes=bucket_bytes)
        out[kind] = {"measured": measured, "modeled": modeled,
                     "traces": [path for _, path in runs]}
    report(1.0, "done")
    return out
