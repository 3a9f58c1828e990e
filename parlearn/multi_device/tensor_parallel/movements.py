"""Data movements as linear operators whose backward is their adjoint (DistDL).

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
:func:`rank_dot_product_worker`): the one-process version is their serial reference, and
:mod:`parlearn.multi_device.tensor_parallel.conv` uses the halo exchange to split a
convolution along its positions. This is our reconstruction from the paper's abstract and
public descriptions, not DistDL's code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as tdist

from parlearn.core.checks import check_choice, check_int, check_seed, check_tensor
from parlearn.distributed.agree import agree

__all__ = ["MOVEMENTS", "movement", "dot_product_test", "movement_matrix",
           "RankBroadcast", "RankSumReduce", "RankScatter", "RankGather", "RankAllGather",
           "RankReduceScatter", "RankHaloExchange", "RankRepartition", "RANK_MOVEMENTS",
           "rank_dot_product_worker"]


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
    _check_pieces(name, pieces, p)
    return list(_Movement.apply(name, p, *pieces))


def _check_pieces(name: str, pieces, p: int) -> None:
    """``pieces`` the per-rank 2-D tensors movement ``name`` takes over ``p`` ranks: as many
    as it maps, of the shapes :data:`MOVEMENTS` gives for the sizes the first one implies
    (nothing silently dropped, broadcast or cut)."""
    if isinstance(pieces, (str, bytes)) or not isinstance(pieces, Sequence) or not pieces:
        raise TypeError(f"pieces must be a non-empty list of tensors, got {pieces!r}")
    for t in pieces:
        check_tensor("pieces", t, ndim=2)
    rows, cols = pieces[0].shape
    if name in ("scatter", "reduce_scatter", "cols_to_rows"):
        rows = rows // p if rows % p == 0 else -1
    elif name == "rows_to_cols":
        cols = cols // p if cols % p == 0 else -1
    elif name == "halo_add":
        cols -= 2
    want = MOVEMENTS[name][2](p, rows, cols) if min(rows, cols) >= 1 else None
    got = [tuple(t.shape) for t in pieces]
    if want is None or got != [tuple(s) for s in want]:
        raise ValueError(f"pieces of shapes {got} do not fit movement {name!r} over p={p} "
                         f"ranks (it takes shapes like {MOVEMENTS[name][2](p, 2, 3)})")


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
# ranks' tensors; a rank whose input the map ignores gets a zero gradient. Each checks its
# input and agrees on the shapes before the first message (a mismatch would hang or abort).

def _agree_block(x, *, split_dim: int | None = None, checks: Callable[[], None] | None = None,
                 fields: dict | None = None, shape_of: Callable | None = None) -> None:
    """``x`` a tensor of >= 1 dims (``split_dim`` divisible by the world size), ``checks()``
    passing; ``shape_of(x)`` (default ``x.shape``), dtype and ``fields`` equal on all ranks."""
    err = None
    try:
        check_tensor("x", x)
        if x.dim() == 0:
            raise ValueError("x must have at least one dimension (the movements cut along "
                             "one), got a 0-dimensional tensor")
        if checks is not None:
            checks()
        p = tdist.get_world_size() if tdist.is_initialized() else 1
        if split_dim is not None and x.shape[split_dim] % p:
            raise ValueError(f"x.shape[{split_dim}]={x.shape[split_dim]} must be divisible by "
                             f"world_size={p} (equal blocks)")
    except (TypeError, ValueError) as e:
        err = e
    shape = (tuple(shape_of(x) if shape_of else x.shape) if isinstance(x, torch.Tensor)
             else None)
    agree({"x.shape": shape, "x.dtype": str(getattr(x, "dtype", None)), **(fields or {})},
          err)

class RankBroadcast(torch.autograd.Function):
    """Rank 0's tensor to every rank; backward: the gradients summed onto rank 0."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        _agree_block(x)
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
        _agree_block(x)
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
        _agree_block(x)
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
        _agree_block(x, split_dim=0)
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
        _agree_block(x, split_dim=0)
        return _scatter0(x.detach())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _gather0(grad)


class RankGather(torch.autograd.Function):
    """Every rank's block joined along dim 0 on rank 0 (zeros elsewhere); backward: a
    scatter of rank 0's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        _agree_block(x)
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
        def checks() -> None:
            check_int("halo", halo, lo=1)
            if halo > x.shape[-1]:
                raise ValueError(f"halo must be in [1, {x.shape[-1]}] (the local length), "
                                 f"got {halo}")

        # Neighbours exchange (*x.shape[:-1], halo) pieces: those sizes must match; the
        # local lengths may differ.
        _agree_block(x, checks=checks, fields={"halo": halo}, shape_of=lambda t: t.shape[:-1])
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
        def checks() -> None:
            check_int("src", src, lo=0, hi=x.dim() - 1)
            check_int("dst", dst, lo=0, hi=x.dim() - 1)

        # checks() refuses a bad dst before its divisibility is looked at
        _agree_block(x, checks=checks, split_dim=dst, fields={"src": src, "dst": dst})
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
    one-process movements of :data:`MOVEMENTS`. ``cols`` >= 2 (the halo)."""
    world_size = check_int("world_size", world_size, lo=1)
    rank = check_int("rank", rank, lo=0, hi=world_size - 1)
    rows, seed = check_int("rows", rows, lo=1), check_int("seed", seed, lo=0)
    cols = check_int("cols", cols, lo=2)   # the halo exchange's 2 cells fit in a block
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
