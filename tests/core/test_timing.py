import pytest

from parlearn.core import timing


def test_measure_counts_calls_and_repeats():
    calls = []
    t = timing.measure(lambda: calls.append(1), warmup=2, repeat=4, device="cpu")
    assert len(calls) == 6 and t.repeats == 4
    assert t.min <= t.median <= t.max and t.device == "cpu"
    assert "measured on cpu" in str(t)


def test_compare_interleaves_and_ratio():
    order = []
    cmp = timing.compare({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                         warmup=0, repeat=3)
    assert order == ["a", "b"] * 3
    assert cmp.baseline == "a"
    ta, tb = cmp.timings["a"].times, cmp.timings["b"].times
    ratios = sorted(a / b for a, b in zip(ta, tb, strict=True))
    assert cmp.speedup("b") == pytest.approx(ratios[1])      # median of the 3 paired ratios
    lo, hi = cmp.speedup_range("b")
    assert lo <= cmp.speedup("b") <= hi
    assert cmp.speedup("a") == pytest.approx(1.0)


def test_compare_slow_vs_fast_is_ordered():
    def slow():
        sum(range(200_000))

    def fast():
        sum(range(2_000))

    cmp = timing.compare({"slow": slow, "fast": fast}, warmup=1, repeat=5)
    assert cmp.speedup("fast") > 1.0


@pytest.mark.parametrize("kw,match", [({"warmup": -1}, "warmup"), ({"repeat": 0}, "repeat"),
                                      ({"baseline": "zz"}, "baseline")])
def test_compare_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        timing.compare({"a": lambda: None}, **kw)


def test_compare_rejects_non_callable():
    with pytest.raises(TypeError, match="candidates"):
        timing.compare({"a": 3})


def test_sweep_records_each_value():
    calls = []
    r = timing.sweep([1, 2, 3], lambda v: {"a": lambda: calls.append(("a", v)),
                                           "b": lambda: calls.append(("b", v))},
                     warmup=0, repeat=2)
    assert r["values"] == [1, 2, 3] and len(r["median_s"]["a"]) == 3
    assert r["speedup"]["a"] == [1.0, 1.0, 1.0]
    assert calls[:4] == [("a", 1), ("b", 1), ("a", 1), ("b", 1)]


def test_spread_and_reliability_flag():
    steady = timing.Timing((1.0, 1.0, 1.01, 1.0, 0.99), "cpu", 1)
    noisy = timing.Timing((1.0, 3.0, 0.5, 2.0, 1.0), "cpu", 1)
    assert steady.spread < 0.05 and steady.reliable and "WARNING" not in str(steady)
    assert noisy.spread > timing.SPREAD_LIMIT and not noisy.reliable
    assert timing.UNRELIABLE in str(noisy) and "1 thread" in str(noisy)


def test_ratio_spread_comes_from_interleaved_pairs():
    a = timing.Timing((2.0, 4.0, 2.0, 4.0, 2.0), "cpu", 1)
    b = timing.Timing((1.0, 1.0, 1.0, 1.0, 1.0), "cpu", 1)
    cmp = timing.Comparison({"a": a, "b": b}, "a", "cpu")
    assert cmp.ratios("b") == [2.0, 4.0, 2.0, 4.0, 2.0]
    lo, hi = cmp.speedup_range("b")
    assert lo == pytest.approx(2.0) and hi == pytest.approx(4.0)
    assert not cmp.reliable and "IQR" in str(cmp)


def test_threads_are_pinned_then_restored():
    import torch

    before = torch.get_num_threads()
    seen = []
    t = timing.measure(lambda: seen.append(torch.get_num_threads()), warmup=0, repeat=2,
                       threads=1)
    assert seen == [1, 1] and t.threads == 1
    assert torch.get_num_threads() == before


def test_threads_restored_after_error():
    import torch

    from parlearn.core import device

    before = torch.get_num_threads()
    with pytest.raises(ZeroDivisionError), device.threads(1):
        raise ZeroDivisionError
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"):
        with device.threads(0):
            pass
