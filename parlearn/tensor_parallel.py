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
self-adjoint. Here the movements act on a *list of per-rank tensors* in one process
(:data:`MOVEMENTS`), each wrapped in an autograd function whose backward calls the
hand-written adjoint; :func:`dot_product_test` checks ``<F x, y> = <x, F* y>``. Four of
them also exist on real ranks (:data:`RANK_MOVEMENTS`, checked by
:func:`rank_dot_product_worker`). This is
our reconstruction from the paper's abstract and public descriptions, not DistDL's code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from .checks import check_choice, check_float, check_int, check_module, check_seed

__all__ = ["CopyToRanks", "SumOverRanks", "ColumnParallelLinear", "RowParallelLinear",
           "MegatronMLP", "serial_mlp", "megatron_worker", "megatron_check",
           "MOVEMENTS", "movement", "dot_product_test", "CUTS", "plan_collectives",
           "plan_cost", "best_one_cut", "brute_force_cut", "recursive_plan",
           "hlo_collectives", "bytes_by_kind", "bench", "RankBroadcast", "RankSumReduce",
           "RankAllGather", "RankReduceScatter", "RANK_MOVEMENTS", "rank_dot_product_worker",
           "two_level_plan"]


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

    from .dist import ledger

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
    from .dist import run

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
}
"""Every movement: ``(F, F*, shapes)``; ``F(pieces, p)`` and ``F*(pieces, p)`` map a list
of per-rank tensors to another; ``shapes(p, rows, cols)`` gives valid input shapes."""


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


# ---------------------------------------------------------------------------------------
# SoyBean-style tiling search for a chain of matmul layers Y_l = X_l W_l, X_{l+1} = act(Y_l).

CUTS = ("batch", "column", "row")
"""How one cut splits a layer's matmul ``(B x d_in) @ (d_in x d_out)`` over the groups:
along the batch (data parallel), along ``d_out`` (W by columns), along ``d_in`` (W by rows,
partial sums). Replicating an operator's work is not offered: with communication as the
only cost it would always win, which is why SoyBean splits every operator."""

# The tiling of X a cut needs, and the tiling of Y it leaves: r = rows (batch) split,
# c = columns split, R = replicated (a row cut all-reduces its partial sums to R).
_NEEDS = {"batch": "r", "column": "R", "row": "c"}
_LEAVES = {"batch": "r", "column": "c", "row": "R"}


def _layer_collectives(cut: str, batch: int, d_in: int, d_out: int, itemsize: int,
                       need_dx: bool) -> list[tuple[str, str, int]]:
    x, w, y = batch * d_in * itemsize, d_in * d_out * itemsize, batch * d_out * itemsize
    if cut == "batch":
        return [("backward", "all_reduce", w)]  # dW: every group holds a partial sum
    if cut == "column":
        return [("backward", "all_reduce", x)] if need_dx else []  # dX partial sums
    return [("forward", "all_reduce", y)]  # the partial sums of Y


def _conversion(src: str, dst: str, size: int, groups: int) -> list[tuple[str, str, int]]:
    """Collectives to re-tile an activation of ``size`` bytes from ``src`` to ``dst`` and
    its gradient back (the adjoint movement): R -> split is a free slice whose adjoint is an
    all-gather; split -> R an all-gather whose adjoint is a free slice; r <-> c an
    all-to-all both ways (payload: one group's block, ``size / groups``)."""
    if src == dst:
        return []
    if src == "R":
        return [("backward", "all_gather", size)]
    if dst == "R":
        return [("forward", "all_gather", size)]
    return [("forward", "all_to_all", size // groups), ("backward", "all_to_all", size // groups)]


def plan_collectives(cuts: Sequence[str], batch: int, widths: Sequence[int], groups: int = 2,
                     itemsize: int = 4) -> list[tuple[int, str, str, int]]:
    """The collectives one training step of the chain issues under ``cuts`` (one per
    layer) over ``groups`` groups: ``(layer, phase, kind, payload bytes)``. ``widths`` is
    ``(d_0, ..., d_L)``; the input's gradient is not needed (it is data), the input arrives
    in whatever tiling layer 0 needs, the output is left in its layer's tiling."""
    widths = [check_int("widths", w, lo=1) for w in widths]
    batch = check_int("batch", batch, lo=1)
    groups = check_int("groups", groups, lo=2)
    if len(cuts) != len(widths) - 1:
        raise ValueError(f"cuts must have one entry per layer ({len(widths) - 1}), "
                         f"got {len(cuts)}")
    out = []
    for layer, cut in enumerate(cuts):
        check_choice("cuts", cut, CUTS)
        if layer:
            size = batch * widths[layer] * itemsize
            out += [(layer, ph, k, b) for ph, k, b in
                    _conversion(_LEAVES[cuts[layer - 1]], _NEEDS[cut], size, groups)]
        out += [(layer, ph, k, b) for ph, k, b in
                _layer_collectives(cut, batch, widths[layer], widths[layer + 1], itemsize,
                                   need_dx=layer > 0)]
    return out


def plan_cost(cuts: Sequence[str], batch: int, widths: Sequence[int], groups: int = 2,
              itemsize: int = 4) -> float:
    """Bytes each group sends in one step under ``cuts``: the ring bytes
    (:func:`parlearn.dist_model.ring_bytes`) of every collective of :func:`plan_collectives`."""
    from .dist_model import ring_bytes

    return float(sum(ring_bytes(k, b, groups) for _, _, k, b in
                     plan_collectives(cuts, batch, widths, groups, itemsize)))


def best_one_cut(batch: int, widths: Sequence[int], groups: int = 2,
                 itemsize: int = 4) -> tuple[list[str], float]:
    """The cuts minimising :func:`plan_cost`, by dynamic programming over the chain (the
    cost is a sum of per-layer terms and terms between consecutive layers, so the best
    plan ending in cut ``c`` at layer ``l`` extends a best plan ending at layer ``l-1``).
    Ties go to the earlier cut in :data:`CUTS`. ``O(L * 9)`` cost evaluations."""
    widths = [check_int("widths", w, lo=1) for w in widths]
    batch = check_int("batch", batch, lo=1)
    groups = check_int("groups", groups, lo=2)
    if len(widths) < 2:
        raise ValueError("widths needs at least 2 entries (one layer)")
    shapes = [[batch, widths[i], widths[i + 1]] for i in range(len(widths) - 1)]
    return _best_local(shapes, itemsize, groups)


def brute_force_cut(batch: int, widths: Sequence[int], groups: int = 2,
                    itemsize: int = 4) -> tuple[list[str], float]:
    """The serial reference of :func:`best_one_cut`: every one of the ``3^L`` plans."""
    import itertools

    plans = itertools.product(CUTS, repeat=len(widths) - 1)
    return min(((list(p), plan_cost(p, batch, widths, groups, itemsize)) for p in plans),
               key=lambda t: t[1])


def recursive_plan(batch: int, widths: Sequence[int], levels: int,
                   itemsize: int = 4) -> tuple[list[list[str]], float]:
    """SoyBean's recursion for ``2^levels`` devices: the best one cut over 2 groups, then
    again inside each half on the layer shapes that cut left, ``levels`` times. Returns the
    cuts per level and the bytes each device sends (sum over levels). Our reconstruction:
    here every layer keeps its own local shape (batch, d_in, d_out) and an activation
    between layers is priced at the size of its consumer's local input; the paper's
    proof that recursing on one-cut optima is optimal is not reproduced."""
    levels = check_int("levels", levels, lo=1)
    widths = [check_int("widths", w, lo=1) for w in widths]
    shapes = [[batch, widths[i], widths[i + 1]] for i in range(len(widths) - 1)]
    per_level, total = [], 0.0
    for _ in range(levels):
        cuts, cost = _best_local(shapes, itemsize, 2)
        per_level.append(cuts)
        total += cost
        for s, c in zip(shapes, cuts, strict=True):
            axis = {"batch": 0, "row": 1, "column": 2}[c]
            if s[axis] % 2:
                raise ValueError(f"a {c} cut needs an even size, got layer shape {s}")
            s[axis] //= 2
    return per_level, total


def _best_local(shapes: list[list[int]], itemsize: int,
                groups: int) -> tuple[list[str], float]:
    """The DP of :func:`best_one_cut` for layers with their own (batch, d_in, d_out)."""
    from .dist_model import ring_bytes

    def cost(items):
        return float(sum(ring_bytes(k, n, groups) for *_, k, n in items))

    b, di, do = shapes[0]
    best = {c: (cost(_layer_collectives(c, b, di, do, itemsize, False)), [c]) for c in CUTS}
    for layer in range(1, len(shapes)):
        b, di, do = shapes[layer]
        size = b * di * itemsize
        new = {}
        for c in CUTS:
            own = cost(_layer_collectives(c, b, di, do, itemsize, True))
            new[c] = min(((best[p][0] + cost(_conversion(_LEAVES[p], _NEEDS[c], size, groups))
                           + own, best[p][1] + [c]) for p in CUTS), key=lambda t: t[0])
        best = new
    total, cuts = min(best.values(), key=lambda t: t[0])
    return cuts, total


# ---------------------------------------------------------------------------------------
# The plan on a JAX mesh: the collectives XLA inserts, read from the compiled HLO.

_HLO_SCRIPT = r'''
import json, re, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
plans, batch, widths, devices = json.loads(sys.argv[1])
mesh = jax.make_mesh((devices,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
sh = lambda s: NamedSharding(mesh, s)
x_spec = {"batch": P("d", None), "column": P(None, None), "row": P(None, "d")}
w_spec = {"batch": P(None, None), "column": P(None, "d"), "row": P("d", None)}
y_spec = {"batch": P("d", None), "column": P(None, "d"), "row": P(None, None)}
size = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}

def collectives(cuts):
    def chain(ws, x):
        for i, (w, c) in enumerate(zip(ws, cuts)):
            x = jax.lax.with_sharding_constraint(x, sh(x_spec[c])) @ w
            x = jax.lax.with_sharding_constraint(x, sh(y_spec[c]))
            if i < len(cuts) - 1:
                x = jnp.tanh(x)
        return x

    def step(ws, x, g):  # the output (a loss needs it) and the weight gradients
        y, back = jax.vjp(lambda v: chain(v, x), ws)
        return y, back(g)[0]

    ws = [jnp.ones((widths[i], widths[i + 1]), jnp.float32) for i in range(len(cuts))]
    x = jnp.ones((batch, widths[0]), jnp.float32)
    g = jnp.ones((batch, widths[-1]), jnp.float32)
    fn = jax.jit(step, in_shardings=([sh(w_spec[c]) for c in cuts], sh(x_spec[cuts[0]]),
                                     sh(y_spec[cuts[-1]])),
                 out_shardings=(sh(y_spec[cuts[-1]]), [sh(w_spec[c]) for c in cuts]))
    ops = []
    for line in fn.lower(ws, x, g).compile().as_text().splitlines():
        line = re.sub(r"/\*index=[0-9]+\*/", "", line)  # tuple results carry these
        m = re.search(r"=\s*(\(?[^=]*?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                      r"collective-permute)(-start)?\(", line)
        if not m:
            continue
        total = 0  # a tuple-shaped op (one piece per peer, or fused ops) counts as one
        for dt, dims in re.findall(r"(f32|f64|bf16|f16|s32|u32|pred)\[([0-9,]*)\]",
                                   m.group(1)):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * size[dt]
        ops.append((m.group(2).replace("-", "_"), total))
    return ops

print(json.dumps([collectives(c) for c in plans]))
'''


def hlo_collectives(plans: Sequence[Sequence[str]], batch: int, widths: Sequence[int],
                    devices: int = 8, timeout: float = 300) -> list[list[tuple[str, int]]]:
    """For each plan (cuts, one per layer): ``(kind, bytes)`` of every collective XLA
    puts in one training step of the chain (output and weight gradients by ``jax.vjp``,
    float32, ``tanh`` between layers, the output's cotangent given in the output's tiling)
    when each layer's input, weight and output are constrained to the tilings of its cut,
    on a mesh of ``devices`` fake CPU devices. Bytes are of the shape the compiled HLO
    gives each op's result (summed over a tuple's elements: XLA fuses collectives and
    gives an all-to-all one element per peer): the payloads :func:`plan_collectives`
    predicts. Runs JAX in
    one subprocess with ``JAX_NUM_CPU_DEVICES`` set, so it works after JAX started here."""
    import json
    import os
    import subprocess
    import sys

    devices = check_int("devices", devices, lo=2)
    widths = [check_int("widths", w, lo=1) for w in widths]
    plans = [list(p) for p in plans]
    for p in plans:
        plan_collectives(p, batch, widths, devices)  # validates cuts and sizes
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", _HLO_SCRIPT,
                           json.dumps([plans, batch, widths, devices])],
                          capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"the JAX subprocess failed:\n{done.stderr[-3000:]}")
    return [[(k, int(b)) for k, b in ops]
            for ops in json.loads(done.stdout.strip().splitlines()[-1])]


def bytes_by_kind(ops: Sequence[tuple]) -> dict[str, int]:
    """Total payload bytes per collective kind of ``ops`` (tuples ending ``kind, bytes``,
    as :func:`plan_collectives` and :func:`hlo_collectives` give them). Totals, not op
    lists, are what to compare: XLA fuses several all-reduces into one tuple-shaped op."""
    out: dict[str, int] = {}
    for *_, kind, nbytes in ops:
        out[kind] = out.get(kind, 0) + int(nbytes)
    return dict(sorted(out.items()))


def bench(device: torch.device, quick: bool) -> list:
    """Rows for ``python -m parlearn.bench tensor_parallel``: communication counted against
    the cost model (``ratio`` = counted bytes / modeled bytes; 1.0 is agreement). Bytes do
    not depend on the device, so every row runs on the CPU whatever ``device`` is (the
    rows name where they ran): the Megatron block on 2 gloo ranks (payloads from
    :func:`parlearn.dist.ledger`, forward plus backward), and the plan
    :func:`best_one_cut` picks for two networks on a JAX mesh of 8 fake CPU devices
    (payloads from the compiled HLO). No times are claimed."""
    from .bench import Row

    del device  # see the docstring: communication volume is device-independent
    rows = []
    b, d, h = (8, 16, 32) if quick else (32, 64, 256)
    res = megatron_check(2, batch=b, d_model=d, d_hidden=h)
    counted = sum(n for phase in res["ledger"].values() for _, n, _ in phase.values())
    modeled = sum(n for *_, n in _layer_collectives("column", b, d, h, 8, True)
                  + _layer_collectives("row", b, h, d, 8, True))
    rows.append(Row("tensor_parallel", "cost model: all-reduce |Y| fwd + |X| bwd",
                    "Megatron MLP from scratch, ledger bytes", counted / modeled,
                    "cpu (gloo, 2 ranks)",
                    target="counted = modeled", met=counted == modeled,
                    detail=f"float64 batch {b}, d {d}, hidden {h}: counted {counted} B, "
                           f"modeled {modeled} B; max error vs unsharded "
                           f"{max(res['scratch'], res['dtensor']):.1e}"))
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


RANK_MOVEMENTS = {"broadcast": RankBroadcast, "sum_reduce": RankSumReduce,
                  "all_gather": RankAllGather, "reduce_scatter": RankReduceScatter}
"""The real-rank movements: name -> autograd function (worker-side)."""


def rank_dot_product_worker(rank: int, world_size: int, rows: int = 2, cols: int = 3,
                            seed: int = 0) -> dict[str, tuple[float, float]]:
    """Worker: ``(<F x, y>, <x, F* y>)`` for every :data:`RANK_MOVEMENTS` entry, each inner
    product summed over ranks, ``F*`` taken as the autograd backward. Rank ``r`` draws its
    own ``x`` and ``y`` (float64) from a generator seeded by ``seed`` and ``r``."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    out = {}
    for name, fn in RANK_MOVEMENTS.items():
        x = torch.randn(world_size * rows if name == "reduce_scatter" else rows, cols,
                        generator=g, dtype=torch.float64, requires_grad=True)
        fx = fn.apply(x)
        y = torch.randn(fx.shape, generator=g, dtype=torch.float64)
        (adj,) = torch.autograd.grad(fx, x, grad_outputs=y)
        sides = torch.stack([(fx.detach() * y).sum(), (x.detach() * adj).sum()])
        tdist.all_reduce(sides)
        out[name] = (sides[0].item(), sides[1].item())
    return out


# ---------------------------------------------------------------------------------------
# An Alpa-style two-level plan on the cost model: pipeline stages x sharding inside each.

def _stage_time(batch: int, widths: Sequence[int], i: int, j: int, group: int, last: bool,
                flops_per_s: float, bytes_per_s: float, itemsize: int) -> tuple[float, list]:
    """Modeled seconds one microbatch of ``batch`` rows spends in stage ``[i, j)`` on
    ``group`` devices (compute, its intra-stage collectives, and sending its activation
    forward and receiving that gradient back), and the stage's cuts."""
    from .dist_model import ring_bytes

    flops = 6.0 * batch * sum(widths[k] * widths[k + 1] for k in range(i, j))
    if group > 1:
        cuts, _ = best_one_cut(batch, widths[i:j + 1], group, itemsize)
        comm = sum(ring_bytes(k, n, group) for *_, k, n in
                   plan_collectives(cuts, batch, widths[i:j + 1], group, itemsize))
    else:
        cuts, comm = ["whole"] * (j - i), 0.0  # one device holds each layer
    p2p = 0.0 if last else 2.0 * batch * widths[j] * itemsize
    return flops / group / flops_per_s + (comm + p2p) / bytes_per_s, cuts


def two_level_plan(batch: int, widths: Sequence[int], devices: int, microbatches: int,
                   flops_per_s: float, bytes_per_s: float, itemsize: int = 4) -> dict:
    """The plan minimising modeled step time ``(m + S - 1) * max_s t_s`` (GPipe's schedule
    with ``m`` microbatches over ``S`` stages) for ``devices`` devices: ``S`` divides
    ``devices``, each stage is a contiguous run of layers on ``devices / S`` devices, and
    each stage's layers take the communication-optimal one cut (:func:`best_one_cut`) over
    its devices. The inner problem (contiguous split minimising the slowest stage) is a
    dynamic program over (stages, layers); the outer one tries every ``S``. Data
    parallelism (``S = 1``, all cuts batch), tensor parallelism (``S = 1``, column/row) and
    a pure pipeline (one device per stage) are all points of this space.

    A simplified reconstruction of Alpa's two levels (Alpa solves the inner level by an
    ILP over a richer sharding space and profiles stages): here times are modeled from
    flops and bytes only, every collective is paid per microbatch (weight gradients are
    synchronised as each microbatch produces them, as DDP does without ``no_sync``), and
    no memory limit is imposed. Returns ``{"step_s", "stages" ([start, end) per stage),
    "group", "cuts" (per stage; ``"whole"`` on one device), "stage_s"}``."""
    widths = [check_int("widths", w, lo=1) for w in widths]
    batch = check_int("batch", batch, lo=1)
    devices = check_int("devices", devices, lo=1)
    m = check_int("microbatches", microbatches, lo=1)
    flops_per_s = check_float("flops_per_s", flops_per_s, lo=0, lo_open=True)
    bytes_per_s = check_float("bytes_per_s", bytes_per_s, lo=0, lo_open=True)
    if batch % m:
        raise ValueError(f"batch {batch} must be divisible by microbatches={m}")
    layers, mb = len(widths) - 1, batch // m
    best = None
    for stages in range(1, min(layers, devices) + 1):
        if devices % stages:
            continue
        group = devices // stages
        if group > 1 and mb % group:
            continue  # a batch cut could not split the microbatch evenly
        t = {(i, j): _stage_time(mb, widths, i, j, group, j == layers, flops_per_s,
                                 bytes_per_s, itemsize)
             for i in range(layers) for j in range(i + 1, layers + 1)}
        # dp[s][j]: the smallest slowest-stage time covering layers [0, j) with s stages.
        dp = [{0: (0.0, [])}] + [{} for _ in range(stages)]
        for s in range(1, stages + 1):
            for j in range(s, layers - (stages - s) + 1):
                dp[s][j] = min(((max(dp[s - 1][i][0], t[i, j][0]), dp[s - 1][i][1] + [(i, j)])
                                for i in range(s - 1, j) if i in dp[s - 1]),
                               key=lambda v: v[0])
        slowest, parts = dp[stages][layers]
        step = (m + stages - 1) * slowest
        if best is None or step < best["step_s"]:
            best = {"step_s": step, "stages": parts, "group": group,
                    "cuts": [t[p][1] for p in parts], "stage_s": [t[p][0] for p in parts]}
    if best is None:
        raise ValueError(f"no plan: the microbatch ({mb} rows) splits evenly over none of "
                         f"the device groups that divide devices={devices}")
    return best
