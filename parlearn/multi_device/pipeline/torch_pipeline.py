"""The real engine: the same stages through ``torch.distributed.pipelining``.

:func:`run_torch_pipeline` computes the gradients of the same step as
:func:`parlearn.multi_device.pipeline.runtime.run_pipeline`, the same layers on each rank,
driven by torch's own schedules (:data:`TORCH_SCHEDULES`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from parlearn.core.checks import check_choice
from parlearn.multi_device.pipeline.runtime import (
    _check_pipeline_args,
    _loss,
    _micro_list,
    _preimport,
    _stage_layers,
)
from parlearn.multi_device.pipeline.schedules import SCHEDULES

__all__ = ["TORCH_SCHEDULES", "run_torch_pipeline"]


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
        out.append([p.grad.detach().clone() for p in sub.parameters()])
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
    stages, counts = _check_pipeline_args(model, x, y, stages, counts)
    ms, single = _micro_list(micro_batches, len(x))
    from parlearn import dist

    _preimport()
    import torch.distributed.pipelining  # noqa: F401  (imported once here, not per rank)
    per_rank = dist.run(_worker_torch, stages, args=(kind, model, x, y, counts, ms),
                        backend="gloo", timeout=timeout, deadline=4 * timeout)
    grads = [[g for r in per_rank for g in r[i]] for i in range(len(ms))]
    return grads[0] if single else grads
