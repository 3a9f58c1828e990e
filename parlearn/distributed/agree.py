"""Ranks agree before the first message: one small all-gather of each rank's verdict on its
own arguments and of a descriptor of what must match (shapes, dtypes, sizes).

A function that runs on ranks checks its arguments locally, catching its own refusal, then
calls :func:`agree`: every rank learns whether any rank refused and whether the
descriptors match, and every rank raises the same kind of error (naming the argument), so
a bad argument on one rank is an error on all of them, never a hang of the others in the
next collective. The exchange is bookkeeping, not payload: it is left out of
:func:`parlearn.distributed.ledger` so the ledgers keep counting the algorithm's own
messages.

    err = None
    try:
        check_tensor("x", x, ndim=3)
    except (TypeError, ValueError) as e:
        err = e
    agree({"x.shape": describe(x)}, err, group=group)
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as tdist

from parlearn.distributed import traffic

__all__ = ["agree", "describe"]


def describe(t: Any) -> Any:
    """A picklable summary of ``t`` to compare across ranks: ``(shape, dtype)`` of a
    tensor, the type name of anything else."""
    if isinstance(t, torch.Tensor):
        return tuple(t.shape), str(t.dtype)
    return type(t).__name__


@contextmanager
def _unrecorded() -> Iterator[None]:
    # The ledger skips collectives issued while its depth marker is set (a collective inside
    # another is not counted twice); set it so the agreement is not counted as payload.
    depth = getattr(traffic._inside, "depth", 0)
    traffic._inside.depth = 1
    try:
        yield
    finally:
        traffic._inside.depth = depth


def agree(fields: dict[str, Any], error: BaseException | None = None, group=None) -> None:
    """All-gather ``(fields, error)`` over ``group``; raise on every rank when a rank refused
    its arguments (its own error on that rank, the same message prefixed with the rank on
    the others) or when a field differs between ranks (``ValueError`` naming the field and
    every rank's value). ``fields`` maps an argument's name (``"x.shape"``) to a picklable
    value that must be equal on every rank."""
    if not tdist.is_initialized():
        if error is not None:
            raise error
        raise RuntimeError("this function needs an initialised torch.distributed group")
    world = tdist.get_world_size(group)
    try:
        pickle.dumps(fields)
    except Exception:   # a user's object that does not pickle: compare what it prints as
        fields = {name: repr(value) for name, value in fields.items()}
    verdict = None if error is None else (type(error).__name__, str(error))
    gathered: list = [None] * world
    with _unrecorded():
        tdist.all_gather_object(gathered, (fields, verdict), group=group)
    if error is not None:
        raise error
    for r, (_, other) in enumerate(gathered):
        if other is not None:
            kind = TypeError if other[0] == "TypeError" else ValueError
            raise kind(f"rank {r} refused its arguments: {other[1]}")
    for name in fields:
        values = [f.get(name) for f, _ in gathered]
        if any(v != values[0] for v in values[1:]):
            got = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(f"{name} must be the same on every rank (it differs between "
                             f"ranks), got {got}")
