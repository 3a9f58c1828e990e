"""ZeRO-1 and ZeRO-2 around any torch optimizer: :class:`ShardedOptimizer`.

The drop-in form of lesson 12's idea, shaped like torch's own
``ZeroRedundancyOptimizer(params, optimizer_class=..., **defaults)``: each parameter tensor
has one owner rank (whole tensors, assigned greedily largest first to the rank holding the
fewest elements, the rule torch's optimizer uses, so the two shard alike), and only the
owner keeps that tensor's optimizer state and runs the update on it. Then every parameter is
broadcast from its owner. Because the wrapped optimizer sees whole tensors, *any* torch
optimizer works (per-tensor ones such as Adafactor too), with param groups, ``closure`` and
learning-rate schedulers unchanged.

- ``stage=1`` (optimizer state sharded): gradients are all-reduced (averaged) over the
  group, every rank keeps every gradient.
- ``stage=2`` (+ gradients sharded): each gradient is reduced to its owner only; the other
  ranks drop theirs (``.grad = None``) after the reduction, so a rank holds the gradients
  it updates and no others.

``average_grads=False`` skips the gradient exchange, for gradients that are already averaged
(by DDP, whose all-reduce makes stage 1's redundant). Accumulating several backwards before
one ``step`` works as with any optimizer: the exchange happens in ``step``.

Memory per rank (modeled): parameters ``P`` (replicated) + state ``K P / N`` (K state
tensors per parameter, ``K = 2`` for Adam) + gradients ``P`` (stage 1) or ``P / N``
(stage 2), where ``/ N`` is "the owner's share", even to within one tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as tdist

from parlearn.core.checks import check_bool, check_choice, check_float
from parlearn.core.recipe import _clip_to
from parlearn.distributed.agree import agree

__all__ = ["ShardedOptimizer", "owners"]


def owners(sizes: list[int], world_size: int, held: list[int] | None = None) -> list[int]:
    """The owner rank of each tensor of one param group of ``sizes`` (numels): largest first,
    each to the rank that holds the fewest elements so far (lowest rank on ties), the rule of
    torch's ``ZeroRedundancyOptimizer``. ``held`` (elements per rank from earlier groups,
    updated in place) carries the count from group to group, as torch's does."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    held = [0] * world_size if held is None else held
    if len(held) != world_size:
        raise ValueError(f"held must have world_size={world_size} entries, got {len(held)}")
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = min(range(world_size), key=lambda r: held[r])
        out[i] = rank
        held[rank] += sizes[i]
    return out


def _param_groups(params: Any) -> list[dict]:
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or of param-group dicts, got a "
                        "single tensor (as torch's optimizers, pass [tensor])")
    if isinstance(params, str) or not isinstance(params, Iterable):
        raise TypeError(f"params must be an iterable of tensors or dicts, got {params!r}")
    params = list(params)
    if not params:
        raise ValueError("params is empty: the optimizer has nothing to update")
    groups = params if isinstance(params[0], dict) else [{"params": params}]
    seen: set[int] = set()
    out = []
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"params[{i}] must be a dict with 'params' (or pass tensors only)")
        tensors = group["params"]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not t.is_leaf:
                raise TypeError(f"params[{i}]['params'] must hold leaf tensors, got {t!r}")
            if id(t) in seen:
                raise ValueError(f"params[{i}] repeats a tensor: a tied weight is passed once")
            seen.add(id(t))
        out.append({**group, "params": tensors})
    return out


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1/2 from scratch around ``optimizer_class`` (module docstring).

        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2,
                               lr=3e-4, weight_decay=0.1)
        loss.backward(); opt.step(); opt.zero_grad()

    ``params``: tensors or param-group dicts, as for any torch optimizer (the same on every
    rank, in the same order: checked before the first step's exchange). ``group``: the
    process group (default: the world). ``**defaults`` go to ``optimizer_class``.
    ``param_groups`` are the full groups, so schedulers and ``lr`` changes work unchanged.
    """

    def __init__(self, params: Any, optimizer_class: type[torch.optim.Optimizer] =
                 torch.optim.AdamW, *, stage: int = 1, group: Any = None,
                 average_grads: bool = True, **defaults: Any) -> None:
        if not (isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got "
                            f"{optimizer_class!r}")
        if optimizer_class is torch.optim.LBFGS:
            raise ValueError("optimizer_class=LBFGS needs every gradient on every rank for its "
                             "line search; it cannot be sharded")
        self.stage = check_choice("stage", stage, (1, 2))
        self.average_grads = check_bool("average_grads", average_grads)
        if not tdist.is_initialized():
            raise RuntimeError("ShardedOptimizer needs an initialised process group (run the "
                               "worker with parlearn.distributed.run or torchrun)")
        groups = _param_groups(params)
        self.group = group
        self.world = tdist.get_world_size(group)
        self.rank = tdist.get_rank(group)
        self.optimizer_class = optimizer_class
        # The inner optimizer checks the hyperparameters (lr < 0, betas...) at once, on a
        # throwaway tensor, so a bad value fails here on every rank, not at the first step.
        try:
            probe = optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)
        except (TypeError, ValueError) as err:   # torch's text does not always name it
            raise type(err)(f"{optimizer_class.__name__} refused its arguments {defaults}: "
                            f"{err}") from None
        # The class's full defaults (momentum=0, nesterov=False...), so param_groups and the
        # consolidated state_dict read exactly as the plain optimizer's.
        super().__init__(groups, probe.defaults)
        held = [0] * self.world
        self._owner = {}
        for g in self.param_groups:
            own = owners([p.numel() for p in g["params"]], self.world, held)
            self._owner.update({id(p): r for p, r in zip(g["params"], own, strict=True)})
        # broadcast/reduce name ranks globally; the owners are ranks of the group
        self._global = [r if group is None else tdist.get_global_rank(group, r)
                        for r in range(self.world)]
        self._exchanged = False
        mine = [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [p for p in g["params"] if self._owner[id(p)] == self.rank]}
                for g in self.param_groups]
        self.optim = optimizer_class(mine, **defaults)
        self._agreed = False

    # -- what torch.optim.Optimizer users call ------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Exchange the gradients (stage 1: all-reduce; stage 2: reduce to owners), step the
        owned tensors with the wrapped optimizer, broadcast every tensor from its owner."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"]]
        if not self._exchanged:
            self.reduce_gradients()
        self._exchanged = False
        for inner, outer in zip(self.optim.param_groups, self.param_groups, strict=True):
            for key, value in outer.items():
                if key != "params":
                    inner[key] = value
        self.optim.step()
        for p in params:
            tdist.broadcast(p.data, src=self._global[self._owner[id(p)]], group=self.group)
        return loss

    def _exchange(self, p: torch.Tensor) -> None:
        if not self.average_grads:
            if self.stage == 2 and self._owner[id(p)] != self.rank:
                p.grad = None
            return
        if self.stage == 1:
            tdist.all_reduce(p.grad, group=self.group)
            p.grad.div_(self.world)
            return
        owner = self._owner[id(p)]
        tdist.reduce(p.grad, dst=self._global[owner], group=self.group)
        if owner == self.rank:
            p.grad.div_(self.world)
        else:
            p.grad = None

    def _check_agreement(self, params: list[torch.Tensor]) -> None:
        agree({"params (shapes and dtypes, in order)":
               [(tuple(p.shape), str(p.dtype)) for p in params]}, group=self.group)
        self._agreed = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "optim", None) is not None:
            raise NotImplementedError("ShardedOptimizer does not take param groups after "
                                      "construction: pass every group to the constructor")
        super().add_param_group(param_group)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm of every gradient on every rank (after the exchange a
        stage-2 rank holds only its own: their norms are summed over ranks first). Call it
        between the gradient exchange and the update: ``step`` runs both, so with clipping
        call :meth:`reduce_gradients`, then this, then ``step`` (which then skips the
        exchange it already did). Returns the total norm before clipping."""
        max_norm = check_float("max_norm", max_norm, lo=0, lo_open=True)
        if self.average_grads and not self._exchanged:
            raise RuntimeError("call reduce_gradients() before clip_grad_norm_(): the norm is "
                               "that of the averaged gradients")
        norm_type = check_float("norm_type", norm_type, lo=1)
        grads = [p.grad for g in self.param_groups for p in g["params"]
                 if p.grad is not None and (self.stage == 1 or self._owner[id(p)] == self.rank)]
        local = (torch.stack([g.detach().abs().pow(norm_type).sum() for g in grads]).sum()
                 if grads else torch.zeros((), dtype=torch.float64))
        total = local.to(torch.float64)
        if self.stage == 2:
            tdist.all_reduce(total, group=self.group)
        return _clip_to(grads, total, max_norm, norm_type)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """The gradient exchange of :meth:`step` on its own (for clipping in between); the
        next ``step`` then skips it. Ranks first agree which tensors have a gradient (an
        unused parameter has none on every rank), so a rank that ran another backward is an
        error on every rank, not a hang."""
        params = [p for g in self.param_groups for p in g["params"]]
        if not self._agreed:
            self._check_agreement(params)
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int64)
        tdist.all_reduce(has, group=self.group)
        odd = [i for i, h in enumerate(has.tolist()) if 0 < h < self.world]
        if odd:
            raise RuntimeError(f"parameters {odd} have a gradient on some ranks and none on "
                               "others: every rank must run the same backward")
        for p, h in zip(params, has.tolist(), strict=True):
            if h:
                self._exchange(p)
        self._exchanged = True

    # -- state: consolidated on one rank, as torch's --------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's optimizer state onto rank ``to`` (a collective: every rank
        calls it); then ``state_dict()`` on rank ``to`` is the state a plain
        ``optimizer_class`` over all the parameters would have."""
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < self.world:
            raise ValueError(f"to must be a rank in [0, {self.world}), got {to!r}")
        flat = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(flat)}
        inner = self.optim.state_dict()
        mine_flat = [p for g in self.optim.param_groups for p in g["params"]]
        state = {index[id(p)]: _cpu(inner["state"][i]) for i, p in enumerate(mine_flat)
                 if i in inner["state"]}
        gathered: list = [None] * self.world
        tdist.all_gather_object(gathered, state, group=self.group)
        self._consolidated = ({k: v for part in gathered for k, v in part.items()}
                              if self.rank == to else None)

    def state_dict(self) -> dict:
        if getattr(self, "_consolidated", None) is None:
            raise RuntimeError("call consolidate_state_dict(to=this rank) on every rank first; "
                               "the consolidated state lives on that rank only")
        groups, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + n))})
            start += n
        return {"state": dict(self._consolidated), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state (``state_dict()`` of this class or of a plain optimizer over the
        same parameters): every rank keeps its own tensors' state and the groups' values."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            raise TypeError("state_dict must be an optimizer state dict with 'state' and "
                            "'param_groups'")
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(state_dict['param_groups'])} param groups, "
                             f"this optimizer {len(self.param_groups)}")
        flat = [p for g in self.param_groups for p in g["params"]]
        for g, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            if len(saved["params"]) != len(g["params"]):
                raise ValueError("state_dict's param groups hold other numbers of tensors")
            g.update({k: v for k, v in saved.items() if k != "params"})
        index = {id(p): i for i, p in enumerate(flat)}
        mine_flat = [p for g in self.optim.param_groups for p in g["params"]]
        inner_state = {j: _to(state_dict["state"][index[id(p)]], p)
                       for j, p in enumerate(mine_flat) if index[id(p)] in state_dict["state"]}
        groups, start = [], 0
        for inner_g, outer_g in zip(self.optim.param_groups, self.param_groups, strict=True):
            n = len(inner_g["params"])
            groups.append({**{k: v for k, v in outer_g.items() if k != "params"},
                           "params": list(range(start, start + n))})
            start += n
        self.optim.load_state_dict({"state": inner_state, "param_groups": groups})

    def held_numel(self) -> dict[str, int]:
        """Elements this rank holds: ``params`` (all), ``grads`` (those not None) and
        ``state`` (the wrapped optimizer's tensors), measured on the live objects."""
        params = [p for g in self.param_groups for p in g["params"]]
        state = sum(v.numel() for s in self.optim.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"params": sum(p.numel() for p in params),
                "grads": sum(p.grad.numel() for p in params if p.grad is not None),
                "state": state}


def _cpu(state: dict) -> dict:
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def _to(state: dict, p: torch.Tensor) -> dict:
    # Step counters stay where the optimizer keeps them (a CPU scalar tensor); state tensors
    # of the parameter's shape go to its device and dtype.
    return {k: v.to(p.device, p.dtype) if isinstance(v, torch.Tensor) and v.shape == p.shape
            else v for k, v in state.items()}

