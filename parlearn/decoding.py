"""Parallel decoders for masked-diffusion LMs, mean-field among them.

A masked-diffusion LM (MDLM, LLaDA, Dream) generates by unmasking. Every forward
pass gives a distribution ``p_i`` for each masked position ``i``; a *strategy*
decides which positions to commit this pass, and each committed position gets a
token sampled from its ``p_i``. Committing many per pass is the parallelism; the
danger is committing positions that are each plausible alone but clash together.

The denoiser protocol: any callable ``tokens (B, L) int64 -> (B, L, V)`` of
probabilities or logits (rows already summing to 1 are read as probabilities,
anything else as logits). ``mask_id`` marks the positions still to generate.

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
* ``mean_field``: the reconstruction below.

Every strategy commits at least the most confident position, so decoding ends.

Mean-field parallel decoding (reconstruction). "Mean-Field Parallel Decoding for
Discrete Diffusion Language Models" (arXiv 2606.15805) could only be read as an
abstract. Our reading: give each masked position a binary commit variable with
field ``h_i = logit(c_i) - logit(tau)`` and non-negative couplings ``J_ij`` that are
large when ``i`` and ``j`` would conflict (default: the overlap of their predictive
distributions, ``1 - JSD(p_i, p_j) / ln 2``, times a strength ``lam`` and a
distance kernel). The mean-field fixed point

    q_i <- (1 - eta) q_i + eta * sigmoid(beta * (h_i - sum_j J_ij q_j))

is iterated until the largest change is below ``tol``, updating positions one at a
time in descending confidence (Gauss-Seidel): a synchronous update would keep two
identical positions identical forever. Positions with ``q_i > 1/2`` are committed.
With ``J = 0`` the fixed point is ``sigmoid(beta h_i)`` and the rule is exactly the
confidence threshold ``c_i > tau``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from .bench import Row
from .device import sync

__all__ = ["STRATEGIES", "GRIDS", "DecodeResult", "decode", "overlap_coupling",
           "mean_field_commit", "confidence", "sweep", "best_setting"]

Denoiser = Callable[[torch.Tensor], torch.Tensor]
Coupling = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_EPS = 1e-6


# --- helpers --------------------------------------------------------------------------


def confidence(probs: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """``c_i = max_v p_i(v)`` on masked positions, ``-inf`` elsewhere."""
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


def overlap_coupling(probs: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """``1 - JSD(p_i, p_j) / ln 2`` for every pair: 1 for identical, 0 for disjoint."""
    p = probs.clamp_min(1e-12)
    m = 0.5 * (p[:, :, None, :] + p[:, None, :, :])
    kl = lambda a: (a * (a.log() - m.log())).sum(-1)  # noqa: E731
    jsd = 0.5 * (kl(p[:, :, None, :]) + kl(p[:, None, :, :]))
    return (1.0 - jsd / math.log(2)).clamp(0.0, 1.0)


def mean_field_commit(conf: torch.Tensor, J: torch.Tensor, masked: torch.Tensor, *,
                      tau: float, beta: float, eta: float, tol: float = 1e-7,
                      max_iter: int = 200) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """Solve the damped mean-field fixed point; return ``(commit, q, sweeps, residual)``.

    Gauss-Seidel sweeps update positions one at a time in descending confidence
    (ties by position), which breaks the symmetry between identical positions.
    """
    c = conf.clamp(_EPS, 1 - _EPS)
    h = torch.logit(c) - math.log(tau / (1 - tau))
    h = h.masked_fill(~masked, -math.inf)
    J = J * (masked[:, :, None] & masked[:, None, :]) * (1 - torch.eye(J.shape[-1],
                                                                       device=J.device))
    q = torch.sigmoid(beta * h)  # the J = 0 solution as the start
    order = conf.masked_fill(~masked, -math.inf).argsort(dim=-1, descending=True, stable=True)
    rows = torch.arange(conf.shape[0], device=conf.device)
    residual, sweeps = math.inf, 0
    while residual > tol and sweeps < max_iter:
        before = q.clone()
        for r in range(conf.shape[-1]):
            i = order[:, r]
            field_i = h[rows, i] - (J[rows, i, :] * q).sum(-1)
            q[rows, i] = (1 - eta) * q[rows, i] + eta * torch.sigmoid(beta * field_i)
        residual = (q - before).abs().max().item()
        sweeps += 1
    return (q > 0.5) & masked, q, sweeps, residual


def _mean_field(probs, masked, generator, *, tau: float = 0.9, lam: float = 2.0,
                beta: float = 8.0, eta: float = 0.5, length_scale: float | None = None,
                coupling: Coupling = overlap_coupling, tol: float = 1e-7,
                max_iter: int = 200, pass_index, stats: dict | None = None):
    conf = confidence(probs, masked)
    J = lam * coupling(probs, masked)
    if J.shape != (*masked.shape, masked.shape[-1]) or (J < 0).any():
        raise ValueError(f"coupling must return non-negative (B, L, L), got {tuple(J.shape)}")
    if length_scale is not None:
        pos = torch.arange(masked.shape[-1], device=J.device, dtype=J.dtype)
        J = J * torch.exp(-(pos[:, None] - pos[None, :]).abs() / length_scale)
    commit, _, sweeps, residual = mean_field_commit(conf, J, masked, tau=tau, beta=beta,
                                                    eta=eta, tol=tol, max_iter=max_iter)
    if stats is not None:
        stats.setdefault("mf_sweeps", []).append(sweeps)
        stats.setdefault("mf_residual", []).append(residual)
        # Near the critical coupling (beta * lam * J / 4 ~ 1) the iteration slows down;
        # count the passes that hit max_iter instead of hiding them.
        stats["mf_unconverged"] = stats.get("mf_unconverged", 0) + int(residual > tol)
    return _at_least_one(commit, conf, masked, generator)


STRATEGIES: dict[str, Callable] = {
    "sequential": _sequential, "fixed_k": _fixed_k, "random": _random,
    "threshold": _threshold, "factor": _factor, "entropy_bound": _entropy_bound,
    "mean_field": _mean_field,
}

_PARAMS = {
    "sequential": set(), "fixed_k": {"k"}, "random": {"steps"}, "threshold": {"tau"},
    "factor": {"f"}, "entropy_bound": {"gamma"},
    "mean_field": {"tau", "lam", "beta", "eta", "length_scale", "coupling", "tol", "max_iter"},
}


def _check_params(strategy: str, params: dict) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    unknown = set(params) - _PARAMS[strategy]
    if unknown:
        raise ValueError(f"strategy {strategy!r} takes {sorted(_PARAMS[strategy]) or 'no'} "
                         f"parameters, got {sorted(unknown)}")
    checks = {"k": lambda v: isinstance(v, int) and v >= 1,
              "steps": lambda v: isinstance(v, int) and v >= 1,
              "tau": lambda v: 0 < v < 1, "f": lambda v: v > 0, "gamma": lambda v: v >= 0,
              "lam": lambda v: v >= 0, "beta": lambda v: v > 0, "eta": lambda v: 0 < v <= 1,
              "length_scale": lambda v: v is None or v > 0, "coupling": callable,
              "tol": lambda v: v > 0, "max_iter": lambda v: isinstance(v, int) and v >= 1}
    for name, value in params.items():
        if not checks[name](value):
            raise ValueError(f"{strategy}: bad value {name}={value!r}")


# --- the decoding loop -------------------------------------------------------------------


@dataclass
class DecodeResult:
    """Decoded tokens and what it cost."""

    tokens: torch.Tensor  # (B, L)
    passes: torch.Tensor  # (B,) forward passes each sequence took part in
    generated: torch.Tensor  # (B,) positions generated (masked at the start)
    trace: list[torch.Tensor] = field(default_factory=list)  # per pass: (B, L) committed
    stats: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Mean over sequences of generated positions / forward passes."""
        return (self.generated / self.passes.clamp_min(1)).double().mean().item()

    @property
    def mean_passes(self) -> float:
        return self.passes.double().mean().item()


def _probabilities(out: torch.Tensor, tokens: torch.Tensor, mask_id: int) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.ndim != 3 or out.shape[:2] != tokens.shape:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"denoiser must return (B, L, V) = ({tokens.shape[0]}, "
                         f"{tokens.shape[1]}, V), got {shape}")
    out = out.float()
    sums = out.sum(-1)
    is_prob = bool((out >= 0).all() and torch.allclose(sums, torch.ones_like(sums), atol=1e-4))
    probs = out if is_prob else torch.softmax(out, -1)
    if mask_id < probs.shape[-1] and probs[..., mask_id].max() > 1e-3:
        raise ValueError(f"the denoiser gives the mask token (mask_id={mask_id}) probability "
                         f"up to {probs[..., mask_id].max():.3f}: a mask id inside the "
                         "vocabulary must never be predicted")
    return probs


def decode(denoiser: Denoiser, *, length: int, batch: int, mask_id: int,
           strategy: str = "mean_field", prompt: torch.Tensor | None = None,
           generator: torch.Generator | None = None, device=None, max_passes: int | None = None,
           **strategy_params) -> DecodeResult:
    """Generate ``batch`` sequences of ``length`` tokens by iterative unmasking.

    ``prompt`` (``(L,)`` or ``(B, L)``, ``mask_id`` where to generate) fixes the other
    positions. Each pass calls the denoiser once on the sequences not yet finished,
    commits the positions the strategy selects, and samples their tokens from the
    predicted distributions (with ``generator``, a CPU ``torch.Generator``).
    """
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be an int >= 1, got {length!r}")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    if not isinstance(mask_id, int) or mask_id < 0:
        raise ValueError(f"mask_id must be an int >= 0, got {mask_id!r}")
    if not callable(denoiser):
        raise TypeError("denoiser must be callable: tokens (B, L) -> (B, L, V)")
    _check_params(strategy, strategy_params)
    if device is None:
        try:
            device = next(denoiser.parameters()).device
        except (AttributeError, StopIteration):
            device = "cpu"
    tokens = torch.full((batch, length), mask_id, dtype=torch.int64, device=device)
    if prompt is not None:
        prompt = prompt.to(device=device, dtype=torch.int64)
        if prompt.shape[-1] != length or prompt.ndim not in (1, 2) or (
                prompt.ndim == 2 and prompt.shape[0] not in (1, batch)):
            raise ValueError(f"prompt must have shape ({length},) or ({batch}, {length}), "
                             f"got {tuple(prompt.shape)}")
        tokens[:] = prompt
    select = STRATEGIES[strategy]
    passes = torch.zeros(batch, dtype=torch.int64)
    generated = (tokens == mask_id).sum(-1).cpu()
    result = DecodeResult(tokens, passes, generated)
    limit = max_passes or 4 * length + 16
    start = time.perf_counter()
    for pass_index in range(limit):
        masked = tokens == mask_id
        active = masked.any(-1)
        if not active.any():
            break
        rows = active.nonzero().squeeze(-1)
        sub_masked = masked[rows]
        extra = {"stats": result.stats} if strategy == "mean_field" else {}
        commit = torch.zeros_like(sub_masked)
        if strategy == "random":
            commit = select(None, sub_masked, generator, pass_index=pass_index, **strategy_params)
            keep = commit.any(-1)  # a pass that reveals nothing needs no forward call
            rows, sub_masked, commit = rows[keep], sub_masked[keep], commit[keep]
            if rows.numel() == 0:
                continue
        with torch.no_grad():
            probs = _probabilities(denoiser(tokens[rows]), tokens[rows], mask_id)
        if strategy != "random":
            commit = select(probs, sub_masked, generator, pass_index=pass_index,
                            **strategy_params, **extra)
        sampled = torch.multinomial(probs[commit].cpu(), 1, generator=generator).squeeze(-1)
        sub = tokens[rows]
        sub[commit] = sampled.to(device)
        tokens[rows] = sub
        passes[rows.cpu()] += 1
        full = torch.zeros_like(masked)
        full[rows] = commit
        result.trace.append(full.cpu())
    else:
        if (tokens == mask_id).any():
            raise RuntimeError(f"decoding did not finish within max_passes={limit}")
    sync(tokens.device)  # count queued GPU work in the wall time
    result.seconds = time.perf_counter() - start
    return result


# --- bench -------------------------------------------------------------------------


def sweep(denoiser, lang, strategy: str, grid: list[dict], *, batch: int = 256,
          seed: int = 0) -> list[tuple[dict, DecodeResult, float]]:
    """Decode ``batch`` sequences with every setting in ``grid``: ``(params, result, validity)``."""
    out = []
    for params in grid:
        res = decode(denoiser, length=lang.length, batch=batch, mask_id=lang.mask_id,
                     strategy=strategy, generator=torch.Generator().manual_seed(seed), **params)
        out.append((params, res, lang.valid(res.tokens.cpu()).double().mean().item()))
    return out


def best_setting(rows: list[tuple[dict, DecodeResult, float]],
                 target: float = 0.99) -> tuple[dict, DecodeResult, float]:
    """Among :func:`sweep` rows, the fewest passes reaching ``target`` validity (or,
    if none does, the most valid)."""
    return min(rows, key=lambda r: (r[2] < target, r[1].mean_passes if r[2] >= target else -r[2]))


# Settings swept for the frontier plot and the bench (lam = 0.5 is avoided: with
# beta = 8 it is the critical coupling, where the fixed point converges slowly).
GRIDS = {
    "sequential": [{}],
    "fixed_k": [{"k": k} for k in (1, 2, 4, 8, 16)],
    "random": [{"steps": s} for s in (2, 4, 8, 16, 32, 64)],
    "threshold": [{"tau": t} for t in (0.1, 0.2, 0.3, 0.5, 0.9)],
    "factor": [{"f": f} for f in (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)],
    "entropy_bound": [{"gamma": g} for g in (0.1, 0.5, 1.0, 2.0, 4.0, 8.0)],
    "mean_field": [{"tau": 0.2, "lam": lam} for lam in (0.05, 0.2, 1.0, 2.0, 4.0)],
}


def bench(device: torch.device, quick: bool) -> list[Row]:
    from .diffusion import PairedPhrase, train_mdlm

    lang = PairedPhrase(slots=8, m=4)
    batch = 64 if quick else 256
    denoisers = {"exact": partial(_on_device, lang.denoiser, device)}
    if not quick:
        denoisers["tiny MDLM"] = train_mdlm(lang, device=device, progress=False)
    rows = []
    for dname, den in denoisers.items():
        found = {s: best_setting(sweep(den, lang, s, GRIDS[s], batch=batch)) for s in STRATEGIES}
        base = found["threshold"][1].mean_passes
        for s, (params, res, v) in found.items():
            ratio = base / res.mean_passes
            met = (ratio >= 3 and v >= 0.99) if s == "mean_field" else None
            rows.append(Row(
                f"decoding {dname}", "threshold, best setting", s, ratio, str(device),
                ">= 3x fewer passes" if s == "mean_field" else "", met,
                ("" if v >= 0.99 else "BELOW 99% VALIDITY at every setting tried; best: ")
                + f"{params or 'default'}: validity {v:.3f}, {res.mean_passes:.2f} passes/seq, "
                f"{res.tokens_per_pass:.2f} tokens/pass, {res.seconds * 1e3:.0f} ms for "
                f"batch {batch} (ratio = passes, not time)"))
    return rows


def _on_device(fn, device, tokens):
    return fn(tokens.cpu()).to(device)
