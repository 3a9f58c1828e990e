"""The decoding loop of parallel decoders for masked-diffusion LMs: unmask, pass by pass.

A masked-diffusion LM (MDLM, LLaDA, Dream) generates by unmasking. Every forward
pass gives a distribution ``p_i`` for each masked position ``i``; a *strategy*
decides which positions to commit this pass, and each committed position gets a
token sampled from its ``p_i``. Committing many per pass is the parallelism; the
danger is committing positions that are each plausible alone but clash together.

The denoiser protocol: any callable ``tokens (B, L) int64 -> (B, L, V)`` of
probabilities or logits (rows already summing to 1 are read as probabilities,
anything else as logits). ``mask_id`` marks the positions still to generate.

:func:`decode` is the loop: one forward pass of the sequences still masked, the strategy's
selection, and the sampling, until every position is generated. ``STRATEGIES`` names the
strategies (:mod:`parlearn.many_copies.decoding.strategies` and
:mod:`parlearn.many_copies.decoding.mean_field`) and ``_PARAMS`` checks their parameters.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from parlearn.core.checks import check_callable, check_choice, check_float, check_int, check_tensor
from parlearn.core.device import sync
from parlearn.many_copies.decoding.mean_field import _mean_field
from parlearn.many_copies.decoding.strategies import (
    _entropy_bound,
    _factor,
    _fixed_k,
    _random,
    _sequential,
    _threshold,
)

__all__ = ["STRATEGIES", "DecodeResult", "decode"]

Denoiser = Callable[[torch.Tensor], torch.Tensor]


# --- the strategies by name, and their parameters ---------------------------------------


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
