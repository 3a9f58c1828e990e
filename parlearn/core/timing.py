"""Honest wall-clock timing: warm-up, repeats, median and spread, threads, device sync.

Everything in parlearn that reports a time goes through here. :func:`compare`
times several candidates *interleaved* (a, b, a, b, ...) so that noise from the
rest of the machine hits all of them alike, and reports the median of the per-repeat
ratios together with their interquartile range.

Every result says how far to trust it: ``spread`` is the interquartile range of the
repeats over their median, and when it exceeds :data:`SPREAD_LIMIT` the result is
marked unreliable and its text says so (the usual cause: another program using the
cores; the spread alone cannot tell which). Each
timing also records the torch intra-op thread count it ran with; see
:data:`parlearn.device.THREAD_POLICY` and :func:`parlearn.device.threads`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from parlearn.core.checks import check_callable, check_device, check_int
from parlearn.core.device import sync
from parlearn.core.device import threads as _threads

__all__ = ["Timing", "Comparison", "measure", "compare", "sweep", "SPREAD_LIMIT",
           "UNRELIABLE"]

# Interquartile range / median above which a figure is flagged as unreadable.
SPREAD_LIMIT = 0.25
UNRELIABLE = ("repeats too spread to read (likely another program on the cores); this "
              "figure is not reliable")


def _quartiles(xs) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one function, measured on ``device``."""

    times: tuple[float, ...]
    device: str
    threads: int = field(default_factory=torch.get_num_threads)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        """Interquartile range of the repeats divided by their median (0 = perfectly steady)."""
        lo, hi = _quartiles(sorted(self.times))
        return (hi - lo) / self.median if self.median > 0 else 0.0

    @property
    def reliable(self) -> bool:
        """False when the spread exceeds :data:`SPREAD_LIMIT`."""
        return self.spread <= SPREAD_LIMIT

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
        text = (
            f"{self.median * 1e3:.3g} ms median (min {self.min * 1e3:.3g}, max "
            f"{self.max * 1e3:.3g}, spread {self.spread:.0%}, {self.repeats} repeats, "
            f"{self.threads} thread(s), measured on {self.device})"
        )
        return text if self.reliable else f"{text}; WARNING: {UNRELIABLE}"


@dataclass(frozen=True)
class Comparison:
    """Timings of several candidates measured side by side in one run."""

    timings: dict[str, Timing]
    baseline: str
    device: str = field(default="cpu")

    def speedup(self, name: str, over: str | None = None) -> float:
        """Median of the per-repeat ratios ``over[i] / name[i]`` (default ``over``: the baseline).

        Each ratio pairs two runs taken back to back, so noise from the rest of the machine
        largely cancels in it; and the headline always lies inside :meth:`speedup_range`
        (a ratio of medians need not: seen 41.5x beside an IQR of 27-41x).
        """
        return statistics.median(self.ratios(name, over))

    def ratios(self, name: str, over: str | None = None) -> list[float]:
        """Per-repeat ratios ``over[i] / name[i]`` of the interleaved pairs."""
        ref = self.timings[over or self.baseline].times
        return [a / b for a, b in zip(ref, self.timings[name].times, strict=True)]

    def speedup_range(self, name: str, over: str | None = None) -> tuple[float, float]:
        """Interquartile range of the per-repeat ratios: the spread of :meth:`speedup`."""
        return _quartiles(sorted(self.ratios(name, over)))

    @property
    def threads(self) -> int:
        return next(iter(self.timings.values())).threads

    @property
    def reliable(self) -> bool:
        """False when any candidate's spread exceeds :data:`SPREAD_LIMIT`."""
        return all(t.reliable for t in self.timings.values())

    def __str__(self) -> str:
        lines = [f"measured on {self.device}, {self.threads} thread(s), interleaved repeats:"]
        for name, t in self.timings.items():
            if name == self.baseline:
                tag = "baseline"
            else:
                lo, hi = self.speedup_range(name)
                tag = f"{self.speedup(name):.2f}x (IQR {lo:.2f}-{hi:.2f})"
            lines.append(f"  {name:<24} {t.median * 1e3:10.3f} ms  spread {t.spread:4.0%}  {tag}")
        if not self.reliable:
            lines.append(f"  WARNING: {UNRELIABLE}")
        return "\n".join(lines)


def _check_counts(warmup: int, repeat: int, device, threads) -> None:
    check_int("warmup", warmup, lo=0)
    check_int("repeat", repeat, lo=1)
    check_device("device", device)
    if threads is not None:
        check_int("threads", threads, lo=1)


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
    threads: int | None = None,
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeat`` timed ones.

    On CUDA/MPS the device is synchronised before and after every timed call,
    so queued kernels are counted. ``threads=n`` runs with ``n`` intra-op threads
    and restores the caller's count; ``None`` uses the caller's count as it is.
    """
    check_callable("fn", fn)
    return compare({"fn": fn}, warmup=warmup, repeat=repeat, device=device,
                   threads=threads).timings["fn"]


def compare(
    candidates: Mapping[str, Callable[[], object]],
    *,
    baseline: str | None = None,
    warmup: int = 1,
    repeat: int = 5,
    device: str | torch.device = "cpu",
    threads: int | None = None,
) -> Comparison:
    """Time every candidate in one interleaved run and return a :class:`Comparison`.

    ``candidates`` maps a name to a zero-argument callable; ``baseline`` (default:
    the first) is what :meth:`Comparison.speedup` divides by. ``threads=n`` pins
    ``n`` torch intra-op threads for the run and restores the caller's count.
    """
    if not candidates:
        raise ValueError("candidates must name at least one function")
    for name, fn in candidates.items():
        if not callable(fn):
            raise TypeError(f"candidates[{name!r}] must be callable, got {type(fn).__name__}")
    baseline = next(iter(candidates)) if baseline is None else baseline
    if baseline not in candidates:
        raise ValueError(f"baseline={baseline!r} is not one of {list(candidates)}")
    _check_counts(warmup, repeat, device, threads)
    dev = torch.device(device)
    if threads is not None:
        with _threads(threads):
            return compare(candidates, baseline=baseline, warmup=warmup, repeat=repeat,
                           device=device)
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeat):
        for name, fn in candidates.items():
            times[name].append(_timed_call(fn, dev))
    n_threads = torch.get_num_threads()
    timings = {name: Timing(tuple(ts), str(dev), n_threads) for name, ts in times.items()}
    return Comparison(timings, baseline, str(dev))


def sweep(
    values: Iterable[Any],
    candidates: Callable[[Any], Mapping[str, Callable[[], object]]],
    *,
    warmup: int = 1,
    repeat: int = 5,
    device: str | torch.device = "cpu",
    threads: int | None = None,
) -> dict:
    """:func:`compare` the candidates ``candidates(value)`` builds, for each value.

    Returns ``{"values", "device", "threads", "reliable", "median_s": {name: [...]},
    "spread": {name: [...]}, "speedup": {name: [...]}, "speedup_lo": {...},
    "speedup_hi": {...}}``; speedups are over the first candidate, measured per value,
    with the interquartile range of the per-repeat ratios in ``speedup_lo``/``_hi``.
    ``reliable`` is False if any comparison's spread exceeded :data:`SPREAD_LIMIT`.
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"values must be an iterable of values, got {values!r}")
    values = list(values)
    if not values:
        raise ValueError("values must hold at least one value")
    check_callable("candidates", candidates)
    _check_counts(warmup, repeat, device, threads)
    out: dict = {"values": [], "device": str(torch.device(device)), "threads": None,
                 "reliable": True, "median_s": {}, "spread": {}, "speedup": {},
                 "speedup_lo": {}, "speedup_hi": {}}
    for value in values:
        cmp = compare(candidates(value), warmup=warmup, repeat=repeat, device=device,
                      threads=threads)
        out["values"].append(value)
        out["threads"] = cmp.threads
        out["reliable"] = out["reliable"] and cmp.reliable
        for name, t in cmp.timings.items():
            lo, hi = cmp.speedup_range(name)
            out["median_s"].setdefault(name, []).append(t.median)
            out["spread"].setdefault(name, []).append(t.spread)
            out["speedup"].setdefault(name, []).append(cmp.speedup(name))
            out["speedup_lo"].setdefault(name, []).append(lo)
            out["speedup_hi"].setdefault(name, []).append(hi)
    return out
