"""Megatron's split linear layers, from scratch beside DTensor (lesson 14).

Megatron-LM (Shoeybi et al. 2019) splits an MLP block ``Y = gelu(X A) B`` over ``N`` ranks:
``A`` by columns (rank ``r`` holds ``A[:, r-th chunk]`` and computes its slice of the
hidden activation with no communication, because gelu acts elementwise: any elementwise
activation does, :data:`ELEMENTWISE`), ``B`` by rows
(rank ``r`` holds ``B[r-th chunk, :]`` and computes a partial sum of ``Y``). Two conjugate
autograd functions place the only communication:

- ``f`` (:class:`CopyToRanks`): identity forward, all-reduce of the gradient backward
  (every rank used the same ``X``, so ``dX`` is the sum of the ranks' contributions);
- ``g`` (:class:`SumOverRanks`): all-reduce forward (the partial sums of ``Y``), identity
  backward.

One block therefore costs one all-reduce of ``|Y|`` forward and one of ``|X|`` backward.
:class:`ColumnParallelLinear` and :class:`RowParallelLinear` are built here from an
unsharded ``nn.Linear`` (so the serial reference is that layer), and
:func:`megatron_worker` checks them, beside DTensor's ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel``, against the unsharded block on real ranks.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from parlearn.core.checks import (
    check_float,
    check_int,
    check_module,
    check_seed,
    check_tensor,
)
from parlearn.distributed.agree import agree

__all__ = ["CopyToRanks", "SumOverRanks", "ColumnParallelLinear", "RowParallelLinear",
           "ELEMENTWISE", "MegatronMLP", "serial_mlp", "megatron_worker", "megatron_check",
           "tp_roofline"]


# ---------------------------------------------------------------------------------------
# Megatron: f and g, and the split layers (worker-side: need an initialised group).

def _check_same(x, group) -> None:
    """``x`` a tensor of one shape and dtype on every rank of ``group`` (the all-reduce sums
    them elementwise: a mismatch would abort inside the backend), checked before the first
    message on every rank."""
    err = None
    try:
        check_tensor("x", x)
    except TypeError as e:
        err = e
    agree({"x.shape": tuple(x.shape) if isinstance(x, torch.Tensor) else None,
           "x.dtype": str(getattr(x, "dtype", None))}, err, group=group)


class CopyToRanks(torch.autograd.Function):
    """Megatron's ``f``: identity forward; all-reduce (sum) of the gradient backward.
    ``CopyToRanks.apply(x, group)`` sums over ``group`` (default: the whole world), which
    is how a tensor-parallel group inside a bigger mesh uses it (:mod:`parlearn.mesh`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group=None) -> torch.Tensor:
        _check_same(x, group)   # the backward all-reduces a gradient of x's shape
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        tdist.all_reduce(grad, group=ctx.group)
        return grad, None


class SumOverRanks(torch.autograd.Function):
    """Megatron's ``g``: all-reduce (sum) forward over ``group`` (default: the world);
    identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group=None) -> torch.Tensor:
        _check_same(x, group)
        x = x.contiguous().clone()
        tdist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _check_linear(full) -> None:
    check_module("full", full)
    if not isinstance(full, nn.Linear):
        raise TypeError(f"full must be an nn.Linear, got {type(full).__name__}")


def _check_dtype(dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return dtype


def _chunk(n: int, rank: int, world_size: int) -> slice:
    if n % world_size:
        raise ValueError(f"width {n} must be divisible by world_size={world_size}")
    size = n // world_size
    return slice(rank * size, (rank + 1) * size)


class ColumnParallelLinear(nn.Module):
    """Rank ``rank``'s share of ``full`` split by output features (columns of ``x @ W.T``'s
    weight matrix ``W.T``): ``forward(x)`` returns this rank's slice of ``full(x)``, with
    ``f`` on the input so that ``dx`` is summed over ranks. ``full`` is not modified."""

    def __init__(self, full: nn.Linear, rank: int, world_size: int):
        super().__init__()
        _check_linear(full)
        world_size = check_int("world_size", world_size, lo=1)
        rank = check_int("rank", rank, lo=0, hi=world_size - 1)
        part = _chunk(full.out_features, rank, world_size)
        self.weight = nn.Parameter(full.weight.detach()[part].clone())
        self.bias = (nn.Parameter(full.bias.detach()[part].clone())
                     if full.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(CopyToRanks.apply(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Rank ``rank``'s share of ``full`` split by input features: ``forward(x_part)`` takes
    this rank's slice of the input features and returns the full ``full(x)`` on every rank,
    by ``g`` (one all-reduce) on the partial sums; the bias is added once, after it."""

    def __init__(self, full: nn.Linear, rank: int, world_size: int):
        super().__init__()
        _check_linear(full)
        world_size = check_int("world_size", world_size, lo=1)
        rank = check_int("rank", rank, lo=0, hi=world_size - 1)
        part = _chunk(full.in_features, rank, world_size)
        self.weight = nn.Parameter(full.weight.detach()[:, part].clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = SumOverRanks.apply(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


# Activations that act on each element alone, with no parameters and no randomness: only
# these commute with the column split (rank r's slice of act(h) is act(rank r's slice of h)).
# Softmax, LayerNorm (mix the hidden features), PReLU (a parameter every rank would train
# apart) and Dropout (a mask drawn per rank, not the serial one) are not among them.
ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.Mish,
               nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU, nn.Softplus, nn.Softsign, nn.Hardtanh,
               nn.Hardswish, nn.Hardsigmoid, nn.LogSigmoid, nn.Tanhshrink, nn.Softshrink,
               nn.Hardshrink, nn.Threshold, nn.Identity)


def _check_block(full: nn.Sequential) -> None:
    if not isinstance(full, nn.Sequential) or len(full) != 3:
        raise TypeError("full must be nn.Sequential(nn.Linear, activation, nn.Linear), got "
                        f"{type(full).__name__} of {len(full) if hasattr(full, '__len__') else '?'}"
                        " elements")
    for i in (0, 2):
        if not isinstance(full[i], nn.Linear):
            raise TypeError(f"full[{i}] must be nn.Linear, got {type(full[i]).__name__}")
    if type(full[1]) not in ELEMENTWISE:
        raise ValueError(f"full[1] must be an elementwise activation without parameters "
                         f"({', '.join(c.__name__ for c in ELEMENTWISE)}), got "
                         f"{type(full[1]).__name__}: the column split is exact only for those")
    if full[0].out_features != full[2].in_features:
        raise ValueError(f"full[0].out_features={full[0].out_features} must equal "
                         f"full[2].in_features={full[2].in_features}")


class MegatronMLP(nn.Module):
    """``fc2(act(fc1(x)))`` with ``fc1`` column-parallel and ``fc2`` row-parallel: one
    all-reduce forward (in ``fc2``), one backward (in ``fc1``'s ``f``). ``full`` is
    ``nn.Sequential(nn.Linear, act, nn.Linear)`` with ``act`` one of :data:`ELEMENTWISE`
    (the block's own module is used, with its settings); anything else is refused."""

    def __init__(self, full: nn.Sequential, rank: int, world_size: int):
        super().__init__()
        check_module("full", full)
        _check_block(full)
        self.fc1 = ColumnParallelLinear(full[0], rank, world_size)
        self.act = copy.deepcopy(full[1])
        self.fc2 = RowParallelLinear(full[2], rank, world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def serial_mlp(d_model: int, d_hidden: int, seed: int | torch.Generator = 0,
               dtype: torch.dtype = torch.float64, activation: nn.Module | None = None
               ) -> nn.Sequential:
    """The unsharded block ``Linear(d_model, d_hidden), activation, Linear(d_hidden,
    d_model)`` (``activation`` a copy of the given module, default ``nn.GELU()``),
    initialised from ``seed`` (its own generator; the global RNG is untouched)."""
    d_model = check_int("d_model", d_model, lo=1)
    d_hidden = check_int("d_hidden", d_hidden, lo=1)
    seed = check_seed("seed", seed)
    dtype = _check_dtype(dtype)
    act = nn.GELU() if activation is None else copy.deepcopy(
        check_module("activation", activation))
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    # nn.Linear's default init draws from the global RNG: restore it (values are replaced).
    with torch.random.fork_rng(devices=[]):
        mlp = nn.Sequential(nn.Linear(d_model, d_hidden), act,
                            nn.Linear(d_hidden, d_model)).to(dtype)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) / p.shape[-1] ** 0.5)
    return mlp


def _inputs(batch: int, d_model: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(batch, d_model, generator=g, dtype=dtype)
    w = torch.randn(batch, d_model, generator=g, dtype=dtype)  # loss = <mlp(x), w>
    return x, w


def megatron_worker(rank: int, world_size: int, batch: int, d_model: int, d_hidden: int,
                    seed: int = 0, activation: nn.Module | None = None) -> dict:
    """Worker: the Megatron block from scratch and via DTensor on this rank, on the loss
    ``<mlp(x), w>``. Returns CPU tensors: ``y`` and ``dx`` of each, this rank's gradient
    shards of the from-scratch layers, DTensor's full gradients, and the number of
    collectives the from-scratch block issued in forward and in backward (by the ledger)."""
    world_size = check_int("world_size", world_size, lo=1)
    rank = check_int("rank", rank, lo=0, hi=world_size - 1)
    batch = check_int("batch", batch, lo=1)
    seed = check_int("seed", seed, lo=0)   # every rank rebuilds the block from it: an int
    _check_block(serial_mlp(d_model, d_hidden, seed, activation=activation))
    if d_hidden % world_size:
        raise ValueError(f"d_hidden={d_hidden} must be divisible by world_size={world_size} "
                         f"(the column and row split)")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from parlearn.distributed import ledger

    full = serial_mlp(d_model, d_hidden, seed, activation=activation)
    x, w = _inputs(batch, d_model, seed, torch.float64)
    out: dict = {}

    tp = MegatronMLP(full, rank, world_size)
    xs = x.clone().requires_grad_(True)
    with ledger() as fwd:
        y = tp(xs)
    with ledger() as bwd:
        (y * w).sum().backward()
    out["scratch"] = dict(y=y.detach(), dx=xs.grad,
                          w1=tp.fc1.weight.grad, b1=tp.fc1.bias.grad,
                          w2=tp.fc2.weight.grad, b2=tp.fc2.bias.grad)
    out["ledger"] = dict(forward=fwd.summary(), backward=bwd.summary())

    mesh = init_device_mesh("cpu", (world_size,))
    model = parallelize_module(serial_mlp(d_model, d_hidden, seed, activation=activation),
                               mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    xd = x.clone().requires_grad_(True)
    yd = model(xd)
    (yd * w).sum().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    out["dtensor"] = dict(y=yd.detach(), dx=xd.grad, w1=grads[0], b1=grads[1],
                          w2=grads[2], b2=grads[3])
    return out


def megatron_check(world_size: int, batch: int = 4, d_model: int = 8, d_hidden: int = 16,
                   seed: int = 0, timeout: float = 30, activation: nn.Module | None = None
                   ) -> dict:
    """Run :func:`megatron_worker` on ``world_size`` real ranks and compare with the
    unsharded block ``serial_mlp(..., activation=activation)`` in this process. Returns
    ``{"scratch": err, "dtensor": err, "ledger": rank 0's ledger summaries}`` where ``err``
    is the largest absolute difference over the output and every gradient (shards
    reassembled in rank order), over all ranks."""
    from parlearn.distributed import run

    world_size = check_int("world_size", world_size, lo=1)
    batch = check_int("batch", batch, lo=1)
    seed = check_int("seed", seed, lo=0)   # the ranks rebuild the block from it: an int
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    full = serial_mlp(d_model, d_hidden, seed, activation=activation)
    _check_block(full)   # refused here, before the ranks start
    if d_hidden % world_size:
        raise ValueError(f"d_hidden={d_hidden} must be divisible by world_size={world_size} "
                         f"(the column and row split)")
    x, w = _inputs(batch, d_model, seed, torch.float64)
    x = x.requires_grad_(True)
    (full(x) * w).sum().backward()
    ref = dict(y=full(x).detach(), dx=x.grad, w1=full[0].weight.grad, b1=full[0].bias.grad,
               w2=full[2].weight.grad, b2=full[2].bias.grad)
    # gloo whatever GPUs exist: the worker computes on CPU tensors on a "cpu" mesh.
    res = run(megatron_worker, world_size, args=(batch, d_model, d_hidden, seed, activation),
              backend="gloo", timeout=timeout, deadline=4 * timeout)
    cat = dict(w1=0, b1=0, w2=1)  # how each scratch shard was cut from the full tensor
    err_s = err_d = 0.0
    for r in res:
        for k in ref:
            if k in cat:
                got = torch.cat([q["scratch"][k] for q in res], dim=cat[k])
            else:
                got = r["scratch"][k]
            err_s = max(err_s, (got - ref[k]).abs().max().item())
            err_d = max(err_d, (r["dtensor"][k] - ref[k]).abs().max().item())
    return {"scratch": err_s, "dtensor": err_d, "ledger": res[0]["ledger"]}


# ---------------------------------------------------------------------------------------
# When the block stays compute-bound (modeled).

def tp_roofline(d_ff: int, tp: int, flops_per_s: float, bandwidth: float) -> dict:
    """Whether a Megatron MLP block ``d -> d_ff -> d`` split ``tp`` ways stays compute-bound:
    the condition of Austin et al., *How to Scale Your Model* (2025), Training and GPU
    chapters. Per token, forward, in bf16: each device computes ``2 * 2 d d_ff / tp`` FLOPs
    (two matmuls) at ``flops_per_s`` (``C``), and the block moves the token's ``d``
    activations twice (all-gather + reduce-scatter, or one all-reduce), ``2 * 2 d`` bytes at
    ``bandwidth`` (``W``, bytes/s one way; the ring's ``(tp-1)/tp`` is dropped, as the book
    does). ``d`` cancels: ``T_math / T_comm = (d_ff / tp) / (C / W)``, so the block is
    compute-bound while the per-device width ``d_ff / tp`` exceeds the hardware's
    FLOPs-to-bytes ratio ``C / W``. Returns ``width`` (``d_ff / tp``), ``intensity``
    (``C / W``, FLOPs per byte), ``ratio`` (``T_math / T_comm``; infinite at ``tp = 1``,
    which communicates nothing), ``compute_bound`` and ``max_tp``, the largest degree that
    stays compute-bound (1, no split, when no split does). Modeled: perfect overlap of the
    collectives with the matmuls, peak rates."""
    d_ff = check_int("d_ff", d_ff, lo=1)
    tp = check_int("tp", tp, lo=1)
    c = check_float("flops_per_s", flops_per_s, lo=0, lo_open=True)
    w = check_float("bandwidth", bandwidth, lo=0, lo_open=True)
    limit = d_ff * w / c   # d_ff / tp > C / W  <=>  tp < d_ff W / C
    return {"width": d_ff / tp, "intensity": c / w,
            "ratio": math.inf if tp == 1 else limit / tp,
            "compute_bound": tp == 1 or tp < limit, "max_tp": max(1, math.ceil(limit) - 1)}
