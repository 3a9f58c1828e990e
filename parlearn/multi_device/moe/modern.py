"""Modern MoE: fine-grained and shared experts, balancing by a router bias, dropless routing.

**Fine-grained and shared experts** (DeepSeekMoE, Dai et al. 2024). Split each of ``N``
experts of width ``f`` into ``m`` experts of width ``f/m`` (``granularity=m``) and route
every token to ``m k`` of them instead of ``k``: the same parameters and the same FLOPs per
token, but ``C(mN, mk)`` possible combinations instead of ``C(N, k)``. Of those ``mN``
narrow experts, ``K_s`` (``shared``) are **shared**: every token runs through them, and the
router picks the other ``mk - K_s`` among ``mN - K_s``, so the FLOPs per token are still
those of ``k`` experts of width ``f``. The shared experts are one GELU MLP of width
``K_s f/m`` (the sum of ``K_s`` MLPs is one MLP of their summed width), added ungated:

    y = MLP_shared(x) + sum_{e in topk} p_e MLP_e(x)

**Auxiliary-loss-free balancing** (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing
Strategy for Mixture-of-Experts"; used in DeepSeek-V3, 2024, section 2.1.2). A per-expert
bias ``b`` is added to the affinity scores for the top-k **selection only**:
``topk(p + b)`` chooses, the gate of a chosen expert stays ``p_e``. So ``b`` steers tokens
without touching the task loss's gradient, unlike the Switch balance loss. After each step

    b_i <- b_i + gamma * sign(mean_j c_j - c_i)

with ``c_i`` the tokens routed to expert ``i`` in that step (before any capacity). Our
affinities are the router's softmax probabilities (DeepSeek-V3 uses sigmoid affinities and
renormalises the gates over the chosen experts; the rule is the same).

**Dropless** (MegaBlocks, Gale et al. 2023). No capacity: every expert takes all the tokens
routed to it, a variable-size batch. :meth:`FineGrainedMoE.combine` does what MegaBlocks'
kernels do, without their block-sparse matmul: sort the ``T k`` assignments by expert
(one gather), run each expert on its contiguous segment, scatter the weighted rows back.
:func:`per_token_reference` is the float64 per-token loop it equals; :func:`drop_rates`
counts what a capacity factor would drop on the same model and inputs instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from parlearn.core.checks import check_float, check_int, check_module, check_tensor
from parlearn.multi_device.moe.layer import MoE, moe_layers
from parlearn.multi_device.moe.router import Routing, token_choice
from parlearn.multi_device.transformer.model import GPT, GPTConfig

__all__ = ["FineGrainedMoE", "bias_update", "fine_grained_shape", "per_token_reference",
           "drop_rates", "modern_gpt"]


def fine_grained_shape(n_experts: int, k: int, d_ff: int, granularity: int = 1,
                       shared: int = 0) -> dict[str, int]:
    """DeepSeekMoE's shapes for ``n_experts`` experts of width ``d_ff``, top-``k``, split
    ``granularity`` ways with ``shared`` of the narrow experts always on: ``routed``
    experts, the router's ``top_k``, each expert's ``width``, the ``active_width`` a token
    runs through (shared included; ``k * d_ff`` whatever the split), and ``combinations``
    ``C(routed, top_k)`` against the coarse layer's ``coarse_combinations`` ``C(N, k)``."""
    n = check_int("n_experts", n_experts, lo=1)
    k = check_int("k", k, lo=1, hi=n)
    f = check_int("d_ff", d_ff, lo=1)
    m = check_int("granularity", granularity, lo=1)
    if f % m:
        raise ValueError(f"granularity={m} must divide d_ff={f}")
    s = check_int("shared", shared, lo=0, hi=m * k - 1)  # at least one expert is routed
    routed, top = m * n - s, m * k - s
    return {"routed": routed, "top_k": top, "width": f // m, "active_width": (top + s) * f // m,
            "combinations": math.comb(routed, top), "coarse_combinations": math.comb(n, k)}


def bias_update(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """Wang et al. 2024's update, a new tensor: ``bias + rate * sign(mean(counts) - counts)``
    (an expert that got more than the mean tokens is made less attractive, one that got
    fewer more attractive, by ``rate`` each step; equal loads leave it unchanged)."""
    check_tensor("bias", bias, ndim=1, floating=True, finite=True)
    check_tensor("counts", counts, shape=(bias.shape[0],), finite=True)
    if counts.dtype == torch.bool or counts.is_complex() or bool((counts < 0).any()):
        raise ValueError(f"counts must be real and >= 0 (tokens per expert), got {counts}")
    rate = check_float("rate", rate, lo=0)
    c = counts.to(torch.float64)
    return bias + (rate * torch.sign(c.mean() - c)).to(bias)


class FineGrainedMoE(MoE):
    """DeepSeekMoE's layer (module docstring): ``n_experts`` experts of width ``d_ff`` and
    top-``k`` split ``granularity`` ways, ``shared`` of the narrow experts always on, the
    router biased for selection by ``self.bias`` (a buffer, zero at start) that
    :meth:`update_bias` moves by ``bias_rate`` after each step. ``capacity_factor=None``
    is dropless (sorted variable-size expert batches). With ``granularity=1, shared=0``
    it is :class:`MoE` ``(d_model, d_ff, n_experts, k)``, weights included (same ``seed``);
    the shared MLP is drawn from a second stream of ``seed``."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, k: int = 1, *,
                 granularity: int = 1, shared: int = 0, capacity_factor: float | None = None,
                 bias_rate: float = 0.0, groups: int = 1, seed: int = 0, out_std: float = 0.02,
                 dtype: torch.dtype = torch.float32):
        d_model = check_int("d_model", d_model, lo=1)
        shape = fine_grained_shape(n_experts, k, d_ff, granularity, shared)
        rate = check_float("bias_rate", bias_rate, lo=0)
        super().__init__(d_model, shape["width"], shape["routed"], shape["top_k"],
                         capacity_factor=capacity_factor, routing="token", groups=groups,
                         seed=seed, out_std=out_std, dtype=dtype)
        self.granularity, self.shared, self.bias_rate = granularity, shared, rate
        self.register_buffer("bias", torch.zeros(shape["routed"], dtype=dtype))
        g = torch.Generator().manual_seed(seed + 2**32)
        width = shared * shape["width"]
        self.w_up_shared = nn.Parameter((torch.randn(d_model, width, generator=g,
                                                     dtype=torch.float64) * 0.02).to(dtype))
        self.w_down_shared = nn.Parameter((torch.randn(width, d_model, generator=g,
                                                       dtype=torch.float64) * out_std).to(dtype))

    def route(self, x: torch.Tensor) -> Routing:
        return token_choice(self.router(x), self.k, self.capacity_factor, bias=self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts (:meth:`MoE.forward`, which sets ``self.last``) plus the
        shared MLP on every token."""
        y = super().forward(x)
        if self.shared:
            y = y + F.gelu(x @ self.w_up_shared) @ self.w_down_shared
        return y

    def combine(self, x: torch.Tensor, r: Routing) -> torch.Tensor:
        """With a capacity, :meth:`MoE.combine`. Dropless: the ``T k`` assignments sorted
        by expert, one variable-size batch per expert, weighted rows added back."""
        if r.capacity is not None:
            return super().combine(x, r)
        order = torch.argsort(r.expert.reshape(-1), stable=True)
        token = order // r.expert.shape[1]
        sizes = torch.bincount(r.expert.reshape(-1), minlength=self.n_experts).tolist()
        rows = x[token].split(sizes)
        y = torch.cat([self.expert(i, part) for i, part in enumerate(rows)])
        return torch.zeros_like(x).index_add(0, token, y * r.gate.reshape(-1)[order, None])

    @torch.no_grad()
    def update_bias(self) -> torch.Tensor:
        """Apply :func:`bias_update` with ``bias_rate`` to the tokens each expert was sent
        in the last forward (``self.last["wanted"]``); returns the new bias."""
        if not self.last:
            raise ValueError("update_bias needs a forward first (it balances the last loads)")
        self.bias.copy_(bias_update(self.bias, self.last["wanted"], self.bias_rate))
        return self.bias


def per_token_reference(layer: FineGrainedMoE, x: torch.Tensor) -> torch.Tensor:
    """The dense per-token computation, in float64, of the experts ``layer`` would choose
    with no capacity: for each token its own softmax, its top-k of ``p + bias``, and
    ``shared(x_t) + sum_e p_e MLP_e(x_t)``, one token and one expert at a time."""
    if not isinstance(layer, FineGrainedMoE):
        raise TypeError(f"layer must be a FineGrainedMoE, got {type(layer).__name__}")
    check_tensor("x", x, floating=True, finite=True)
    if x.dim() < 1 or x.shape[-1] != layer.d_model:
        raise ValueError(f"x must end in d_model={layer.d_model}, got {tuple(x.shape)}")
    d = torch.float64
    w_r, up, down = (w.detach().to(d) for w in (layer.router.weight, layer.w_up, layer.w_down))
    s_up, s_down = layer.w_up_shared.detach().to(d), layer.w_down_shared.detach().to(d)
    bias = layer.bias.to(d)
    tokens = x.detach().to(d).reshape(-1, layer.d_model)
    out = torch.zeros_like(tokens)
    for t, xt in enumerate(tokens):
        p = torch.softmax(w_r @ xt, dim=0)
        for e in (p + bias).topk(layer.k).indices.tolist():
            out[t] += p[e] * (F.gelu(xt @ up[e]) @ down[e])
        if layer.shared:
            out[t] += F.gelu(xt @ s_up) @ s_down
    return out.view(x.shape)


@torch.no_grad()
def drop_rates(model: nn.Module, x: torch.Tensor, capacity_factors) -> dict:
    """Fraction of the assignments dropped by ``model``'s MoE layers on input ``x`` under
    each capacity factor (None: dropless, always 0), measured by a forward with every
    layer's ``capacity_factor`` set to it; ``{factor: dropped / wanted}`` summed over
    layers. The layers' factors and ``last`` records are restored afterwards."""
    check_module("model", model)
    layers = moe_layers(model)
    if not layers:
        raise ValueError("model has no MoE layer")
    if any(m.routing != "token" for m in layers):
        raise ValueError("drop_rates counts token-choice drops; model has an expert-choice layer")
    check_tensor("x", x, finite=True)  # NaN would reach the router as NaN logits
    if isinstance(capacity_factors, (str, bytes)) or not hasattr(capacity_factors, "__iter__"):
        raise TypeError(f"capacity_factors must be a list of floats or None, "
                        f"got {capacity_factors!r}")
    factors = [None if c is None else check_float("capacity_factors", c, lo=0, lo_open=True)
               for c in capacity_factors]
    if not factors:
        raise ValueError("capacity_factors must name at least one factor")
    saved = [(m.capacity_factor, m.last) for m in layers]
    out = {}
    try:
        for c in factors:
            for m in layers:
                m.capacity_factor = c
            model(x)
            wanted = sum(int(m.last["wanted"].sum()) for m in layers)
            out[c] = sum(m.last["dropped"] for m in layers) / max(wanted, 1)
    finally:
        for m, (c, last) in zip(layers, saved, strict=True):
            m.capacity_factor, m.last = c, last
    return out


def modern_gpt(cfg: GPTConfig, n_experts: int, k: int = 1, *, granularity: int = 1,
               shared: int = 0, capacity_factor: float | None = None, bias_rate: float = 0.0,
               dtype: torch.dtype = torch.float32) -> GPT:
    """:func:`moe_gpt` with :class:`FineGrainedMoE` layers (same seeds per layer, so with
    ``granularity=1, shared=0`` the same weights). ``cfg.mlp`` must be "gelu"."""
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
    if cfg.mlp != "gelu":
        raise ValueError(f"modern_gpt builds GELU experts; cfg.mlp must be 'gelu', "
                         f"got {cfg.mlp!r}")
    fine_grained_shape(n_experts, k, cfg.ff, granularity, shared)
    if capacity_factor is not None:
        check_float("capacity_factor", capacity_factor, lo=0, lo_open=True)
    check_float("bias_rate", bias_rate, lo=0)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    model = GPT(cfg, dtype=dtype)
    out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    for i, block in enumerate(model.blocks):
        block.mlp = FineGrainedMoE(cfg.d_model, cfg.ff, n_experts, k, granularity=granularity,
                                   shared=shared, capacity_factor=capacity_factor,
                                   bias_rate=bias_rate, seed=cfg.seed * 1000 + i + 1,
                                   out_std=out_std, dtype=dtype)
    return model
