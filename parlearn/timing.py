"""Honest wall-clock timing: warm-up, repeats, median/min/max, device sync.

Everything in parlearn that reports a time goes through here. :func:`compare`
times several candidates *interleaved* (a, b, a, b, ...) so that noise from the
rest of the machine hits all of them alike, and reports ratios of medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .device import sync

__all__ = ["Timing", "Comparison", "measure", "compare", "sweep"]


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one function, measured on ``device``."""

    times: tuple[float, ...]
    device: str

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def max(self) -> float:
        return max(self.times)

    @property
    def repeats(self) -> int:
        return len(self.times)

    def __str__(self) -> str:
        return (
            f"{self.median * 1e3:.3g} ms median (min {self.min * 1e3:.3g}, max "
            f"{self.max * 1e3:.3g}, {self.repeats} repeats, measured on {self.device})"
        )


@dataclass(frozen=True)
class Comparison:
    """Timings of several candidates measured side by side in one run."""

    timings: dict[str, Timing]
    baseline: str
    device: str = field(default="cpu")

    def speedup(self, name: str, over: str | None = None) -> float:
        """Median time of ``over`` (default: the baseline) divided by that of ``name``."""
        ref = self.timings[over or self.baseline]
        return ref.median / self.timings[name].median

    def __str__(self) -> str:
        lines = [f"measured on {self.device}, interleaved repeats:"]
        for name, t in self.timings.items():
            tag = "baseline" if name == self.baseline else f"{self.speedup(name):.2f}x"
            lines.append(f"  {name:<24} {t.median * 1e3:10.3f} ms   {tag}")
        return "\n".join(lines)


def _check_counts(warmup: int, repeat: int) -> None:
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be an int >= 1, got {repeat!r}")


def _timed_call(fn: Callable[[], object], dev: torch.device) -> float:
    sync(dev)
    start = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - start


def measure(
    fn: Callable[[], object],
    *,
    warmup: int = 1,
    repeat: int = 5,
    device: str | torch.device = "cpu",
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeat`` timed ones.

    On CUDA/MPS the device is synchronised before and after every timed call,
    so queued kernels are counted.
    """
    return compare({"fn": fn}, warmup=warmup, repeat=repeat, device=device).timings["fn"]


def compare(
    candidates: Mapping[str, Callable[[], object]],
    *,
    baseline: str | None = None,
    warmup: int = 1,
    repeat: int = 5,
    device: str | torch.device = "cpu",
) -> Comparison:
    """Time every candidate in one interleaved run and return a :class:`Comparison`.

    ``candidates`` maps a name to a zero-argument callable; ``baseline`` (default:
    the first) is what :meth:`Comparison.speedup` divides by.
    """
    if not candidates:
        raise ValueError("candidates must name at least one function")
    for name, fn in candidates.items():
        if not callable(fn):
            raise TypeError(f"candidates[{name!r}] must be callable, got {type(fn).__name__}")
    baseline = next(iter(candidates)) if baseline is None else baseline
    if baseline not in candidates:
        raise ValueError(f"baseline={baseline!r} is not one of {list(candidates)}")
    _check_counts(warmup, repeat)
    dev = torch.device(device)
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeat):
        for name, fn in candidates.items():
            times[name].append(_timed_call(fn, dev))
    timings = {name: Timing(tuple(ts), str(dev)) for name, ts in times.items()}
    return Comparison(timings, baseline, str(dev))


def sweep(
    values: Iterable[Any],
    candidates: Callable[[Any], Mapping[str, Callable[[], object]]],
    *,
    warmup: int = 1,
    repeat: int = 5,
    device: str | torch.device = "cpu",
) -> dict:
    """:func:`compare` the candidates ``candidates(value)`` builds, for each value.

    Returns ``{"values", "device", "median_s": {name: [...]}, "speedup": {name: [...]}}``;
    speedups are over the first candidate, measured per value.
    """
    out: dict = {"values": [], "device": str(torch.device(device)), "median_s": {},
                 "speedup": {}}
    for value in values:
        cmp = compare(candidates(value), warmup=warmup, repeat=repeat, device=device)
        out["values"].append(value)
        for name, t in cmp.timings.items():
            out["median_s"].setdefault(name, []).append(t.median)
            out["speedup"].setdefault(name, []).append(cmp.speedup(name))
    return out
