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
from fractions import Fraction

import torch

from parlearn.core.checks import check_float, check_int, check_tensor

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


def _exact(name: str, value) -> Fraction:
    """``value`` (> 0) as an exact fraction: a float as the decimal it prints as (``1.1`` is
    11/10, not the binary double just above it, whose product can cross an integer and move
    a ceiling by one), an int or a Fraction as itself."""
    if isinstance(value, Fraction):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
        return value
    return Fraction(repr(check_float(name, value, lo=0, lo_open=True)))


def capacity(tokens: int, n_experts: int, k: int, capacity_factor: float | None) -> int | None:
    """``ceil(capacity_factor * tokens * k / n_experts)`` (None when the factor is None),
    computed in exact arithmetic: a float factor counts as the decimal it prints as, so
    ``capacity(90, 6, 2, 1.1)`` is ``ceil(33) = 33`` (float products would give 34)."""
    tokens = check_int("tokens", tokens, lo=0)
    n_experts = check_int("n_experts", n_experts, lo=1)
    k = check_int("k", k, lo=1, hi=n_experts)
    if capacity_factor is None:
        return None
    return math.ceil(_exact("capacity_factor", capacity_factor) * tokens * k / n_experts)


def _check(logits: torch.Tensor, k: int, capacity_factor: float | None) -> tuple[int, int]:
    # NaN or inf logits route arbitrarily (topk of NaN): refused, not silently routed.
    check_tensor("logits", logits, ndim=2, floating=True, finite=True)
    if logits.shape[1] < 1:
        raise ValueError(f"logits must have at least one expert column, got shape "
                         f"{tuple(logits.shape)}")
    E = logits.shape[1]
    k = check_int("k", k, lo=1)
    if k > E:
        raise ValueError(f"k={k} must be at most the number of experts ({E})")
    if capacity_factor is not None:
        _exact("capacity_factor", capacity_factor)
    return E, k


def token_choice(logits: torch.Tensor, k: int = 1, capacity_factor: float | None = None,
                 bias: torch.Tensor | None = None) -> Routing:
    """Every token picks its top-``k`` experts by softmax probability (module docstring);
    assignments beyond the capacity are dropped, slot-major then token order.

    ``bias`` (``(E,)``, None: none) is added to the probabilities for the top-``k``
    **selection only**; the gates stay the probabilities of the selected experts
    (auxiliary-loss-free balancing, Wang et al. 2024; see :mod:`.modern`). A zero bias
    routes exactly as no bias."""
    E, k = _check(logits, k, capacity_factor)
    if bias is not None:
        check_tensor("bias", bias, shape=(E,), floating=True, finite=True)
    T = logits.shape[0]
    probs = torch.softmax(logits, dim=-1)
    if bias is None:
        gate, expert = probs.topk(k, dim=-1)
    else:
        # The bias never carries gradient and never enters the gates: only the choice moves.
        expert = (probs.detach() + bias.detach().to(probs)).topk(k, dim=-1).indices
        gate = probs.gather(1, expert)
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
    """Switch load-balancing loss ``E * sum_e f_e P_e`` of one group (module docstring); 0
    for a group of no tokens (nothing to balance; ``f`` and ``P`` would be 0/0), still
    attached to the router's graph so a backward through it runs on every rank."""
    if not isinstance(r, Routing):
        raise TypeError(f"r must be a Routing, got {type(r).__name__}")
    E = r.n_experts
    if r.expert.numel() == 0:
        return r.probs.sum() * 0.0
    f = r.wanted.to(r.probs.dtype) / r.expert.numel()
    return E * (f * r.probs.mean(0)).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss ``mean_t (logsumexp_e logits_te)^2`` (Zoph et al. 2022); 0 for no
    tokens (the mean of nothing would be NaN), attached to ``logits``' graph."""
    check_tensor("logits", logits, ndim=2, floating=True)
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits, dim=-1).square().mean()
