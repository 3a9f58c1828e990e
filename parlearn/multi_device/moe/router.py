"""Routers: which experts each token goes to, with what weight, and what it costs.

Token choice (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch, Fedus et al.
2021): every token picks its ``k`` best experts. We take the **softmax over all experts
first, then the top k**, and use those probabilities as the gates without renormalising
them. The reason: with ``k = 1`` (Switch) a top-1-then-softmax gate is identically 1, so
the task loss would send no gradient to the router at all; the probability of the chosen
expert does carry one. (Mixtral renormalises over the chosen k; with ``k >= 2`` both work.)

Capacity: an expert takes at most ``C = ceil(capacity_factor * T * k / E)`` of the ``T * k``
assignments of a group of ``T`` tokens. Assignments queue slot-major, as in GShard: every
token's first choice before any second choice, and tokens in order within a slot; those
beyond ``C`` are **dropped** (gate 0: the token's residual stream carries it past the
layer). ``capacity_factor=None`` keeps every assignment.

Expert choice (Zhou et al. 2022) turns it around: every expert picks its ``C`` best tokens,
so no expert is ever over capacity and none idles, but a token may be picked by no expert.

Auxiliary losses, per group: the Switch load-balancing loss ``E * sum_e f_e P_e`` with
``f_e`` the fraction of the group's assignments routed to expert ``e`` (before capacity) and
``P_e`` the mean router probability of ``e``; it is 1 when both are uniform and approaches
``E`` as routing collapses onto one expert (only ``P`` carries gradient). The router z-loss
(ST-MoE, Zoph et al. 2022) ``mean_t (logsumexp_e logits_te)^2`` keeps the logits small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parlearn.core.checks import check_float, check_int

__all__ = ["Routing", "capacity", "token_choice", "expert_choice", "balance_loss", "z_loss"]


@dataclass(frozen=True)
class Routing:
    """Where the ``T`` tokens of one group go. ``expert[t, j]`` is token ``t``'s ``j``-th
    expert and ``gate[t, j]`` its weight (0 where ``kept`` is False, i.e. dropped);
    ``logits`` and ``probs`` the router's scores and softmax ``(T, E)``; ``wanted`` how
    many assignments each expert was sent before capacity; ``capacity`` the per-expert
    limit (None: unlimited)."""

    expert: torch.Tensor
    gate: torch.Tensor
    kept: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor
    wanted: torch.Tensor
    capacity: int | None

    @property
    def n_experts(self) -> int:
        return self.probs.shape[1]

    def counts(self) -> torch.Tensor:
        """Assignments each expert computes (after capacity), ``(E,)`` int64."""
        return torch.bincount(self.expert[self.kept], minlength=self.n_experts)

    def dropped(self) -> int:
        """Assignments dropped for lack of capacity (wanted but not computed)."""
        return int(self.wanted.sum() - self.kept.sum())

    def unrouted(self) -> int:
        """Tokens that no expert computes (dropped entirely, or picked by no expert)."""
        return int((~self.kept.any(1)).sum())


def capacity(tokens: int, n_experts: int, k: int, capacity_factor: float | None) -> int | None:
    """``ceil(capacity_factor * tokens * k / n_experts)`` (None when the factor is None)."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * k / n_experts)


def _check(logits: torch.Tensor, k: int, capacity_factor: float | None) -> tuple[int, int]:
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
        raise ValueError(f"logits must be a (tokens, experts) tensor, got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}")
    E = logits.shape[1]
    k = check_int("k", k, lo=1)
    if k > E:
        raise ValueError(f"k={k} must be at most the number of experts ({E})")
    if capacity_factor is not None:
        check_float("capacity_factor", capacity_factor, lo=0, lo_open=True)
    return E, k


def token_choice(logits: torch.Tensor, k: int = 1, capacity_factor: float | None = None
                 ) -> Routing:
    """Every token picks its top-``k`` experts by softmax probability (module docstring);
    assignments beyond the capacity are dropped, slot-major then token order."""
    E, k = _check(logits, k, capacity_factor)
    T = logits.shape[0]
    probs = torch.softmax(logits, dim=-1)
    gate, expert = probs.topk(k, dim=-1)
    wanted = torch.bincount(expert.flatten(), minlength=E)
    cap = capacity(T, E, k, capacity_factor)
    if cap is None:
        kept = torch.ones_like(expert, dtype=torch.bool)
    else:
        # Place of each assignment in its expert's queue: slot-major order (k, T).
        onehot = torch.nn.functional.one_hot(expert.T.reshape(-1), E)
        place = ((onehot.cumsum(0) - 1) * onehot).sum(1).view(k, T).T
        kept = place < cap
    return Routing(expert, gate * kept, kept, logits, probs, wanted, cap)


def expert_choice(logits: torch.Tensor, k: int = 1, capacity_factor: float = 1.0) -> Routing:
    """Every expert picks its ``C = ceil(capacity_factor * T * k / E)`` best tokens by
    softmax probability (Zhou et al. 2022). Returned in token-major form with ``E`` slots
    per token (slot ``e`` is expert ``e``; ``kept`` where expert ``e`` picked the token), so
    the same layer code runs it: no expert exceeds ``C``, nothing is dropped for capacity."""
    E, k = _check(logits, k, capacity_factor)
    T = logits.shape[0]
    probs = torch.softmax(logits, dim=-1)
    cap = min(capacity(T, E, k, capacity_factor), T)
    picked = probs.topk(cap, dim=0).indices  # (C, E): each expert's chosen tokens
    kept = torch.zeros(T, E, dtype=torch.bool, device=logits.device)
    kept[picked, torch.arange(E, device=logits.device)] = True
    expert = torch.arange(E, device=logits.device).expand(T, E)
    return Routing(expert, probs * kept, kept, logits, probs, kept.sum(0), cap)


def balance_loss(r: Routing) -> torch.Tensor:
    """Switch load-balancing loss ``E * sum_e f_e P_e`` of one group (module docstring)."""
    E = r.n_experts
    f = r.wanted.to(r.probs.dtype) / r.expert.numel()
    return E * (f * r.probs.mean(0)).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss ``mean_t (logsumexp_e logits_te)^2`` (Zoph et al. 2022)."""
    return torch.logsumexp(logits, dim=-1).square().mean()
