"""Megatron-LM's tensor-parallel layers with Megatron's own constructor arguments (lesson 14).

:mod:`parlearn.multi_device.tensor_parallel.megatron` builds the split layers from a full
``nn.Linear``; here they are built the way Megatron-LM (Shoeybi et al. 2019,
arXiv:1909.08053, ``megatron/core/tensor_parallel/layers.py``) and picotron build them,
from the layer's sizes: ``MegatronColumnParallelLinear(in_features, out_features,
gather_output=...)``, ``MegatronRowParallelLinear(..., input_is_parallel=...)``,
:class:`VocabParallelEmbedding` and :func:`vocab_parallel_cross_entropy`.

Initialisation follows Megatron's ``use_cpu_initialization`` path: every rank builds the
full ``nn.Linear`` / ``nn.Embedding`` from ``seed`` (:func:`serial_linear`,
:func:`serial_embedding`: the serial references) and keeps its slice, so the union of the
ranks' shards is exactly the full layer a user builds with the same seed.

Besides ``f`` / ``g`` (:class:`~parlearn.multi_device.tensor_parallel.megatron.CopyToRanks`,
:class:`~parlearn.multi_device.tensor_parallel.megatron.SumOverRanks`), two more
conjugate operators move activations along the last (feature) dimension:

- :class:`GatherFromRanks` (Megatron's ``gather_from_tensor_model_parallel_region``):
  all-gather forward, SPLIT backward (each rank keeps its slice of the gradient);
- :class:`SplitToRanks` (``scatter_to_tensor_model_parallel_region``): split forward,
  all-gather backward.

They are not sequence parallelism's gather / reduce-scatter pair
(:mod:`parlearn.multi_device.context_parallel.sequence_parallel`): there every rank's
gathered output feeds a *different* computation (its own column shard), so the gradients
must be summed; here every rank computes the *same* loss from the same gathered tensor,
so summing the ranks' (equal) gradients would make them ``N`` times too large.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from parlearn.core.checks import check_bool, check_callable, check_choice, check_int, check_tensor
from parlearn.distributed.agree import agree
from parlearn.multi_device.tensor_parallel.megatron import CopyToRanks, SumOverRanks

__all__ = ["GatherFromRanks", "SplitToRanks", "MegatronColumnParallelLinear",
           "MegatronRowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "serial_linear", "serial_embedding"]


# ---------------------------------------------------------------------------------------
# Checks shared by the layers.

def _check_dtype(dtype: Any) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return dtype


def _check_group(group: Any) -> Any:
    if group is not None and not isinstance(group, tdist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got "
                        f"{type(group).__name__}")
    return group


def _world(group: Any) -> tuple[int, int] | None:
    """``(rank, world_size)`` in ``group``, None when no group is initialised (``agree``
    then raises the argument error or says a group is needed)."""
    if not tdist.is_initialized():
        return None
    return tdist.get_rank(group), tdist.get_world_size(group)


def _divisible(name: str, n: int, world: int) -> None:
    if n % world:
        raise ValueError(f"{name}={n} must be divisible by the tensor-parallel group size "
                         f"{world} (every rank holds an equal shard)")


def _name_of(fn: Callable | None) -> str | None:
    # Compared across ranks: a lambda's repr holds an address that differs per process.
    return None if fn is None else getattr(fn, "__qualname__", type(fn).__name__)


def _agree_input(name: str, x: Any, want: tuple, group: Any, *, floating: bool = True,
                 high: int | None = None) -> None:
    """``x`` a tensor whose trailing sizes are ``want`` (and, for ids, in ``[0, high)``),
    of one shape and dtype on every rank: checked before the first message."""
    err = None
    try:
        check_tensor(name, x, floating=floating)
        if x.dim() < max(int(floating), len(want)) or tuple(x.shape[x.dim() - len(want):]) != want:
            raise ValueError(f"{name} must end in sizes {want}, got shape {tuple(x.shape)}")
        if high is not None and x.numel() and not (0 <= int(x.min()) and int(x.max()) < high):
            raise ValueError(f"{name} must hold ids in [0, {high}), got values in "
                             f"[{int(x.min())}, {int(x.max())}]")
    except (TypeError, ValueError) as e:
        err = e
    agree({f"{name}.shape": tuple(x.shape) if isinstance(x, torch.Tensor) else None,
           f"{name}.dtype": str(getattr(x, "dtype", None))}, err, group=group)


# ---------------------------------------------------------------------------------------
# The tensor-parallel gather / split pair, along the last dimension.

def _all_gather_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(tdist.get_world_size(group))]
    tdist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _my_slice_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    world, rank = tdist.get_world_size(group), tdist.get_rank(group)
    return x.chunk(world, dim=-1)[rank].contiguous()


class GatherFromRanks(torch.autograd.Function):
    """All-gather along the last dimension forward; backward SPLIT: this rank's slice of the
    gradient, no reduction (Megatron's ``_GatherFromModelParallelRegion``).
    ``GatherFromRanks.apply(x, group)``.

    Every rank then computes the same function of the same gathered tensor, so the gradient
    is already the full one on each rank: rank ``r`` keeps the columns it produced. (Sequence
    parallelism's gather reduce-scatters instead, because there each rank's use of the
    gathered tensor is different; applied here it would sum ``N`` equal gradients.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group=None) -> torch.Tensor:
        _check_group(group)
        _agree_input("x", x, (), group)
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _my_slice_last(grad, ctx.group), None


class SplitToRanks(torch.autograd.Function):
    """Keep this rank's slice of the last dimension forward (no communication); backward
    ALL-GATHER of the slices' gradients, so every rank gets the gradient of the whole input
    (Megatron's ``_ScatterToModelParallelRegion``). ``SplitToRanks.apply(x, group)``; the
    last dimension must divide by the group size."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group=None) -> torch.Tensor:
        _check_group(group)
        err = None
        try:
            check_tensor("x", x)
            if x.dim() == 0:
                raise ValueError("x must have at least one dimension to split")
            _divisible("x.shape[-1]", x.shape[-1], tdist.get_world_size(group))
        except (TypeError, ValueError) as e:
            err = e
        agree({"x.shape": tuple(x.shape) if isinstance(x, torch.Tensor) else None,
               "x.dtype": str(getattr(x, "dtype", None))}, err, group=group)
        ctx.group = group
        return _my_slice_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_last(grad, ctx.group), None


# ---------------------------------------------------------------------------------------
# Serial references: the full layers every rank slices.

def serial_linear(in_features: int, out_features: int, bias: bool = True, *, seed: int = 0,
                  dtype: torch.dtype = torch.float32,
                  init_method: Callable[[torch.Tensor], Any] | None = None) -> nn.Linear:
    """``nn.Linear(in_features, out_features, bias)`` initialised by torch's default from
    CPU seed ``seed`` (then ``init_method(weight)`` under the same seed, when given), in
    ``dtype``. The global RNG is restored afterwards."""
    in_features = check_int("in_features", in_features, lo=1)
    out_features = check_int("out_features", out_features, lo=1)
    bias = check_bool("bias", bias)
    seed = check_int("seed", seed, lo=0)   # an int: every rank rebuilds the layer from it
    dtype = _check_dtype(dtype)
    if init_method is not None:
        check_callable("init_method", init_method)
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        full = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
        if init_method is not None:
            with torch.no_grad():
                init_method(full.weight)
    return full


def serial_embedding(num_embeddings: int, embedding_dim: int, *, seed: int = 0,
                     dtype: torch.dtype = torch.float32,
                     init_method: Callable[[torch.Tensor], Any] | None = None) -> nn.Embedding:
    """``nn.Embedding(num_embeddings, embedding_dim)`` initialised (N(0, 1), torch's
    default, or ``init_method(weight)``) from CPU seed ``seed``; the global RNG is restored."""
    num_embeddings = check_int("num_embeddings", num_embeddings, lo=1)
    embedding_dim = check_int("embedding_dim", embedding_dim, lo=1)
    seed = check_int("seed", seed, lo=0)
    dtype = _check_dtype(dtype)
    if init_method is not None:
        check_callable("init_method", init_method)
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        full = nn.Embedding(num_embeddings, embedding_dim, dtype=dtype)
        if init_method is not None:
            with torch.no_grad():
                init_method(full.weight)
    return full


def _setup(fields: dict[str, Any], checks: Callable[[], None], group: Any,
           split: tuple[str, int] | None) -> tuple[int, int]:
    """Run ``checks`` and the divisibility of ``split = (name, size)`` locally, then agree
    with every rank of ``group`` on the verdict and on ``fields``; ``(rank, world)``."""
    err, g = None, group
    try:
        _check_group(group)
    except TypeError as e:   # agree over the world: the only group this rank can name
        err, g = e, None
    where = _world(g)
    if err is None:
        try:
            checks()
            if where is not None and split is not None:
                _divisible(split[0], split[1], where[1])
        except (TypeError, ValueError) as e:
            err = e
    agree(fields, err, group=g)
    assert where is not None   # agree raised otherwise
    return where


def _linear_shard(in_features: Any, out_features: Any, bias: Any, flag: tuple[str, Any],
                  group: Any, init_method: Any, seed: Any, dtype: Any, *,
                  split: str) -> tuple[int, nn.Linear, slice]:
    """The Megatron linear layers' shared set-up: check their arguments (and the layer's own
    bool ``flag = (name, value)``) and agree on them with every rank of ``group``, then build
    the full :func:`serial_linear`. ``(world, full, part)``: ``part`` is the slice of the
    ``split`` dimension (``"in_features"`` or ``"out_features"``) this rank holds."""
    flag_name, flag_value = flag

    def checks() -> None:
        check_int("in_features", in_features, lo=1)
        check_int("out_features", out_features, lo=1)
        check_bool("bias", bias)
        check_bool(flag_name, flag_value)
        if init_method is not None:
            check_callable("init_method", init_method)
        check_int("seed", seed, lo=0)
        _check_dtype(dtype)

    fields = {"in_features": in_features, "out_features": out_features, "bias": bias,
              flag_name: flag_value, "seed": seed, "dtype": str(dtype),
              "init_method": _name_of(init_method)}
    n = {"in_features": in_features, "out_features": out_features}[split]
    rank, world = _setup(fields, checks, group, (split, n))
    full = serial_linear(in_features, out_features, bias, seed=seed, dtype=dtype,
                         init_method=init_method)
    return world, full, slice(rank * n // world, (rank + 1) * n // world)


# ---------------------------------------------------------------------------------------
# The layers.

class MegatronColumnParallelLinear(nn.Module):
    """Megatron's ``ColumnParallelLinear(in_features, out_features, bias, gather_output)``:
    this rank holds output features ``[r O/N, (r+1) O/N)`` of the full
    :func:`serial_linear` ``(in_features, out_features, bias, seed=seed)``. ``forward(x)``
    applies ``f`` (:class:`CopyToRanks`: ``dx`` summed over ranks) and returns this rank's
    slice of ``full(x)``, or with ``gather_output=True`` the whole ``full(x)`` on every rank
    by :class:`GatherFromRanks`. ``out_features`` must divide by the group size."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 gather_output: bool = False, group=None,
                 init_method: Callable[[torch.Tensor], Any] | None = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        _, full, part = _linear_shard(in_features, out_features, bias,
                                      ("gather_output", gather_output), group, init_method,
                                      seed, dtype, split="out_features")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.group = gather_output, group
        self.weight = nn.Parameter(full.weight.detach()[part].clone())
        self.bias = nn.Parameter(full.bias.detach()[part].clone()) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _agree_input("x", x, (self.in_features,), self.group)
        if x.dtype != self.weight.dtype:
            raise TypeError(f"x must have dtype {self.weight.dtype}, got {x.dtype}")
        y = F.linear(CopyToRanks.apply(x, self.group), self.weight, self.bias)
        return GatherFromRanks.apply(y, self.group) if self.gather_output else y


class MegatronRowParallelLinear(nn.Module):
    """Megatron's ``RowParallelLinear(in_features, out_features, bias, input_is_parallel)``:
    this rank holds input features ``[r I/N, (r+1) I/N)`` of the full :func:`serial_linear`.
    ``forward(x)`` takes this rank's slice of the input features (``input_is_parallel=True``)
    or the full input, which it splits itself by :class:`SplitToRanks` (backward: the
    slices' gradients all-gathered); the partial products are summed by ``g``
    (:class:`SumOverRanks`) and the bias, held whole on every rank, is added once after the
    sum. Returns ``full(x)`` on every rank. ``in_features`` must divide by the group size."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 input_is_parallel: bool = True, group=None,
                 init_method: Callable[[torch.Tensor], Any] | None = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        world, full, part = _linear_shard(in_features, out_features, bias,
                                          ("input_is_parallel", input_is_parallel), group,
                                          init_method, seed, dtype, split="in_features")
        self.in_features, self.out_features, self.world = in_features, out_features, world
        self.input_is_parallel, self.group = input_is_parallel, group
        self.weight = nn.Parameter(full.weight.detach()[:, part].clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.in_features // self.world if self.input_is_parallel else self.in_features
        _agree_input("x", x, (width,), self.group)
        if x.dtype != self.weight.dtype:
            raise TypeError(f"x must have dtype {self.weight.dtype}, got {x.dtype}")
        if not self.input_is_parallel:
            x = SplitToRanks.apply(x, self.group)
        y = SumOverRanks.apply(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Megatron's ``VocabParallelEmbedding(num_embeddings, embedding_dim)``: this rank holds
    rows ``[r V/N, (r+1) V/N)`` of the full :func:`serial_embedding`. ``forward(ids)`` looks
    up the ids it owns, writes 0 for the others, and ``g`` (:class:`SumOverRanks`) sums the
    ranks' outputs: exactly one rank contributes each token's row. Returns ``full(ids)`` on
    every rank; ids outside ``[0, num_embeddings)`` are refused (on every rank)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group=None,
                 init_method: Callable[[torch.Tensor], Any] | None = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32):
        super().__init__()

        def checks() -> None:
            check_int("num_embeddings", num_embeddings, lo=1)
            check_int("embedding_dim", embedding_dim, lo=1)
            if init_method is not None:
                check_callable("init_method", init_method)
            check_int("seed", seed, lo=0)
            _check_dtype(dtype)

        fields = dict(num_embeddings=num_embeddings, embedding_dim=embedding_dim, seed=seed,
                      dtype=str(dtype), init_method=_name_of(init_method))
        rank, world = _setup(fields, checks, group, ("num_embeddings", num_embeddings))
        full = serial_embedding(num_embeddings, embedding_dim, seed=seed, dtype=dtype,
                                init_method=init_method)
        self.start = rank * num_embeddings // world
        self.end = (rank + 1) * num_embeddings // world
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.weight = nn.Parameter(full.weight.detach()[self.start:self.end].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _agree_input("ids", ids, (), self.group, floating=False, high=self.num_embeddings)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)   # any valid row: zeroed below
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return SumOverRanks.apply(out, self.group)


# ---------------------------------------------------------------------------------------
# Cross-entropy over logits split along the vocabulary.

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss ``logsumexp(z) - z[target]`` from this rank's vocabulary slice of the
    logits ``z`` (Megatron's ``_VocabParallelCrossEntropy``): three all-reduces of one
    number per token (max, target logit, sum of exponentials), never the whole logits."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group=None) -> torch.Tensor:
        rank, n = tdist.get_rank(group), logits.shape[-1]
        start = rank * n
        # Subtracting the global max keeps exp() from overflowing; it cancels in the loss.
        m = logits.detach().max(dim=-1).values
        tdist.all_reduce(m, op=tdist.ReduceOp.MAX, group=group)
        shifted = logits.detach() - m.unsqueeze(-1)
        outside = (target < start) | (target >= start + n)
        local = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        tdist.all_reduce(picked, group=group)    # the target's owner contributes its logit
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        tdist.all_reduce(total, group=group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, outside)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # d loss / d z = softmax(z) - onehot(target): the softmax is this rank's slice; the
        # one-hot has its 1 on the owner's slice only. No communication.
        soft, local, outside = ctx.saved_tensors
        onehot = torch.zeros_like(soft).scatter_(-1, local.unsqueeze(-1), 1.0)
        onehot.masked_fill_(outside.unsqueeze(-1), 0.0)
        return (soft - onehot) * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor,
                                 group=None, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(full_logits.flatten(0, -2), target.flatten(), reduction=reduction)``
    from this rank's slice ``logits_shard`` (``(..., V/N)``, columns ``[r V/N, (r+1) V/N)``
    of the full logits, e.g. a :class:`MegatronColumnParallelLinear` output with
    ``gather_output=False``) and ``target`` (``(...)``, ids in ``[0, V)``), with its exact
    gradient; equal on every rank of ``group``. ``reduction``: ``"mean"``, ``"sum"`` or
    ``"none"`` (per-token losses, shaped like ``target``)."""
    err, g = None, group
    try:
        _check_group(group)
    except TypeError as e:
        err, g = e, None
    try:
        check_tensor("logits_shard", logits_shard, floating=True)
        if logits_shard.dim() < 1 or logits_shard.shape[-1] < 1:
            raise ValueError(f"logits_shard must have a non-empty last (vocabulary) dimension, "
                             f"got shape {tuple(logits_shard.shape)}")
        check_tensor("target", target, floating=False, shape=tuple(logits_shard.shape[:-1]))
        reduction = check_choice("reduction", reduction, ("mean", "sum", "none"))
        vocab = logits_shard.shape[-1] * (tdist.get_world_size(g)
                                          if tdist.is_initialized() else 1)
        if target.numel() and not (0 <= int(target.min()) and int(target.max()) < vocab):
            raise ValueError(f"target must hold ids in [0, {vocab}), got values in "
                             f"[{int(target.min())}, {int(target.max())}]")
    except (TypeError, ValueError) as e:
        err = err or e
    agree({"logits_shard.shape": tuple(getattr(logits_shard, "shape", ())),
           "logits_shard.dtype": str(getattr(logits_shard, "dtype", None)),
           "target.shape": tuple(getattr(target, "shape", ())), "reduction": reduction},
          err, group=g)
    loss = _VocabParallelCrossEntropy.apply(logits_shard, target, group)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.mean()
