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

Every strategy but ``random`` commits at least the most confident position per pass;
``random`` follows its schedule, which reveals everything by pass ``steps``.

Mean-field parallel decoding (reconstruction). "Mean-Field Parallel Decoding for
Discrete Diffusion Language Models" (arXiv 2606.15805) could only be read as an
abstract. Our reading: give each masked position a binary commit variable ``s_i`` with
field ``h_i = logit(c_i) - logit(tau)`` and non-negative couplings ``J_ij`` that are
large when ``i`` and ``j`` would conflict (default: the overlap of their predictive
distributions, ``1 - JSD(p_i, p_j) / ln 2``, times a strength ``lam`` and optionally a
distance kernel), i.e. the energy ``E(s) = -sum_i h_i s_i + 1/2 sum_ij J_ij s_i s_j``
at inverse temperature ``beta``. Minimising the mean-field free energy over
independent ``q_i = P(s_i = 1)`` gives the stationarity condition
``q_i = sigmoid(beta (h_i - sum_j J_ij q_j))``; we iterate it damped,

    q_i <- (1 - eta) q_i + eta * sigmoid(beta * (h_i - sum_j J_ij q_j))

until the largest change is below ``tol``, updating positions one at a
time in descending confidence (Gauss-Seidel): a synchronous update would keep two
identical positions identical forever. Positions with ``q_i > 1/2`` are committed.
With ``J = 0`` the fixed point is ``sigmoid(beta h_i)`` and the rule is exactly the
confidence threshold ``c_i > tau``. The defaults (``tau="auto"``, ``lam=8``,
``beta=8``) read the confidence scale off each pass (:func:`auto_tau`) and were chosen
on the language family of :func:`family_table`, not on one language.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from parlearn.core.bench import Row
from parlearn.core.checks import check_callable, check_choice, check_float, check_int, check_tensor
from parlearn.core.device import sync

__all__ = ["STRATEGIES", "GRIDS", "FAMILY_TAUS", "DecodeResult", "decode", "overlap_coupling",
           "overlap_coupling_dense", "coupling_matrix", "auto_tau", "mean_field_commit",
           "confidence", "sweep", "best_setting", "family_table", "format_family_table"]

Denoiser = Callable[[torch.Tensor], torch.Tensor]
Coupling = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_EPS = 1e-6
_SURE = 1 - 1e-3  # confidence at which a position is decoupled (see coupling_matrix)


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


def overlap_coupling_dense(probs: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """``1 - JSD(p_i, p_j) / ln 2`` for every pair, the direct way: builds ``(B, L, L, V)``.

    The reference for :func:`overlap_coupling`; usable only where ``B L^2 V`` floats fit.
    """
    p = probs.clamp_min(1e-12)
    m = 0.5 * (p[:, :, None, :] + p[:, None, :, :])
    kl = lambda a: (a * (a.log() - m.log())).sum(-1)  # noqa: E731
    jsd = 0.5 * (kl(p[:, :, None, :]) + kl(p[:, None, :, :]))
    return (1.0 - jsd / math.log(2)).clamp(0.0, 1.0)


def overlap_coupling(probs: torch.Tensor, masked: torch.Tensor, *,
                     top_k: int = 32) -> torch.Tensor:
    """``1 - JSD(p_i, p_j) / ln 2`` for every pair, each ``p_i`` cut to its top-``k`` support.

    For distributions that sum to one, ``JSD = ln 2 + 1/2 sum_v g(p_v, q_v)`` with
    ``g(a, b) = a ln(a/(a+b)) + b ln(b/(a+b))``, and ``g`` vanishes where either is 0.
    So the overlap is ``-sum_v g(p_i(v), p_j(v)) / (2 ln 2)``, a sum over the tokens
    both distributions support. Each ``p_i`` is kept on its ``top_k`` most likely
    tokens and renormalised there, which turns the sum into a gather of ``(B, L, k, L)``
    values: memory ``O(B L^2 k)`` beyond the ``(B, L, V)`` input, instead of the
    ``O(B L^2 V)`` of :func:`overlap_coupling_dense`. Where every support has at most
    ``top_k`` tokens the two are equal (to round-off, tested); otherwise this is the
    overlap of the renormalised top-``k`` distributions (identical ones still give 1).
    """
    k = min(top_k, probs.shape[-1])
    vals, idx = probs.topk(k, dim=-1)  # (B, L, k)
    vals = vals / vals.sum(-1, keepdim=True)
    trunc = torch.zeros_like(probs).scatter_(-1, idx, vals)  # p_j on its own top-k only
    B, L, _ = probs.shape
    # other[b, j, i*k + t] = trunc[b, j, idx[b, i, t]]
    other = trunc.gather(-1, idx.reshape(B, 1, L * k).expand(B, L, L * k))
    a = vals.reshape(B, 1, L * k)
    s = a + other
    g = torch.where((other > 0) & (a > 0), a * (a / s).log() + other * (other / s).log(),
                    torch.zeros((), dtype=probs.dtype, device=probs.device))
    overlap = -g.reshape(B, L, L, k).sum(-1).transpose(1, 2) / (2 * math.log(2))
    return overlap.clamp(0.0, 1.0)


def coupling_matrix(probs: torch.Tensor, masked: torch.Tensor, *, lam: float,
                    coupling: Coupling = overlap_coupling,
                    length_scale: float | None = None) -> torch.Tensor:
    """``J_ij = lam * coupling(p)_ij * exp(-|i - j| / length_scale)`` (no kernel if None).

    Positions the model is sure of (``c_i >= 1 - 1e-3``) are decoupled: their sample
    is (almost) fixed, so committing them cannot clash with anything.
    """
    C = coupling(probs, masked)
    shape = (*masked.shape, masked.shape[-1])
    if not isinstance(C, torch.Tensor) or tuple(C.shape) != shape:
        got = tuple(C.shape) if isinstance(C, torch.Tensor) else type(C).__name__
        raise ValueError(f"coupling must return a (B, L, L) = {shape} tensor, got {got}")
    if not bool(torch.isfinite(C).all()) or bool((C < 0).any()):
        raise ValueError("coupling must return finite, non-negative values")
    J = lam * C.to(probs.dtype)
    if length_scale is not None:
        pos = torch.arange(masked.shape[-1], device=J.device, dtype=J.dtype)
        J = J * torch.exp(-(pos[:, None] - pos[None, :]).abs() / length_scale)
    unsure = confidence(probs, masked) < _SURE
    return J * (unsure[:, :, None] & unsure[:, None, :])


def _fields(conf: torch.Tensor, masked: torch.Tensor, tau) -> torch.Tensor:
    """``h_i = logit(c_i) - logit(tau)`` (``tau`` a float or one per row), -inf off the mask."""
    c = conf.clamp(_EPS, 1 - _EPS)
    log_tau = torch.logit(torch.as_tensor(tau, dtype=c.dtype, device=c.device))
    h = torch.logit(c) - (log_tau[:, None] if log_tau.ndim else log_tau)
    return h.masked_fill(~masked, -math.inf)


def auto_tau(conf: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """``tau="auto"``: per row, ``logit(tau) = logit(min c_i) - 1`` over masked positions.

    Every masked position then wants to commit alone (``h_i >= 1``), and only the
    couplings hold positions back: the decoder reads the confidence scale off the
    model's distributions instead of assuming one.
    """
    c = conf.clamp(_EPS, 1 - _EPS).masked_fill(~masked, math.inf).min(-1).values
    c = torch.where(torch.isfinite(c), c, torch.full_like(c, 0.5))  # rows with nothing masked
    return torch.sigmoid(torch.logit(c) - 1.0)


def _mean_field_commit_loop(conf, J, masked, *, tau, beta, eta, tol=1e-7, max_iter=200):
    """Serial reference for :func:`mean_field_commit`: the plain Gauss-Seidel loop over
    all ``L`` positions, indexing ``J`` row by row."""
    h = _fields(conf, masked, tau)
    J = J * (masked[:, :, None] & masked[:, None, :]) * (1 - torch.eye(J.shape[-1],
                                                                       device=J.device))
    q = torch.sigmoid(beta * h)
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


def mean_field_commit(conf: torch.Tensor, J: torch.Tensor, masked: torch.Tensor, *,
                      tau: float | torch.Tensor, beta: float, eta: float, tol: float = 1e-7,
                      max_iter: int = 200) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """Solve the damped mean-field fixed point; return ``(commit, q, sweeps, residual)``.

    ``h_i = logit(c_i) - logit(tau)``; each sweep updates positions one at a time in
    descending confidence (ties by position; Gauss-Seidel), which breaks the symmetry
    between identical positions: ``q_i <- (1 - eta) q_i + eta sigmoid(beta (h_i -
    sum_j J_ij q_j))``. Sweeps stop when the largest change is at most ``tol`` or after
    ``max_iter``. Gauss-Seidel is a nonlinear triangular solve, so the positions of a
    sweep cannot be updated at once; what is vectorised is every row of the batch,
    and the loop runs over the masked ranks only, on ``h`` and ``J`` permuted into
    update order once. Equal to :func:`_mean_field_commit_loop` to round-off (tested).
    """
    B, L = conf.shape
    order = conf.masked_fill(~masked, -math.inf).argsort(dim=-1, descending=True, stable=True)
    n = int(masked.sum(-1).max().item())  # ranks past n are unmasked in every row
    order = order[:, :n]
    h = _fields(conf, masked, tau).gather(-1, order)
    keep = masked.gather(-1, order)
    Jp = J.gather(1, order[:, :, None].expand(B, n, L)).gather(2, order[:, None, :].expand(
        B, n, n))
    Jp = Jp * (keep[:, :, None] & keep[:, None, :]) * (1 - torch.eye(n, device=J.device,
                                                                     dtype=J.dtype))
    q = torch.sigmoid(beta * h)  # the J = 0 solution as the start
    residual, sweeps = (math.inf if n else 0.0), 0
    while residual > tol and sweeps < max_iter:
        before = q.clone()
        for r in range(n):
            field_r = h[:, r] - (Jp[:, r, :] * q).sum(-1)
            q[:, r] = (1 - eta) * q[:, r] + eta * torch.sigmoid(beta * field_r)
        residual = (q - before).abs().max().item()
        sweeps += 1
    q_full = torch.zeros_like(conf, dtype=q.dtype).scatter_(-1, order, q)
    return (q_full > 0.5) & masked, q_full, sweeps, residual


def _mean_field(probs, masked, generator, *, tau: float | str = "auto", lam: float = 8.0,
                beta: float = 8.0, eta: float = 0.5, length_scale: float | None = None,
                coupling: Coupling = overlap_coupling, tol: float = 1e-7,
                max_iter: int = 200, pass_index, stats: dict | None = None):
    conf = confidence(probs, masked)
    J = coupling_matrix(probs, masked, lam=lam, coupling=coupling, length_scale=length_scale)
    t = auto_tau(conf, masked) if tau == "auto" else tau
    commit, _, sweeps, residual = mean_field_commit(conf, J, masked, tau=t, beta=beta,
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


def _check_tau(name, v):
    if isinstance(v, str):
        return check_choice(name, v, ("auto",))
    return check_float(name, v, lo=0, hi=1, lo_open=True, hi_open=True)


def _check_length_scale(name, v):
    return None if v is None else check_float(name, v, lo=0, lo_open=True)


# Every parameter a strategy takes, with its check (one table: nothing silently ignored).
_PARAMS: dict[str, dict[str, Callable]] = {
    "sequential": {},
    "fixed_k": {"k": partial(check_int, lo=1)},
    "random": {"steps": partial(check_int, lo=1)},
    "threshold": {"tau": partial(check_float, lo=0, hi=1, lo_open=True, hi_open=True)},
    "factor": {"f": partial(check_float, lo=0, lo_open=True)},
    "entropy_bound": {"gamma": partial(check_float, lo=0)},
    "mean_field": {"tau": _check_tau, "lam": partial(check_float, lo=0),
                   "beta": partial(check_float, lo=0, lo_open=True),
                   "eta": partial(check_float, lo=0, hi=1, lo_open=True),
                   "length_scale": _check_length_scale, "coupling": check_callable,
                   "tol": partial(check_float, lo=0, lo_open=True),
                   "max_iter": partial(check_int, lo=1)},
}


def _check_params(strategy: str, params: dict) -> None:
    check_choice("strategy", strategy, tuple(STRATEGIES))
    unknown = set(params) - set(_PARAMS[strategy])
    if unknown:
        raise ValueError(f"strategy {strategy!r} takes {sorted(_PARAMS[strategy]) or 'no'} "
                         f"parameters, got {sorted(unknown)}")
    for name, value in params.items():
        _PARAMS[strategy][name](name, value)


# --- the decoding loop -------------------------------------------------------------------


@dataclass
class DecodeResult:
    """Decoded tokens and what it cost."""

    tokens: torch.Tensor  # (B, L)
    passes: torch.Tensor  # (B,) forward passes each sequence took part in
    generated: torch.Tensor  # (B,) positions generated (masked at the start)
    trace: list[torch.Tensor] = field(default_factory=list)  # per pass: (B, L) committed
    stats: dict = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the whole decode
    denoiser_seconds: float = 0.0  # of which in the denoiser's forward passes
    strategy_seconds: float = 0.0  # of which in the strategy (the decoder's own cost)

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
    if out.device != tokens.device:
        raise ValueError(f"denoiser returned its output on {out.device} for tokens on "
                         f"{tokens.device}: pass device={str(out.device)!r} to decode (it "
                         "defaults to the denoiser's parameters' device, else the CPU)")
    if not out.is_floating_point() or not bool(torch.isfinite(out).all()):
        raise ValueError("denoiser must return finite floating-point probabilities or logits")
    out = out.float()
    sums = out.sum(-1)
    is_prob = bool((out >= 0).all() and torch.allclose(sums, torch.ones_like(sums), atol=1e-4))
    probs = out if is_prob else torch.softmax(out, -1)
    if mask_id < probs.shape[-1] and probs[..., mask_id].max() > 1e-3:
        raise ValueError(f"the denoiser gives the mask token (mask_id={mask_id}) probability "
                         f"up to {probs[..., mask_id].max():.3f}: a mask id inside the "
                         "vocabulary must never be predicted")
    return probs


def _check_vocabulary(tokens: torch.Tensor, vocab: int, mask_id: int) -> None:
    known = tokens[tokens != mask_id]
    if bool((known >= vocab).any()):
        raise ValueError(f"prompt tokens must lie in the vocabulary [0, {vocab}) or be "
                         f"mask_id={mask_id}, got {known.max().item()}")


def decode(denoiser: Denoiser, *, length: int, batch: int, mask_id: int,
           strategy: str = "mean_field", prompt: torch.Tensor | None = None,
           generator: torch.Generator | None = None, device=None, max_passes: int | None = None,
           **strategy_params) -> DecodeResult:
    """Generate ``batch`` sequences of ``length`` tokens by iterative unmasking.

    ``prompt`` (an integer tensor ``(L,)`` or ``(B, L)``, ``mask_id`` where to generate)
    fixes the other positions; its tokens must lie in the vocabulary, which is checked
    against the first forward pass before anything is committed. Each pass calls the
    denoiser once on the sequences not yet finished, commits the positions the strategy
    selects, and samples their tokens from the predicted distributions (with
    ``generator``, a CPU ``torch.Generator``). Every strategy but ``random`` commits at
    least the most confident position per pass; ``random`` may reveal nothing in a
    pass, and then no forward call is made for that sequence. ``result.seconds`` splits
    into the denoiser's time, the strategy's time and the sampling/bookkeeping rest.
    """
    check_int("length", length, lo=1)
    check_int("batch", batch, lo=1)
    check_int("mask_id", mask_id, lo=0)
    check_callable("denoiser", denoiser)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if max_passes is not None:
        check_int("max_passes", max_passes, lo=1)
    _check_params(strategy, strategy_params)
    if prompt is not None:
        check_tensor("prompt", prompt, ndim=(1, 2), floating=False)
        if prompt.shape[-1] != length or (prompt.ndim == 2 and prompt.shape[0] not in (1, batch)):
            raise ValueError(f"prompt must have shape ({length},) or ({batch}, {length}), "
                             f"got {tuple(prompt.shape)}")
        if bool((prompt < 0).any()):
            raise ValueError("prompt tokens must be >= 0")
    if device is None:
        try:
            device = next(denoiser.parameters()).device
        except (AttributeError, StopIteration):
            device = "cpu"
    tokens = torch.full((batch, length), mask_id, dtype=torch.int64, device=device)
    if prompt is not None:
        tokens[:] = prompt.to(device=device, dtype=torch.int64)
        if not bool((tokens == mask_id).any()):  # nothing to generate: one call for V
            with torch.no_grad():
                out = _probabilities(denoiser(tokens[:1]), tokens[:1], mask_id)
            _check_vocabulary(tokens, out.shape[-1], mask_id)
    select = STRATEGIES[strategy]
    passes = torch.zeros(batch, dtype=torch.int64)
    generated = (tokens == mask_id).sum(-1).cpu()
    result = DecodeResult(tokens, passes, generated)
    limit = max_passes or 4 * length + 16
    dev = torch.device(device)
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
        t0 = time.perf_counter()
        with torch.no_grad():
            probs = _probabilities(denoiser(tokens[rows]), tokens[rows], mask_id)
        if pass_index == 0 and prompt is not None:
            _check_vocabulary(tokens, probs.shape[-1], mask_id)
        sync(dev)
        t1 = time.perf_counter()
        if strategy != "random":
            commit = select(probs, sub_masked, generator, pass_index=pass_index,
                            **strategy_params, **extra)
        sync(dev)
        result.denoiser_seconds += t1 - t0
        result.strategy_seconds += time.perf_counter() - t1
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
    sync(dev)  # count queued GPU work in the wall time
    result.seconds = time.perf_counter() - start
    return result


# --- bench -------------------------------------------------------------------------


def sweep(denoiser, lang, strategy: str, grid: list[dict], *, batch: int = 256,
          seed: int = 0, device=None) -> list[tuple[dict, DecodeResult, float]]:
    """Decode ``batch`` sequences with every setting in ``grid``: ``(params, result, validity)``.

    ``device`` goes to :func:`decode` (where the tokens live; default: the denoiser's)."""
    check_int("batch", batch, lo=1)
    check_int("seed", seed, lo=0)
    for params in grid:
        _check_params(strategy, params)
    out = []
    for params in grid:
        res = decode(denoiser, length=lang.length, batch=batch, mask_id=lang.mask_id,
                     strategy=strategy, generator=torch.Generator().manual_seed(seed),
                     device=device, **params)
        out.append((params, res, lang.valid(res.tokens.cpu()).double().mean().item()))
    return out


def best_setting(rows: list[tuple[dict, DecodeResult, float]],
                 target: float = 0.99) -> tuple[dict, DecodeResult, float]:
    """Among :func:`sweep` rows, the fewest passes reaching ``target`` validity (or,
    if none does, the most valid)."""
    if not rows:
        raise ValueError("rows must hold at least one sweep row")
    check_float("target", target, lo=0, hi=1)
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
    "mean_field": [{"tau": 0.2, "lam": lam} for lam in (0.05, 0.2, 1.0, 2.0, 4.0)]
    + [{}],  # {} = the defaults (tau="auto")
}

# The threshold settings the language-family table searches for the best one.
FAMILY_TAUS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)


def family_table(languages=None, *, batch: int = 128, seed: int = 0, target: float = 0.95,
                 taus: tuple[float, ...] = FAMILY_TAUS) -> list[dict]:
    """Mean field at its defaults against sequential and the best threshold setting.

    For each language (default: :func:`parlearn.diffusion.language_family`), with its
    exact denoiser, ``batch`` sequences per setting: ``sequential`` passes (one per
    generated position, so the length), the threshold ``tau`` in ``taus`` with the
    fewest passes reaching ``target`` validity (None if none does), and mean field's
    passes, validity, own time and the denoiser's time. ``half`` says whether mean
    field reached ``target`` in at most half the sequential passes; ``vs_threshold``
    whether it reached ``target`` in at most one pass more than the best threshold.
    All figures are measured in this call.
    """
    from parlearn.many_copies.diffusion import language_family

    languages = language_family() if languages is None else list(languages)
    check_int("batch", batch, lo=1)
    check_float("target", target, lo=0, hi=1)
    for t in taus:
        check_float("taus[...]", t, lo=0, hi=1, lo_open=True, hi_open=True)
    rows = []
    for lang in languages:
        thr = sweep(lang.denoiser, lang, "threshold", [{"tau": t} for t in taus], batch=batch,
                    seed=seed)
        ok = [(r.mean_passes, p["tau"], v) for p, r, v in thr if v >= target]
        best = min(ok) if ok else None
        (_, mf, v), = sweep(lang.denoiser, lang, "mean_field", [{}], batch=batch, seed=seed)
        reached = v >= target
        rows.append({
            "language": lang.name, "length": lang.length, "sequential": float(lang.length),
            "threshold_tau": None if best is None else best[1],
            "threshold_passes": None if best is None else best[0],
            "threshold_validity": None if best is None else best[2],
            "mean_field_passes": mf.mean_passes, "mean_field_validity": v,
            "mean_field_seconds": mf.strategy_seconds, "denoiser_seconds": mf.denoiser_seconds,
            "half": reached and mf.mean_passes <= lang.length / 2,
            "vs_threshold": reached and (best is None or mf.mean_passes <= best[0] + 1),
        })
    return rows


def format_family_table(rows: list[dict]) -> str:
    """:func:`family_table` rows as text."""
    head = (f"{'language':32s} {'L':>3s} {'threshold best':>16s} {'mean field':>17s} "
            f"{'<= L/2':>6s} {'<= thr+1':>8s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        thr = ("none >= target" if r["threshold_tau"] is None else
               f"tau {r['threshold_tau']:.2f}: {r['threshold_passes']:5.2f}")
        lines.append(f"{r['language']:32s} {r['length']:3d} {thr:>16s} "
                     f"{r['mean_field_passes']:5.2f} p, v {r['mean_field_validity']:.3f} "
                     f"{'yes' if r['half'] else 'NO':>6s} "
                     f"{'yes' if r['vs_threshold'] else 'NO':>8s}")
    return "\n".join(lines)


def bench(device: torch.device, quick: bool) -> list[Row]:
    from parlearn.many_copies.diffusion import PairedPhrase, train_mdlm

    lang = PairedPhrase(slots=8, m=4)
    batch = 64 if quick else 256
    denoisers = {"exact": partial(_on_device, lang.denoiser, device)}
    if not quick:
        denoisers["tiny MDLM"] = train_mdlm(lang, device=device, progress=False)
    rows = []
    for dname, den in denoisers.items():
        found = {s: best_setting(sweep(den, lang, s, GRIDS[s], batch=batch, device=device))
                 for s in STRATEGIES}
        base = found["threshold"][1].mean_passes
        for s, (params, res, v) in found.items():
            ratio = base / res.mean_passes
            met = (ratio >= 3 and v >= 0.99) if s == "mean_field" else None
            rows.append(Row(
                f"decoding {dname}", "threshold, best setting", s, ratio, str(device),
                ">= 3x fewer passes" if s == "mean_field" else "", met,
                ("" if v >= 0.99 else "BELOW 99% VALIDITY at every setting tried; best: ")
                + f"{params or 'default'}: validity {v:.3f}, {res.mean_passes:.2f} passes/seq, "
                f"{res.tokens_per_pass:.2f} tokens/pass; wall {res.seconds * 1e3:.0f} ms for "
                f"batch {batch}: denoiser {res.denoiser_seconds * 1e3:.0f} ms, strategy (the "
                f"decoder's own cost) {res.strategy_seconds * 1e3:.0f} ms (ratio = passes, "
                "not time)"))
    # The family's exact denoisers run on the CPU whatever ``device`` is: the row says so.
    fam = family_table(None if not quick else _quick_family(), batch=batch // 2)
    rows.append(Row(
        "decoding family (exact)", "sequential", "mean_field defaults",
        sum(r["half"] for r in fam) / len(fam), "cpu", "most languages <= L/2 passes",
        sum(r["half"] for r in fam) > len(fam) / 2 and all(r["vs_threshold"] for r in fam),
        f"ratio = share of {len(fam)} languages reaching 95% validity in <= L/2 passes; "
        f"{sum(r['vs_threshold'] for r in fam)}/{len(fam)} within one pass of the best "
        f"threshold; mean-field time {sum(r['mean_field_seconds'] for r in fam):.2f} s vs "
        f"denoiser {sum(r['denoiser_seconds'] for r in fam):.2f} s"))
    return rows


def _quick_family():
    from parlearn.many_copies.diffusion import language_family

    fam = language_family()
    return [fam[0], fam[6], fam[-1]]


def _on_device(fn, device, tokens):
    return fn(tokens.cpu()).to(device)
