"""Expert parallelism on real ranks: experts spread over ranks, tokens sent to them and back.

With ``P`` ranks in an expert-parallel (EP) group and ``E`` experts, rank ``j`` holds experts
``j E/P .. (j+1) E/P - 1`` and its own tokens (its group, in :mod:`layer`'s sense). One MoE
forward on a rank:

1. **route** its tokens (the router is replicated: every rank has the same weights);
2. **exchange counts**: how many assignments it sends to each expert, an
   ``all_to_all_single`` of ``E`` integers, so every rank learns how many rows it will
   receive from each peer (the split sizes vary from step to step);
3. **dispatch**: its kept assignments, sorted by expert (so by destination rank), as one
   ``all_to_all_single`` with those split sizes;
4. run its local experts on what arrived (rows from every rank, grouped by source);
5. **combine**: send the outputs back by the reverse all-to-all, and add each one, times its
   gate, at its token.

Backward is the same exchange run backwards: the adjoint of an all-to-all with splits
``(in, out)`` is the all-to-all with ``(out, in)`` (:class:`AllToAll`). An expert's weight
gradient thus already sums the contributions of every rank's tokens.

EP x DP: on ``world = dp * ep`` ranks, rank ``i * ep + j`` is EP index ``j`` of data-parallel
row ``i``. Experts are sharded over the EP dimension and replicated over DP, so expert
gradients are all-reduced over the DP group and everything else (router, attention,
embeddings) over all ranks (:func:`sync_grads`).
"""

from __future__ import annotations

import torch
import torch.distributed as tdist
from torch import nn

from parlearn.core.checks import check_int, check_module, check_tensor
from parlearn.distributed.agree import _unrecorded, agree
from parlearn.multi_device.moe.layer import MoE, moe_layers
from parlearn.multi_device.moe.router import Routing

__all__ = ["AllToAll", "ExpertParallelMoE", "mesh_groups", "to_expert_parallel", "sync_grads"]


def _splits(name: str, value, world: int) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of {world} row counts, got {value!r}")
    if len(value) != world:
        raise ValueError(f"{name} must hold one row count per rank ({world}), got {value!r}")
    return [check_int(name, n, lo=0) for n in value]


def _check_all_to_all(x, out_splits, in_splits, group) -> None:
    """Each rank's arguments, then that what rank ``i`` sends rank ``j``
    (``in_splits[j]`` on ``i``) is what ``j`` expects from ``i`` (``out_splits[i]`` on
    ``j``), on every rank before the exchange: a mismatch would abort or hang in it."""
    err = None
    try:
        if group is not None and not isinstance(group, tdist.ProcessGroup):
            raise TypeError(f"group must be a ProcessGroup or None, got {type(group).__name__}")
        check_tensor("x", x)
        if x.dim() == 0:
            raise ValueError("x must have at least one dimension (its rows are exchanged)")
        world = tdist.get_world_size(group) if tdist.is_initialized() else 1
        out_splits = _splits("out_splits", out_splits, world)
        in_splits = _splits("in_splits", in_splits, world)
        if sum(in_splits) != x.shape[0]:
            raise ValueError(f"in_splits must sum to the rows of x ({x.shape[0]}), got "
                             f"{in_splits}")
    except (TypeError, ValueError) as e:
        err = e
    ok = isinstance(group, tdist.ProcessGroup | None)
    agree({"x.shape[1:]": tuple(x.shape[1:]) if isinstance(x, torch.Tensor) else None,
           "x.dtype": str(getattr(x, "dtype", None))}, err, group=group if ok else None)
    table: list = [None] * tdist.get_world_size(group)
    with _unrecorded():   # bookkeeping, like agree's own exchange: not in the ledger
        tdist.all_gather_object(table, (list(in_splits), list(out_splits)), group=group)
    for i, (sends, _) in enumerate(table):
        for j, (_, expects) in enumerate(table):
            if sends[j] != expects[i]:
                raise ValueError(f"in_splits and out_splits must match across ranks: rank {i} "
                                 f"sends {sends[j]} rows to rank {j}, which expects "
                                 f"{expects[i]} (in_splits per rank: "
                                 f"{[t[0] for t in table]}, out_splits: "
                                 f"{[t[1] for t in table]})")


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows of ``x`` with split sizes, differentiable: backward
    sends the gradient rows back with the splits swapped. ``AllToAll.apply(x, out_splits,
    in_splits, group)``: ``in_splits[j]`` rows of ``x`` (in order) go to rank ``j``,
    ``out_splits[i]`` rows arrive from rank ``i``; checked on every rank first."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        _check_all_to_all(x, out_splits, in_splits, group)
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        tdist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        tdist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class ExpertParallelMoE(MoE):
    """The :class:`MoE` ``full`` with only the experts of EP rank ``ep_rank`` of ``ep_size``
    (copied), routing this rank's tokens as one group and exchanging them over ``group``.
    ``last["sent"]`` and ``last["received"]`` hold the rows this rank sent to (received
    from) each EP rank in the last forward's dispatch."""

    def __init__(self, full: MoE, ep_rank: int, ep_size: int, group=None):
        if not isinstance(full, MoE) or isinstance(full, ExpertParallelMoE):
            raise TypeError(f"full must be a parlearn MoE, got {type(full).__name__}")
        ep_size = check_int("ep_size", ep_size, lo=1)
        ep_rank = check_int("ep_rank", ep_rank, lo=0, hi=ep_size - 1)
        if full.n_experts % ep_size:
            raise ValueError(f"n_experts={full.n_experts} must be divisible by the EP degree "
                             f"ep_size={ep_size}")
        nn.Module.__init__(self)
        for name in ("d_model", "d_ff", "n_experts", "k", "capacity_factor", "routing"):
            setattr(self, name, getattr(full, name))
        self.groups, self.ep_size, self.group = 1, ep_size, group
        per = full.n_experts // ep_size
        self.experts = list(range(ep_rank * per, (ep_rank + 1) * per))
        self.router = nn.utils.skip_init(nn.Linear, full.d_model, full.n_experts, bias=False,
                                         dtype=full.router.weight.dtype)
        with torch.no_grad():
            self.router.weight.copy_(full.router.weight)
        sl = slice(self.experts[0], self.experts[-1] + 1)
        self.w_up = nn.Parameter(full.w_up.detach()[sl].clone())
        self.w_down = nn.Parameter(full.w_down.detach()[sl].clone())
        self.last = {}

    def combine(self, x: torch.Tensor, r: Routing) -> torch.Tensor:
        E, P = self.n_experts, self.ep_size
        per = E // P
        # Kept assignments sorted by expert, hence by the rank that holds it.
        token, slot = torch.nonzero(r.kept, as_tuple=True)
        expert = r.expert[token, slot]
        order = torch.argsort(expert, stable=True)
        token, slot, expert = token[order], slot[order], expert[order]
        send_counts = torch.bincount(expert, minlength=E)
        recv_counts = torch.empty_like(send_counts)
        tdist.all_to_all_single(recv_counts, send_counts, group=self.group)  # step 2
        in_splits = send_counts.view(P, per).sum(1).tolist()
        out_splits = recv_counts.view(P, per).sum(1).tolist()
        got = AllToAll.apply(x[token], out_splits, in_splits, self.group)  # step 3: dispatch
        # Rows arrive grouped by source rank, then by local expert within each source.
        local = torch.repeat_interleave(torch.arange(per).repeat(P), recv_counts)
        # got * 0, not zeros: a rank whose experts receive nothing must still take part in
        # the backward all-to-all, so its output stays in the graph.
        done = got * 0
        for i in range(per):  # step 4
            rows = torch.nonzero(local == i, as_tuple=True)[0]
            if len(rows):
                done = done.index_add(0, rows, self.expert(i, got[rows]))
        back = AllToAll.apply(done, in_splits, out_splits, self.group)  # step 5: combine
        self.sent, self.received = in_splits, out_splits
        return torch.zeros_like(x).index_add(0, token, back * r.gate[token, slot, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Checked on every rank and agreed before the all-to-alls: a rank that refused x
        # alone would leave the others waiting in the dispatch.
        err = None
        try:
            check_tensor("x", x, floating=True)
            if x.dim() < 1 or x.shape[-1] != self.d_model:
                raise ValueError(f"x must end in d_model={self.d_model}, got "
                                 f"{tuple(x.shape)}")
        except (TypeError, ValueError) as e:
            err = e
        agree({"x.dtype": str(getattr(x, "dtype", None))}, err, group=self.group)
        y = super().forward(x)
        self.last["sent"], self.last["received"] = self.sent, self.received
        return y


def mesh_groups(world_size: int, ep: int) -> tuple[int, int, object, object]:
    """``(ep_rank, dp_rank, ep_group, dp_group)`` of this rank on the ``(world/ep, ep)`` mesh
    (module docstring). Every rank must call it, in the same order (``new_group`` is
    collective)."""
    world_size = check_int("world_size", world_size, lo=1)
    if tdist.is_initialized() and world_size != tdist.get_world_size():
        raise ValueError(f"world_size={world_size} must be the group's size "
                         f"{tdist.get_world_size()}")
    ep = check_int("ep", ep, lo=1, hi=world_size)
    if world_size % ep:
        raise ValueError(f"ep={ep} must divide world_size={world_size}")
    dp, rank = world_size // ep, tdist.get_rank()
    ep_groups = [tdist.new_group([i * ep + j for j in range(ep)]) for i in range(dp)]
    dp_groups = [tdist.new_group([i * ep + j for i in range(dp)]) for j in range(ep)]
    return rank % ep, rank // ep, ep_groups[rank // ep], dp_groups[rank % ep]


def to_expert_parallel(model: nn.Module, ep_rank: int, ep_size: int, group=None) -> nn.Module:
    """Replace every :class:`MoE` inside ``model`` (in place) by its
    :class:`ExpertParallelMoE` for EP rank ``ep_rank``; returns ``model``. The ranks are
    checked first, even for a model without an MoE layer (nothing ignored)."""
    check_module("model", model)
    ep_size = check_int("ep_size", ep_size, lo=1)
    ep_rank = check_int("ep_rank", ep_rank, lo=0, hi=ep_size - 1)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MoE) and not isinstance(child, ExpertParallelMoE):
                setattr(parent, name, ExpertParallelMoE(child, ep_rank, ep_size, group))
    return model


def _is_expert(model: nn.Module) -> set[int]:
    return {id(p) for m in moe_layers(model) for p in (m.w_up, m.w_down)}


def sync_grads(model: nn.Module, world_size: int, dp_group=None, dp_size: int = 1) -> None:
    """Make every ``.grad`` the gradient of the mean of the ranks' losses: replicated
    parameters all-reduced over all ranks, expert weights over ``dp_group`` (their
    replicas; the all-to-all backward already summed over the EP group), all divided by
    ``world_size``. A parameter without a gradient (an expert that got no token) gets
    zeros, so every rank issues the same collectives."""
    check_module("model", model)
    world_size = check_int("world_size", world_size, lo=1)
    dp_size = check_int("dp_size", dp_size, lo=1, hi=world_size)
    if dp_group is not None and not isinstance(dp_group, tdist.ProcessGroup):
        raise TypeError(f"dp_group must be a torch.distributed ProcessGroup or None, got "
                        f"{type(dp_group).__name__}")
    experts = _is_expert(model)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if id(p) in experts:
            if dp_size > 1:
                tdist.all_reduce(p.grad, group=dp_group)
        else:
            tdist.all_reduce(p.grad)
        p.grad /= world_size
