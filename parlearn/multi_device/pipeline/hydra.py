"""Hydra-style shard parallelism: several independent models through the same stages.

:func:`hydra_schedule` interleaves ``K`` models' micro-batches in one schedule, so one
model's idle slots hold another's work; :func:`hydra_train` runs it on real ranks with
the stages of :mod:`parlearn.multi_device.pipeline.runtime`, and :func:`hydra_reference`
trains each model alone in one process, the result it must equal.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from parlearn.core.checks import check_choice, check_float, check_int, check_module, check_tensor
from parlearn.multi_device.pipeline.partition import split_layers
from parlearn.multi_device.pipeline.runtime import (
    _check_pipeline_args,
    _check_ties,
    _preimport,
    _run_orders,
    _stage_layers,
    _trainable,
    reference_grads,
)
from parlearn.multi_device.pipeline.schedules import SCHEDULES, Op, schedule

__all__ = ["hydra_schedule", "hydra_train", "hydra_reference"]


# ---------------------------------------------------------------------------------------
# Hydra-style shard parallelism: several independent models through the same stages.

def hydra_schedule(kind: str, stages: int, micro_batches: int, models: int) -> list[list[Op]]:
    """:func:`schedule` of ``models * micro_batches`` micro-batches, interleaved: op
    micro-batch ``j`` is micro-batch ``j // models`` of model ``j % models``. One model's
    idle slots hold another's work: the bubble is ``(P-1)/(K M + P-1)`` instead of
    ``(P-1)/(M+P-1)`` per model trained one after another."""
    models = check_int("models", models, lo=1)
    return schedule(kind, stages, check_int("micro_batches", micro_batches, lo=1) * models)


def _worker_hydra(rank: int, world: int, kind: str, models: list[nn.Sequential],
                  data: list[tuple[torch.Tensor, torch.Tensor]], counts: Sequence[int], m: int,
                  steps: int, lr: float, specs_in: list[list]) -> list[list[torch.Tensor]]:
    layers = [_stage_layers(model, counts, rank) for model in models]
    order = hydra_schedule(kind, world, m, len(models))[rank]
    xs, ys = [d[0] for d in data], [d[1] for d in data]
    for _ in range(steps):
        _run_orders(rank, world, order, layers, xs, ys, m, kind == "zb",
                    [specs[rank] for specs in specs_in])
        with torch.no_grad():   # plain SGD on this rank's shard of every model
            for p in (p for lays in layers for p in _trainable(lays)):
                p -= lr * p.grad
                p.grad = None
    # Every parameter (frozen too), each once: the order of the model's parameters().
    return [[p.detach().clone() for p in nn.Sequential(*lays).parameters()]
            for lays in layers]


def _check_hydra(models, data, steps, lr):
    if not isinstance(models, (list, tuple)) or not models:
        raise TypeError("models must be a non-empty list of nn.Sequential")
    for model in models:
        check_module("models", model)
        if not isinstance(model, nn.Sequential) or len(model) != len(models[0]):
            raise ValueError("models must be nn.Sequential with the same number of layers")
    if not isinstance(data, (list, tuple)) or len(data) != len(models):
        raise ValueError(f"data must hold one (x, y) per model ({len(models)})")
    for x, y in data:
        check_tensor("x", x, ndim=2)
        check_tensor("y", y, ndim=2)
    return check_int("steps", steps, lo=1), check_float("lr", lr, lo=0, lo_open=True)


def hydra_train(models: Sequence[nn.Sequential], data: Sequence[tuple[torch.Tensor, torch.Tensor]],
                stages: int = 2, micro_batches: int = 2, *, steps: int = 3, lr: float = 0.1,
                kind: str = "1f1b", counts: Sequence[int] | None = None, timeout: float = 30
                ) -> list[nn.Sequential]:
    """Train every model of ``models`` on its own ``data[i] = (x, y)`` for ``steps`` full-batch
    SGD steps of rate ``lr``, all at once through one pipeline of ``stages`` real ranks:
    stage ``s`` holds layers ``counts`` of every model, and the models' micro-batches are
    interleaved by :func:`hydra_schedule`. Returns trained copies (the inputs untouched)."""
    check_choice("kind", kind, SCHEDULES)
    steps, lr = _check_hydra(models, data, steps, lr)
    specs_in = []
    for model, (x, y) in zip(models, data, strict=True):
        stages, counts, specs = _check_pipeline_args(model, x, y, stages, counts)
        bounds = split_layers(len(model), counts)
        _check_ties(model, bounds)
        specs_in.append([specs[a] for a, _ in bounds])
    m = check_int("micro_batches", micro_batches, lo=1, hi=min(len(x) for x, _ in data))
    from parlearn import distributed as dist

    _preimport()
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    per_rank = dist.run(_worker_hydra, stages,
                        args=(kind, list(models), list(data), counts, m, steps, lr, specs_in),
                        backend="gloo", timeout=timeout, deadline=4 * timeout)
    trained = []
    for i, model in enumerate(models):
        new = copy.deepcopy(model)
        with torch.no_grad():
            for p, value in zip(new.parameters(), [t for r in per_rank for t in r[i]],
                                strict=True):
                p.copy_(value)
        trained.append(new)
    return trained


def hydra_reference(models: Sequence[nn.Sequential],
                    data: Sequence[tuple[torch.Tensor, torch.Tensor]], *, steps: int = 3,
                    lr: float = 0.1) -> list[nn.Sequential]:
    """Each model trained alone in one process, as :func:`hydra_train` trains it."""
    steps, lr = _check_hydra(models, data, steps, lr)
    trained = []
    for model, (x, y) in zip(models, data, strict=True):
        new = copy.deepcopy(model)
        for _ in range(steps):
            grads = reference_grads(new, x, y)
            with torch.no_grad():
                for p, g in zip(_trainable([new]), grads, strict=True):
                    p -= lr * g
        trained.append(new)
    return trained
