"""Parallel dither and dropout: P noisy copies of each example, one batched pass.

Reconstruction. Simpson, "Parallel dither and dropout for regularising deep neural
networks" (arXiv 1508.07130) and "Taming the ReLU with parallel dither in a deep
neural network" (arXiv 1509.05173) could only be read as abstracts. What is built
here is our reading of them:

* *dither* is additive input noise (uniform, Gaussian or triangular); *dropout*
  zeroes input features with probability p and rescales the rest by 1/(1-p);
* both regularise minibatch SGD but, per the abstract, "fail without batch
  averaging": with one example per update the noise dominates each step;
* *parallel* regularisation makes P copies of the example, each with its own noise
  and dropout mask, and averages their gradients into one update. Its expectation
  is the gradient of the noise-smoothed loss, and its variance falls like 1/P;
* the P copies are one batched forward/backward on the device: that is the
  parallelism (:func:`parallel_grad`). :func:`sequential_grad` is its serial
  reference: a Python loop over the same copies with the same noise.

The demodulation view: averaged over dither, a ReLU's transfer curve is smoothed
near 0 (:func:`smoothed_relu`), which weakens the harmonics ("decoy features") it
makes from a sinusoid (:func:`relu_spectrum`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from .bench import Row
from .timing import compare, sweep

__all__ = [
    "NOISES",
    "REGIMES",
    "Noise",
    "draw_noise",
    "parallel_grad",
    "sequential_grad",
    "smoothed_relu",
    "relu_spectrum",
    "mlp",
    "History",
    "train",
    "grad_variance",
    "compare_regimes",
    "throughput",
]

NOISES = ("uniform", "gaussian", "triangular")
REGIMES = ("batch", "single", "parallel")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# --- noise ---------------------------------------------------------------------------


def _check_noise(copies: int, dither: str | None, scale: float, dropout: float | None) -> None:
    if not isinstance(copies, int) or isinstance(copies, bool) or copies < 1:
        raise ValueError(f"copies must be an int >= 1, got {copies!r}")
    if dither is not None and dither not in NOISES:
        raise ValueError(f"dither must be None or one of {NOISES}, got {dither!r}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale >= 0):
        raise ValueError(f"scale must be a finite number >= 0, got {scale!r}")
    if dither is None and scale != 0:
        raise ValueError(f"scale={scale} given with dither=None: name the noise kind")
    if dropout is not None and not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be None or in [0, 1), got {dropout!r}")


@dataclass
class Noise:
    """The noise for P copies of a batch: ``x_copy = (x + add) * keep``.

    ``add`` and ``keep`` have shape ``(copies, *x.shape)``; either may be None
    (no dither, no dropout).
    """

    copies: int
    add: torch.Tensor | None
    keep: torch.Tensor | None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """All copies, shape ``(copies, *x.shape)``."""
        for t in (self.add, self.keep):
            if t is not None and t.shape != (self.copies, *x.shape):
                raise ValueError(f"noise has shape {tuple(t.shape)}, expected "
                                 f"{(self.copies, *x.shape)}")
        out = x.unsqueeze(0).expand(self.copies, *x.shape)
        if self.add is not None:
            out = out + self.add
        if self.keep is not None:
            out = out * self.keep
        return out


def _sample(kind: str, shape, scale: float, generator, dtype, device) -> torch.Tensor:
    """Zero-mean noise: ``scale`` is the std for Gaussian, the half-width otherwise."""
    def u():
        return torch.rand(shape, generator=generator, dtype=dtype).to(device)

    if kind == "gaussian":
        return scale * torch.randn(shape, generator=generator, dtype=dtype).to(device)
    if kind == "uniform":
        return scale * (2 * u() - 1)
    return scale * (u() - u())  # triangular on [-scale, scale]


def draw_noise(x: torch.Tensor, copies: int, *, dither: str | None = None, scale: float = 0.0,
               dropout: float | None = None,
               generator: torch.Generator | None = None) -> Noise:
    """Draw independent dither and dropout masks for ``copies`` copies of ``x``.

    Random numbers come from ``generator`` (a CPU ``torch.Generator``) and are moved
    to ``x``'s device, so a seed gives the same noise on every device.
    """
    _check_noise(copies, dither, scale, dropout)
    shape = (copies, *x.shape)
    add = keep = None
    if dither is not None and scale > 0:
        add = _sample(dither, shape, float(scale), generator, x.dtype, x.device)
    if dropout:
        kept = torch.rand(shape, generator=generator, dtype=x.dtype) >= dropout
        keep = kept.to(x.dtype).div_(1.0 - dropout).to(x.device)
    return Noise(copies, add, keep)


# --- the primitive and its serial reference ------------------------------------------


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training:
            raise ValueError(
                f"model layer {name or type(mod).__name__!r} is BatchNorm in train mode: the P "
                "copies of one example would make its batch statistics meaningless. Use "
                "model.eval() for that layer, or LayerNorm/GroupNorm."
            )


def _check_xy(x: torch.Tensor, y: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError("x and y must be tensors")
    if x.ndim < 1 or y.ndim < 1 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(f"x and y need the same non-zero batch size, got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")


def parallel_grad(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, *,
                  copies: int, dither: str | None = None, scale: float = 0.0,
                  dropout: float | None = None, generator: torch.Generator | None = None,
                  noise: Noise | None = None, max_rows: int = 16384) -> float:
    """Average the gradient over ``copies`` noisy copies of the batch in one batched pass.

    ``loss_fn(output, target)`` must return the *mean* over its batch (as torch's
    losses do by default). The gradient of the mean over copies and examples is
    *added* to each parameter's ``.grad`` (accumulating like ``backward()``); the
    mean loss is returned. When ``copies * batch`` exceeds ``max_rows`` the copies
    are processed in chunks (same result, less memory). Pass ``noise`` (from
    :func:`draw_noise`) to reuse exact noise tensors instead of drawing new ones.
    Layers of the model that are themselves random (``nn.Dropout`` in train mode)
    draw independently for every row, so every copy gets its own mask there too.
    """
    _check_model(model)
    _check_xy(x, y)
    if noise is None:
        noise = draw_noise(x, copies, dither=dither, scale=scale, dropout=dropout,
                           generator=generator)
    elif noise.copies != copies:
        raise ValueError(f"noise was drawn for {noise.copies} copies, but copies={copies}")
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    batch = x.shape[0]
    per_chunk = max(1, max_rows // batch)
    xs = noise.apply(x)
    total = 0.0
    for start in range(0, copies, per_chunk):
        chunk = xs[start:start + per_chunk]
        n = chunk.shape[0]
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
    _check_xy(x, y)
    xs = noise.apply(x)
    total = 0.0
    for p in range(noise.copies):
        loss = loss_fn(model(xs[p]), y) / noise.copies
        loss.backward()
        total += loss.item()
    return total


def grad_variance(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, *,
                  copies: int, draws: int, dither: str | None = None, scale: float = 0.0,
                  dropout: float | None = None, seed: int = 0) -> float:
    """Total variance (trace of the covariance) of the parallel gradient over ``draws`` redraws.

    Measures the gradient noise the regulariser injects; it falls like ``1/copies``.
    """
    if draws < 2:
        raise ValueError(f"draws must be >= 2, got {draws}")
    g = torch.Generator().manual_seed(seed)
    grads = []
    params = [p for p in model.parameters() if p.requires_grad]
    for _ in range(draws):
        for p in params:
            p.grad = None
        parallel_grad(model, loss_fn, x, y, copies=copies, dither=dither, scale=scale,
                      dropout=dropout, generator=g)
        grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
    for p in params:
        p.grad = None
    return torch.stack(grads).var(dim=0).sum().item()


# --- the demodulation picture ---------------------------------------------------------


def smoothed_relu(x, scale: float, noise: str = "gaussian"):
    """Closed form of ``E[ReLU(x + n)]`` for zero-mean noise ``n`` of the given kind.

    Gaussian (std ``s``): ``x Phi(x/s) + s phi(x/s)``. Uniform on ``[-a, a]``:
    ``0`` below ``-a``, ``(x + a)^2 / (4a)`` inside, ``x`` above ``a``. Triangular
    on ``[-a, a]``: ``(x + a)^3 / (6a^2)`` for ``-a <= x <= 0`` and
    ``x + (a - x)^3 / (6a^2)`` for ``0 <= x <= a``. Works on numpy arrays.
    """
    if noise not in NOISES:
        raise ValueError(f"noise must be one of {NOISES}, got {noise!r}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    x = np.asarray(x, dtype=float)
    s = float(scale)
    if noise == "gaussian":
        z = x / s
        cdf = 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
        return x * cdf + s * np.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
    inside = np.abs(x) < s
    out = np.maximum(x, 0.0)
    xi = x[inside]
    if noise == "uniform":
        out[inside] = (xi + s) ** 2 / (4 * s)
    else:
        out[inside] = np.where(xi <= 0, (xi + s) ** 3 / (6 * s**2), xi + (s - xi) ** 3 / (6 * s**2))
    return out


def relu_spectrum(*, offset: float = 0.0, amplitude: float = 1.0, cycles: int = 8,
                  samples: int = 1024, scale: float = 0.0, noise: str = "gaussian",
                  copies: int = 1, seed: int = 0) -> dict:
    """Spectrum of ``ReLU(offset + amplitude sin(2 pi t) + dither)`` averaged over copies.

    The input has energy at one frequency only; every other peak of the output is a
    distortion product (harmonic) the ReLU made. Averaging ``copies`` dithered copies
    replaces the ReLU by its smoothed version and weakens the high harmonics.
    Returns ``{"harmonic", "magnitude", "t", "output"}``; ``harmonic`` is frequency in
    units of the input frequency.
    """
    _check_noise(copies, noise if scale > 0 else None, scale, None)
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(samples, dtype=torch.float64) / samples * cycles
    x = offset + amplitude * torch.sin(2 * math.pi * t)
    if scale > 0:
        d = _sample(noise, (copies, samples), scale, g, torch.float64, "cpu")
        out = torch.relu(x + d).mean(0)
    else:
        out = torch.relu(x)
    mag = torch.fft.rfft(out).abs() / samples
    harmonic = torch.arange(mag.numel(), dtype=torch.float64) / cycles
    return {"harmonic": harmonic.numpy(), "magnitude": mag.numpy(), "t": t.numpy(),
            "output": out.numpy()}


# --- the three-regime experiment -------------------------------------------------------


def mlp(n_in: int, hidden: int, n_out: int, *, dropout: float = 0.0, seed: int = 0,
        dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """A one-hidden-layer ReLU MLP (optionally with a Dropout layer after the ReLU)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(n_in, hidden), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(hidden, n_out))
    return nn.Sequential(*layers).to(dtype)


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
    model.eval()
    with torch.no_grad():
        out = model(x)
        loss = nn.functional.cross_entropy(out, y).item()
        acc = (out.argmax(1) == y).double().mean().item()
    model.train()
    return loss, acc


def train(regime: str, data, *, epochs: int = 5, lr: float = 0.05, hidden: int = 64,
          batch_size: int = 32, copies: int = 16, dither: str | None = None,
          scale: float = 0.0, dropout: float | None = None, seed: int = 0,
          progress: bool = True) -> History:
    """Train an MLP on ``data`` (a :class:`parlearn.datasets.Split`) in one of three regimes.

    * ``"batch"``: minibatch SGD (``batch_size`` examples per update), one noisy copy each;
    * ``"single"``: one example per update, one noisy copy;
    * ``"parallel"``: one example per update, ``copies`` noisy copies averaged.

    Records after every epoch: updates, forward passes (examples pushed through the
    model, copies included), train loss, test loss and accuracy.
    """
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    if epochs < 1 or batch_size < 1 or lr <= 0:
        raise ValueError(f"need epochs >= 1, batch_size >= 1, lr > 0; got {epochs}, "
                         f"{batch_size}, {lr}")
    p = copies if regime == "parallel" else 1
    _check_noise(p, dither, scale, dropout)
    bs = batch_size if regime == "batch" else 1
    model = mlp(data.n_features, hidden, data.n_classes, seed=seed, dtype=data.x_train.dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 1)
    hist = History(regime)
    n = data.x_train.shape[0]
    updates = forwards = 0
    bar = tqdm(total=epochs * math.ceil(n / bs), desc=f"{regime} SGD", disable=not progress,
               leave=False)
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
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
            bar.update()
        test_loss, test_acc = _evaluate(model, data.x_test, data.y_test)
        hist.updates.append(updates)
        hist.forwards.append(forwards)
        hist.train_loss.append(running / n)
        hist.test_loss.append(test_loss)
        hist.test_acc.append(test_acc)
    bar.close()
    return hist


def compare_regimes(data, *, epochs: int, batch_size: int = 16, copies: int = 16,
                    dither: str | None = "gaussian", scale: float = 0.3,
                    dropout: float | None = None, lr: float = 0.05, seed: int = 0,
                    progress: Callable[[float, str], None] | None = None) -> dict[str, History]:
    """The lesson's experiment at equal updates *and* equal forward passes.

    Single-example runs make ``epochs`` passes over the data (``n * epochs`` updates);
    batch runs make ``epochs * batch_size`` passes, so they take as many updates, and
    with ``copies == batch_size`` the parallel run pushes as many examples through
    the model as batch SGD does. Returns ``{name: History}``.
    """
    noisy = {"dither": dither, "scale": scale, "dropout": dropout}
    plan = {
        "batch SGD": dict(regime="batch", epochs=epochs * batch_size, batch_size=batch_size),
        "batch SGD + noise": dict(regime="batch", epochs=epochs * batch_size,
                                  batch_size=batch_size, **noisy),
        "single-example SGD + noise": dict(regime="single", epochs=epochs, **noisy),
        f"parallel noise, P={copies}": dict(regime="parallel", epochs=epochs, copies=copies,
                                           **noisy),
    }
    out = {}
    for i, (name, kw) in enumerate(plan.items()):
        if progress is not None:
            progress(i / len(plan), f"training: {name}")
        out[name] = train(data=data, lr=lr, seed=seed, progress=False, **kw)
    return out


def throughput(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, *,
               copies_list, dither: str | None = "gaussian", scale: float = 0.1,
               dropout: float | None = None, repeat: int = 5, device="cpu") -> dict:
    """Measured time of one P-copy gradient, batched vs looped, for each P in ``copies_list``."""
    def candidates(p):
        noise = draw_noise(x, int(p), dither=dither, scale=scale, dropout=dropout,
                           generator=torch.Generator().manual_seed(0))
        return {"loop": partial(sequential_grad, model, loss_fn, x, y, noise=noise),
                "batched": partial(parallel_grad, model, loss_fn, x, y, copies=int(p),
                                   noise=noise)}

    r = sweep([int(p) for p in copies_list], candidates, repeat=repeat, device=device)
    model.zero_grad(set_to_none=True)
    return {"copies": r["values"], "loop_s": r["median_s"]["loop"],
            "batched_s": r["median_s"]["batched"], "speedup": r["speedup"]["batched"],
            "device": r["device"]}


# --- bench --------------------------------------------------------------------------


def bench(device: torch.device, quick: bool) -> list[Row]:
    from .datasets import digits

    data = digits(device=device)
    model = mlp(data.n_features, 64, data.n_classes).to(device)
    loss_fn = nn.functional.cross_entropy
    rows = []
    copies = 64
    target = ">= 5x" if device.type == "cpu" else ">= 20x"
    need = 5.0 if device.type == "cpu" else 20.0
    for batch in (1, 8) if quick else (1, 4, 32):
        x, y = data.x_train[:batch], data.y_train[:batch]
        noise = draw_noise(x, copies, dither="gaussian", scale=0.1,
                           generator=torch.Generator().manual_seed(0))
        cmp = compare({
            "loop": partial(sequential_grad, model, loss_fn, x, y, noise=noise),
            "batched": partial(parallel_grad, model, loss_fn, x, y, copies=copies, noise=noise),
        }, warmup=2, repeat=5 if quick else 15, device=device)
        ratio = cmp.speedup("batched")
        rows.append(Row(f"dither P={copies} batch={batch}", "loop over copies",
                        "one batched pass", ratio, str(device), target, ratio >= need))
    return rows
