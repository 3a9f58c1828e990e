"""The strategies of a parallel decoder: which masked positions to commit this pass.

Strategies (each a short function ``select(probs, masked, generator, **params)``
returning the positions to commit):

* ``sequential``: the single most confident position (``c_i = max_v p_i(v)``).
* ``fixed_k``: the ``k`` most confident (LLaDA-style low-confidence remasking).
* ``random``: MDLM ancestral unmasking with ``steps`` passes on a linear schedule.
* ``threshold``: every position with ``c_i > tau`` (Fast-dLLM).
* ``factor``: the largest ``n`` with ``(n + 1)(1 - c_(n)) < f`` (Fast-dLLM's
  factor rule, as we read it).
* ``entropy_bound``: the largest low-entropy set with ``sum H - max H <= gamma``
  (EB-sampler).
* ``mean_field``: the reconstruction of :mod:`parlearn.many_copies.decoding.mean_field`.

Every strategy but ``random`` commits at least the most confident position per pass;
``random`` follows its schedule, which reveals everything by pass ``steps``.

This file holds the shared helpers and every strategy but mean field; the table of them all
(``STRATEGIES``) and their parameters is in :mod:`parlearn.many_copies.decoding.loop`.
"""

from __future__ import annotations

import math

import torch

from parlearn.core.checks import check_tensor

__all__ = ["confidence"]


# --- helpers --------------------------------------------------------------------------


def confidence(probs: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """``c_i = max_v p_i(v)`` on masked positions, ``-inf`` elsewhere."""
    check_tensor("probs", probs, floating=True)
    if probs.dim() < 2 or probs.shape[-1] < 1:
        raise ValueError(f"probs must be (..., L, V) with V >= 1, got {tuple(probs.shape)}")
    check_tensor("masked", masked, shape=tuple(probs.shape[:-1]), dtype=torch.bool)
    return probs.max(-1).values.masked_fill(~masked, -math.inf)


def _ranked(score: torch.Tensor, generator) -> torch.Tensor:
    """Positions by descending score, ties broken uniformly at random."""
    shuffle = torch.rand(score.shape, generator=generator).to(score.device).argsort(-1)
    order = score.gather(-1, shuffle).argsort(dim=-1, descending=True, stable=True)
    return shuffle.gather(-1, order)


def _top_n(score: torch.Tensor, n: torch.Tensor, generator) -> torch.Tensor:
    """Commit mask of the ``n[b]`` best-scoring positions of each row."""
    order = _ranked(score, generator)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(score.shape[-1],
                                            device=score.device).expand_as(order))
    return rank < n.unsqueeze(-1)


def _at_least_one(commit: torch.Tensor, conf: torch.Tensor, masked: torch.Tensor,
                  generator) -> torch.Tensor:
    """Where a row selected nothing, select its most confident masked position."""
    commit = commit & masked
    best = _top_n(conf, torch.ones(conf.shape[0], dtype=torch.int64, device=conf.device),
                  generator)
    return commit | (best & masked & ~commit.any(-1, keepdim=True))


def _entropy(probs: torch.Tensor) -> torch.Tensor:
    return -(probs * probs.clamp_min(1e-12).log()).sum(-1)


# --- strategies ------------------------------------------------------------------------


def _sequential(probs, masked, generator, *, pass_index):
    return _fixed_k(probs, masked, generator, k=1, pass_index=pass_index)


def _fixed_k(probs, masked, generator, *, k: int = 2, pass_index):
    conf = confidence(probs, masked)
    return _top_n(conf, torch.full((probs.shape[0],), k, device=probs.device), generator) & masked


def _random(probs, masked, generator, *, steps: int = 16, pass_index):
    # linear schedule: at pass t of T each masked position is revealed w.p. 1/(T - t)
    left = max(steps - pass_index, 1)
    draw = torch.rand(masked.shape, generator=generator).to(masked.device) < 1.0 / left
    return draw & masked


def _threshold(probs, masked, generator, *, tau: float = 0.9, pass_index):
    conf = confidence(probs, masked)
    return _at_least_one(conf > tau, conf, masked, generator)


def _factor(probs, masked, generator, *, f: float = 1.0, pass_index):
    conf = confidence(probs, masked)
    sorted_c = conf.sort(-1, descending=True).values  # masked first, -inf after
    n = torch.arange(1, conf.shape[-1] + 1, device=conf.device)
    ok = ((n + 1) * (1 - sorted_c) < f) & torch.isfinite(sorted_c)
    # the largest n such that every prefix up to n satisfies the rule
    count = ok.int().cumprod(-1).sum(-1)
    return _at_least_one(_top_n(conf, count, generator), conf, masked, generator)


def _entropy_bound(probs, masked, generator, *, gamma: float = 0.5, pass_index):
    ent = _entropy(probs).masked_fill(~masked, math.inf)
    order = _ranked(-ent, generator)
    h = ent.gather(-1, order)
    finite = torch.isfinite(h)
    cum = torch.where(finite, h, 0.0).cumsum(-1)
    # sorted ascending, so the max of a prefix is its last element
    ok = (cum - torch.where(finite, h, 0.0) <= gamma) & finite
    count = ok.int().cumprod(-1).sum(-1)
    conf = confidence(probs, masked)
    commit = _top_n(-ent, count, generator) & masked
    return _at_least_one(commit, conf, masked, generator)
