"""The noise of parallel dither: P independent draws of dither and dropout for one batch.

*Dither* is additive zero-mean input noise (uniform, Gaussian or triangular); ``scale`` is
its **standard deviation** for every kind. *Dropout* then zeroes input features with
probability p and rescales the rest by 1/(1-p), so a dropped feature is exactly zero,
dither included: ``x_copy = (x + dither) * mask``. :func:`draw_noise` draws it for P copies
at once, from a CPU generator, so a seed gives the same noise on every device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parlearn.core.checks import check_choice, check_float, check_int, check_tensor

__all__ = ["NOISES", "Noise", "noise_half_width", "draw_noise"]

NOISES = ("uniform", "gaussian", "triangular")

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
