"""Several meshes checked against one process in one launch of the ranks: :func:`mesh_checks`.

Lesson 19 checks the tiny GPT on four meshes of 8 ranks; starting 8 ranks costs seconds each
time, so :func:`mesh_checks` trains every mesh in turn in the same processes
(:func:`parlearn.distributed.run_many`: each from a fresh model, each with its own process
groups) and compares each with :func:`parlearn.context_parallel.serial_train`, exactly as
:func:`mesh_check` does.
"""

from __future__ import annotations

from parlearn.core.checks import check_float
from parlearn.multi_device.mesh.composed import (
    _against_serial,
    check_train_args,
    mesh_train_worker,
)
from parlearn.multi_device.mesh.layout import MeshShape
from parlearn.multi_device.transformer.model import GPTConfig

__all__ = ["mesh_checks"]


def _check_shapes(cfg: GPTConfig, shapes, steps: int, batch: int, seq: int,
                  micro_batches: int, lr: float, seed: int) -> list[MeshShape]:
    """``shapes``: a non-empty list of :class:`MeshShape` of one world size, each one
    :func:`mesh_train` can run with these arguments."""
    if not isinstance(shapes, list | tuple) or not shapes:
        raise TypeError(f"shapes must be a non-empty list of MeshShape, got {shapes!r}")
    for i, s in enumerate(shapes):
        if not isinstance(s, MeshShape):
            raise TypeError(f"shapes[{i}] must be a MeshShape, got {type(s).__name__}")
        if s.world != shapes[0].world:
            raise ValueError(f"shapes[{i}] has {s.world} ranks, shapes[0] {shapes[0].world}: "
                             "one launch needs one world size")
        check_train_args(cfg, s, steps, batch, seq, micro_batches, lr, seed, True, 1, "none",
                         "1f1b")
    return list(shapes)


def mesh_checks(cfg: GPTConfig, shapes: list, *, steps: int = 3, batch: int = 8, seq: int = 16,
                micro_batches: int = 2, lr: float = 1e-2, seed: int = 0,
                timeout: float = 60) -> list[dict]:
    """:func:`mesh_check` for each of ``shapes`` (one world size) in one launch of the
    ranks: ``result[i]`` is what ``mesh_check(cfg, shapes[i], ...)`` returns."""
    from parlearn.distributed import run_many

    shapes = _check_shapes(cfg, shapes, steps, batch, seq, micro_batches, lr, seed)
    check_float("timeout", timeout, lo=0, lo_open=True)
    per_shape = run_many(mesh_train_worker, shapes[0].world,
                         [(cfg, s, steps, batch, seq, micro_batches, lr, seed, True, 1, "none",
                           "1f1b") for s in shapes], backend="gloo", timeout=timeout)
    same = dict(steps=steps, batch=batch, seq=seq, lr=lr, seed=seed)
    return [_against_serial(cfg, s, ranks, same, None)
            for s, ranks in zip(shapes, per_shape, strict=True)]
