"""The MoE feed-forward layer and its single-process reference: a plain loop over experts.

    moe = MoE(d_model=64, d_ff=256, n_experts=8, k=1)
    y = moe(x)                      # x: (..., d_model); y has x's shape
    moe.last                        # routing figures of that forward (see MoE.forward)

Each expert is the tiny GPT's GELU MLP (``down(gelu(up(x)))``, no bias); the router is one
linear layer ``d_model -> n_experts``. With ``k = 1`` and ``d_ff`` equal to the dense MLP's
width, a token costs what it costs in the dense model (plus the router's ``2 h E`` FLOPs),
while the parameters grow ``n_experts`` times: sparse compute, dense capacity.

Tokens are routed in ``groups`` (GShard's word): the ``T`` tokens of the input, flattened,
split into ``groups`` equal consecutive parts, each routed with its own capacity and its
own auxiliary losses (averaged over groups). Under expert parallelism a group is what one
rank holds, so ``MoE(groups=P)`` in one process is the reference a ``P``-rank run equals.

:func:`moe_gpt` puts an MoE layer in place of every block's MLP of a
:class:`parlearn.transformer.GPT`; :func:`aux_loss` sums what its layers last computed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from parlearn.core.checks import check_choice, check_float, check_int, check_module, check_tensor
from parlearn.multi_device.moe.router import (
    Routing,
    balance_loss,
    expert_choice,
    token_choice,
    z_loss,
)
from parlearn.multi_device.transformer.model import GPT, GPTConfig

__all__ = ["MoE", "ROUTINGS", "moe_gpt", "moe_layers", "aux_loss"]

ROUTINGS = ("token", "expert")


class MoE(nn.Module):
    """Mixture-of-experts MLP: router, capacity, ``n_experts`` GELU experts (module
    docstring). Expert weights are stacked: ``w_up (E, d_model, d_ff)``, ``w_down
    (E, d_ff, d_model)``; weights are drawn from ``seed`` (never the global RNG)."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, k: int = 1, *,
                 capacity_factor: float | None = None, routing: str = "token", groups: int = 1,
                 seed: int = 0, out_std: float = 0.02, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.d_model, self.d_ff = check_int("d_model", d_model, lo=1), check_int("d_ff", d_ff, lo=1)
        self.n_experts = check_int("n_experts", n_experts, lo=1)
        self.k = check_int("k", k, lo=1)
        if k > n_experts:
            raise ValueError(f"k={k} must be at most n_experts={n_experts}")
        if capacity_factor is not None:
            capacity_factor = check_float("capacity_factor", capacity_factor, lo=0, lo_open=True)
        self.capacity_factor = capacity_factor
        self.routing = check_choice("routing", routing, ROUTINGS)
        if routing == "expert" and capacity_factor is None:
            self.capacity_factor = 1.0
        self.groups = check_int("groups", groups, lo=1)
        out_std = check_float("out_std", out_std, lo=0)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        g = torch.Generator().manual_seed(check_int("seed", seed, lo=0))
        E, h, f = n_experts, d_model, d_ff

        def draw(*shape, std):
            w = torch.randn(shape, generator=g, dtype=torch.float64) * std
            return nn.Parameter(w.to(dtype))
        self.router = nn.utils.skip_init(nn.Linear, h, E, bias=False, dtype=dtype)  # no global RNG
        with torch.no_grad():
            self.router.weight.copy_(draw(E, h, std=0.02))
        self.w_up, self.w_down = draw(E, h, f, std=0.02), draw(E, f, h, std=out_std)
        self.experts = list(range(E))  # the experts whose weights this module holds
        self.last: dict = {}

    def expert(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``self.experts[i]`` on tokens ``x (n, d_model)``."""
        return F.gelu(x @ self.w_up[i]) @ self.w_down[i]

    def route(self, x: torch.Tensor) -> Routing:
        logits = self.router(x)
        fn = token_choice if self.routing == "token" else expert_choice
        return fn(logits, self.k, self.capacity_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``y`` of ``x``'s shape. Sets ``self.last``: ``balance`` and ``z`` (auxiliary losses,
        means over groups, with gradients), ``wanted`` and ``counts`` (``(E,)`` assignments
        per expert before and after capacity, summed over groups), ``dropped``
        (assignments) and ``unrouted`` (tokens no expert computes), ``capacity`` (per
        expert and group)."""
        check_tensor("x", x, floating=True)
        if x.dim() < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must end in d_model={self.d_model}, got {tuple(x.shape)}")
        tokens = x.reshape(-1, self.d_model)
        if tokens.shape[0] % self.groups:
            raise ValueError(f"groups={self.groups} must divide the {tokens.shape[0]} tokens")
        outs, routes = [], []
        for part in tokens.chunk(self.groups):
            r = self.route(part)
            routes.append(r)
            outs.append(self.combine(part, r))
        self.last = {
            "balance": sum(balance_loss(r) for r in routes) / self.groups,
            "z": sum(z_loss(r.logits) for r in routes) / self.groups,
            "wanted": sum(r.wanted for r in routes), "counts": sum(r.counts() for r in routes),
            "dropped": sum(r.dropped() for r in routes),
            "unrouted": sum(r.unrouted() for r in routes), "capacity": routes[0].capacity}
        return torch.cat(outs).view(x.shape)

    def combine(self, x: torch.Tensor, r: Routing) -> torch.Tensor:
        """The reference: for each expert, gather its kept tokens, run it, and add its output
        times the gate back at those tokens."""
        out = torch.zeros_like(x)
        for i, e in enumerate(self.experts):
            token, slot = torch.nonzero((r.expert == e) & r.kept, as_tuple=True)
            if len(token):
                y = self.expert(i, x[token]) * r.gate[token, slot, None]
                out = out.index_add(0, token, y)
        return out


def moe_gpt(cfg: GPTConfig, n_experts: int, k: int = 1, *, capacity_factor: float | None = None,
            routing: str = "token", groups: int = 1, dtype: torch.dtype = torch.float32) -> GPT:
    """A :class:`GPT` ``(cfg)`` whose every MLP is an :class:`MoE` of ``n_experts`` experts
    as wide as the dense MLP (``cfg.ff``); expert weights drawn from ``cfg.seed`` and the
    layer index. ``cfg.mlp`` must be "gelu" (the experts are GELU MLPs)."""
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
    if cfg.mlp != "gelu":
        raise ValueError(f"moe_gpt builds GELU experts; cfg.mlp must be 'gelu', got {cfg.mlp!r}")
    model = GPT(cfg, dtype=dtype)
    out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    for i, block in enumerate(model.blocks):
        block.mlp = MoE(cfg.d_model, cfg.ff, n_experts, k, capacity_factor=capacity_factor,
                        routing=routing, groups=groups, seed=cfg.seed * 1000 + i + 1,
                        out_std=out_std, dtype=dtype)
    return model


def moe_layers(model: nn.Module) -> list[MoE]:
    """The :class:`MoE` layers of ``model`` in order."""
    check_module("model", model)
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(model: nn.Module, balance: float = 0.01, z: float = 0.0) -> torch.Tensor:
    """``balance * sum balance_loss + z * sum z_loss`` over the MoE layers' last forward."""
    check_module("model", model)
    check_float("balance", balance, lo=0)
    check_float("z", z, lo=0)
    layers = moe_layers(model)
    if not layers or not all(m.last for m in layers):
        raise ValueError("model has no MoE layer that has run a forward")
    check_float("balance", balance, lo=0)
    check_float("z", z, lo=0)
    return sum(balance * m.last["balance"] + z * m.last["z"] for m in layers)
