"""MAP-Elites (parlearn.qd): vmap scoring and scatter insertion equal their serial loops;
insertion never lowers a cell; the QD-score is monotone; batch size does not change the
QD-score much at an equal budget; the same task and budget in qdax give a comparable score."""

import numpy as np
import pytest
import torch

# JAX starts threads: these tests run in a fresh interpreter (see fresh_process in
# tests/conftest.py).
pytestmark = pytest.mark.fresh_process

jax = pytest.importorskip("jax")
jnp = jax.numpy

from parlearn.many_copies import qd  # noqa: E402

TASKS = [qd.arm_task(8), qd.rastrigin_task(6)]


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_vmapped_scoring_equals_python_loop(task):
    x = jax.random.uniform(jax.random.key(0), (33, task.dim))
    f1, d1 = qd.score_batch(task, x)
    f2, d2 = qd.score_loop(task, x)
    np.testing.assert_allclose(f1, f2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(d1, d2, rtol=1e-6, atol=1e-6)
    assert float(d1.min()) >= 0.0 and float(d1.max()) <= 1.0
    assert float(f1.min()) >= task.fitness_floor


def _random_batch(key, task, n, ties=True):
    x = jax.random.uniform(key, (n, task.dim))
    f, d = qd.score_batch(task, x)
    if ties:  # several children per cell, some with exactly equal fitness
        f = jnp.round(f * 20) / 20
        d = jnp.round(d * 8) / 8
    return x, f, d


@pytest.mark.parametrize("ties", [True, False])
def test_insert_equals_serial_loop(ties):
    task = qd.arm_task(5)
    archive = qd.empty_archive(task, cells_per_dim=8)
    ref = archive
    insert = jax.jit(qd.insert)
    for i in range(4):
        x, f, d = _random_batch(jax.random.key(i), task, 200, ties)
        archive = insert(archive, x, f, d)
        ref = qd.insert_loop(ref, x, f, d)
        for a, b in zip(archive, ref, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_insert_never_lowers_a_cell():
    task = qd.arm_task(5)
    archive = qd.empty_archive(task, cells_per_dim=8)
    best_seen = np.full(64, -np.inf, np.float32)
    insert = jax.jit(qd.insert)
    for i in range(6):
        x, f, d = _random_batch(jax.random.key(10 + i), task, 300)
        new = insert(archive, x, f, d)
        assert bool(jnp.all(new.fitness >= archive.fitness))
        # and each elite is the best child ever seen in its cell
        np.maximum.at(best_seen, np.asarray(qd.cell_index(d, 8)), np.asarray(f))
        np.testing.assert_array_equal(np.asarray(new.fitness), best_seen)
        archive = new


@pytest.fixture(scope="module")
def runs():
    task = qd.arm_task(8)
    budget = 4096 * 12
    return {b: qd.map_elites(task, batch_size=b, budget=budget, seed=0, records=8)
            for b in (64, 4096)}


def test_qd_score_is_monotone(runs):
    for r in runs.values():
        assert np.all(np.diff(r.qd_score) >= 0)
        assert np.all(np.diff(r.coverage) >= 0)
        assert r.qd_score[-1] > 1.2 * r.qd_score[0]  # it did search, not just sample once
        assert r.evaluations[-1] <= 4096 * 12


def test_batch_64_and_4096_within_10_percent_at_equal_budget(runs):
    small, large = runs[64].qd_score[-1], runs[4096].qd_score[-1]
    assert abs(large / small - 1) <= 0.10, (small, large)
    assert abs(runs[4096].coverage[-1] - runs[64].coverage[-1]) <= 0.10


@pytest.mark.parametrize("batch_size", [1, 64, 5000])
def test_padded_first_batch_equals_the_unpadded_one(batch_size):
    # map_elites' first batch draws a padded block of genotypes (one program for all batch
    # sizes) and masks the extra rows: the archive must be the one of batch_size rows alone.
    from parlearn.many_copies.qd.search import _first_batch_pad, _first_batch_program

    task, key = qd.arm_task(8), jax.random.key(4)
    archive, m = _first_batch_program(task, 16, _first_batch_pad(batch_size))(key, batch_size)
    x = jax.random.uniform(key, (batch_size, task.dim))
    ref = qd.insert_loop(qd.empty_archive(task, 16), x, *qd.score_batch(task, x))
    # The same cells filled by the same genotypes; fitness and hand position to round-off
    # (XLA's vectorised cos/sin over 4096 rows may differ from 64 rows' in the last bit).
    np.testing.assert_array_equal(np.isfinite(archive.fitness), np.isfinite(ref.fitness))
    np.testing.assert_array_equal(np.asarray(archive.genotypes), np.asarray(ref.genotypes))
    for got, want in zip(archive, ref, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(m["qd_score"]),
                               float(qd.qd_metrics(ref, task.fitness_floor)["qd_score"]),
                               rtol=1e-6)


def test_seeded_and_callers_rng_untouched():
    task = qd.arm_task(4)
    np_state, torch_state = np.random.get_state(), torch.get_rng_state()  # noqa: NPY002
    a = qd.map_elites(task, batch_size=32, budget=320, cells_per_dim=8, seed=3, records=2)
    b = qd.map_elites(task, batch_size=32, budget=320, cells_per_dim=8, seed=3, records=2)
    assert a.qd_score[-1] > a.qd_score[0]
    np.testing.assert_array_equal(a.archive.fitness, b.archive.fitness)
    np.testing.assert_array_equal(a.archive.genotypes, b.archive.genotypes)
    assert np.array_equal(np.random.get_state()[1], np_state[1])  # noqa: NPY002
    assert torch.equal(torch.get_rng_state(), torch_state)


def test_evals_per_second_reports_a_curve():
    r = qd.evals_per_second(qd.arm_task(4), [1, 64], repeat=2)
    assert r["batch_sizes"] == [1, 64] and len(r["compile_s"]) == 2
    assert all(np.isfinite(v) and v > 0 for v in r["evals_per_s"])


# --- against the qdax package (the [massive] extra) ---------------------------------------

def test_arm_and_grid_match_qdax():
    pytest.importorskip("qdax")
    from qdax.core.containers.mapelites_repertoire import (
        compute_euclidean_centroids,
        get_cells_indices,
    )
    from qdax.tasks.arm import arm_scoring_function

    task = qd.arm_task(8)
    x = jax.random.uniform(jax.random.key(1), (500, 8))
    f1, d1 = qd.score_batch(task, x)
    f2, d2, _ = arm_scoring_function(x, jax.random.key(0))
    np.testing.assert_allclose(f1, f2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(d1, d2, rtol=1e-6, atol=1e-6)
    centroids = compute_euclidean_centroids((16, 16), 0.0, 1.0)
    np.testing.assert_array_equal(qd.cell_index(d1, 16), get_cells_indices(d1, centroids))


def test_comparable_qd_score_to_qdax_same_task_and_budget():
    pytest.importorskip("qdax")
    task = qd.arm_task(8)
    ours = qd.map_elites(task, batch_size=256, budget=256 * 40, seed=0, records=2)
    theirs = qd.qdax_map_elites(task, batch_size=256, budget=256 * 40, seed=0, records=2)
    assert theirs.engine == "qdax" and theirs.evaluations[-1] == ours.evaluations[-1]
    assert abs(ours.qd_score[-1] / theirs.qd_score[-1] - 1) <= 0.10
    assert abs(ours.coverage[-1] - theirs.coverage[-1]) <= 0.10


# --- bad calls fail fast --------------------------------------------------------------------

ARM = qd.arm_task(4)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: qd.arm_task(0), ValueError, "dofs"),
    (lambda: qd.arm_task(2.0), TypeError, "dofs"),
    (lambda: qd.rastrigin_task(1), ValueError, "dim"),
    (lambda: qd.empty_archive(ARM, 0), ValueError, "cells_per_dim"),
    (lambda: qd.map_elites("arm", batch_size=8, budget=64), TypeError, "task"),
    (lambda: qd.map_elites(ARM, batch_size=0, budget=64), ValueError, "batch_size"),
    (lambda: qd.map_elites(ARM, batch_size=64, budget=100), ValueError, "budget"),
    (lambda: qd.map_elites(ARM, batch_size=8, budget=64, iso_sigma=-1), ValueError, "iso_sigma"),
    (lambda: qd.map_elites(ARM, batch_size=8, budget=64, seed=-1), ValueError, "seed"),
    (lambda: qd.map_elites(ARM, batch_size=8, budget=64, records=0), ValueError, "records"),
    (lambda: qd.evals_per_second(ARM, [1], mode="fast"), ValueError, "mode"),
    (lambda: qd.evals_per_second(ARM, []), ValueError, "batch_sizes"),
    (lambda: qd.evals_per_second(ARM, [0]), ValueError, "batch_sizes"),
])
def test_bad_calls_fail_fast(call, exc, match):
    with pytest.raises(exc, match=match):
        call()

