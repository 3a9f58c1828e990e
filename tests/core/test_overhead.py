import math

import numpy as np
import pytest

from parlearn.core import overhead
from parlearn.core.overhead import BatchingFit, fit_batching

NS = np.array([1, 2, 4, 16, 64, 256])


@pytest.mark.parametrize("t0,c", [(3e-5, 2e-7), (1e-3, 1e-9), (1e-6, 1e-4)])
def test_fit_recovers_known_t0_and_c(t0, c):
    f = fit_batching(NS, t0 + c * NS)
    assert f.t0 == pytest.approx(t0, rel=1e-9) and f.c == pytest.approx(c, rel=1e-9)
    assert f.residual < 1e-9 and f.points == len(NS)
    assert f.knee == pytest.approx(t0 / c, rel=1e-9)


def test_fit_is_relative_least_squares():
    """Noisy points: the fit is numpy's polyfit weighted by 1 / time (when both are >= 0)."""
    rng = np.random.default_rng(0)
    t = (2e-5 + 3e-7 * NS) * np.exp(rng.normal(0, 0.1, len(NS)))
    c, t0 = np.polyfit(NS, t, 1, w=1 / t)
    f = fit_batching(NS.tolist(), t.tolist())
    assert (f.t0, f.c) == pytest.approx((t0, c), rel=1e-9)
    assert f.residual == pytest.approx(np.max(np.abs(t0 + c * NS - t) / t), rel=1e-9)


def test_model_formulas():
    f = BatchingFit(4e-5, 1e-7)
    n = np.array([1.0, 10.0, 1e3])
    np.testing.assert_allclose(f.predict(n), 4e-5 + 1e-7 * n, rtol=1e-15)
    np.testing.assert_allclose(f.throughput(n), n / (4e-5 + 1e-7 * n), rtol=1e-15)
    np.testing.assert_allclose(f.loop(n), n * (4e-5 + 1e-7), rtol=1e-15)
    np.testing.assert_allclose(f.speedup(n), n * (4e-5 + 1e-7) / (4e-5 + 1e-7 * n), rtol=1e-15)
    assert f.speedup(1) == pytest.approx(1)
    assert f.max_speedup() == pytest.approx(1 + 4e-5 / 1e-7)
    assert f.speedup(1e12) == pytest.approx(f.max_speedup(), rel=1e-6)
    # Against a measured loop whose own call costs `one`:
    assert f.speedup(10, one=1e-4) == pytest.approx(10 * 1e-4 / (4e-5 + 1e-6))
    assert f.max_speedup(one=1e-4) == pytest.approx(1e-4 / 1e-7)
    # At the knee the throughput is half its limit 1 / c.
    assert f.throughput(f.knee) == pytest.approx(0.5 / f.c)


def test_negative_parameters_are_never_fitted():
    """Times that fall with n (noise) give c = 0 and t0 alone, never a negative cost."""
    f = fit_batching([1, 2, 4], [1.0e-3, 0.9e-3, 0.95e-3])
    assert f.c == 0 and f.t0 > 0 and math.isinf(f.knee) and math.isinf(f.max_speedup())
    g = fit_batching([1, 2, 4], [1e-6, 2.2e-6, 4.1e-6])  # through (0, <0): t0 = 0
    assert g.t0 == 0 and g.c > 0 and g.speedup(100) == pytest.approx(1)
    assert "batching gains nothing" in g.verdict(4)


def test_verdict_reads_the_fit():
    f = fit_batching(NS, 3e-5 + 2e-7 * NS)  # knee 150
    low, high = f.verdict(16), f.verdict(4096)
    assert "overhead-bound" in low and "past the knee" in high
    assert "per-call overhead amortised, not parallelism" in low
    assert "agrees with the model" in f.verdict(64, measured_speedup=float(f.speedup(64)))
    assert "above that bound" in f.verdict(64, measured_speedup=10 * f.max_speedup())
    assert "below the model" in f.verdict(64, measured_speedup=1.0)
    assert "cannot be judged" in fit_batching([1, 8], [1e-5, 2e-5]).verdict(4)
    noisy = fit_batching([1, 2, 4, 8], [1e-3, 4e-3, 1e-3, 4e-3])
    assert "rough" in noisy.verdict(4)


def test_the_fit_is_what_the_lessons_see():
    """A broken formula fails: the predicted times go back through the measured ones."""
    f = fit_batching(NS, 5e-5 + 1e-6 * NS)
    np.testing.assert_allclose(f.predict(NS), f.seconds, rtol=1e-9)
    assert f.ns == tuple(float(n) for n in NS)


@pytest.mark.parametrize("ns,seconds,arg,err", [
    ([1, True, 4], [1e-3] * 3, "ns", TypeError),
    (np.array([True, False]), [1e-3] * 2, "ns", TypeError),
    ([1, 2, 4], [1e-3, True, 1e-3], "seconds", TypeError),
    ([1, 2, 4], [1e-3, -1e-3, 1e-3], "seconds", ValueError),
    ([1, 2, 4], [1e-3, 0.0, 1e-3], "seconds", ValueError),
    ([1, 2, 4], [1e-3, math.nan, 1e-3], "seconds", ValueError),
    ([1, 0, 4], [1e-3] * 3, "ns", ValueError),
    ([4], [1e-3], "ns", ValueError),           # too few points
    ([4, 4, 4], [1e-3] * 3, "ns", ValueError),  # one distinct size
    ([1, 2, 4], [1e-3, 2e-3], "ns and seconds", ValueError),
    ("124", [1e-3] * 3, "ns", TypeError),
    ([1, 2], "ab", "seconds", TypeError),
    ([[1, 2], [3, 4]], [[1e-3] * 2] * 2, "ns", TypeError),
])
def test_fit_refuses_bad_arguments_naming_them(ns, seconds, arg, err):
    with pytest.raises(err, match=arg):
        fit_batching(ns, seconds)


def test_model_refuses_bad_arguments_naming_them():
    f = BatchingFit(1e-5, 1e-7)
    for bad, err in ((True, TypeError), (0.5, ValueError), (math.nan, ValueError),
                     ([1, True], TypeError), ("3", TypeError)):
        for method in (f.predict, f.throughput, f.loop, f.speedup):
            with pytest.raises(err, match="n"):
                method(bad)
    for bad, err in ((True, TypeError), (0.0, ValueError), (-1.0, ValueError)):
        with pytest.raises(err, match="one"):
            f.speedup(4, one=bad)
        with pytest.raises(err, match="measured_speedup"):
            f.verdict(4, measured_speedup=bad)
    with pytest.raises(TypeError, match="n must be one number"):
        f.verdict([1, 2])
    for kw, arg in ((dict(t0=-1.0, c=1.0), "t0"), (dict(t0=1.0, c=True), "c"),
                    (dict(t0=0.0, c=0.0), "t0 and c"),
                    (dict(t0=1.0, c=1.0, ns=(1, 2), seconds=(1.0,)), "ns and seconds")):
        with pytest.raises((TypeError, ValueError), match=arg):
            BatchingFit(**kw)


def test_short_name():
    import parlearn.overhead

    assert parlearn.overhead is overhead


def test_verdict_says_which_side_left_the_model():
    """A measured speedup off the model names the side that left it: the loop (its calls
    cost more than one call alone) or the batched call (off the straight line)."""
    ns, t0, c = [1, 4, 16, 64], 2e-4, 1e-6
    f = fit_batching(ns, [t0 + c * n for n in ns])
    one = t0 + c
    # The loop of 64 took 1.5 x 64 one-item calls; the batched call sits on its line.
    slow_loop = 1.5 * 64 * one / (t0 + 64 * c)
    text = f.verdict(64, measured_speedup=slow_loop)
    assert "the loop of 64 one-item calls took 1.50x" in text and "fitted line's" not in text
    # The batched call of 64 took twice its line: only a fitted point can say so.
    g = fit_batching([1, 4, 16, 64, 256], [t0 + c * n for n in (1, 4, 16)]
                     + [2 * (t0 + c * 64), t0 + c * 256])
    text = g.verdict(64, measured_speedup=64 * one / (2 * (t0 + c * 64)), one=one)
    assert "the batched call of 64 items took" in text and "the loop of" not in text
    assert "not a fitted point" in f.verdict(32, measured_speedup=1.0)


def test_above_bound_blames_a_loop_that_left_its_model():
    """Above the bound with the loop off its line n * one: the loop is named, not vector units."""
    f = fit_batching(NS, 3e-5 + 2e-7 * NS)
    n = 64.0
    batched = f.seconds[f.ns.index(n)]
    slow_loop = 6 * n * (f.t0 + f.c)  # the loop took 6x the calls the model charges
    text = f.verdict(n, measured_speedup=slow_loop / batched)
    assert "above that bound" in text and "took 6.00x the 64 calls" in text
    assert "vector units" not in text
    # A loop on its line and a batched call far under it: the model leaves something out.
    fast = tuple(s / 10 if k == n else s for k, s in zip(f.ns, f.seconds, strict=True))
    g = BatchingFit(f.t0, f.c, f.ns, fast)
    on_line = g.verdict(n, measured_speedup=n * (g.t0 + g.c) / (batched / 10))
    assert "above that bound" in on_line and "vector units" in on_line


def test_zero_c_says_the_knee_is_beyond_the_sweep():
    f = fit_batching([1, 8, 32, 64], [1.0e-3, 0.9e-3, 0.9e-3, 0.85e-3])
    text = f.verdict(64, measured_speedup=13.4)
    assert f.c == 0 and "no per-item cost found over n = 1 to 64" in text
    assert "beyond the measured range" in text and "inf" not in text
