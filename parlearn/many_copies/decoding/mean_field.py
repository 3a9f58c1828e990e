"""Mean-field parallel decoding: commit the positions a mean-field fixed point keeps apart.

A reconstruction of an unverified source. "Mean-Field Parallel Decoding for
Discrete Diffusion Language Models" (given to us as arXiv 2606.15805; the identifier
could not be checked) could only be read as an abstract attributed to it. Our reading:
give each masked position a binary commit variable ``s_i`` with
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
on the language family of
:func:`parlearn.many_copies.decoding.measure.family_table`, not on one language.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from parlearn.core.checks import check_callable, check_float, check_int, check_tensor
from parlearn.many_copies.decoding.strategies import _at_least_one, confidence

__all__ = ["overlap_coupling", "overlap_coupling_dense", "coupling_matrix", "auto_tau",
           "mean_field_commit"]

Coupling = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_EPS = 1e-6
_SURE = 1 - 1e-3  # confidence at which a position is decoupled (see coupling_matrix)

def _check_probs(probs: Any, masked: Any) -> None:
    """``probs`` (B, L, V) distributions over the last axis (finite, >= 0, rows summing to
    1 within 1e-2: softmax round-off, not unnormalised scores), ``masked`` (B, L) bool."""
    check_tensor("probs", probs, ndim=3, floating=True)
    check_tensor("masked", masked, dtype=torch.bool)
    if masked.shape != probs.shape[:2]:
        raise ValueError(f"masked must have the (B, L) of probs {tuple(probs.shape)}, got "
                         f"{tuple(masked.shape)}")
    if probs.shape[-1] < 1:
        raise ValueError(f"probs must be (B, L, V) with V >= 1, got {tuple(probs.shape)}")
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
        raise ValueError("probs must hold finite, non-negative probabilities")
    sums = probs.sum(-1)
    if not bool(((sums - 1).abs() <= 1e-2).all()):
        raise ValueError(f"probs must sum to 1 over the last axis (within 1e-2), got sums "
                         f"from {sums.min().item():.4g} to {sums.max().item():.4g}")


def _check_conf(conf: Any, masked: Any) -> None:
    """``conf`` (B, L) floating, in [0, 1] on the masked positions (anything elsewhere:
    :func:`confidence` puts -inf there); ``masked`` (B, L) bool."""
    check_tensor("conf", conf, ndim=2, floating=True)
    check_tensor("masked", masked, dtype=torch.bool)
    if masked.shape != conf.shape:
        raise ValueError(f"masked must have the shape of conf {tuple(conf.shape)}, got "
                         f"{tuple(masked.shape)}")
    on = conf[masked]
    if bool(on.isnan().any()) or bool((on < 0).any()) or bool((on > 1).any()):
        raise ValueError("conf must lie in [0, 1] on the masked positions (a confidence "
                         "max_v p(v)), got NaN or a value outside")


def overlap_coupling_dense(probs: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """``1 - JSD(p_i, p_j) / ln 2`` for every pair, the direct way: builds ``(B, L, L, V)``.

    The reference for :func:`overlap_coupling`; usable only where ``B L^2 V`` floats fit.
    ``probs`` (B, L, V) holds distributions; ``masked`` (B, L) bool is checked but not used
    (every coupling takes it: see :func:`coupling_matrix`).
    """
    _check_probs(probs, masked)
    p = probs.clamp_min(1e-12)
    m = 0.5 * (p[:, :, None, :] + p[:, None, :, :])
    kl = lambda a: (a * (a.log() - m.log())).sum(-1)  # noqa: E731
    jsd = 0.5 * (kl(p[:, :, None, :]) + kl(p[:, None, :, :]))
    return (1.0 - jsd / math.log(2)).clamp(0.0, 1.0)


def _overlap_coupling_gather(probs: torch.Tensor, masked: torch.Tensor, *,
                             top_k: int = 32) -> torch.Tensor:
    """Reference for :func:`overlap_coupling` (its first form): ``g`` summed term by term
    over each ``p_i``'s top-``k`` support, from a ``(B, L, k, L)`` gather."""
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


def _xlogx_(s: torch.Tensor, work: torch.Tensor | None = None) -> torch.Tensor:
    """``s ln s`` (0 where ``s = 0``) in place, returned. ``torch.xlogy`` gives the same
    values but its CPU kernel is scalar; ``ln max(s, tiny)`` is vectorised, and where
    ``0 < s < tiny`` (subnormals) the product is 0 to within ``tiny``."""
    log = torch.clamp_min(s, torch.finfo(s.dtype).tiny, out=work)
    return s.mul_(log.log_())


def _pair_xlogx(p: torch.Tensor, chunk_bytes: int = 1 << 19):
    """``sum_v s ln s`` with ``s = p_i + p_j`` for the pairs ``i < j`` of each row of ``p``
    (B, L, V): ``(pairs (B, L(L-1)/2), (i, j))``. ``p_i + p_j`` is ``p_j + p_i`` bit for
    bit, so half the pairs are all there is to compute (the diagonal needs none). Rows
    are taken a few at a time into two reused buffers (``chunk_bytes`` each, a size that
    stays in cache): the ``(B, L^2/2, V)`` intermediates would otherwise be allocated,
    and page-faulted in, op by op."""
    B, L, V = p.shape
    i, j = torch.triu_indices(L, L, offset=1, device=p.device)
    rows = max(1, min(B, chunk_bytes // max(1, i.numel() * V * p.element_size())))
    s = p.new_empty(rows, i.numel(), V)
    work = torch.empty_like(s)
    pairs = p.new_empty(B, i.numel())
    for b0 in range(0, B, rows):
        pc, n = p[b0:b0 + rows], min(rows, B - b0)
        a, w = s[:n], work[:n]
        torch.index_select(pc, 1, i, out=a)
        a.add_(torch.index_select(pc, 1, j, out=w))
        torch.sum(_xlogx_(a, w), -1, out=pairs[b0:b0 + n])
    return pairs, (i, j)


def overlap_coupling(probs: torch.Tensor, masked: torch.Tensor, *,
                     top_k: int = 32) -> torch.Tensor:
    """``1 - JSD(p_i, p_j) / ln 2`` for every pair, each ``p_i`` cut to its top-``k`` support.

    For distributions that sum to one, ``JSD = ln 2 + 1/2 sum_v g(p_v, q_v)`` with
    ``g(a, b) = a ln(a/(a+b)) + b ln(b/(a+b)) = a ln a + b ln b - (a+b) ln(a+b)``, which
    vanishes where either is 0. So the overlap is ``-sum_v g(p_i(v), p_j(v)) / (2 ln 2)``:
    the two entropies (one per position) and one pairwise sum of ``s ln s``, ``s = p_i +
    p_j`` (three elementwise passes over the pairs instead of a dozen). Each ``p_i`` is
    kept on its ``top_k`` most likely tokens and renormalised there; when that cuts
    something, the pairwise sum runs over ``p_i``'s support, from a gather of ``(B, L, L,
    k)`` values (memory ``O(B L^2 k)`` beyond the ``(B, L, V)`` input, instead of the
    ``O(B L^2 V)`` of :func:`overlap_coupling_dense`): ``sum_v s ln s = sum_{t in supp
    p_i} (s_t ln s_t - q_t ln q_t) + sum_v q_v ln q_v``. Where every support has at most
    ``top_k`` tokens this equals the dense form (to round-off, tested); otherwise it is
    the overlap of the renormalised top-``k`` distributions (identical ones still give 1).
    ``probs`` (B, L, V) holds distributions (rows summing to 1 within 1e-2, renormalised
    here); ``masked`` (B, L) bool is checked but not used (see :func:`coupling_matrix`).
    """
    _check_probs(probs, masked)
    top_k = check_int("top_k", top_k, lo=1)
    B, L, V = probs.shape
    k = min(top_k, V)
    if k == V:                          # nothing to cut: the pairwise sum over all V
        p = probs / probs.sum(-1, keepdim=True)      # the identity needs sums of one
        pairs, (i, j) = _pair_xlogx(p)  # i < j
        cross = probs.new_zeros(B, L * L)  # filled by two copies along one flat index
        cross.index_copy_(1, i * L + j, pairs).index_copy_(1, j * L + i, pairs)
        neg_h = _xlogx_(p.clone()).sum(-1)
        overlap = cross.view(B, L, L) - neg_h[:, :, None] - neg_h[:, None, :]
        # JSD(p_i, p_i) = 0: the diagonal is 1 exactly, with no sum to compute
        overlap.diagonal(dim1=1, dim2=2).fill_(2 * math.log(2))
    else:
        vals, idx = probs.topk(k, dim=-1)  # (B, L, k)
        vals = vals / vals.sum(-1, keepdim=True)
        trunc = torch.zeros_like(probs).scatter_(-1, idx, vals)  # p_j on its own top-k
        # other[b, j, i*k + t] = trunc[b, j, idx[b, i, t]]
        other = trunc.gather(-1, idx.reshape(B, 1, L * k).expand(B, L, L * k))
        s = vals.reshape(B, 1, L * k) + other
        inside = (_xlogx_(s) - _xlogx_(other)).reshape(B, L, L, k).sum(-1)
        neg_h = _xlogx_(vals.clone()).sum(-1)
        # inside[b, j, i] sums over p_i's support; p_j's entropy term cancels
        overlap = inside.transpose(1, 2) - neg_h[:, :, None]
    return (overlap / (2 * math.log(2))).clamp(0.0, 1.0)


def coupling_matrix(probs: torch.Tensor, masked: torch.Tensor, *, lam: float,
                    coupling: Coupling = overlap_coupling,
                    length_scale: float | None = None) -> torch.Tensor:
    """``J_ij = lam * coupling(p)_ij * exp(-|i - j| / length_scale)`` (no kernel if None).

    Positions the model is sure of (``c_i >= 1 - 1e-3``) are decoupled: their sample
    is (almost) fixed, so committing them cannot clash with anything. ``lam >= 0``,
    ``length_scale > 0`` or None; ``coupling(probs, masked)`` returns (B, L, L) values >= 0.
    """
    _check_probs(probs, masked)
    lam = check_float("lam", lam, lo=0)
    check_callable("coupling", coupling)
    if length_scale is not None:
        length_scale = check_float("length_scale", length_scale, lo=0, lo_open=True)
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
    model's distributions instead of assuming one. ``conf`` (B, L) in [0, 1] on the
    masked positions, ``masked`` (B, L) bool; a row with nothing masked gets ``tau =
    sigmoid(-1)``.
    """
    _check_conf(conf, masked)
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


def _update_order(conf: torch.Tensor, J: torch.Tensor, masked: torch.Tensor,
                  tau: float | torch.Tensor):
    """The masked positions in update order (descending confidence, ties by position):
    ``(order, h, Jp, n)`` with the fields ``h`` and the couplings ``Jp`` permuted into that
    order once, couplings to unmasked positions and the diagonal zeroed; ``n`` ranks (past
    it every row is unmasked)."""
    B, L = conf.shape
    order = conf.masked_fill(~masked, -math.inf).argsort(dim=-1, descending=True, stable=True)
    n = int(masked.sum(-1).max().item())
    order = order[:, :n]
    h = _fields(conf, masked, tau).gather(-1, order)
    keep = masked.gather(-1, order)
    Jp = J.gather(1, order[:, :, None].expand(B, n, L)).gather(2, order[:, None, :].expand(
        B, n, n))
    Jp = Jp * (keep[:, :, None] & keep[:, None, :]) * (1 - torch.eye(n, device=J.device,
                                                                     dtype=J.dtype))
    return order, h, Jp, n


def _sweeps_torch(bh: torch.Tensor, bJ: torch.Tensor, q: torch.Tensor, eta: float,
                  tol: float, max_iter: int) -> tuple[int, float]:
    """Gauss-Seidel sweeps on ``q`` (B, n) in place, in torch (any device): rank ``r``'s
    update is three kernels on views made once, ``beta h_r - (beta J_r) . q`` in one
    batched matmul, sigmoid in place, and the damping ``(1 - eta) q_r + eta s`` as
    ``q_r.lerp_(s, eta)``. Returns ``(sweeps, residual)``."""
    n = q.shape[1]
    column = q[:, :, None]
    steps = [(bh[:, r, None, None], bJ[:, r:r + 1, :], column[:, r:r + 1]) for r in range(n)]
    residual, sweeps = (math.inf if n else 0.0), 0
    while residual > tol and sweeps < max_iter:
        before = q.clone()
        for bh_r, bJ_r, q_r in steps:
            q_r.lerp_(torch.baddbmm(bh_r, bJ_r, column, alpha=-1).sigmoid_(), eta)
        residual = (q - before).abs().max().item()
        sweeps += 1
    return sweeps, residual


def _pow2(x: int, least: int) -> int:
    """The smallest power of two that is at least ``max(x, least)``."""
    return 1 << (max(x, least) - 1).bit_length()


@functools.cache
def _jax_sweeps():
    """The compiled Gauss-Seidel loop (built on first use: importing JAX costs a second).

    ``Ja`` (N, N+1, Bp) holds rank ``r``'s couplings ``beta J_r.`` augmented with
    ``-beta h_r``; ``qa`` (N+1, Bp) holds ``q`` augmented with a constant 1, so ``sum_j
    Ja[r, j] qa[j]`` is minus rank ``r``'s field. Rank ``r`` then takes ``q_r <- (1 - eta)
    q_r + eta / (1 + exp(-field))``; a sweep is ranks ``0 .. n-1`` in a loop inside the
    program, and sweeps repeat while the largest change exceeds ``tol`` and fewer than
    ``max_iter`` ran. ``n``, ``eta``, ``tol`` and ``max_iter`` are traced, so one program
    serves every value; only the padded shape recompiles."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    @jax.jit
    def sweeps(Ja, qa, n, eta, tol, max_iter):
        keep = 1.0 - eta

        def rank(r, qa):
            x = jnp.sum(Ja[r] * qa, axis=0)  # -(field of rank r), for every row
            return qa.at[r].set(qa[r] * keep + eta / (1.0 + jnp.exp(x)))

        def sweep(state):
            qa, _, k = state
            new = lax.fori_loop(0, n, rank, qa)
            return new, jnp.max(jnp.abs(new - qa)), k + 1

        def more(state):
            _, residual, k = state
            return (residual > tol) & (k < max_iter)

        start = (qa, jnp.asarray(jnp.inf, qa.dtype), jnp.asarray(0, jnp.int32))
        return lax.while_loop(more, sweep, start)

    return sweeps


def _sweeps_jax(bh: torch.Tensor, bJ: torch.Tensor, q: torch.Tensor, eta: float,
                tol: float, max_iter: int) -> tuple[int, float]:
    """:func:`_sweeps_torch` on the CPU, compiled with JAX (XLA): the loop is ``n`` steps
    per sweep, each a few operations on ``B`` values, so in torch or NumPy dispatch is
    the whole cost (10-24 us a rank); one compiled program runs every sweep for about
    5 us a rank, of which the arithmetic is a fraction. Shapes are padded to powers of two
    (``B`` to at least 8, ``n`` to at least 4), so the rows that drop out as decoding
    proceeds reuse a handful of compiled programs (about 0.2 s each, once per process).
    A padded row or rank has ``q = 0``, zero couplings and a field of ``-inf``:
    ``exp(inf) = inf`` keeps it at 0, and it never changes the residual (unmasked
    positions of a row are padded ranks already). Runs in JAX's 64-bit mode, switched on
    only for the call, so float64 stays float64. Like every JAX-using part of parlearn it
    starts JAX's threads in this process; a later ``parlearn.distributed.run`` that forks its
    ranks then meets JAX's warning about fork (the tests run this module in a fresh
    interpreter for that reason)."""
    import jax

    B, n = q.shape
    if n == 0:
        return 0, 0.0
    Bp, N = _pow2(B, 8), _pow2(n, 4)
    dtype = q.dtype
    Ja = torch.zeros(N, N + 1, Bp, dtype=dtype)
    Ja[:n, :n, :B] = bJ.detach().permute(1, 2, 0)
    Ja[:, N, :] = math.inf
    Ja[:n, N, :B] = -bh.detach().t()
    qa = torch.zeros(N + 1, Bp, dtype=dtype)
    qa[:n, :B] = q.detach().t()
    qa[N] = 1.0
    with jax.enable_x64(True):
        out, residual, sweeps = _jax_sweeps()(Ja.numpy(), qa.numpy(), n, eta, tol, max_iter)
        out = np.asarray(out)
        residual, sweeps = float(residual), int(sweeps)
    q.copy_(torch.from_numpy(out[:n, :B].copy()).t())
    return sweeps, residual


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
    update order once: compiled with JAX on the CPU (:func:`_sweeps_jax`), in torch
    elsewhere (:func:`_sweeps_torch`). Equal to :func:`_mean_field_commit_loop` to round-off
    (tested, both).

    ``conf`` (B, L) in [0, 1] on the masked positions; ``J`` (B, L, L) finite, >= 0, of
    ``conf``'s dtype; ``masked`` (B, L) bool; ``tau`` in (0, 1), a float or one per row
    (B,); ``beta > 0``, ``eta`` in (0, 1], ``tol > 0``, ``max_iter >= 1``.
    """
    _check_conf(conf, masked)
    B, L = conf.shape
    check_tensor("J", J, shape=(B, L, L), dtype=conf.dtype)
    if not bool(torch.isfinite(J).all()) or bool((J < 0).any()):
        raise ValueError("J must hold finite, non-negative couplings")
    if isinstance(tau, torch.Tensor):
        check_tensor("tau", tau, shape=(B,), floating=True)
        if not bool(((tau > 0) & (tau < 1)).all()):
            raise ValueError("tau must lie in (0, 1) in every row, got NaN or a value outside")
    else:
        tau = check_float("tau", tau, lo=0, hi=1, lo_open=True, hi_open=True)
    beta = check_float("beta", beta, lo=0, lo_open=True)
    eta = check_float("eta", eta, lo=0, hi=1, lo_open=True)
    tol = check_float("tol", tol, lo=0, lo_open=True)
    max_iter = check_int("max_iter", max_iter, lo=1)
    order, h, Jp, n = _update_order(conf, J, masked, tau)
    q = torch.sigmoid(beta * h)  # the J = 0 solution as the start
    sweeps_of = _sweeps_jax if q.device.type == "cpu" else _sweeps_torch
    sweeps, residual = sweeps_of(beta * h, beta * Jp, q, eta, tol, max_iter)
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
