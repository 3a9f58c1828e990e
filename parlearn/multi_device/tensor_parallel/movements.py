"""Tensor parallelism: Megatron's split linear layers, data movements as linear operators.

Megatron-LM (Shoeybi et al. 2019) splits an MLP block ``Y = gelu(X A) B`` over ``N`` ranks:
``A`` by columns (rank ``r`` holds ``A[:, r-th chunk]`` and computes its slice of the
hidden activation with no communication, because gelu acts elementwise), ``B`` by rows
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

DistDL (Hewett & Grady 2020) views every data movement of model parallelism as a linear
operator ``F`` whose backward is its adjoint ``F*``: broadcast and sum-reduce are adjoint,
scatter and gather are adjoint, all-gather and reduce-scatter are adjoint, all-reduce is
self-adjoint, a halo exchange's adjoint adds the halo gradients back onto the cells they
were copied from, and a transpose of the partition (split along one dim -> split along
another, an all-to-all) has the reverse transpose as adjoint. Here the movements act on a
*list of per-rank tensors* in one process (:data:`MOVEMENTS`), each wrapped in an autograd
function whose backward calls the hand-written adjoint; :func:`dot_product_test` checks
``<F x, y> = <x, F* y>`` and :func:`movement_matrix` compares the matrices of ``F`` and of
the backward. The same movements exist on real ranks (:data:`RANK_MOVEMENTS`, checked by
:func:`rank_dot_product_worker`), and :class:`SpatialConv1d` uses the halo exchange to
split a convolution along its positions (:func:`halo_conv_check` compares it with the
unsharded convolution). This is our reconstruction from the paper's abstract and public
descriptions, not DistDL's code.

The planners (SoyBean's tiling search, its recursion, SplitBrain's hybrid, Alpa's two
levels) live in :mod:`parlearn.multi_device.tp_plan` and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from parlearn.core.checks import check_choice, check_int, check_module, check_seed
from parlearn.multi_device.tp_plan import (
    CONV_CUTS,
    CUTS,
    Conv,
    Dense,
    best_one_cut,
    brute_force_cut,
    brute_force_joint,
    bytes_by_kind,
    hlo_collectives,
    is_splitbrain,
    joint_plan,
    network,
    plan_collectives,
    plan_cost,
    plan_levels_cost,
    recursive_plan,
    two_level_plan,
)

__all__ = ["CopyToRanks", "SumOverRanks", "ColumnParallelLinear", "RowParallelLinear",
           "MegatronMLP", "serial_mlp", "megatron_worker", "megatron_check",
           "MOVEMENTS", "movement", "dot_product_test", "movement_matrix",
           "RankBroadcast", "RankSumReduce", "RankScatter", "RankGather", "RankAllGather",
           "RankReduceScatter",
           "RankHaloExchange", "RankRepartition", "RANK_MOVEMENTS", "rank_dot_product_worker",
           "SpatialConv1d", "serial_conv", "halo_conv_worker", "halo_conv_check", "bench",
           # re-exported from parlearn.multi_device.tp_plan
           "Dense", "Conv", "CUTS", "CONV_CUTS", "network", "plan_collectives", "plan_cost",
           "best_one_cut", "brute_force_cut", "recursive_plan", "joint_plan",
           "brute_force_joint", "plan_levels_cost", "is_splitbrain", "hlo_collectives",
           "bytes_by_kind", "two_level_plan"]


# ---------------------------------------------------------------------------------------
# Megatron: f and g, and the split layers (worker-side: need an initialised group).

class CopyToRanks(torch.autograd.Function):
    """Megatron's ``f``: identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        tdist.all_reduce(grad)
        return grad


class SumOverRanks(torch.autograd.Function):
    """Megatron's ``g``: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous().clone()
        tdist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


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
        check_module("full", full)
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
        check_module("full", full)
        world_size = check_int("world_size", world_size, lo=1)
        rank = check_int("rank", rank, lo=0, hi=world_size - 1)
        part = _chunk(full.in_features, rank, world_size)
        self.weight = nn.Parameter(full.weight.detach()[:, part].clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = SumOverRanks.apply(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class MegatronMLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` with ``fc1`` column-parallel and ``fc2`` row-parallel: one
    all-reduce forward (in ``fc2``), one backward (in ``fc1``'s ``f``)."""

    def __init__(self, full: nn.Sequential, rank: int, world_size: int):
        super().__init__()
        check_module("full", full)
        self.fc1 = ColumnParallelLinear(full[0], rank, world_size)
        self.fc2 = RowParallelLinear(full[2], rank, world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def serial_mlp(d_model: int, d_hidden: int, seed: int | torch.Generator = 0,
               dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """The unsharded block ``Linear(d_model, d_hidden), GELU, Linear(d_hidden, d_model)``,
    initialised from ``seed`` (its own generator; the global RNG is untouched)."""
    d_model = check_int("d_model", d_model, lo=1)
    d_hidden = check_int("d_hidden", d_hidden, lo=1)
    seed = check_seed("seed", seed)
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    # nn.Linear's default init draws from the global RNG: restore it (values are replaced).
    with torch.random.fork_rng(devices=[]):
        mlp = nn.Sequential(nn.Linear(d_model, d_hidden), nn.GELU(),
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
                    seed: int = 0) -> dict:
    """Worker: the Megatron block from scratch and via DTensor on this rank, on the loss
    ``<mlp(x), w>``. Returns CPU tensors: ``y`` and ``dx`` of each, this rank's gradient
    shards of the from-scratch layers, DTensor's full gradients, and the number of
    collectives the from-scratch block issued in forward and in backward (by the ledger)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from parlearn.dist import ledger

    full = serial_mlp(d_model, d_hidden, seed)
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
    model = parallelize_module(serial_mlp(d_model, d_hidden, seed), mesh,
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    xd = x.clone().requires_grad_(True)
    yd = model(xd)
    (yd * w).sum().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    out["dtensor"] = dict(y=yd.detach(), dx=xd.grad, w1=grads[0], b1=grads[1],
                          w2=grads[2], b2=grads[3])
    return out


def megatron_check(world_size: int, batch: int = 4, d_model: int = 8, d_hidden: int = 16,
                   seed: int = 0, timeout: float = 30) -> dict:
    """Run :func:`megatron_worker` on ``world_size`` real ranks and compare with the
    unsharded block in this process. Returns ``{"scratch": err, "dtensor": err, "ledger":
    rank 0's ledger summaries}`` where ``err`` is the largest absolute difference over the
    output and every gradient (shards reassembled in rank order), over all ranks."""
    from parlearn.dist import run

    world_size = check_int("world_size", world_size, lo=1)
    full = serial_mlp(d_model, d_hidden, seed)
    x, w = _inputs(batch, d_model, seed, torch.float64)
    x = x.requires_grad_(True)
    (full(x) * w).sum().backward()
    ref = dict(y=full(x).detach(), dx=x.grad, w1=full[0].weight.grad, b1=full[0].bias.grad,
               w2=full[2].weight.grad, b2=full[2].bias.grad)
    # gloo whatever GPUs exist: the worker computes on CPU tensors on a "cpu" mesh.
    res = run(megatron_worker, world_size, args=(batch, d_model, d_hidden, seed),
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
# DistDL: movements as linear operators on lists of per-rank tensors (one process).

Pieces = list[torch.Tensor]


def _broadcast(x: Pieces, p: int) -> Pieces:  # rank 0's tensor -> every rank
    return [x[0] for _ in range(p)]


def _sum_reduce(y: Pieces, p: int) -> Pieces:  # every rank's tensor summed onto rank 0
    return [torch.stack(y).sum(0)]


def _scatter(x: Pieces, p: int) -> Pieces:  # rank 0's tensor cut into p row blocks
    return list(x[0].chunk(p, 0))


def _gather(y: Pieces, p: int) -> Pieces:  # the ranks' row blocks joined on rank 0
    return [torch.cat(y, 0)]


def _all_gather(x: Pieces, p: int) -> Pieces:
    whole = torch.cat(x, 0)
    return [whole for _ in range(p)]


def _reduce_scatter(y: Pieces, p: int) -> Pieces:
    return list(torch.stack(y).sum(0).chunk(p, 0))


def _all_reduce(x: Pieces, p: int) -> Pieces:
    s = torch.stack(x).sum(0)
    return [s for _ in range(p)]


def _rows_to_cols(x: Pieces, p: int) -> Pieces:  # a transpose of the partition (all-to-all)
    return list(torch.cat(x, 0).chunk(p, 1))


def _cols_to_rows(y: Pieces, p: int) -> Pieces:
    return list(torch.cat(y, 1).chunk(p, 0))


def _halo(x: Pieces, p: int, halo: int = 1) -> Pieces:
    """A 1-D domain split along the last dim: each rank's block padded with ``halo`` cells
    of each neighbour (zeros past the ends, as a zero-padded convolution sees them)."""
    out = []
    for r, t in enumerate(x):
        zeros = t.new_zeros(*t.shape[:-1], halo)
        left = x[r - 1][..., -halo:] if r > 0 else zeros
        right = x[r + 1][..., :halo] if r < len(x) - 1 else zeros
        out.append(torch.cat([left, t, right], -1))
    return out


def _halo_add(y: Pieces, p: int, halo: int = 1) -> Pieces:
    """The adjoint of :func:`_halo`: each rank keeps its interior and adds the halo cells
    its neighbours hold of its own block (their gradients) back onto them; the padding past
    the ends is dropped."""
    out = []
    for r, t in enumerate(y):
        own = t[..., halo:t.shape[-1] - halo].clone()
        if r > 0:  # rank r-1's right halo is my first cells
            own[..., :halo] += y[r - 1][..., -halo:]
        if r < len(y) - 1:  # rank r+1's left halo is my last cells
            own[..., -halo:] += y[r + 1][..., :halo]
        out.append(own)
    return out


# name -> (forward, adjoint, shapes of the input pieces for a block of shape (rows, cols)).
MOVEMENTS: dict[str, tuple[Callable, Callable, Callable]] = {
    "broadcast": (_broadcast, _sum_reduce, lambda p, r, c: [(r, c)]),
    "sum_reduce": (_sum_reduce, _broadcast, lambda p, r, c: [(r, c)] * p),
    "scatter": (_scatter, _gather, lambda p, r, c: [(p * r, c)]),
    "gather": (_gather, _scatter, lambda p, r, c: [(r, c)] * p),
    "all_gather": (_all_gather, _reduce_scatter, lambda p, r, c: [(r, c)] * p),
    "reduce_scatter": (_reduce_scatter, _all_gather, lambda p, r, c: [(p * r, c)] * p),
    "all_reduce": (_all_reduce, _all_reduce, lambda p, r, c: [(r, c)] * p),
    "rows_to_cols": (_rows_to_cols, _cols_to_rows, lambda p, r, c: [(r, p * c)] * p),
    "cols_to_rows": (_cols_to_rows, _rows_to_cols, lambda p, r, c: [(p * r, c)] * p),
    "halo_exchange": (_halo, _halo_add, lambda p, r, c: [(r, c)] * p),
    "halo_add": (_halo_add, _halo, lambda p, r, c: [(r, c + 2)] * p),
}
"""Every movement: ``(F, F*, shapes)``; ``F(pieces, p)`` and ``F*(pieces, p)`` map a list
of per-rank tensors to another; ``shapes(p, rows, cols)`` gives valid input shapes. The halo
movements here use a halo of 1 cell (``_halo`` takes any width)."""


class _Movement(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name: str, p: int, *pieces: torch.Tensor):
        ctx.name, ctx.p = name, p
        return tuple(t.clone() for t in MOVEMENTS[name][0](list(pieces), p))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        # DistDL's rule: the backward of a linear movement is its adjoint.
        return (None, None, *MOVEMENTS[ctx.name][1](list(grads), ctx.p))


def movement(name: str, pieces: Sequence[torch.Tensor], p: int) -> Pieces:
    """Apply movement ``name`` of :data:`MOVEMENTS` to per-rank ``pieces`` over ``p``
    ranks, differentiably: its backward is the hand-written adjoint."""
    check_choice("name", name, MOVEMENTS)
    p = check_int("p", p, lo=1)
    pieces = list(pieces)
    return list(_Movement.apply(name, p, *pieces))


def _inner(a: Pieces, b: Pieces) -> torch.Tensor:
    if [t.shape for t in a] != [t.shape for t in b]:
        raise ValueError("the pieces of the two sides differ in shape")
    return sum((u * v).sum() for u, v in zip(a, b, strict=True))


def dot_product_test(name: str, p: int, rows: int = 3, cols: int = 2,
                     seed: int | torch.Generator = 0) -> tuple[float, float]:
    """``(<F x, y>, <x, F* y>)`` for movement ``name`` on ``p`` ranks with random float64
    ``x`` and ``y`` (its own generator), ``F*`` taken as the autograd backward of
    :func:`movement` (so the test checks the backward the layers use). Equal to round-off
    exactly when the backward is the adjoint."""
    check_choice("name", name, MOVEMENTS)
    p = check_int("p", p, lo=1)
    rows, cols = check_int("rows", rows, lo=1), check_int("cols", cols, lo=1)
    seed = check_seed("seed", seed)
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    x = [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
         for s in MOVEMENTS[name][2](p, rows, cols)]
    fx = movement(name, x, p)
    y = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in fx]
    lhs = _inner([t.detach() for t in fx], y)
    adj = torch.autograd.grad(fx, x, grad_outputs=y)
    rhs = _inner([t.detach() for t in x], list(adj))
    return lhs.item(), rhs.item()


def movement_matrix(name: str, p: int, rows: int = 2,
                    cols: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The serial matrix form of movement ``name``: ``(M, M_adj)``, the matrix of ``F``
    (column ``j`` is ``F`` of the ``j``-th unit vector, all pieces flattened and joined in
    rank order) and the matrix of the autograd backward of :func:`movement` (built the
    same way from the output side). The backward is the adjoint exactly when
    ``M_adj == M.T``; both are 0/1 matrices, so the comparison is exact."""
    check_choice("name", name, MOVEMENTS)
    p = check_int("p", p, lo=1)
    rows, cols = check_int("rows", rows, lo=1), check_int("cols", cols, lo=1)
    shapes = MOVEMENTS[name][2](p, rows, cols)
    sizes = [torch.Size(s).numel() for s in shapes]
    x = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in shapes]
    fx = movement(name, x, p)
    out_sizes = [t.numel() for t in fx]
    m = torch.stack([torch.cat([t.reshape(-1) for t in movement(
        name, [c.reshape(sh) for c, sh in zip(e.split(sizes), shapes, strict=True)], p)])
        for e in torch.eye(sum(sizes), dtype=torch.float64)], 1)
    cols_adj = []
    for e in torch.eye(sum(out_sizes), dtype=torch.float64).unbind(0):
        ys = [c.reshape(t.shape) for c, t in zip(e.split(out_sizes), fx, strict=True)]
        adj = torch.autograd.grad(fx, x, grad_outputs=ys, retain_graph=True)
        cols_adj.append(torch.cat([a.reshape(-1) for a in adj]))
    return m, torch.stack(cols_adj, 1)


# ---------------------------------------------------------------------------------------
# The same adjoint pairs on real ranks (worker-side). Each map acts on the tuple of all
# ranks' tensors; a rank whose input the map ignores gets a zero gradient.

class RankBroadcast(torch.autograd.Function):
    """Rank 0's tensor to every rank; backward: the gradients summed onto rank 0."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.detach().clone()
        tdist.broadcast(out, 0)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        tdist.reduce(grad, 0)
        return grad if tdist.get_rank() == 0 else torch.zeros_like(grad)


class RankSumReduce(torch.autograd.Function):
    """The ranks' tensors summed onto rank 0 (zeros elsewhere); backward: a broadcast."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.detach().clone()
        tdist.reduce(out, 0)
        return out if tdist.get_rank() == 0 else torch.zeros_like(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        tdist.broadcast(grad, 0)
        return grad


class RankAllGather(torch.autograd.Function):
    """Every rank's block joined along dim 0 on every rank; backward: a reduce-scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(tdist.get_world_size())]
        tdist.all_gather(parts, x.detach().contiguous())
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        chunks = [c.contiguous() for c in grad.chunk(tdist.get_world_size(), 0)]
        out = torch.empty_like(chunks[0])
        tdist.reduce_scatter(out, chunks)
        return out


class RankReduceScatter(torch.autograd.Function):
    """Block ``rank`` (along dim 0) of the sum over ranks; backward: an all-gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        chunks = [c.contiguous() for c in x.detach().chunk(tdist.get_world_size(), 0)]
        out = torch.empty_like(chunks[0])
        tdist.reduce_scatter(out, chunks)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(grad) for _ in range(tdist.get_world_size())]
        tdist.all_gather(parts, grad.contiguous())
        return torch.cat(parts, 0)


def _gather0(x: torch.Tensor) -> torch.Tensor:
    """Every rank's block joined along dim 0 on rank 0; zeros of that shape elsewhere."""
    p, rank = tdist.get_world_size(), tdist.get_rank()
    parts = [torch.empty_like(x) for _ in range(p)] if rank == 0 else None
    tdist.gather(x.contiguous(), parts, dst=0)
    return torch.cat(parts, 0) if rank == 0 else x.new_zeros(p * x.shape[0], *x.shape[1:])


def _scatter0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's tensor cut into blocks along dim 0, block ``r`` to rank ``r``."""
    p, rank = tdist.get_world_size(), tdist.get_rank()
    chunks = [c.contiguous() for c in x.chunk(p, 0)]
    out = torch.empty_like(chunks[0])
    tdist.scatter(out, chunks if rank == 0 else None, src=0)
    return out


class RankScatter(torch.autograd.Function):
    """Rank 0's tensor cut into blocks along dim 0, block ``r`` to rank ``r`` (the other
    ranks' inputs are ignored); backward: a gather onto rank 0 (zeros elsewhere)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _scatter0(x.detach())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _gather0(grad)


class RankGather(torch.autograd.Function):
    """Every rank's block joined along dim 0 on rank 0 (zeros elsewhere); backward: a
    scatter of rank 0's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _gather0(x.detach())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _scatter0(grad)


def _exchange(sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> None:
    """Point-to-point: send ``sends[peer]`` to each peer and receive ``recvs[peer]`` from
    each, all posted at once (no ordering can deadlock)."""
    ops = [tdist.P2POp(tdist.isend, t.contiguous(), peer) for peer, t in sends.items()]
    ops += [tdist.P2POp(tdist.irecv, t, peer) for peer, t in recvs.items()]
    if ops:
        for req in tdist.batch_isend_irecv(ops):
            req.wait()


def _rank_halo(x: torch.Tensor, halo: int) -> torch.Tensor:
    rank, p = tdist.get_rank(), tdist.get_world_size()
    left, right = (x.new_zeros(*x.shape[:-1], halo) for _ in range(2))
    sends, recvs = {}, {}
    if rank > 0:
        sends[rank - 1], recvs[rank - 1] = x[..., :halo], left
    if rank < p - 1:
        sends[rank + 1], recvs[rank + 1] = x[..., -halo:], right
    _exchange(sends, recvs)
    return torch.cat([left, x, right], -1)


def _rank_halo_add(y: torch.Tensor, halo: int) -> torch.Tensor:
    rank, p = tdist.get_rank(), tdist.get_world_size()
    own = y[..., halo:y.shape[-1] - halo].clone()
    from_left, from_right = (y.new_empty(*y.shape[:-1], halo) for _ in range(2))
    sends, recvs = {}, {}
    if rank > 0:  # my left halo's gradient belongs to rank-1's last cells
        sends[rank - 1], recvs[rank - 1] = y[..., :halo], from_left
    if rank < p - 1:
        sends[rank + 1], recvs[rank + 1] = y[..., -halo:], from_right
    _exchange(sends, recvs)
    if rank > 0:
        own[..., :halo] += from_left
    if rank < p - 1:
        own[..., -halo:] += from_right
    return own


class RankHaloExchange(torch.autograd.Function):
    """This rank's block of a tensor split along its last dim, padded with ``halo`` cells
    from each neighbouring rank (zeros past the ends); backward: the adjoint, each halo's
    gradient sent back and added to the cells it was copied from."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, halo: int) -> torch.Tensor:
        if not 1 <= halo <= x.shape[-1]:
            raise ValueError(f"halo must be in [1, {x.shape[-1]}] (the local length), "
                             f"got {halo}")
        ctx.halo = halo
        return _rank_halo(x.detach(), halo)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _rank_halo_add(grad, ctx.halo), None


def _repartition(x: torch.Tensor, src: int, dst: int) -> torch.Tensor:
    p = tdist.get_world_size()
    if x.shape[dst] % p:
        raise ValueError(f"dim {dst} of the block ({x.shape[dst]}) must be divisible by "
                         f"world_size={p}")
    sends = [c.contiguous() for c in x.chunk(p, dst)]
    recvs = [torch.empty_like(c) for c in sends]
    tdist.all_to_all(recvs, sends)
    return torch.cat(recvs, src)


class RankRepartition(torch.autograd.Function):
    """A transpose of the partition: this rank's block of a tensor split along dim ``src``
    becomes its block of the same tensor split along dim ``dst`` (an all-to-all: block
    ``j`` of my piece goes to rank ``j``); backward: the reverse repartition, its adjoint
    (a permutation's adjoint is its inverse)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, src: int, dst: int) -> torch.Tensor:
        ctx.src, ctx.dst = src, dst
        return _repartition(x.detach(), src, dst)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _repartition(grad, ctx.dst, ctx.src), None, None


RANK_MOVEMENTS: dict[str, tuple[Callable, Callable]] = {
    "broadcast": (RankBroadcast.apply, lambda p, r, c: (r, c)),
    "sum_reduce": (RankSumReduce.apply, lambda p, r, c: (r, c)),
    "scatter": (RankScatter.apply, lambda p, r, c: (p * r, c)),
    "gather": (RankGather.apply, lambda p, r, c: (r, c)),
    "all_gather": (RankAllGather.apply, lambda p, r, c: (r, c)),
    "reduce_scatter": (RankReduceScatter.apply, lambda p, r, c: (p * r, c)),
    "halo_exchange": (lambda x: RankHaloExchange.apply(x, 2), lambda p, r, c: (r, c)),
    "rows_to_cols": (lambda x: RankRepartition.apply(x, 0, 1), lambda p, r, c: (r, p * c)),
    "cols_to_rows": (lambda x: RankRepartition.apply(x, 1, 0), lambda p, r, c: (p * r, c)),
}
"""The real-rank movements (worker-side): name -> ``(map, shape)``; ``map(x)`` is
differentiable with the adjoint as its backward, ``shape(world_size, rows, cols)`` a valid
shape of this rank's input. The halo exchange here uses a halo of 2 cells."""


def rank_dot_product_worker(rank: int, world_size: int, rows: int = 2, cols: int = 3,
                            seed: int = 0) -> dict[str, tuple[float, float]]:
    """Worker: ``(<F x, y>, <x, F* y>)`` for every :data:`RANK_MOVEMENTS` entry, each inner
    product summed over ranks, ``F*`` taken as the autograd backward. Rank ``r`` draws its
    own ``x`` and ``y`` (float64) from a generator seeded by ``seed`` and ``r``. Under the
    key ``"values"``: this rank's ``(x, F x)`` of every movement, to compare with the
    one-process movements of :data:`MOVEMENTS`."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    out: dict = {"values": {}}
    for name, (fn, shape) in RANK_MOVEMENTS.items():
        x = torch.randn(shape(world_size, rows, cols), generator=g, dtype=torch.float64,
                        requires_grad=True)
        fx = fn(x)
        y = torch.randn(fx.shape, generator=g, dtype=torch.float64)
        (adj,) = torch.autograd.grad(fx, x, grad_outputs=y)
        sides = torch.stack([(fx.detach() * y).sum(), (x.detach() * adj).sum()])
        tdist.all_reduce(sides)
        out[name] = (sides[0].item(), sides[1].item())
        out["values"][name] = (x.detach(), fx.detach())
    return out


# ---------------------------------------------------------------------------------------
# A convolution split along its positions: halo exchange in front, weight replicated.

class SpatialConv1d(nn.Module):
    """Rank ``rank``'s share of ``full`` (an ``nn.Conv1d`` with stride 1, odd kernel and
    "same" zero padding) for an input split along its length over ``world_size`` ranks:
    ``forward(x_block)`` exchanges ``(kernel - 1) / 2`` halo cells with the neighbours
    (:class:`RankHaloExchange`) and convolves without padding, giving this rank's block of
    ``full(x)``. The weight and bias are replicated, passed through ``f``
    (:class:`CopyToRanks`) so their gradients are summed over ranks, as data parallelism
    would: the spatial cut's two collectives are the halo and that all-reduce."""

    def __init__(self, full: nn.Conv1d, rank: int, world_size: int):
        super().__init__()
        check_module("full", full)
        if not isinstance(full, nn.Conv1d):
            raise TypeError(f"full must be an nn.Conv1d, got {type(full).__name__}")
        k = full.kernel_size[0]
        if (full.stride, full.dilation, full.groups, full.padding_mode) != ((1,), (1,), 1,
                                                                              "zeros") \
                or k % 2 == 0 or full.padding != ((k - 1) // 2,):
            raise ValueError("full must have stride 1, dilation 1, groups 1, an odd kernel "
                             "and padding (kernel - 1) / 2 with zeros")
        world_size = check_int("world_size", world_size, lo=1)
        check_int("rank", rank, lo=0, hi=world_size - 1)
        self.halo = (k - 1) // 2
        self.weight = nn.Parameter(full.weight.detach().clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.halo:
            x = RankHaloExchange.apply(x, self.halo)
        bias = None if self.bias is None else CopyToRanks.apply(self.bias)
        return F.conv1d(x, CopyToRanks.apply(self.weight), bias)


def serial_conv(c_in: int, c_out: int, kernel: int, seed: int | torch.Generator = 0,
                dtype: torch.dtype = torch.float64) -> nn.Conv1d:
    """The unsharded ``nn.Conv1d(c_in, c_out, kernel, padding=(kernel - 1) // 2)``,
    initialised from ``seed`` (its own generator; the global RNG is untouched)."""
    c_in, c_out = check_int("c_in", c_in, lo=1), check_int("c_out", c_out, lo=1)
    kernel = check_int("kernel", kernel, lo=1)
    if kernel % 2 == 0:
        raise ValueError(f"kernel must be odd (same padding), got {kernel}")
    seed = check_seed("seed", seed)
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        conv = nn.Conv1d(c_in, c_out, kernel, padding=(kernel - 1) // 2).to(dtype)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) / (c_in * kernel) ** 0.5)
    return conv


def _conv_inputs(batch: int, c_in: int, c_out: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed + 11)
    x = torch.randn(batch, c_in, length, generator=g, dtype=torch.float64)
    w = torch.randn(batch, c_out, length, generator=g, dtype=torch.float64)  # loss weights
    return x, w


def halo_conv_worker(rank: int, world_size: int, batch: int, c_in: int, c_out: int,
                     length: int, kernel: int, seed: int = 0) -> dict:
    """Worker: :class:`SpatialConv1d` on this rank's block of the input's positions, on the
    loss ``<conv(x), w>`` (this rank's block of it). Returns CPU tensors: this rank's block
    of the output and of ``dx``, the (all-reduced) weight and bias gradients, and the
    ledger of the forward and backward collectives."""
    from parlearn.dist import ledger

    full = serial_conv(c_in, c_out, kernel, seed)
    x, w = _conv_inputs(batch, c_in, c_out, length, seed)
    part = _chunk(length, rank, world_size)
    conv = SpatialConv1d(full, rank, world_size)
    xs = x[..., part].clone().requires_grad_(True)
    with ledger() as fwd:
        y = conv(xs)
    with ledger() as bwd:
        (y * w[..., part]).sum().backward()
    return dict(y=y.detach(), dx=xs.grad, dw=conv.weight.grad, db=conv.bias.grad,
                ledger=dict(forward=fwd.summary(), backward=bwd.summary()))


def halo_conv_check(world_size: int, batch: int = 2, c_in: int = 3, c_out: int = 4,
                    length: int = 12, kernel: int = 3, seed: int = 0,
                    timeout: float = 30) -> dict:
    """Run :func:`halo_conv_worker` on ``world_size`` real ranks and compare with the
    unsharded convolution in this process. Returns ``{"y", "dx", "dw", "db"}``: the largest
    absolute difference of each (blocks joined in rank order; the weight and bias
    gradients of every rank), and ``"ledger"``: every rank's ledger summaries."""
    from parlearn.dist import run

    world_size = check_int("world_size", world_size, lo=1)
    length = check_int("length", length, lo=1)
    if length % world_size or length // world_size < (kernel - 1) // 2:
        raise ValueError(f"length {length} must split evenly over world_size={world_size} "
                         f"into blocks at least (kernel - 1) / 2 = {(kernel - 1) // 2} long")
    full = serial_conv(c_in, c_out, kernel, seed)
    x, w = _conv_inputs(batch, c_in, c_out, length, seed)
    x = x.requires_grad_(True)
    y = full(x)
    (y * w).sum().backward()
    res = run(halo_conv_worker, world_size, args=(batch, c_in, c_out, length, kernel, seed),
              backend="gloo", timeout=timeout, deadline=4 * timeout)
    err = {"y": (torch.cat([r["y"] for r in res], -1) - y.detach()).abs().max().item(),
           "dx": (torch.cat([r["dx"] for r in res], -1) - x.grad).abs().max().item(),
           "dw": max((r["dw"] - full.weight.grad).abs().max().item() for r in res),
           "db": max((r["db"] - full.bias.grad).abs().max().item() for r in res)}
    return {**err, "ledger": [r["ledger"] for r in res]}


def bench(device: torch.device, quick: bool) -> list:
    """Rows for ``python -m parlearn.bench tensor_parallel``: communication counted against
    the cost model (``ratio`` = counted bytes / modeled bytes; 1.0 is agreement). Bytes do
    not depend on the device, so every row runs on the CPU whatever ``device`` is (the
    rows name where they ran): the Megatron block on 2 gloo ranks (payloads from
    :func:`parlearn.dist.ledger`, forward plus backward), the spatially split convolution
    on 3 gloo ranks against the planner's spatial cut (:class:`Conv`), and the plan
    :func:`best_one_cut` picks for two networks on a JAX mesh of 8 fake CPU devices
    (payloads from the compiled HLO). No times are claimed."""
    from parlearn.core.bench import Row

    del device  # see the docstring: communication volume is device-independent
    rows = []
    b, d, h = (8, 16, 32) if quick else (32, 64, 256)
    res = megatron_check(2, batch=b, d_model=d, d_hidden=h)
    counted = sum(n for phase in res["ledger"].values() for _, n, _ in phase.values())
    modeled = sum(n for *_, n in Dense.collectives("column", (b, d, h), 8, True, 2)
                  + Dense.collectives("row", (b, h, d), 8, True, 2))
    rows.append(Row("tensor_parallel", "cost model: all-reduce |Y| fwd + |X| bwd",
                    "Megatron MLP from scratch, ledger bytes", counted / modeled,
                    "cpu (gloo, 2 ranks)",
                    target="counted = modeled", met=counted == modeled,
                    detail=f"float64 batch {b}, d {d}, hidden {h}: counted {counted} B, "
                           f"modeled {modeled} B; max error vs unsharded "
                           f"{max(res['scratch'], res['dtensor']):.1e}"))
    # The spatial cut on 3 ranks: rank 1 has two neighbours. The ledger counts what a rank
    # sends plus what it receives point to point; the planner ignores biases, so the bias
    # all-reduce is added to its figure.
    b, ci, co, n, k = (2, 3, 4, 12, 5) if quick else (8, 16, 32, 96, 5)
    res = halo_conv_check(3, batch=b, c_in=ci, c_out=co, length=n, kernel=k)
    led = res["ledger"][1]
    counted = (led["forward"]["batch_isend_irecv"][1] + led["backward"]["batch_isend_irecv"][1]
               ) // 2 + led["backward"]["all_reduce"][1]
    modeled = sum(x for *_, x in Conv(ci, co, n, k).collectives(
        "spatial", (b, ci, co, n // 3), 8, True, 3)) + co * 8
    rows.append(Row("tensor_parallel", "planner's spatial cut: 2 halos each way + |W| (+|b|)",
                    "conv split along positions (halo exchange), ledger bytes",
                    counted / modeled, "cpu (gloo, 3 ranks)",
                    target="counted = modeled", met=counted == modeled,
                    detail=f"float64 batch {b}, channels {ci}->{co}, length {n}, kernel {k}, "
                           f"rank 1: counted {counted} B of payload (halo sends + "
                           f"all-reduce), modeled {modeled} B; max error vs unsharded "
                           f"{max(res[q] for q in ('y', 'dx', 'dw', 'db')):.1e}"))
    nets = {"wide layers, small batch": (8, [256, 1024, 256]),
            "narrow layers, large batch": (512, [32, 64, 32])}
    plans = {name: best_one_cut(bt, w, 8)[0] for name, (bt, w) in nets.items()}
    for name, (bt, w) in nets.items():
        ops = hlo_collectives([plans[name]], bt, w)[0]
        predicted = bytes_by_kind(plan_collectives(plans[name], bt, w, 8))
        got, want = sum(bytes_by_kind(ops).values()), sum(predicted.values())
        rows.append(Row("tensor_parallel", "planner's predicted payload bytes",
                        f"{name}: plan {'/'.join(plans[name])}, XLA HLO bytes",
                        got / want, "JAX, 8 fake CPU devices",
                        target="counted = modeled", met=got == want,
                        detail=f"batch {bt}, widths {w}: HLO {bytes_by_kind(ops)}, "
                               f"predicted {predicted}"))
    return rows
