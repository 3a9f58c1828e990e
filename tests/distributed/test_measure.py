"""parlearn.distributed.measure: the ring-vs-gloo study and the load check (no timed assertions).

The study's times are whatever this machine gives; what is checked is the shape of what it
returns, that its ratios and quartiles are computed from its own repeats, that both
all-reduces sum the same tensors, and that bad arguments fail before any rank starts.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from parlearn.distributed import collectives, measure, run
from parlearn.distributed.cost import AlphaBeta, collective_time, fit_alpha_beta

T = 20  # group timeout (s); generous for a loaded machine
SIZES = [256, 4100]  # bytes: 64 and 1025 float32 (1025 does not split evenly on 2 or 3 ranks)
WORLD = [2, 3]


@pytest.fixture(scope="module")
def study() -> dict:
    return measure.ring_vs_gloo(SIZES, WORLD, repeat=3, timeout=T)


def test_study_returns_every_field_at_every_world_size_and_size(study):
    assert study["sizes"] == SIZES and study["world_sizes"] == WORLD and study["repeat"] == 3
    assert study["backend"] == "gloo" and "gloo" in study["device"]
    # The ranks run one intra-op thread each; gloo adds threads of its own beside it.
    assert study["torch_threads"] == [1, 1]
    assert all(n >= 1 for n in study["os_threads"])
    assert all(x is None or x >= 0 for x in study["load"])
    assert isinstance(study["reliable"], bool)
    for impl in ("all_reduce", "ring_all_reduce"):
        for i in range(len(WORLD)):
            for j in range(len(SIZES)):
                ts = study["times_s"][impl][i][j]
                assert len(ts) == 3 and all(t > 0 for t in ts)
                q1, q3 = study["q1_s"][impl][i][j], study["q3_s"][impl][i][j]
                assert study["median_s"][impl][i][j] == statistics.median(ts)
                assert q1 <= statistics.median(ts) <= q3


def test_ratio_is_the_median_of_paired_repeats_gloo_over_ring(study):
    for i in range(len(WORLD)):
        for j in range(len(SIZES)):
            g = study["times_s"]["all_reduce"][i][j]
            r = study["times_s"]["ring_all_reduce"][i][j]
            per_repeat = [a / b for a, b in zip(g, r, strict=True)]
            assert study["ratio"][i][j] == pytest.approx(statistics.median(per_repeat))
            assert study["ratio_q1"][i][j] <= study["ratio"][i][j] <= study["ratio_q3"][i][j]


def test_model_is_the_ring_formula_fitted_per_world_size_and_implementation(study):
    for i, n_ranks in enumerate(WORLD):
        for impl in ("all_reduce", "ring_all_reduce"):
            fit = study["fit"][impl][i]
            assert isinstance(fit, AlphaBeta)
            # Fitted to this implementation's own medians at this world size.
            assert fit == fit_alpha_beta(SIZES, study["median_s"][impl][i], kind="all_reduce",
                                         world_size=n_ranks)
            expected = [collective_time("all_reduce", n, n_ranks, fit) for n in SIZES]
            assert study["modeled_s"][impl][i] == pytest.approx(expected)
        ratio = [a / b for a, b in zip(study["modeled_s"]["all_reduce"][i],
                                       study["modeled_s"]["ring_all_reduce"][i], strict=True)]
        assert study["modeled_ratio"][i] == pytest.approx(ratio)


def test_both_all_reduces_give_the_serial_sum_in_the_study(study):
    for i, n_ranks in enumerate(WORLD):
        for j, nbytes in enumerate(SIZES):
            serial = sum(collectives.rank_tensor(r, nbytes // 4, 0, torch.float32)
                         for r in range(n_ranks))
            # max_abs is the largest |entry| of gloo's result: it must be the serial sum's...
            assert study["max_abs"][i][j] == pytest.approx(float(serial.abs().max()), rel=1e-6)
            # ...and the ring's result differs from gloo's by float32 round-off at most.
            assert study["max_diff"][i][j] <= 1e-6 * study["max_abs"][i][j]


def test_the_worker_times_each_implementation_every_repeat():
    out = run(collectives.ring_vs_gloo_times, 2, args=((64,), 4, 0), timeout=T)
    for r in out:
        assert len(r["all_reduce"][64]) == 4 and len(r["ring_all_reduce"][64]) == 4
        assert r["torch_threads"] == 1


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(sizes=[12], world_sizes=[4]), ValueError, "sizes"),       # 3 floats on 4 ranks
    (dict(sizes=[4096], world_sizes=[1]), ValueError, "world_sizes"),
    (dict(sizes=[4096], world_sizes=[2], backend="mpi"), ValueError, "backend"),
    (dict(sizes=[4096], world_sizes=[2], repeat=0), ValueError, "repeat"),
    (dict(sizes=[4096], world_sizes="2"), TypeError, "world_sizes"),
    (dict(sizes=4096, world_sizes=[2]), TypeError, "sizes"),
    (dict(sizes=[], world_sizes=[2]), ValueError, "sizes"),
])
def test_study_refuses_bad_arguments_naming_them(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        measure.ring_vs_gloo(timeout=T, **kwargs)


def _burn(rank, world_size, seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return time.process_time()


def test_the_ranks_cpu_counts_as_our_own_not_as_another_programs():
    before = measure._busy_seconds()
    if before is None:
        pytest.skip("no /proc/stat here")
    run(_burn, 2, args=(0.3,), timeout=T)
    after = measure._busy_seconds()
    # Two ranks burned at least 0.3 CPU-seconds each; our own count must include them.
    assert after[1] - before[1] >= 0.55


def test_other_load_subtracts_our_own_cpu(monkeypatch):
    # Scripted snapshots: the machine got 0.5 CPU-s busier, all of it ours -> no one else.
    snaps = iter([(100.0, 5.0), (100.5, 5.5)])
    monkeypatch.setattr(measure, "_busy_seconds", lambda: next(snaps))
    value, load = measure.other_load(lambda: "done")
    assert value == "done" and load == 0.0
    # The machine got 0.75 CPU-s busier, 0.5 of it ours: someone else used 0.25 CPU-s.
    snaps = iter([(100.0, 5.0), (100.75, 5.5)])
    monkeypatch.setattr(measure, "_busy_seconds", lambda: next(snaps))
    _, load = measure.other_load(lambda: time.sleep(0.05))
    assert load > 0
    monkeypatch.setattr(measure, "_busy_seconds", lambda: None)
    assert measure.other_load(lambda: 1) == (1, None)


def test_study_takes_the_slowest_rank_of_each_repeat(monkeypatch):
    # Scripted ranks (no processes): rank 1 is the slower one in some repeats, rank 0 in others.
    def fake_run(fn, world_size, **kwargs):
        assert fn is collectives.ring_vs_gloo_times and world_size == 2
        base = {"max_diff": {64: 0.0, 128: 0.0}, "max_abs": {64: 1.0, 128: 1.0},
                "torch_threads": 1, "os_threads": 4}
        return [dict(base, all_reduce={64: [1.0, 5.0, 2.0], 128: [2.0, 2.0, 2.0]},
                     ring_all_reduce={64: [2.0, 1.0, 1.0], 128: [4.0, 4.0, 8.0]}),
                dict(base, all_reduce={64: [3.0, 1.0, 2.0], 128: [2.0, 2.0, 2.0]},
                     ring_all_reduce={64: [1.0, 1.0, 4.0], 128: [4.0, 4.0, 4.0]})]

    monkeypatch.setattr(measure, "run", fake_run)
    st = measure.ring_vs_gloo([64, 128], [2], repeat=3)
    assert st["times_s"]["all_reduce"][0] == [[3.0, 5.0, 2.0], [2.0, 2.0, 2.0]]
    assert st["times_s"]["ring_all_reduce"][0] == [[2.0, 1.0, 4.0], [4.0, 4.0, 8.0]]
    # Per-repeat gloo/ring: 1.5, 5, 0.5 -> median 1.5; and 0.5, 0.5, 0.25 -> median 0.5.
    assert st["ratio"][0] == [1.5, 0.5]
    assert st["median_s"]["all_reduce"][0] == [3.0, 2.0]
    assert st["q1_s"]["ring_all_reduce"][0][1] == 4.0 and st["q3_s"]["ring_all_reduce"][0][1] == 6.0


def test_bench_label_blames_other_programs_only_when_they_used_the_cores():
    busy = measure._trust(1.3, [0.1])
    assert busy.startswith("UNRELIABLE") and "1.3 cores" in busy
    # A wide spread with the machine otherwise quiet is the ranks' own jitter, not load.
    quiet = measure._trust(0.05, [0.6])
    assert "UNRELIABLE" not in quiet and "60%" in quiet and "own jitter" in quiet
    assert "unknown" in measure._trust(None, [0.1])
