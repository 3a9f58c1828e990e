"""Small seeded models the lessons and benches share.

:func:`mlp` draws its weights from its own ``seed``, never from the caller's global RNG, so
two calls with one seed give the same network on every rank: what data-parallel replicas
and their single-process reference need.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from parlearn.core.checks import check_int, check_ints

__all__ = ["mlp", "mlp_param_bytes"]


def _check_widths(widths) -> list[int]:
    return check_ints("widths", widths, lo=1, min_len=2)


def mlp(widths: Sequence[int], *, seed: int = 0, dtype: torch.dtype = torch.float32
        ) -> nn.Sequential:
    """``Linear -> ReLU -> ... -> Linear`` with the given widths, initialised from ``seed``."""
    widths = _check_widths(widths)
    seed = check_int("seed", seed, lo=0)
    gen = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        # skip_init: nn.Linear's own init would draw from the caller's global RNG.
        lin = nn.utils.skip_init(nn.Linear, a, b, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(b, a, generator=gen, dtype=dtype) * (2 / a) ** 0.5)
            lin.bias.zero_()
        layers += [lin] if i == len(widths) - 2 else [lin, nn.ReLU()]
    return nn.Sequential(*layers)


def mlp_param_bytes(widths: Sequence[int], element_size: int = 4) -> list[int]:
    """Gradient sizes in bytes of :func:`mlp` ``(widths)``, in registration order."""
    widths = _check_widths(widths)
    element_size = check_int("element_size", element_size, lo=1)
    out = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        out += [a * b * element_size, b * element_size]
    return out
