"""Megatron sequence parallelism inside a tensor-parallel group (lesson 17).

Tensor parallelism (lesson 14) splits the matmuls but leaves LayerNorm, dropout and the
residual add replicated: every rank keeps the whole ``(s, b, h)`` activation of those
regions. Korthikanti et al. (2022) shard them along the sequence instead, which is free
because they act token by token. The conjugate operators change:

- ``g`` (:class:`GatherSequence`): all-gather along the sequence forward (the column-
  parallel matmul needs every token), reduce-scatter backward;
- ``g-bar`` (:class:`ScatterSequence`): reduce-scatter forward (sums the row-parallel
  partial outputs AND leaves each rank its slice of tokens), all-gather backward.

A ring all-reduce IS a reduce-scatter followed by an all-gather, so one block moves the
same bytes as under plain TP (:func:`parlearn.distributed.ring_bytes`: ``2(t-1)/t n`` either way)
while the LayerNorm/dropout activations per rank fall from ``s b h`` to ``s b h / t``.
Tensors here are sequence-first ``(s, b, h)`` as in Megatron, and the sequence must divide
by ``t`` (the gather concatenates equal slices).

LayerNorm's weights stay replicated under SP but each rank sees only its tokens, so their
gradients are partial sums: the caller all-reduces them over the group (Megatron does the
same); :func:`sp_block_worker` checks their sum.

torch's own version is ``parallelize_module`` with ``SequenceParallel`` on the norms and
``ColwiseParallel(input_layouts=Shard(0))`` / ``RowwiseParallel(output_layouts=Shard(0))``
on the linears; :func:`sp_block_worker` runs it beside ours.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from parlearn.core.checks import check_int, check_module, check_tensor
from parlearn.distributed.agree import agree
from parlearn.multi_device.tensor_parallel.megatron import CopyToRanks, SumOverRanks

__all__ = ["GatherSequence", "ScatterSequence", "SequenceParallelBlock", "TensorParallelBlock",
           "serial_block", "sp_block_worker"]


def _check_agree(x, group, dim, scatter: bool) -> int:
    """Check ``x`` and ``dim`` on every rank and that the ranks hold the same shape and
    dtype (equal slices: an uneven one would abort inside the collective), before the
    first message; returns ``dim`` made non-negative."""
    err = None
    try:
        check_tensor("x", x)
        dim = check_int("dim", dim, lo=-max(x.dim(), 1), hi=max(x.dim(), 1) - 1)
        dim %= max(x.dim(), 1)
        world = tdist.get_world_size(group)
        if scatter and x.shape[dim] % world:
            raise ValueError(f"sequence parallelism needs the sequence of x (dim {dim}, "
                             f"{x.shape[dim]} tokens) divisible by the group size {world}")
    except (TypeError, ValueError) as e:
        err = e
    agree({"x.shape": tuple(x.shape) if isinstance(x, torch.Tensor) else None,
           "x.dtype": str(getattr(x, "dtype", None)), "dim": dim}, err, group=group)
    return dim


def _gather(x: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(tdist.get_world_size(group))]
    tdist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _scatter(x: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    world = tdist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(f"sequence parallelism needs the sequence (dim {dim}, "
                         f"{x.shape[dim]} tokens) divisible by the group size {world}")
    parts = [p.contiguous() for p in x.chunk(world, dim=dim)]
    out = torch.empty_like(parts[0])
    tdist.reduce_scatter(out, parts, group=group)
    return out


class GatherSequence(torch.autograd.Function):
    """SP's ``g``: all-gather along the sequence forward, reduce-scatter backward.
    ``GatherSequence.apply(x, group, dim)``: over ``group`` (default: the world), the
    sequence at ``dim`` (default 0, Megatron's sequence-first layout)."""

    @staticmethod
    def forward(ctx, x, group=None, dim: int = 0):
        dim = _check_agree(x, group, dim, scatter=False)
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _scatter(grad, ctx.group, ctx.dim), None, None


class ScatterSequence(torch.autograd.Function):
    """SP's ``g-bar``: reduce-scatter along the sequence forward, all-gather backward
    (``ScatterSequence.apply(x, group, dim)``, as :class:`GatherSequence`)."""

    @staticmethod
    def forward(ctx, x, group=None, dim: int = 0):
        dim = _check_agree(x, group, dim, scatter=True)
        ctx.group, ctx.dim = group, dim
        return _scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


def serial_block(d_model: int, d_hidden: int, seed: int = 0) -> nn.Sequential:
    """The reference: ``[LayerNorm, Linear, GELU, Linear]`` (float64, no bias on the
    linears); the block computes ``x + mlp(ln(x))``."""
    d_model, d_hidden = check_int("d_model", d_model, lo=1), check_int("d_hidden", d_hidden, lo=1)
    seed = check_int("seed", seed, lo=0)
    gen = torch.Generator().manual_seed(seed)
    block = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, d_hidden, bias=False),
                          nn.GELU(), nn.Linear(d_hidden, d_model, bias=False)).double()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5
                    + (1.0 if p.ndim == 1 else 0.0))
    return block


class _Sharded(nn.Module):
    def __init__(self, full: nn.Sequential, rank: int, world_size: int):
        super().__init__()
        check_module("full", full)
        kinds = (nn.LayerNorm, nn.Linear, nn.Module, nn.Linear)
        if not isinstance(full, nn.Sequential) or len(full) != 4 or not all(
                isinstance(m, k) for m, k in zip(full, kinds, strict=True)):
            raise TypeError("full must be nn.Sequential(LayerNorm, Linear, activation, Linear) "
                            f"as serial_block builds, got {type(full).__name__}")
        world_size = check_int("world_size", world_size, lo=1)
        rank = check_int("rank", rank, lo=0, hi=world_size - 1)
        hidden = full[1].out_features
        if hidden % world_size:
            raise ValueError(f"the hidden width {hidden} must be divisible by "
                             f"world_size={world_size}")
        part = slice(rank * hidden // world_size, (rank + 1) * hidden // world_size)
        self.ln = nn.LayerNorm(full[0].normalized_shape).double()
        self.ln.load_state_dict(full[0].state_dict())
        self.w1 = nn.Parameter(full[1].weight.detach()[part].clone())     # column shard
        self.w2 = nn.Parameter(full[3].weight.detach()[:, part].clone())  # row shard


class TensorParallelBlock(_Sharded):
    """Plain TP (lesson 14): ``x`` replicated ``(s, b, h)``; ``f`` before the column
    shard (all-reduce of the gradient), ``g`` after the row shard (all-reduce forward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = CopyToRanks.apply(self.ln(x))
        return x + SumOverRanks.apply(F.linear(F.gelu(F.linear(h, self.w1)), self.w2))


class SequenceParallelBlock(_Sharded):
    """Megatron SP: ``x`` is this rank's ``(s/t, b, h)`` slice of tokens; LayerNorm and the
    residual add run on the slice; ``g`` gathers before the column shard, ``g-bar``
    reduce-scatters after the row shard. Returns this rank's slice of the output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = GatherSequence.apply(self.ln(x))
        return x + ScatterSequence.apply(F.linear(F.gelu(F.linear(h, self.w1)), self.w2))


def sp_block_worker(rank: int, world_size: int, seq: int, batch: int, d_model: int,
                    d_hidden: int, seed: int = 0) -> dict:
    """Worker: the block under TP, under our SP, and under torch's SP style, on the loss
    ``<block(x), w>``. Returns CPU tensors (outputs, ``dx``, weight-gradient shards, LN
    gradients all-reduced), each scheme's ledger summaries and saved-activation bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from parlearn.distributed import ledger
    from parlearn.multi_device.context_parallel.workers import saved_bytes

    world_size = check_int("world_size", world_size, lo=1)
    rank = check_int("rank", rank, lo=0, hi=world_size - 1)
    seq, batch = check_int("seq", seq, lo=1), check_int("batch", batch, lo=1)
    if seq % world_size:
        raise ValueError(f"seq={seq} must be divisible by world_size={world_size} for SP")
    full = serial_block(d_model, d_hidden, seed)   # checks d_model, d_hidden and seed
    if d_hidden % world_size:
        raise ValueError(f"d_hidden={d_hidden} must be divisible by world_size={world_size} "
                         f"(the column and row split)")
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(seq, batch, d_model, generator=gen, dtype=torch.float64)
    w = torch.randn(seq, batch, d_model, generator=gen, dtype=torch.float64)
    mine = slice(rank * seq // world_size, (rank + 1) * seq // world_size)
    out: dict = {}
    for name, block, xin, win in (("tp", TensorParallelBlock, x, w),
                                  ("sp", SequenceParallelBlock, x[mine], w[mine])):
        model = block(full, rank, world_size)
        xs = xin.clone().requires_grad_(True)
        with ledger() as fwd:
            y, saved = saved_bytes(model, xs)
        with ledger() as bwd:
            (y * win).sum().backward()
        ln = [p.grad.clone() for p in model.ln.parameters()]
        for g in ln:
            if name == "sp":
                tdist.all_reduce(g)
        out[name] = dict(y=y.detach(), dx=xs.grad, w1=model.w1.grad, w2=model.w2.grad,
                         ln=ln, saved=saved,
                         ledger=fwd.records + bwd.records)

    # torch's SP style on the same block (DTensor; its collectives are not in our ledger)
    mesh = init_device_mesh("cpu", (world_size,))
    model = parallelize_module(serial_block(d_model, d_hidden, seed), mesh, {
        "0": SequenceParallel(sequence_dim=0),
        "1": ColwiseParallel(input_layouts=Shard(0)),
        "3": RowwiseParallel(output_layouts=Shard(0))})
    xs = x[mine].clone().requires_grad_(True)
    y = xs + model(xs)
    (y * w[mine]).sum().backward()
    out["torch"] = dict(y=y.detach(), dx=xs.grad,
                        grads=[p.grad.full_tensor() for p in model.parameters()])
    return out
