import math

import numpy as np
import pytest
import torch

from parlearn.core import basics, device


def test_batched_equals_looped_float64(any_device):
    a, b = basics.random_batch(7, 5, device=any_device)
    a, b = a.double(), b.double()
    torch.testing.assert_close(basics.batched_matmul(a, b), basics.looped_matmul(a, b),
                               rtol=0, atol=1e-12)


def test_batched_equals_looped_rectangular():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, 2, 3, generator=g), torch.randn(4, 3, 5, generator=g)
    torch.testing.assert_close(basics.batched_matmul(a, b), basics.looped_matmul(a, b))
    assert basics.looped_matmul(a, b).shape == (4, 2, 5)


def test_random_batch_seeded_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a1, b1 = basics.random_batch(3, 4, seed=7)
    a2, b2 = basics.random_batch(3, 4, seed=torch.Generator().manual_seed(7))
    a3, _ = basics.random_batch(3, 4, seed=8)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a1, a2) and torch.equal(b1, b2) and not torch.equal(a1, a3)
    assert not torch.equal(a1, b1)


def test_amdahl_limits():
    assert basics.amdahl(0.0, 8) == pytest.approx(8.0)
    assert basics.amdahl(1.0, 8) == pytest.approx(1.0)
    s = basics.amdahl(0.1, np.array([1, 10, 1e9]))
    assert s[0] == pytest.approx(1) and s[-1] == pytest.approx(10, rel=1e-6)
    assert basics.amdahl(0.25, 3) == pytest.approx(2.0)


def test_brent_bounds():
    lo, hi = basics.brent_bounds(100, 10, 4)
    assert lo == 25 and hi == 35
    lo, hi = basics.brent_bounds(100, 40, 4)  # span-bound: more workers do not help
    assert lo == 40 and hi == 65


def test_batching_model_formula():
    m = basics.batching_model(np.array([1, 10]), 4, alpha=2e-6, beta=1e-9)
    w = 1e-9 * 64
    np.testing.assert_allclose(m["loop_s"], [2e-6 + w, 10 * (2e-6 + w)])
    np.testing.assert_allclose(m["bmm_s"], [2e-6 + w, 2e-6 + 10 * w])
    assert m["speedup"][0] == pytest.approx(1)
    big = basics.batching_model(1e9, 4, alpha=2e-6, beta=1e-9)["speedup"]
    assert big == pytest.approx(1 + 2e-6 / w, rel=1e-6)


@pytest.mark.parametrize("alpha,beta", [(3e-6, 2e-10), (5e-6, 0.0), (0.0, 1e-9)])
def test_fit_recovers_the_model(alpha, beta):
    n = np.array([1, 4, 16, 64, 256])
    m = basics.batching_model(n, 16, alpha=alpha, beta=beta)
    fit = basics.fit_batching_model({"n": n.tolist(), "loop_s": m["loop_s"].tolist(),
                                     "bmm_s": m["bmm_s"].tolist(), "size": 16})
    assert fit["alpha"] == pytest.approx(alpha, rel=1e-6, abs=1e-15)
    assert fit["beta"] == pytest.approx(beta, rel=1e-6, abs=1e-18)
    assert fit["alpha"] >= 0 and fit["beta"] >= 0


def test_fit_never_negative():
    # bmm slower than the loop at n = 1 pulls an unconstrained alpha below zero.
    r = {"n": [1, 2, 4, 8], "loop_s": [1e-6, 2e-6, 4e-6, 8e-6],
         "bmm_s": [5e-6, 2.5e-6, 4.5e-6, 8.5e-6], "size": 8}
    fit = basics.fit_batching_model(r)
    assert fit["alpha"] >= 0 and fit["beta"] >= 0
    assert fit["alpha"] + fit["beta"] > 0


def test_sweep_batching_result_and_threads():
    with device.threads(3):
        r = basics.sweep_batching([1, 4], 4, repeat=2, threads=1)
        assert torch.get_num_threads() == 3
    assert r["n"] == [1, 4] and r["threads"] == 1 and r["size"] == 4
    for key in ("loop_s", "bmm_s", "speedup", "speedup_lo", "speedup_hi"):
        assert len(r[key]) == 2 and all(v > 0 for v in r[key])
    assert isinstance(r["reliable"], bool)


_A, _B = torch.zeros(2, 3, 4), torch.zeros(2, 4, 2)
BAD_CALLS = {
    "amdahl s>1": (lambda: basics.amdahl(1.5, 2), ValueError, "serial_fraction"),
    "amdahl s nan": (lambda: basics.amdahl(math.nan, 2), ValueError, "serial_fraction"),
    "amdahl s bool": (lambda: basics.amdahl(True, 2), TypeError, "serial_fraction"),
    # np.asarray([True, 2.5]) is [1.0, 2.5]: a bool inside a list once passed as 1 worker
    "amdahl p bool in list": (lambda: basics.amdahl(0.5, [True, 2.5]), TypeError, "workers"),
    "gustafson p bool in tuple": (lambda: basics.gustafson(0.5, (4, True)), TypeError,
                                  "workers"),
    "amdahl p=0": (lambda: basics.amdahl(0.5, 0), ValueError, "workers"),
    "amdahl p str": (lambda: basics.amdahl(0.5, "8"), TypeError, "workers"),
    "amdahl p inf": (lambda: basics.amdahl(0.5, math.inf), ValueError, "workers"),
    "bmm shapes": (lambda: basics.batched_matmul(torch.zeros(2, 3, 4), torch.zeros(3, 4, 2)),
                   ValueError, "a and b"),
    "bmm 2-D": (lambda: basics.batched_matmul(torch.zeros(3, 4), torch.zeros(4, 2)),
                ValueError, "a must have 3"),
    "bmm list": (lambda: basics.batched_matmul([[1]], _B), TypeError, "a must"),
    "bmm dtype": (lambda: basics.batched_matmul(_A, _B.double()), ValueError, "dtype"),
    "loop shapes": (lambda: basics.looped_matmul(_A, torch.zeros(2, 3, 2)), ValueError, "a and b"),
    "random_batch n=0": (lambda: basics.random_batch(0, 3), ValueError, "n must"),
    "random_batch size=2.5": (lambda: basics.random_batch(2, 2.5), TypeError, "size"),
    "random_batch seed=-1": (lambda: basics.random_batch(2, 2, seed=-1), ValueError, "seed"),
    "brent work<depth": (lambda: basics.brent_bounds(1, 5, 2), ValueError, "work"),
    "brent workers=0": (lambda: basics.brent_bounds(10, 5, 0), ValueError, "workers"),
    "brent workers=1.5": (lambda: basics.brent_bounds(10, 5, 1.5), TypeError, "workers"),
    "brent depth<0": (lambda: basics.brent_bounds(10, -1, 2), ValueError, "depth"),
    "sweep counts 4.5": (lambda: basics.sweep_batching([4.5], 4), TypeError, "counts"),
    "sweep counts 0": (lambda: basics.sweep_batching([0, 2], 4), ValueError, "counts"),
    "sweep counts empty": (lambda: basics.sweep_batching([], 4), ValueError, "counts"),
    "sweep counts int": (lambda: basics.sweep_batching(8, 4), TypeError, "counts"),
    "sweep repeat=True": (lambda: basics.sweep_batching([2], 4, repeat=True), TypeError,
                          "repeat"),
    "sweep repeat=0": (lambda: basics.sweep_batching([2], 4, repeat=0), ValueError, "repeat"),
    "sweep size=0": (lambda: basics.sweep_batching([2], 0), ValueError, "size"),
    "sweep threads=0": (lambda: basics.sweep_batching([2], 4, threads=0), ValueError, "threads"),
    "model beta<0": (lambda: basics.batching_model(4, 4, 1e-6, -1.0), ValueError, "beta"),
    "model both 0": (lambda: basics.batching_model(4, 4, 0.0, 0.0), ValueError, "alpha"),
    "model n=0": (lambda: basics.batching_model(0, 4, 1e-6, 1e-9), ValueError, "n must"),
    "fit not dict": (lambda: basics.fit_batching_model([1, 2]), TypeError, "result"),
    "fit zero time": (lambda: basics.fit_batching_model(
        {"n": [1], "loop_s": [0.0], "bmm_s": [1.0], "size": 4}), ValueError, "times"),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_calls_are_refused_clearly(name):
    call, exc, match = BAD_CALLS[name]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("n", [2, 3, 5, 8, 13, 1024])
def test_sum_graph_work_and_depth(n):
    for shape, depth in (("chain", n - 1), ("tree", math.ceil(math.log2(n)))):
        g = basics.sum_graph(n, shape)
        assert basics.work_depth(g["edges"], g["ops"]) == (n - 1, depth)
        # every op adds exactly two earlier values; every input is used once
        ins = [a for a, _ in g["edges"]]
        assert all(sum(b == v for _, b in g["edges"]) == 2 for v in g["ops"])
        assert sorted(v for v in ins if v in g["leaves"]) == sorted(g["leaves"])
        assert set(g["pos"]) == set(g["leaves"]) | set(g["ops"])


def test_work_depth_counts_only_operations_and_refuses_cycles():
    # x -> a -> b, y -> b: two ops, longest path a, b; inputs are free
    assert basics.work_depth([("x", "a"), ("a", "b"), ("y", "b")], ["a", "b"]) == (2, 2)
    assert basics.work_depth([("x", "a"), ("y", "b")], ["a", "b"]) == (2, 1)
    with pytest.raises(ValueError, match="edges"):
        basics.work_depth([("a", "b"), ("b", "a")], ["a", "b"])


def test_gustafson_grows_linearly_where_amdahl_saturates():
    assert basics.gustafson(0.0, 8) == pytest.approx(8.0)
    assert basics.gustafson(1.0, 8) == pytest.approx(1.0)
    assert basics.gustafson(0.25, 5) == pytest.approx(0.25 + 0.75 * 5)
    p = np.array([1, 10, 1000])
    assert np.all(basics.gustafson(0.05, p) >= basics.amdahl(0.05, p))
    assert basics.gustafson(0.05, 1000) == pytest.approx(950.05)


def test_roofline_two_roofs_meet_at_the_ridge():
    peak, bw = 1e12, 1e11                       # ridge at 10 FLOP/byte
    r = basics.roofline(np.array([1.0, 10.0, 100.0]), peak, bw)
    np.testing.assert_allclose(r, [1e11, 1e12, 1e12])
    assert basics.roofline(5.0, peak, bw) == pytest.approx(5e11)


def test_matmul_intensity_counts_two_reads_and_one_write():
    # s x s float32: 2 s^3 FLOPs over 3 s^2 4 bytes
    for s in (1, 16, 128):
        assert basics.matmul_intensity(s, 4) == pytest.approx(2 * s**3 / (3 * s * s * 4))
    assert basics.matmul_intensity(900, 2) == pytest.approx(300.0)   # bf16: s / 3


def test_measure_roofline_shapes_and_its_own_arithmetic():
    r = basics.measure_roofline([4, 32], working_set=2**20, peak_size=64, repeat=2)
    assert r["sizes"] == [4, 32] and r["threads"] == 1 and r["device"] == "cpu"
    assert r["n"] == [2**20 // (12 * 16), 2**20 // (12 * 32 * 32)]
    np.testing.assert_allclose(r["intensity"], basics.matmul_intensity([4, 32], 4))
    assert all(f > 0 for f in r["flops"]) and r["peak_flops"] > 0 and r["bandwidth"] > 0
    assert isinstance(r["reliable"], bool)


@pytest.mark.parametrize("fn, arg", [("sweep_batching", "counts"), ("measure_roofline", "sizes")])
def test_size_lists_refuse_a_bool_inside(fn, arg):
    # np.asarray([True, 2]) is [1, 2]: a bool inside the list once passed as the count 1.
    f = getattr(basics, fn)
    with pytest.raises(TypeError, match=rf"{arg}\[0\] must be an int, got True"):
        f([True, 2], 4) if fn == "sweep_batching" else f([True, 2])


def test_measure_roofline_ridge_range_brackets_the_median_ridge():
    r = basics.measure_roofline([4], working_set=2**20, peak_size=64, repeat=3)
    lo, hi = r["ridge_range"]
    ridge = r["peak_flops"] / r["bandwidth"]
    assert 0 < lo <= ridge * (1 + 1e-9) and ridge * (1 - 1e-9) <= hi


def test_roofline_bound_labels_with_a_margin_so_two_runs_cannot_flip():
    assert basics.roofline_bound([1.0, 3.0, 5.0, 12.0], (4.0, 5.0)) == [
        "memory", "near the ridge", "near the ridge", "compute"]
    assert basics.roofline_bound([3.0, 6.0], (4.0, 5.0), margin=1.0) == ["memory", "compute"]
    # ridges 2 and 7.9 (less than margin**2 apart): a point can be "memory" in one run and
    # "near the ridge" in the other, never "memory" in one and "compute" in the other
    for x in np.geomspace(0.1, 100, 200):
        a, b = basics.roofline_bound(x, (2.0, 2.0))[0], basics.roofline_bound(x, (7.9, 7.9))[0]
        assert {a, b} != {"memory", "compute"}


def test_measure_roofline_roofs_bound_every_point(monkeypatch):
    # A busy core once slowed the one 512x512 matmul taken as the peak, and a bmm point drew
    # at 223% of its roof. The roofs are now the best rate of any kernel measured.
    from parlearn.core.timing import Timing
    calls = []

    def fake(fn, *, repeat, device, threads):
        calls.append(fn)
        k = len(calls)
        times = {1: (1.0, 1.2, 1.1), 2: (1.0, 1.0, 1.0)}.get(k, (1e-4, 1.2e-4, 1.1e-4))
        return Timing(times, "cpu", 1)

    monkeypatch.setattr(basics, "measure", fake)
    r = basics.measure_roofline([4, 32], working_set=2**20, peak_size=64, repeat=3)
    roof = basics.roofline(np.array(r["intensity"]), r["peak_flops"], r["bandwidth"])
    assert np.all(np.array(r["flops"]) <= roof * (1 + 1e-9))
    assert r["peak_from"] == "bmm s=32" and r["bandwidth_from"] == "bmm s=4"
    lo, hi = r["ridge_range"]
    assert lo <= r["peak_flops"] / r["bandwidth"] <= hi
