"""Parallel dither and dropout: P noisy copies of each example, one batched pass.

Reconstruction. Simpson, "Parallel dither and dropout for regularising deep neural
networks" (arXiv 1508.07130) and "Taming the ReLU with parallel dither in a deep
neural network" (arXiv 1509.05173) could only be read as abstracts. What is built
here is our reading of them:

* *dither* is additive zero-mean input noise (uniform, Gaussian or triangular);
  ``scale`` is its **standard deviation** for every kind. *Dropout* then zeroes input
  features with probability p and rescales the rest by 1/(1-p), so a dropped feature
  is exactly zero, dither included: ``x_copy = (x + dither) * mask``;
* both regularise minibatch SGD but, per the abstract, "fail without batch
  averaging": with one example per update the noise dominates each step;
* *parallel* regularisation makes P copies of the example, each with its own noise
  and dropout mask, and averages their **gradients** into one update. Its expectation
  is the gradient of the noise-smoothed loss, and its variance falls like 1/P;
* the P copies are one batched forward/backward on the device: that is the
  parallelism (:func:`parallel_grad`). :func:`sequential_grad` is its serial
  reference: a Python loop over the same copies with the same noise.

The demodulation view: averaged over dither, a ReLU's transfer curve is smoothed
near 0 (:func:`smoothed_relu`), which weakens the harmonics ("decoy features") it
makes from a sinusoid (:func:`relu_spectrum`). That is an average of *activations*.
:func:`parallel_grad` averages *gradients*; the two agree where the loss is linear in
the unit's output (then the averaged gradient is the slope of the smoothed curve,
:func:`smoothed_relu_slope`), and differ otherwise.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from torch import nn

from parlearn.core.bench import Row
from parlearn.core.checks import (
    check_bool,
    check_callable,
    check_choice,
    check_float,
    check_int,
    check_module,
    check_seed,
    check_tensor,
)
from parlearn.core.device import threads as _threads
from parlearn.core.timing import compare, sweep

__all__ = [
    "NOISES",
    "REGIMES",
    "Noise",
    "noise_half_width",
    "draw_noise",
    "parallel_grad",
    "sequential_grad",
    "smoothed_relu",
    "smoothed_relu_slope",
    "relu_spectrum",
    "mlp",
    "History",
    "train",
    "grad_variance",
    "compare_regimes",
    "summarise",
    "paired_difference",
    "throughput",
    "bench",
]

NOISES = ("uniform", "gaussian", "triangular")
REGIMES = ("batch", "single", "parallel")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Half-width of each bounded kind per unit standard deviation: a uniform variable on
# [-a, a] has variance a^2/3, a triangular one (difference of two uniforms) a^2/6.
_HALF_WIDTH_PER_STD = {"uniform": math.sqrt(3.0), "triangular": math.sqrt(6.0)}


# --- noise ---------------------------------------------------------------------------


def _check_noise(copies, dither, scale, dropout) -> tuple[int, str | None, float, float | None]:
    """Validate one noise specification; refuse a kind without a scale and vice versa."""
    copies = check_int("copies", copies, lo=1)
    if dither is not None:
        check_choice("dither", dither, NOISES)
    scale = check_float("scale", scale, lo=0.0)
    if dither is None and scale != 0:
        raise ValueError(f"scale={scale} given with dither=None: name the noise kind "
                         f"(one of {list(NOISES)})")
    if dither is not None and scale == 0:
        raise ValueError(f"dither={dither!r} with scale=0 adds no noise: give scale > 0 "
                         "(the standard deviation) or dither=None")
    if dropout is not None:
        dropout = check_float("dropout", dropout, lo=0.0, hi=1.0, hi_open=True)
    return copies, dither, scale, dropout


def noise_half_width(kind: str, scale: float) -> float:
    """Half-width ``a`` of a bounded noise kind whose standard deviation is ``scale``.

    Uniform on ``[-a, a]`` has std ``a/sqrt(3)``, triangular on ``[-a, a]`` has std
    ``a/sqrt(6)``. Gaussian noise is unbounded: asking for it is an error.
    """
    check_choice("kind", kind, tuple(_HALF_WIDTH_PER_STD))
    return _HALF_WIDTH_PER_STD[kind] * check_float("scale", scale, lo=0.0)


@dataclass
class Noise:
    """The noise for P copies of a batch: ``x_copy = (x + add) * keep``.

    ``add`` and ``keep`` have shape ``(copies, *x.shape)``; either may be None
    (no dither, no dropout). Dropout comes *after* the dither, so a dropped input
    is exactly zero.
    """

    copies: int
    add: torch.Tensor | None
    keep: torch.Tensor | None

    def apply(self, x: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Copies ``start:stop`` (default: all), shape ``(stop - start, *x.shape)``."""
        check_tensor("x", x, floating=True)
        stop = self.copies if stop is None else stop
        start = check_int("start", start, lo=0, hi=self.copies - 1)
        stop = check_int("stop", stop, lo=start + 1, hi=self.copies)
        for name in ("add", "keep"):
            t = getattr(self, name)
            if t is not None and t.shape != (self.copies, *x.shape):
                raise ValueError(f"noise.{name} has shape {tuple(t.shape)}, but x needs "
                                 f"{(self.copies, *x.shape)}")
        out = x.unsqueeze(0).expand(stop - start, *x.shape)
        if self.add is not None:
            out = out + self.add[start:stop]
        if self.keep is not None:
            out = out * self.keep[start:stop]
        return out


def _sample(kind: str, shape, scale: float, generator, dtype, device) -> torch.Tensor:
    """Zero-mean noise of standard deviation ``scale``, drawn on the CPU, moved to ``device``."""
    def u():
        return torch.rand(shape, generator=generator, dtype=dtype)

    if kind == "gaussian":
        out = scale * torch.randn(shape, generator=generator, dtype=dtype)
    else:
        a = _HALF_WIDTH_PER_STD[kind] * scale
        out = a * (2 * u() - 1) if kind == "uniform" else a * (u() - u())
    return out.to(device)


def _check_generator(generator) -> torch.Generator | None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got "
                        f"{type(generator).__name__}")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(f"generator must be a CPU generator (noise is drawn on the CPU), "
                         f"got one on {generator.device}")
    return generator


def draw_noise(x: torch.Tensor, copies: int, *, dither: str | None = None, scale: float = 0.0,
               dropout: float | None = None,
               generator: torch.Generator | None = None) -> Noise:
    """Draw independent dither and dropout masks for ``copies`` copies of ``x``.

    ``scale`` is the dither's standard deviation (for every kind); ``dropout`` the
    probability of zeroing an input feature. Random numbers come from ``generator`` (a
    CPU ``torch.Generator``; None means torch's global generator) and are moved to
    ``x``'s device, so a seed gives the same noise on every device.
    """
    check_tensor("x", x, floating=True)
    copies, dither, scale, dropout = _check_noise(copies, dither, scale, dropout)
    _check_generator(generator)
    shape = (copies, *x.shape)
    add = keep = None
    if dither is not None:
        add = _sample(dither, shape, scale, generator, x.dtype, x.device)
    if dropout:
        kept = torch.rand(shape, generator=generator, dtype=x.dtype) >= dropout
        keep = kept.to(x.dtype).div_(1.0 - dropout).to(x.device)
    return Noise(copies, add, keep)


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


# --- the demodulation picture ---------------------------------------------------------


def _check_curve_args(x, scale, noise) -> tuple[np.ndarray, float]:
    check_choice("noise", noise, NOISES)
    scale = check_float("scale", scale, lo=0.0, lo_open=True)
    x = np.asarray(x, dtype=float)
    if not np.isfinite(x).all():
        raise ValueError("x must be finite")
    return x, scale


def smoothed_relu(x, scale: float, noise: str = "gaussian") -> np.ndarray:
    """Closed form of ``E[ReLU(x + n)]`` for zero-mean noise ``n`` of standard deviation ``scale``.

    Gaussian (std ``s``): ``x Phi(x/s) + s phi(x/s)``. Uniform on ``[-a, a]`` with
    ``a = sqrt(3) s``: ``0`` below ``-a``, ``(x + a)^2 / (4a)`` inside, ``x`` above ``a``.
    Triangular on ``[-a, a]`` with ``a = sqrt(6) s``: ``(x + a)^3 / (6a^2)`` for
    ``-a <= x <= 0`` and ``x + (a - x)^3 / (6a^2)`` for ``0 <= x <= a``. Works on arrays.
    """
    x, s = _check_curve_args(x, scale, noise)
    if noise == "gaussian":
        z = x / s
        cdf = 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
        return x * cdf + s * np.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
    a = noise_half_width(noise, s)
    inside = np.abs(x) < a
    out = np.array(np.maximum(x, 0.0), dtype=float)  # an array even for a scalar x
    xi = x[inside]
    if noise == "uniform":
        out[inside] = (xi + a) ** 2 / (4 * a)
    else:
        out[inside] = np.where(xi <= 0, (xi + a) ** 3 / (6 * a**2), xi + (a - xi) ** 3 / (6 * a**2))
    return out


def smoothed_relu_slope(x, scale: float, noise: str = "gaussian") -> np.ndarray:
    """``d/dx E[ReLU(x + n)] = P(x + n > 0)``: the expected ReLU gradient under the noise.

    This is what :func:`parallel_grad` averages for a unit whose loss is linear in its
    output. Gaussian: ``Phi(x/s)``; uniform: ``(x + a)/(2a)`` inside ``[-a, a]``;
    triangular: ``(x + a)^2/(2a^2)`` for ``x <= 0`` and ``1 - (a - x)^2/(2a^2)`` for
    ``x >= 0``; ``0`` below ``-a`` and ``1`` above ``a`` (half-widths as in
    :func:`smoothed_relu`).
    """
    x, s = _check_curve_args(x, scale, noise)
    if noise == "gaussian":
        return 0.5 * (1 + np.vectorize(math.erf)(x / (s * math.sqrt(2))))
    a = noise_half_width(noise, s)
    out = np.array(x >= a, dtype=float)
    inside = np.abs(x) < a
    xi = x[inside]
    if noise == "uniform":
        out[inside] = (xi + a) / (2 * a)
    else:
        out[inside] = np.where(xi <= 0, (xi + a) ** 2 / (2 * a**2), 1 - (a - xi) ** 2 / (2 * a**2))
    return out


def relu_spectrum(*, offset: float = 0.0, amplitude: float = 1.0, cycles: int = 8,
                  samples: int = 1024, noise: str | None = None, scale: float = 0.0,
                  copies: int = 1, seed: int | torch.Generator = 0) -> dict:
    """Spectrum of ``ReLU(offset + amplitude sin(2 pi t) + dither)`` averaged over copies.

    The input has energy at one frequency only; every other peak of the output is a
    distortion product the ReLU made. With ``offset = 0`` the output is a half-wave
    rectified sine: DC, the fundamental and the *even* harmonics only, with magnitudes
    ``A/pi``, ``A/4`` and ``A/(pi (4k^2 - 1))`` at harmonic ``2k``; an offset brings in
    odd harmonics too. Averaging ``copies`` dithered copies (``noise`` kind, ``scale`` =
    standard deviation; both or neither) replaces the ReLU by its smoothed version and
    weakens the high harmonics. ``magnitude`` is ``|rfft| / samples`` (half the
    amplitude of each cosine, the DC term itself).
    Returns ``{"harmonic", "magnitude", "t", "output"}``; ``harmonic`` is frequency in
    units of the input frequency.
    """
    offset = check_float("offset", offset)
    amplitude = check_float("amplitude", amplitude, lo=0.0, lo_open=True)
    cycles = check_int("cycles", cycles, lo=1)
    samples = check_int("samples", samples, lo=8 * cycles)
    copies, noise, scale, _ = _check_noise(copies, noise, scale, None)
    if noise is None and copies != 1:
        raise ValueError(f"copies={copies} without noise: copies of a clean signal are all "
                         "the same; give noise and scale")
    seed = check_seed("seed", seed)
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    t = torch.arange(samples, dtype=torch.float64) / samples * cycles
    x = offset + amplitude * torch.sin(2 * math.pi * t)
    if noise is not None:
        d = _sample(noise, (copies, samples), scale, g, torch.float64, "cpu")
        out = torch.relu(x + d).mean(0)
    else:
        out = torch.relu(x)
    mag = torch.fft.rfft(out).abs() / samples
    harmonic = torch.arange(mag.numel(), dtype=torch.float64) / cycles
    return {"harmonic": harmonic.numpy(), "magnitude": mag.numpy(), "t": t.numpy(),
            "output": out.numpy()}


# --- the regime experiment ------------------------------------------------------------


def mlp(n_in: int, hidden: int, n_out: int, *, dropout: float = 0.0,
        seed: int | torch.Generator = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """A one-hidden-layer ReLU MLP (optionally with a Dropout layer after the ReLU).

    Weights and biases are drawn as ``nn.Linear`` draws them (uniform on
    ``+-1/sqrt(fan_in)``) but from ``seed`` (an int or a ``torch.Generator``), never
    from torch's global generator.
    """
    n_in = check_int("n_in", n_in, lo=1)
    hidden = check_int("hidden", hidden, lo=1)
    n_out = check_int("n_out", n_out, lo=1)
    dropout = check_float("dropout", dropout, lo=0.0, hi=1.0, hi_open=True)
    seed = check_seed("seed", seed)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    # skip_init: nn.Linear's own initialisation would draw from the global generator.
    first = nn.utils.skip_init(nn.Linear, n_in, hidden, dtype=dtype)
    last = nn.utils.skip_init(nn.Linear, hidden, n_out, dtype=dtype)
    with torch.no_grad():
        for layer in (first, last):
            bound = 1 / math.sqrt(layer.in_features)
            for p in (layer.weight, layer.bias):
                p.uniform_(-bound, bound, generator=g)
    layers: list[nn.Module] = [first, nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(last)
    return nn.Sequential(*layers)


@dataclass
class History:
    """Per-epoch record of one training run, with the compute it spent."""

    regime: str
    updates: list[int] = field(default_factory=list)
    forwards: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    test_loss: list[float] = field(default_factory=list)
    test_acc: list[float] = field(default_factory=list)

    @property
    def test_error(self) -> list[float]:
        return [1 - a for a in self.test_acc]


def _evaluate(model, x, y):
    with torch.no_grad():
        out = model(x)
        loss = nn.functional.cross_entropy(out, y).item()
        acc = (out.argmax(1) == y).double().mean().item()
    return loss, acc


def _check_split(data) -> None:
    for name in ("x_train", "y_train", "x_test", "y_test"):
        if not isinstance(getattr(data, name, None), torch.Tensor):
            raise TypeError(f"data must be a parlearn.datasets.Split (with {name}), got "
                            f"{type(data).__name__}")
    _check_xy(data.x_train, data.y_train)
    _check_xy(data.x_test, data.y_test)
    check_tensor("data.x_train", data.x_train, ndim=2, floating=True, finite=True)
    check_tensor("data.y_train", data.y_train, ndim=1, floating=False)


def train(regime: str, data, *, epochs: int = 5, lr: float = 0.05, hidden: int = 64,
          batch_size: int | None = None, copies: int | None = None,
          dither: str | None = None, scale: float = 0.0, dropout: float | None = None,
          seed: int = 0, progress: bool = False) -> History:
    """Train an MLP on ``data`` (a :class:`parlearn.datasets.Split`) in one of three regimes.

    * ``"batch"``: minibatch SGD (``batch_size`` examples per update), one noisy copy each;
    * ``"single"``: one example per update, one noisy copy;
    * ``"parallel"``: one example per update, ``copies`` noisy copies averaged.

    ``batch_size`` (default 32) is used by ``"batch"`` only and ``copies`` (default 16)
    by ``"parallel"`` only; giving either to another regime is an error. ``seed`` fixes the
    initial weights, the data order and the noise; torch's global generator is not used.
    The model has no random layers (the noise is on the input, see :func:`draw_noise`).
    Records after every epoch: updates, forward passes (examples pushed through the
    model, copies included), train loss, test loss and accuracy. ``progress`` shows a
    text progress bar (tqdm) on stderr.
    """
    regime = check_choice("regime", regime, REGIMES)
    _check_split(data)
    epochs = check_int("epochs", epochs, lo=1)
    lr = check_float("lr", lr, lo=0.0, lo_open=True)
    hidden = check_int("hidden", hidden, lo=1)
    if regime != "batch" and batch_size is not None:
        raise ValueError(f"batch_size={batch_size!r} is only used by regime='batch', not "
                         f"{regime!r}")
    if regime != "parallel" and copies is not None:
        raise ValueError(f"copies={copies!r} is only used by regime='parallel', not {regime!r}")
    bs = p = 1
    if regime == "batch":
        bs = check_int("batch_size", 32 if batch_size is None else batch_size, lo=1)
    if regime == "parallel":
        p = check_int("copies", 16 if copies is None else copies, lo=1)
    seed = check_int("seed", seed, lo=0)
    check_bool("progress", progress)
    _check_noise(p, dither, scale, dropout)
    n_classes = int(torch.cat([data.y_train, data.y_test]).max()) + 1
    model = mlp(data.n_features, hidden, n_classes, seed=seed, dtype=data.x_train.dtype)
    model.to(data.x_train.device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 1)
    hist = History(regime)
    n = data.x_train.shape[0]
    updates = forwards = 0
    bar = None
    if progress:
        from tqdm.std import tqdm  # the text bar: no widget, nothing left waiting in a kernel

        bar = tqdm(total=epochs * math.ceil(n / bs), desc=f"{regime} SGD", leave=False)
    try:
        for _ in range(epochs):
            order = torch.randperm(n, generator=g).to(data.x_train.device)
            running = 0.0
            for start in range(0, n, bs):
                idx = order[start:start + bs]
                opt.zero_grad(set_to_none=True)
                running += parallel_grad(model, nn.functional.cross_entropy, data.x_train[idx],
                                         data.y_train[idx], copies=p, dither=dither, scale=scale,
                                         dropout=dropout, generator=g) * len(idx)
                opt.step()
                updates += 1
                forwards += p * len(idx)
                if bar is not None:
                    bar.update()
            test_loss, test_acc = _evaluate(model, data.x_test, data.y_test)
            hist.updates.append(updates)
            hist.forwards.append(forwards)
            hist.train_loss.append(running / n)
            hist.test_loss.append(test_loss)
            hist.test_acc.append(test_acc)
    finally:
        if bar is not None:
            bar.close()
    return hist


def _regime_plan(epochs: int, batch_size: int, copies: int,
                 noises: dict[str, dict]) -> dict[str, dict]:
    plan = {
        "batch SGD": dict(regime="batch", epochs=epochs * batch_size, batch_size=batch_size),
        "single-example SGD": dict(regime="single", epochs=epochs),
    }
    for label, kw in noises.items():
        plan[f"batch SGD + {label}"] = dict(regime="batch", epochs=epochs * batch_size,
                                            batch_size=batch_size, **kw)
        plan[f"single-example SGD + {label}"] = dict(regime="single", epochs=epochs, **kw)
        plan[f"parallel {label}, P={copies}"] = dict(regime="parallel", epochs=epochs,
                                                    copies=copies, **kw)
    return plan


def compare_regimes(data, *, epochs: int, batch_size: int = 16, copies: int = 16,
                    noises: dict[str, dict] | None = None, lr: float = 0.05, hidden: int = 64,
                    seeds: Sequence[int] = (0,),
                    progress: Callable[[float, str], None] | None = None,
                    threads: int | None = 1) -> dict[str, list[History]]:
    """The lesson's experiment, at equal updates, for each seed in ``seeds``.

    ``noises`` maps a label to the noise arguments of :func:`train`, e.g.
    ``{"dither": {"dither": "gaussian", "scale": 0.3}, "dropout": {"dropout": 0.2}}``
    (default: Gaussian dither of standard deviation 0.3). The runs are the two clean
    controls, batch SGD and single-example SGD, and for each noise: batch SGD +
    noise, single-example SGD + noise, and parallel noise with ``copies`` copies.

    Single-example runs make ``epochs`` passes over the data (``n * epochs`` updates);
    batch runs make ``epochs * batch_size`` passes, so they take as many updates, and
    with ``copies == batch_size`` the parallel run pushes as many examples through
    the model as batch SGD does. Returns ``{name: [History for each seed]}``.
    ``progress(fraction, text)`` is called before every run. ``threads`` pins torch's
    intra-op thread count for the call and restores it (one thread is fastest for these
    tiny models and keeps a busy machine usable); ``None`` keeps the caller's count.
    """
    _check_split(data)
    epochs = check_int("epochs", epochs, lo=1)
    batch_size = check_int("batch_size", batch_size, lo=1)
    copies = check_int("copies", copies, lo=1)
    if noises is None:
        noises = {"dither": {"dither": "gaussian", "scale": 0.3}}
    if not isinstance(noises, dict) or not noises:
        raise TypeError(f"noises must be a non-empty dict of label -> noise arguments, got "
                        f"{noises!r}")
    for label, kw in noises.items():
        if not isinstance(label, str) or not isinstance(kw, dict):
            raise TypeError(f"noises[{label!r}] must map a str label to a dict, got {kw!r}")
        bad = set(kw) - {"dither", "scale", "dropout"}
        if bad:
            raise ValueError(f"noises[{label!r}] has unknown keys {sorted(bad)}; use dither, "
                             "scale, dropout")
        _check_noise(1, kw.get("dither"), kw.get("scale", 0.0), kw.get("dropout"))
        if kw.get("dither") is None and not kw.get("dropout"):
            raise ValueError(f"noises[{label!r}] adds no noise")
    check_float("lr", lr, lo=0.0, lo_open=True)
    check_int("hidden", hidden, lo=1)
    seeds = [check_int("seeds[]", s, lo=0) for s in seeds]
    if not seeds:
        raise ValueError("seeds must name at least one seed")
    if progress is not None:
        check_callable("progress", progress)
    if threads is not None:
        threads = check_int("threads", threads, lo=1)
    plan = _regime_plan(epochs, batch_size, copies, noises)
    out: dict[str, list[History]] = {name: [] for name in plan}
    total, done = len(plan) * len(seeds), 0
    with _threads(threads) if threads is not None else contextlib.nullcontext():
        for seed in seeds:
            for name, kw in plan.items():
                if progress is not None:
                    progress(done / total, f"training {name} (seed {seed})")
                out[name].append(train(data=data, lr=lr, hidden=hidden, seed=seed, **kw))
                done += 1
    if progress is not None:
        progress(1.0, "done")
    return out


def summarise(results: dict[str, list[History]]) -> dict[str, dict]:
    """Final test accuracy of each regime over its seeds: mean, sample std, min, max, n."""
    out = {}
    for name, hists in results.items():
        accs = [h.test_acc[-1] for h in hists]
        out[name] = {"mean": statistics.fmean(accs),
                     "std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                     "min": min(accs), "max": max(accs), "n": len(accs)}
    return out


def paired_difference(results: dict[str, list[History]], a: str, b: str) -> dict:
    """Final test accuracy of regime ``a`` minus that of ``b``, paired by seed.

    Returns ``{"mean", "se", "n", "low", "high", "verdict"}``: the mean difference, its
    standard error, the 95% Student-t interval and ``"better"``/``"worse"`` when that
    interval excludes 0, else ``"not distinguishable"`` (always so with one seed).
    """
    for name in (a, b):
        if name not in results:
            raise ValueError(f"{name!r} is not one of the regimes {list(results)}")
    if len(results[a]) != len(results[b]):
        raise ValueError(f"{a!r} and {b!r} were run with different numbers of seeds")
    d = [ha.test_acc[-1] - hb.test_acc[-1] for ha, hb in zip(results[a], results[b],
                                                            strict=True)]
    n, mean = len(d), statistics.fmean(d)
    if n < 2:
        return {"mean": mean, "se": math.nan, "n": n, "low": -math.inf, "high": math.inf,
                "verdict": "not distinguishable"}
    from scipy.stats import t as student_t

    se = statistics.stdev(d) / math.sqrt(n)
    half = float(student_t.ppf(0.975, n - 1)) * se
    low, high = mean - half, mean + half
    verdict = "better" if low > 0 else "worse" if high < 0 else "not distinguishable"
    return {"mean": mean, "se": se, "n": n, "low": low, "high": high, "verdict": verdict}


def throughput(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, *,
               copies_list: Sequence[int], dither: str | None = "gaussian", scale: float = 0.1,
               dropout: float | None = None, repeat: int = 5, device="cpu",
               threads: int | None = 1) -> dict:
    """Measured time of one P-copy gradient, batched vs looped, for each P in ``copies_list``.

    Both candidates use the same noise. ``threads`` pins torch's intra-op thread count
    for the measurement (see :data:`parlearn.device.THREAD_POLICY`) and restores it; the
    model's ``.grad`` are left as the caller had them. Returns the
    :func:`parlearn.timing.sweep` result (``r["speedup"]["batched"]`` is loop / batched,
    with its spread) with ``copies``, ``loop_s`` and ``batched_s`` (median seconds) added.
    """
    _check_model(model)
    check_callable("loss_fn", loss_fn)
    _check_xy(x, y)
    if isinstance(copies_list, (str, bytes)) or not isinstance(copies_list, Sequence):
        raise TypeError(f"copies_list must be a sequence of ints, got {copies_list!r}")
    if not copies_list:
        raise ValueError("copies_list must name at least one number of copies")
    ps = [check_int("copies_list[]", p, lo=1) for p in copies_list]
    _check_noise(1, dither, scale, dropout)
    repeat = check_int("repeat", repeat, lo=1)
    if threads is not None:
        threads = check_int("threads", threads, lo=1)

    def candidates(p):
        noise = draw_noise(x, p, dither=dither, scale=scale, dropout=dropout,
                           generator=torch.Generator().manual_seed(0))
        return {"loop": partial(sequential_grad, model, loss_fn, x, y, noise=noise),
                "batched": partial(parallel_grad, model, loss_fn, x, y, copies=p,
                                   noise=noise)}

    with _own_grads(model):
        r = sweep(ps, candidates, repeat=repeat, device=device, threads=threads)
    r.update(copies=r["values"], loop_s=r["median_s"]["loop"],
             batched_s=r["median_s"]["batched"])
    return r


# --- bench --------------------------------------------------------------------------


def bench(device: torch.device, quick: bool) -> list[Row]:
    """P=64 copies, one batched pass vs a loop over copies, one intra-op thread."""
    from parlearn.core.datasets import digits

    device = torch.device(device)
    check_bool("quick", quick)
    data = digits(device=device)
    model = mlp(data.n_features, 64, 10).to(device)
    loss_fn = nn.functional.cross_entropy
    rows = []
    copies = 64
    target = ">= 5x" if device.type == "cpu" else ">= 20x"
    need = 5.0 if device.type == "cpu" else 20.0
    for batch in (1, 8) if quick else (1, 4, 32):
        x, y = data.x_train[:batch], data.y_train[:batch]
        noise = draw_noise(x, copies, dither="gaussian", scale=0.1,
                           generator=torch.Generator().manual_seed(0))
        with _own_grads(model):
            cmp = compare({
                "loop": partial(sequential_grad, model, loss_fn, x, y, noise=noise),
                "batched": partial(parallel_grad, model, loss_fn, x, y, copies=copies,
                                   noise=noise),
            }, warmup=2, repeat=5 if quick else 15, device=device, threads=1)
        ratio = cmp.speedup("batched")
        lo, hi = cmp.speedup_range("batched")
        detail = f"IQR {lo:.1f}-{hi:.1f}x, {cmp.threads} thread(s)"
        if not cmp.reliable:
            detail += "; unreliable (busy machine)"
        rows.append(Row(f"dither P={copies} batch={batch}", "loop over copies",
                        "one batched pass", ratio, str(device), target, ratio >= need, detail))
    return rows
