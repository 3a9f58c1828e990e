"""Parallel dither's primitive: P noisy copies of a batch in one batched forward/backward.

Reconstruction. Simpson, "Parallel dither and dropout for regularising deep neural
networks" (arXiv 1508.07130) and "Taming the ReLU with parallel dither in a deep
neural network" (arXiv 1509.05173) could only be read as abstracts. What is built
here is our reading of them:

* dither and dropout (:mod:`parlearn.many_copies.dither.noise`) both regularise minibatch
  SGD but, per the abstract, "fail without batch averaging": with one example per update
  the noise dominates each step;
* *parallel* regularisation makes P copies of the example, each with its own noise
  and dropout mask, and averages their **gradients** into one update. Its expectation
  is the gradient of the noise-smoothed loss, and its variance falls like 1/P
  (:func:`grad_variance`);
* the P copies are one batched forward/backward on the device: that is the
  parallelism (:func:`parallel_grad`). :func:`sequential_grad` is its serial
  reference: a Python loop over the same copies with the same noise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from parlearn.core.checks import check_callable, check_int, check_module, check_seed, check_tensor
from parlearn.core.device import threads as _threads
from parlearn.many_copies.dither.noise import Noise, _check_generator, _check_noise, draw_noise

__all__ = ["parallel_grad", "sequential_grad", "grad_variance"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# --- the primitive and its serial reference ------------------------------------------


def _check_model(model: nn.Module) -> None:
    check_module("model", model)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training:
            raise ValueError(
                f"model layer {name or type(mod).__name__!r} is BatchNorm in train mode: the P "
                "copies of one example would make its batch statistics meaningless. Use "
                "model.eval() for that layer, or LayerNorm/GroupNorm."
            )


def _check_xy(x, y) -> None:
    check_tensor("x", x, floating=True)
    check_tensor("y", y)
    if x.ndim < 1 or y.ndim < 1 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(f"x and y need the same non-zero batch size, got shapes "
                         f"{tuple(x.shape)} and {tuple(y.shape)}")
    if x.device != y.device:
        raise ValueError(f"x is on {x.device} but y on {y.device}")


def _check_noise_for(noise, x: torch.Tensor) -> Noise:
    if not isinstance(noise, Noise):
        raise TypeError(f"noise must be a dither.Noise (from draw_noise), got "
                        f"{type(noise).__name__}")
    for name in ("add", "keep"):
        t = getattr(noise, name)
        if t is None:
            continue
        if t.shape != (noise.copies, *x.shape):
            raise ValueError(f"noise.{name} has shape {tuple(t.shape)}, but x needs "
                             f"{(noise.copies, *x.shape)}")
        if t.device != x.device or t.dtype != x.dtype:
            raise ValueError(f"noise.{name} is {t.dtype} on {t.device}, x is {x.dtype} on "
                             f"{x.device}: draw the noise for this x")
    return noise


def parallel_grad(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, *,
                  copies: int, dither: str | None = None, scale: float = 0.0,
                  dropout: float | None = None, generator: torch.Generator | None = None,
                  noise: Noise | None = None, max_rows: int = 16384) -> float:
    """Average the gradient over ``copies`` noisy copies of the batch in one batched pass.

    ``loss_fn(output, target)`` must return the *mean* over its batch (as torch's
    losses do by default). The gradient of the mean over copies and examples is
    *added* to each parameter's ``.grad`` (accumulating like ``backward()``); the
    mean loss is returned.

    The noise is either drawn here (``dither``, ``scale`` = its standard deviation,
    ``dropout``, ``generator``; see :func:`draw_noise`) or given as ``noise`` (from
    :func:`draw_noise`), never both: passing ``noise`` together with any of the other
    four is an error, as is ``copies`` differing from ``noise.copies``.

    When ``copies * batch`` exceeds ``max_rows``, the copies go through the model in
    chunks of ``max(1, max_rows // batch)`` copies, one forward/backward each: the
    model's activations and the noisy inputs are then held for one chunk at a time.
    Noise drawn here is drawn chunk by chunk too (same distribution, but a different
    draw from the same generator than one unchunked call); a given ``noise`` is held
    whole by the caller, and the gradient equals the unchunked one to round-off.
    Layers of the model that are themselves random (``nn.Dropout`` in train mode)
    draw from torch's global generator independently for every row.
    """
    _check_model(model)
    check_callable("loss_fn", loss_fn)
    _check_xy(x, y)
    copies = check_int("copies", copies, lo=1)
    max_rows = check_int("max_rows", max_rows, lo=1)
    _check_generator(generator)
    if noise is not None:
        given = {"dither": dither is not None, "scale": scale != 0.0,
                 "dropout": dropout is not None, "generator": generator is not None}
        clash = [k for k, v in given.items() if v]
        if clash:
            raise ValueError(f"noise= was given together with {clash}: those would be "
                             "ignored. Pass either noise= or the arguments to draw it.")
        _check_noise_for(noise, x)
        if noise.copies != copies:
            raise ValueError(f"noise was drawn for {noise.copies} copies, but copies={copies}")
    else:
        _check_noise(copies, dither, scale, dropout)
    batch = x.shape[0]
    per_chunk = max(1, max_rows // batch)
    total = 0.0
    for start in range(0, copies, per_chunk):
        n = min(per_chunk, copies - start)
        if noise is None:
            chunk = draw_noise(x, n, dither=dither, scale=scale, dropout=dropout,
                               generator=generator).apply(x)
        else:
            chunk = noise.apply(x, start, start + n)
        rows = chunk.reshape(n * batch, *x.shape[1:])
        targets = y.unsqueeze(0).expand(n, *y.shape).reshape(n * batch, *y.shape[1:])
        loss = loss_fn(model(rows), targets) * (n / copies)
        loss.backward()
        total += loss.item()
    return total


def sequential_grad(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, *,
                    noise: Noise) -> float:
    """Serial reference: one forward/backward per copy of ``noise``, gradients averaged."""
    _check_model(model)
    check_callable("loss_fn", loss_fn)
    _check_xy(x, y)
    _check_noise_for(noise, x)
    total = 0.0
    for p in range(noise.copies):
        loss = loss_fn(model(noise.apply(x, p, p + 1)[0]), y) / noise.copies
        loss.backward()
        total += loss.item()
    return total


@contextlib.contextmanager
def _own_grads(model: nn.Module) -> Iterator[list[nn.Parameter]]:
    """Give the block empty ``.grad`` slots and put the caller's gradients back afterwards."""
    params = list(model.parameters())
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield [p for p in params if p.requires_grad]
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g


def grad_variance(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, *,
                  copies: int, draws: int, dither: str | None = None, scale: float = 0.0,
                  dropout: float | None = None, seed: int | torch.Generator = 0,
                  threads: int | None = 1) -> float:
    """Total variance (trace of the covariance) of the parallel gradient over ``draws`` redraws.

    Measures the gradient noise the regulariser injects; it falls like ``1/copies``.
    The model's ``.grad`` are left as the caller had them. ``threads`` pins torch's
    intra-op thread count for the call and restores it (``None``: the caller's count).
    """
    _check_model(model)
    check_callable("loss_fn", loss_fn)
    _check_xy(x, y)
    _check_noise(copies, dither, scale, dropout)
    if dither is None and not dropout:
        raise ValueError("grad_variance needs noise: give dither and scale, or dropout")
    draws = check_int("draws", draws, lo=2)
    seed = check_seed("seed", seed)
    if threads is not None:
        threads = check_int("threads", threads, lo=1)
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    grads = []
    pin = _threads(threads) if threads is not None else contextlib.nullcontext()
    with pin, _own_grads(model) as params:
        if not params:
            raise ValueError("model has no parameters that require a gradient")
        for _ in range(draws):
            for p in params:
                p.grad = None
            parallel_grad(model, loss_fn, x, y, copies=copies, dither=dither, scale=scale,
                          dropout=dropout, generator=g)
            grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                                    .reshape(-1) for p in params]))
    return torch.stack(grads).var(dim=0).sum().item()
