"""The real engine: the same stages through ``torch.distributed.pipelining``.

:func:`run_torch_pipeline` computes the gradients of the same step as
:func:`parlearn.multi_device.pipeline.runtime.run_pipeline`, the same layers on each rank,
driven by torch's own schedules (:data:`TORCH_SCHEDULES`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from parlearn.core.checks import check_choice, check_float
from parlearn.multi_device.pipeline.partition import split_layers
from parlearn.multi_device.pipeline.runtime import (
    _check_pipeline_args,
    _check_ties,
    _loss,
    _micro_list,
    _preimport,
    _stage_layers,
    _trainable,
)
from parlearn.multi_device.pipeline.schedules import SCHEDULES

__all__ = ["TORCH_SCHEDULES", "run_torch_pipeline", "TORCH_ZOO", "run_torch_zoo",
           "dualpipe_v_order"]


# ---------------------------------------------------------------------------------------
# The real engine: the same stages through torch.distributed.pipelining.

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "zb": "ScheduleInterleavedZeroBubble"}


def _worker_torch(rank: int, world: int, kind: str, model: nn.Sequential, x: torch.Tensor,
                  y: torch.Tensor, counts: Sequence[int], ms: Sequence[int]) -> list[list]:
    from torch.distributed import pipelining

    out = []
    n_total = len(x)
    for m in ms:
        sub = nn.Sequential(*_stage_layers(model, counts, rank))
        stage = pipelining.PipelineStage(sub, rank, world, torch.device("cpu"))
        cls = getattr(pipelining, TORCH_SCHEDULES[kind])
        # Losses summed over the full batch size and no rescaling: as in run_pipeline.
        sched = cls([stage] if kind == "zb" else stage, m,
                    loss_fn=lambda o, t: _loss(o, t, n_total), scale_grads=False)
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        out.append([p.grad.detach().clone() for p in _trainable([sub])])
    return out


def run_torch_pipeline(kind: str, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor,
                       stages: int = 2, micro_batches: int | Sequence[int] = 4, *,
                       counts: Sequence[int] | None = None, timeout: float = 30
                       ) -> list[torch.Tensor] | list[list[torch.Tensor]]:
    """The gradients of the same step as :func:`run_pipeline` computed by
    ``torch.distributed.pipelining``: a ``PipelineStage`` per rank holding the same layers,
    driven by :data:`TORCH_SCHEDULES` ``[kind]`` (``ScheduleInterleavedZeroBubble`` with one
    stage per rank for ``"zb"``). torch splits the batch with ``torch.tensor_split``, so
    ``len(x)`` should be divisible by the micro-batch count for equal shapes."""
    check_choice("kind", kind, SCHEDULES)
    stages, counts, _ = _check_pipeline_args(model, x, y, stages, counts)
    _check_ties(model, split_layers(len(model), counts))
    ms, single = _micro_list(micro_batches, len(x))
    from parlearn import distributed as dist

    _preimport()
    import torch.distributed.pipelining  # noqa: F401  (imported once here, not per rank)
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    per_rank = dist.run(_worker_torch, stages, args=(kind, model, x, y, counts, ms),
                        backend="gloo", timeout=timeout, deadline=4 * timeout)
    grads = [[g for r in per_rank for g in r[i]] for i in range(len(ms))]
    return grads[0] if single else grads


# ---------------------------------------------------------------------------------------
# torch's multi-stage schedules beside the zoo's: several stages per rank.

TORCH_ZOO = {"interleaved": ("ScheduleInterleaved1F1B", "loop"),
             "interleaved-zb": ("ScheduleInterleavedZeroBubble", "loop"),
             "zb-v": ("ScheduleZBVZeroBubble", "v"),
             "dualpipe-v": ("ScheduleDualPipeV", "v")}


def _worker_torch_zoo(rank: int, world: int, name: str, model: nn.Sequential, x: torch.Tensor,
                      y: torch.Tensor, ms: Sequence[int]) -> list[dict]:
    from torch.distributed import pipelining

    from parlearn.multi_device.pipeline.schedules import Schedule
    from parlearn.multi_device.pipeline.virtual import chunk_layers

    cls_name, placement = TORCH_ZOO[name]
    place = Schedule([[] for _ in range(world)], name, world, 1, 2, placement)
    bounds = chunk_layers(len(model), place)
    out = []
    for m in ms:
        subs, stages = {}, []
        for c in range(2):
            g = place.stage_of(rank, c)
            a, b = bounds[g]
            # One deepcopy per stage: a weight tied within it stays tied.
            subs[g] = nn.Sequential(*copy.deepcopy([model[i] for i in range(a, b)]))
            stages.append(pipelining.PipelineStage(subs[g], g, 2 * world, torch.device("cpu")))
        sched = getattr(pipelining, cls_name)(stages, m, loss_fn=lambda o, t: _loss(o, t, len(x)),
                                              scale_grads=False)
        kwargs = {}
        if 0 in subs:
            kwargs["x"] = x
        if 2 * world - 1 in subs:
            kwargs.update(target=y, losses=[])
        sched.step(*([kwargs.pop("x")] if "x" in kwargs else []), **kwargs)
        out.append({g: [p.grad.detach().clone() for p in _trainable([s])]
                    for g, s in subs.items()})
    return out


def run_torch_zoo(name: str, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor,
                  stages: int = 2, micro_batches: int | Sequence[int] = 4, *,
                  timeout: float = 30) -> list[torch.Tensor] | list[list[torch.Tensor]]:
    """The gradients of the same step computed by torch's multi-stage schedule
    :data:`TORCH_ZOO` ``[name]``, two stages per rank (the loop placement for the
    interleaved ones, the V placement for ZB-V and DualPipe-V), the model cut into ``2P``
    virtual stages as :func:`parlearn.multi_device.pipeline.virtual.run_schedule` cuts it."""
    check_choice("name", name, tuple(TORCH_ZOO))
    stages = _check_pipeline_args(model, x, y, stages, None)[0]
    from parlearn.multi_device.pipeline.schedules import Schedule
    from parlearn.multi_device.pipeline.virtual import chunk_layers

    # The same cut as the worker's: two virtual stages per rank.
    _check_ties(model, chunk_layers(len(model), Schedule([[] for _ in range(stages)], name,
                                                         stages, 1, 2, TORCH_ZOO[name][1])))
    ms, single = _micro_list(micro_batches, len(x))
    from parlearn import distributed as dist

    _preimport()
    import torch.distributed.pipelining  # noqa: F401
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    per_rank = dist.run(_worker_torch_zoo, stages, args=(name, model, x, y, ms),
                        backend="gloo", timeout=timeout, deadline=4 * timeout)
    grads = []
    for i in range(len(ms)):
        by_stage = {g: gr for r in per_rank for g, gr in r[i].items()}
        grads.append([g for k in sorted(by_stage) for g in by_stage[k]])
    return grads[0] if single else grads


def dualpipe_v_order(stages: int, micro_batches: int):
    """Torch's DualPipe-V order (``ScheduleDualPipeV``, after DeepSeek's DualPipe repository)
    as our :class:`parlearn.multi_device.pipeline.schedules.Schedule`, so that our
    simulator times it and our ranks execute it: torch's ``F``, ``I`` (input gradient) and
    ``W`` become our ``F``, ``B`` and ``W``; its full backward ``B`` our ``B`` then ``W``; its
    ``OVERLAP_F_B`` our ``F``, ``B`` and ``W`` marked as one overlapped F&B group (the
    schedule's ``overlap``). :func:`parlearn.multi_device.pipeline.zoo.dualpipe_v` builds
    the same order from DeepSeek's phases. It reads a private torch method (torch 2.13), so it
    may break with another torch. Needs ``micro_batches >= 2 * stages``."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    from parlearn.core.checks import check_int
    from parlearn.multi_device.pipeline.schedules import Op, Schedule

    p, m = check_int("stages", stages, lo=1), check_int("micro_batches", micro_batches, lo=1)
    if m < 2 * p:
        raise ValueError(f"micro_batches must be at least 2 * stages = {2 * p} for "
                         f"DualPipe-V, got {m}")
    fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m)
    orders, overlap = [], []
    for r in range(p):
        ops: list = []

        def add(action, r=r, ops=ops):
            chunk, kind, mb = int(action.stage_index != r), action.computation_type.value, \
                action.microbatch_index
            ours = {"F": ["F"], "I": ["B"], "W": ["W"], "B": ["B", "W"]}[kind]
            ops.extend(Op(k, mb, chunk) for k in ours)

        for action in ScheduleDualPipeV._calculate_single_rank_operations(fake, r):
            if action is None:
                continue
            if action.sub_actions:
                overlap.append((r, len(ops)))
                for sub in action.sub_actions:
                    add(sub)
            else:
                add(action)
        orders.append(ops)
    return Schedule(orders, "dualpipe-v", p, m, chunks=2, placement="v", overlap=overlap)
