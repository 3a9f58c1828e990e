"""The demodulation picture: what dither does to a ReLU, in closed form and in a spectrum.

Averaged over dither, a ReLU's transfer curve is smoothed near 0 (:func:`smoothed_relu`),
which weakens the harmonics ("decoy features") it makes from a sinusoid
(:func:`relu_spectrum`). That is an average of *activations*.
:func:`parlearn.many_copies.dither.gradients.parallel_grad` averages *gradients*; the two
agree where the loss is linear in the unit's output (then the averaged gradient is the
slope of the smoothed curve, :func:`smoothed_relu_slope`), and differ otherwise.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from parlearn.core.checks import check_choice, check_float, check_int, check_seed
from parlearn.many_copies.dither.noise import NOISES, _check_noise, _sample, noise_half_width

__all__ = ["smoothed_relu", "smoothed_relu_slope", "relu_spectrum"]

# --- the demodulation picture ---------------------------------------------------------


def _check_curve_args(x, scale, noise) -> tuple[np.ndarray, float]:
    check_choice("noise", noise, NOISES)
    scale = check_float("scale", scale, lo=0.0, lo_open=True)
    if isinstance(x, str | bytes):
        raise TypeError(f"x must be a number or an array of numbers, got {x!r}")
    try:
        x = np.asarray(x, dtype=float)
    except (TypeError, ValueError) as err:
        raise TypeError(f"x must be a number or an array of numbers, got "
                        f"{type(x).__name__}") from err
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
    samples = check_int("samples", samples, lo=8)
    if samples < 8 * cycles:
        raise ValueError(f"samples must be >= 8 * cycles = {8 * cycles} (cycles={cycles}), got "
                         f"{samples}")
    if noise is not None:
        check_choice("noise", noise, NOISES)
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
