"""One model of batched work: a call costs a fixed overhead plus a cost per item.

Part 3 and Part 4 batch many small things into one call: P noisy copies of a gradient,
B genotypes in one ``vmap``, R replicas in one program, B episodes in one backward sweep,
N particles in one decoder pass. Every one of them is read with the same model,

    t(n) = t0 + c n,

``t0`` what one call costs whatever it carries (Python, op launch, dispatch, loop set-up),
``c`` what each item adds. A loop of ``n`` one-item calls costs ``n (t0 + c)``, so

    speedup(n) = n (t0 + c) / (t0 + c n)  ->  1 + t0 / c,    throughput n / t(n)  ->  1 / c.

The gain is ``t0`` paid once instead of ``n`` times: per-call overhead amortised, not
parallelism. At the knee ``n = t0 / c`` the items' own work equals the overhead and the
throughput is half its limit ``1 / c``; below it extra items are nearly free.

:func:`fit_batching` fits ``t0`` and ``c`` to measured times; the :class:`BatchingFit` it
returns predicts (modeled), compares with a loop and says in words what the fit shows.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from parlearn.core.checks import check_float
from parlearn.core.timing import SPREAD_LIMIT

__all__ = ["BatchingFit", "fit_batching"]


def _series(name: str, value, *, positive: bool = True) -> np.ndarray:
    """``value`` as a 1-D float array of finite numbers (> 0 when ``positive``); bools refused."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        raise TypeError(f"{name} must be a sequence of real numbers, got {value!r}")
    items = value.tolist() if isinstance(value, np.ndarray) else list(value)
    if np.asarray(value).dtype == bool or not all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) for v in items):
        raise TypeError(f"{name} must hold real numbers (not bools), got {value!r}")
    arr = np.asarray(items, dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and np.any(arr <= 0):
        raise ValueError(f"{name} must all be > 0, got {value!r}")
    return arr


def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def _items(name: str, n) -> np.ndarray | float:
    """``n`` (a number or an array) as floats >= 1: the model is a smooth curve in n."""
    if isinstance(n, numbers.Real) and not isinstance(n, bool):
        return check_float(name, n, lo=1)
    arr = _series(name, n)
    if np.any(arr < 1):
        raise ValueError(f"{name} must be >= 1, got {n!r}")
    return arr


@dataclass(frozen=True)
class BatchingFit:
    """``t(n) = t0 + c n``: seconds of one call carrying ``n`` items (modeled).

    ``t0``: seconds per call, ``c``: seconds per item, both ``>= 0`` and not both 0;
    ``ns``/``seconds``: the measured points the fit came from (empty for a model written
    down by hand). Built by :func:`fit_batching`, or directly from known ``t0`` and ``c``.
    """

    t0: float
    c: float
    ns: tuple[float, ...] = ()
    seconds: tuple[float, ...] = ()

    def __post_init__(self):
        check_float("t0", self.t0, lo=0)
        check_float("c", self.c, lo=0)
        if self.t0 == self.c == 0:
            raise ValueError("t0 and c cannot both be 0: a call would cost nothing")
        ns = _series("ns", self.ns) if len(self.ns) else np.zeros(0)
        sec = _series("seconds", self.seconds) if len(self.seconds) else np.zeros(0)
        if len(ns) != len(sec):
            raise ValueError(f"ns and seconds must have the same length, got {len(ns)} and "
                             f"{len(sec)}")
        object.__setattr__(self, "ns", tuple(ns.tolist()))
        object.__setattr__(self, "seconds", tuple(sec.tolist()))

    @property
    def points(self) -> int:
        """How many measured points the fit came from."""
        return len(self.ns)

    @property
    def residual(self) -> float:
        """The model's worst miss, ``max |t(n) - measured| / measured`` over the points
        (NaN without points; 0 by construction with two)."""
        if not self.ns:
            return math.nan
        t = np.asarray(self.seconds)
        return float(np.max(np.abs(self.t0 + self.c * np.asarray(self.ns) - t) / t))

    @property
    def knee(self) -> float:
        """``t0 / c``: the items' work equals the overhead; half the limiting throughput."""
        return math.inf if self.c == 0 else self.t0 / self.c

    def predict(self, n):
        """Modeled seconds of one call of ``n`` items, ``t0 + c n`` (``n`` may be an array)."""
        return self.t0 + self.c * _items("n", n)

    def throughput(self, n):
        """Modeled items per second of one call of ``n`` items, ``n / (t0 + c n)``."""
        n = _items("n", n)
        return n / (self.t0 + self.c * n)

    def loop(self, n, one: float | None = None):
        """Modeled seconds of a loop of ``n`` one-item calls, ``n * one``; ``one`` is the
        seconds of one call of that loop (a measured loop's own), default ``t0 + c``."""
        return _items("n", n) * self._one(one)

    def speedup(self, n, one: float | None = None):
        """Modeled ``loop(n, one) / predict(n)``; with the default ``one`` it is
        ``n (t0 + c) / (t0 + c n)``, which never exceeds :meth:`max_speedup`."""
        n = _items("n", n)
        return n * self._one(one) / (self.t0 + self.c * n)

    def max_speedup(self, one: float | None = None) -> float:
        """The limit of :meth:`speedup` as ``n`` grows: ``one / c`` (``1 + t0 / c`` by
        default); infinite when ``c = 0``."""
        one = self._one(one)
        return math.inf if self.c == 0 else one / self.c

    def _one(self, one) -> float:
        return self.t0 + self.c if one is None else check_float("one", one, lo=0, lo_open=True)

    def verdict(self, n, measured_speedup: float | None = None, one: float | None = None) -> str:
        """What the fit says at ``n`` items, in words: overhead- or work-bound, the modeled
        speedup over a loop and its bound, and (given one) how a measured speedup compares.

        A measured speedup above the bound by more than :data:`~parlearn.core.timing.SPREAD_LIMIT`
        is blamed on the loop when ``n`` is a fitted point and the measured loop is off its
        model line ``n * one``; otherwise on something the model leaves out (each item also
        costs less inside the batch).
        """
        n = _items("n", n)
        if not isinstance(n, float):
            raise TypeError(f"n must be one number for a verdict, got {n!r}")
        if measured_speedup is not None:
            measured_speedup = check_float("measured_speedup", measured_speedup, lo=0,
                                           lo_open=True)
        model, bound = float(self.speedup(n, one)), self.max_speedup(one)
        out = [f"t(n) = t0 + c n with t0 = {_duration(self.t0)} per call and "
               f"c = {_duration(self.c)} per item (modeled)"]
        if self.points == 2:
            out[0] += "; fitted through 2 points, so the fit cannot be judged"
        elif self.points:
            out[0] += (f"; worst miss {self.residual:.0%} of a measured time over "
                       f"{self.points} points")
            if self.residual > SPREAD_LIMIT:
                out.append("the straight line misses these times badly: read what follows as rough")
        share = self.t0 / (self.t0 + self.c * n)
        if self.c == 0:
            span = (f" over n = {min(self.ns):.4g} to {max(self.ns):.4g}" if self.points else "")
            out.append(f"no per-item cost found{span} (c = 0): the time did not grow with n, so "
                       "the knee t0/c lies beyond the measured range and the model cannot say "
                       "where it is")
        elif self.t0 == 0:
            out.append("no per-call overhead: one call of n items costs what n calls cost, so "
                       "batching gains nothing in this model")
        elif share >= 0.5:
            out.append(f"at n = {n:.4g} the overhead t0 is {share:.0%} of a call: overhead-bound, "
                       f"extra items nearly free up to the knee n = t0/c = {self.knee:.3g}")
        else:
            out.append(f"at n = {n:.4g} the items' own work is {1 - share:.0%} of a call: past "
                       f"the knee n = t0/c = {self.knee:.3g}, more items cost nearly "
                       "proportionally more")
        if self.t0 > 0:
            limit = f"at most {bound:.3g}x" if self.c else "no bound found in the measured range"
            out.append(f"modeled speedup over a loop of one-item calls {model:.3g}x, {limit} "
                       "for any n: per-call overhead amortised, not parallelism")
        if measured_speedup is not None:
            m = measured_speedup
            if m > bound * (1 + SPREAD_LIMIT):
                out.append(f"measured {m:.3g}x is above that bound")
                loop_off = n in self.ns and abs(self._loop_ratio(n, m, one) - 1) > SPREAD_LIMIT
                if loop_off:
                    out.extend(self._why_off(n, m, one))
                else:
                    out.append("inside the batch each item also costs less than in a call of "
                               "its own (vector units, threads), which this model leaves out")
            elif abs(m / model - 1) <= SPREAD_LIMIT:
                out.append(f"measured {m:.3g}x agrees with the model's {model:.3g}x "
                           f"(within {SPREAD_LIMIT:.0%})")
            else:
                out.append(f"measured {m:.3g}x is {'above' if m > model else 'below'} the "
                           f"model's {model:.3g}x by more than {SPREAD_LIMIT:.0%}")
                out.extend(self._why_off(n, m, one))
        return "; ".join(out) + "."

    def _loop_ratio(self, n: float, measured_speedup: float, one) -> float:
        """The measured loop at a fitted ``n`` (speedup times the batched time there) over
        the ``n * one`` the model charges."""
        batched = self.seconds[self.ns.index(n)]
        return measured_speedup * batched / (n * self._one(one))

    def _why_off(self, n: float, measured_speedup: float, one) -> list[str]:
        """Which side of the measured ratio left the model, when ``n`` is a fitted point.

        The measured speedup is (loop at ``n``) / (batched at ``n``). The batched time at
        ``n`` is one of the fitted points, so the loop's measured time is the speedup times
        it; each is set against what the model charges (``n * one`` and ``t0 + c n``).
        """
        if n not in self.ns:
            return ["n is not a fitted point, so the model cannot say whether the loop or the "
                    "batched call left it"]
        batched = self.seconds[self.ns.index(n)]
        loop_ratio = self._loop_ratio(n, measured_speedup, one)
        fit_ratio = batched / float(self.predict(n))
        why = []
        if abs(loop_ratio - 1) > SPREAD_LIMIT:
            why.append(f"the loop of {n:.4g} one-item calls took {loop_ratio:.2f}x the {n:.4g} "
                       "calls the model charges (each of its calls did not cost what one call "
                       "alone costs)")
        if abs(fit_ratio - 1) > SPREAD_LIMIT:
            why.append(f"the batched call of {n:.4g} items took {fit_ratio:.2f}x the fitted "
                       "line's t0 + c n (the straight line does not hold at this n)")
        if not why:
            why.append(f"the loop and the batched call each sit within {SPREAD_LIMIT:.0%} of "
                       "the model: their misses add up")
        return why


def fit_batching(ns, seconds) -> BatchingFit:
    """Fit ``t(n) = t0 + c n`` to measured ``seconds`` of calls carrying ``ns`` items.

    Least squares on relative errors (each point weighted by 1 / its time, as
    ``numpy.polyfit(ns, seconds, 1, w=1 / seconds)``, so a 10 us call counts as much as a
    10 ms one), with ``t0, c >= 0``: a negative cost has no meaning, so when the free fit
    gives one the other is fitted alone (``c = 0``: the time did not grow over the range).
    Needs at least two distinct ``ns`` (with exactly two the line passes through both).
    """
    n = _series("ns", ns)
    t = _series("seconds", seconds)
    if len(n) != len(t):
        raise ValueError(f"ns and seconds must have the same length, got {len(n)} and {len(t)}")
    if len(np.unique(n)) < 2:
        raise ValueError(f"ns must hold at least two distinct sizes to fit t0 and c, got {ns!r}")
    a = np.column_stack([np.ones_like(n), n]) / t[:, None]
    coef, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if np.any(coef < 0):
        # One column alone: its least-squares coefficient is a.b / a.a, which is > 0 here.
        alone = [np.zeros(2) for _ in range(2)]
        for j in (0, 1):
            alone[j][j] = a[:, j].sum() / (a[:, j] @ a[:, j])
        coef = min(alone, key=lambda k: float(np.sum((a @ k - 1) ** 2)))
    return BatchingFit(float(coef[0]), float(coef[1]), tuple(n.tolist()), tuple(t.tolist()))
