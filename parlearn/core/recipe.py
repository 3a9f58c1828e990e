"""The training recipe a torch user writes, in one place: :class:`Recipe`.

AdamW with weight decay on matrices only (LayerNorm gains and biases in a second group with
no decay), clipping by the global gradient norm, and a linear warm-up followed by a cosine
decay of the learning rate to a floor. It is what nanoGPT-style trainers run, and every
parallel wrapper in parlearn runs it unchanged: DDP with ``no_sync``, ZeRO-1/2
(:class:`parlearn.sharding.ShardedOptimizer`), the FSDP-style wrapper and the n-D mesh
(:func:`parlearn.mesh.mesh_train` with ``recipe=``), each checked equal to one process.

What a wrapper changes is only *where* the pieces run: the param groups are built from the
tensors a rank holds, the schedule steps the wrapper's optimizer, and the global norm is the
norm over every gradient element of the whole model exactly once, which on sharded ranks
takes a sum over ranks (each wrapper's ``clip_grad_norm_``).

    recipe = Recipe(weight_decay=0.1, clip=1.0, warmup=10)
    opt = torch.optim.AdamW(recipe.param_groups(model.parameters()), lr=3e-3,
                            betas=recipe.betas)
    sched = recipe.scheduler(opt, steps=300)
    ...; loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
    opt.step(); sched.step()
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parlearn.core.checks import check_float, check_int

__all__ = ["Recipe"]


@dataclass(frozen=True)
class Recipe:
    """AdamW's decay groups, a global-norm clip and a warm-up + cosine schedule.

    ``weight_decay``: decoupled decay (Loshchilov and Hutter, 2019) on tensors with two or
    more dims; vectors (norms' gains, biases) get none. ``clip``: the largest global L2
    norm of the gradients. ``warmup``: steps of linear warm-up. ``floor``: the cosine ends
    at ``floor`` times the peak learning rate. ``betas``: AdamW's."""

    weight_decay: float = 0.1
    clip: float = 1.0
    warmup: int = 2
    floor: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)

    def __post_init__(self) -> None:
        check_float("weight_decay", self.weight_decay, lo=0)
        check_float("clip", self.clip, lo=0, lo_open=True)
        check_int("warmup", self.warmup, lo=1)
        check_float("floor", self.floor, lo=0, hi=1)
        if not isinstance(self.betas, tuple) or len(self.betas) != 2:
            raise TypeError(f"betas must be a tuple of two floats, got {self.betas!r}")
        for i, b in enumerate(self.betas):
            check_float(f"betas[{i}]", b, lo=0, hi=1, hi_open=True)

    def param_groups(self, params) -> list[dict]:
        """Two groups of ``params`` (tensors, or ``(name, tensor)`` pairs from
        ``named_parameters()``): tensors with ``dim() >= 2`` decay, the others do not. A
        frozen tensor (``requires_grad=False``) is left out: no optimizer should hold it."""
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors, got a single tensor")
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        for i, p in enumerate(tensors):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params[{i}] must be a tensor, got {type(p).__name__}")
        live = [p for p in tensors if p.requires_grad]
        if not live:
            raise ValueError("params has no tensor that requires a gradient")
        return [{"params": [p for p in live if p.dim() >= 2], "weight_decay": self.weight_decay},
                {"params": [p for p in live if p.dim() < 2], "weight_decay": 0.0}]

    def factor(self, step: int, steps: int) -> float:
        """The learning rate at ``step`` (0-based) of ``steps``, as a fraction of the peak:
        linear warm-up over ``warmup`` steps times a cosine from 1 down to ``floor``."""
        step, steps = check_int("step", step, lo=0), check_int("steps", steps, lo=1)
        warm = min(1.0, (step + 1) / self.warmup)
        return warm * (self.floor + (1 - self.floor) * 0.5 * (
            1 + math.cos(math.pi * min(step, steps) / steps)))

    def scheduler(self, optimizer: torch.optim.Optimizer, steps: int):
        """A ``LambdaLR`` on ``optimizer`` (any torch optimizer, a sharded one included:
        its ``param_groups`` are the full groups) that follows :meth:`factor`."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch optimizer, got "
                            f"{type(optimizer).__name__}")
        steps = check_int("steps", steps, lo=1)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: self.factor(i, steps))


def _clip_to(grads, total: torch.Tensor, max_norm: float, norm_type: float = 2.0
             ) -> torch.Tensor:
    """The scaling step every sharded ``clip_grad_norm_`` shares: ``total`` is the sum, over
    every rank, of ``|g| ** norm_type`` of the gradient elements each rank answers for;
    ``grads`` (this rank's gradients) are scaled in place by torch's factor
    ``max_norm / (norm + 1e-6)`` when it is below 1. Returns the norm."""
    norm = total.pow(1.0 / norm_type)
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1:
        for g in grads:
            g.detach().mul_(coef)
    return norm
