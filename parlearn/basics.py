"""Work, depth and Amdahl's law; the simplest parallelism there is: batching.

A computation's *work* W is the total number of operations; its *depth* D
(critical path) is the longest chain of operations that must run one after
another. With p workers the time is at least ``max(W/p, D)`` (Brent: at most
``W/p + D``). Amdahl's law is the same idea in fractions: if a fraction ``s``
of the serial time cannot be parallelised, the speedup on p workers is

    S(p) = 1 / (s + (1 - s) / p)   ->   1/s as p -> infinity.

On one device the cheapest parallelism is batching: n independent matmuls as one
``torch.bmm`` call instead of a Python loop of n calls.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from .bench import Row
from .timing import compare, sweep

__all__ = [
    "amdahl", "brent_bounds", "looped_matmul", "batched_matmul", "random_batch", "sweep_batching",
]


def amdahl(serial_fraction, workers):
    """Modeled speedup ``1 / (s + (1 - s) / p)``; broadcasts over numpy arrays."""
    s = np.asarray(serial_fraction, dtype=float)
    p = np.asarray(workers, dtype=float)
    if np.any((s < 0) | (s > 1)):
        raise ValueError(f"serial_fraction must lie in [0, 1], got {serial_fraction!r}")
    if np.any(p < 1):
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    return 1.0 / (s + (1.0 - s) / p)


def brent_bounds(work: float, depth: float, workers: int) -> tuple[float, float]:
    """Modeled time bounds on p workers: ``(max(W/p, D), W/p + D)`` in units of one op."""
    if work < depth or depth < 0:
        raise ValueError(f"need work >= depth >= 0, got work={work}, depth={depth}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return max(work / workers, depth), work / workers + depth


def random_batch(n: int, size: int, *, device="cpu", seed: int = 0):
    """Two stacks of ``n`` random ``size x size`` matrices."""
    if n < 1 or size < 1:
        raise ValueError(f"n and size must be >= 1, got n={n}, size={size}")
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, size, size, generator=g)
    b = torch.randn(n, size, size, generator=g)
    return a.to(device), b.to(device)


def looped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Serial reference: one ``a[i] @ b[i]`` call per matrix."""
    return torch.stack([a[i] @ b[i] for i in range(a.shape[0])])


def batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All ``n`` products in one ``torch.bmm`` call."""
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"a and b must be (n, i, k) and (n, k, j); got {a.shape}, {b.shape}")
    return torch.bmm(a, b)


def sweep_batching(counts, size: int, *, device="cpu", repeat: int = 5, seed: int = 0) -> dict:
    """Measure loop vs ``bmm`` for each ``n`` in ``counts`` (interleaved, per ``n``).

    Returns ``{"n", "loop_s", "bmm_s", "speedup", "device", "size"}`` with medians in
    seconds; ``speedup`` is loop time / bmm time, measured.
    """
    counts = [int(n) for n in counts]
    if not counts or min(counts) < 1:
        raise ValueError(f"counts must be positive ints, got {counts!r}")

    def candidates(n):
        a, b = random_batch(n, size, device=device, seed=seed)
        return {"loop": partial(looped_matmul, a, b), "bmm": partial(batched_matmul, a, b)}

    r = sweep(counts, candidates, repeat=repeat, device=device)
    return {"n": counts, "loop_s": r["median_s"]["loop"], "bmm_s": r["median_s"]["bmm"],
            "speedup": r["speedup"]["bmm"], "device": r["device"], "size": size}


def bench(device: torch.device, quick: bool) -> list[Row]:
    rows = []
    for n, size in ((256, 16), (64, 64)) if quick else ((1024, 16), (256, 64), (64, 256)):
        a, b = random_batch(n, size, device=device)
        cmp = compare({"loop": partial(looped_matmul, a, b), "bmm": partial(batched_matmul, a, b)},
                      warmup=2, repeat=5 if quick else 15, device=device)
        rows.append(Row(f"basics n={n} {size}x{size}", "python loop", "torch.bmm",
                        cmp.speedup("bmm"), str(device)))
    return rows
