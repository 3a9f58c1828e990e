"""The argument contract of parlearn.qd (MAP-Elites in JAX; see harness.py).

Like test_contract_jax.py, every test runs in a child pytest (``fresh_process``): the calls
start JAX. The top level imports no JAX and ``good()`` builds NumPy arrays and Tasks only
(a Task imports JAX when it scores, not when it is built).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from harness import Case, contract_tests

pytestmark = pytest.mark.fresh_process


def _arm(dofs=3):
    from parlearn.many_copies.qd.search import arm_task
    return arm_task(dofs)


def _genotypes(n=5, dim=3, seed=0):
    """(n, dim) float32 genotypes in [0, 1], the last row all 1/2 (the arm stretched out:
    its descriptor is (1, 1/2), on the grid's closed upper edge)."""
    x = np.random.default_rng(seed).random((n, dim), dtype=np.float32)
    x[-1] = 0.5
    return x


def _nan(a):
    a = a.copy()
    a.flat[0] = math.nan
    return a


def _descriptors():
    """(5, 2) descriptors in [0, 1], both edges included."""
    return np.array([[0.0, 0.0], [1.0, 1.0], [0.3, 0.9], [0.26, 0.24], [0.5, 1.0]], np.float32)


def _archive(cells_per_dim=4, dim=3, n_desc=2):
    """An empty archive as NumPy arrays (empty_archive's, without starting JAX)."""
    from parlearn.many_copies.qd.search import Archive
    cells = cells_per_dim ** n_desc
    return Archive(np.full(cells, -np.inf, np.float32), np.zeros((cells, dim), np.float32),
                   np.zeros((cells, n_desc), np.float32))


def _odd_archive():
    """15 cells: no cells_per_dim ** 2."""
    from parlearn.many_copies.qd.search import Archive
    return Archive(np.zeros(15, np.float32), np.zeros((15, 3), np.float32),
                   np.zeros((15, 2), np.float32))


def _children():
    """Five children for ``_archive()``: two share cell 0 (the first, fitter one wins), one
    has fitness -inf (it never enters)."""
    d = np.array([[0.1, 0.1], [0.2, 0.05], [1.0, 1.0], [0.6, 0.3], [0.9, 0.9]], np.float32)
    f = np.array([0.5, 0.2, -1.0, 0.0, -np.inf], np.float32)
    return dict(genotypes=_genotypes(), fitness=f, descriptors=d)


def _cells(d, c):
    """The closed form of cell_index: floor(d c) per axis (d = 1 in cell c - 1), first axis
    fastest."""
    idx = np.minimum(np.floor(np.asarray(d, np.float64) * c), c - 1).astype(np.int64)
    return (idx * c ** np.arange(idx.shape[-1])).sum(-1)


def _cell_index(result, kw):
    np.testing.assert_array_equal(np.asarray(result),
                                  _cells(kw["descriptors"], kw["cells_per_dim"]))


def _elites(result, kw):
    """Each cell holds its best child when that beats the elite (-inf: empty)."""
    fit = np.asarray(kw["archive"].fitness).copy()
    gen = np.asarray(kw["archive"].genotypes).copy()
    for i, c in enumerate(_cells(kw["descriptors"], kw["archive"].cells_per_dim)):
        if kw["fitness"][i] > fit[c]:
            fit[c], gen[c] = kw["fitness"][i], kw["genotypes"][i]
    np.testing.assert_array_equal(np.asarray(result.fitness), fit)
    np.testing.assert_array_equal(np.asarray(result.genotypes), gen)


def _arm_scores(result, kw):
    """The arm's closed form: fitness -std(x); the hand at (1/2, 1/2) + sum of links of
    length 1/(2 dofs) at the cumulative angles 2 pi x - pi."""
    fitness, desc = (np.asarray(a, np.float64) for a in result)
    x = kw["genotypes"].astype(np.float64)
    angles = np.cumsum(2 * np.pi * x - np.pi, axis=1)
    hand = np.stack([np.cos(angles).sum(1), np.sin(angles).sum(1)], 1) / (2 * x.shape[1])
    np.testing.assert_allclose(fitness, -x.std(1), atol=1e-6)
    np.testing.assert_allclose(desc, hand + 0.5, atol=1e-6)
    assert desc.min() >= 0 and desc.max() <= 1


def _children_in_unit(result, kw):
    """Children in [0, 1] of the parents' shape; with no noise, the first parents."""
    out = np.asarray(result)
    assert out.shape == kw["x1"].shape and out.min() >= 0 and out.max() <= 1
    if kw["iso_sigma"] == 0 and kw["line_sigma"] == 0:
        np.testing.assert_array_equal(out, kw["x1"])


def _wide_score(x):
    """A Task's score that breaks the Task contract: descriptors in [0, 2]."""
    import jax.numpy as jnp
    return -jnp.std(x), 2 * x[:2]


def _wide_task():
    from parlearn.many_copies.qd.search import Task
    return Task("wide", 3, 2, _wide_score, fitness_floor=-1.0)


def _curve(result, kw):
    assert result["batch_sizes"] == kw["batch_sizes"] and result["mode"] == kw["mode"]
    assert all(np.isfinite(v) and v > 0 for v in result["evals_per_s"])


BAD_TASK = ["arm", 3, None]
BAD_GENOTYPES = [_genotypes() + 1, -_genotypes(), _nan(_genotypes()), _genotypes(5, 4),
                 _genotypes()[0], np.ones((5, 3), np.int64)]
RUN = dict(batch_size=8, budget=32, cells_per_dim=4, iso_sigma=0.005, line_sigma=0.05, seed=0,
           records=2)
RUN_RANGES = {"batch_size": (1, 16), "budget": (16, None), "cells_per_dim": (1, None),
              "iso_sigma": (0.0, None), "line_sigma": (0.0, None), "seed": (0, None),
              "records": (1, None)}

CASES: list[Case] = [
    Case("parlearn.many_copies.qd.search.cell_index",
         lambda: dict(descriptors=_descriptors(), cells_per_dim=4),
         ranges={"cells_per_dim": (1, None)},
         bad={"descriptors": [_descriptors() + 0.01, _descriptors() - 0.01, _nan(_descriptors()),
                              np.ones((5, 2), np.int64), np.zeros(()), np.zeros((5, 0))],
              "cells_per_dim": [10**6]},  # 10**12 cells: past an int32 index
         check=_cell_index),
    Case("parlearn.many_copies.qd.search.score_batch",
         lambda: dict(task=_arm(), genotypes=_genotypes()),
         bad={"task": BAD_TASK, "genotypes": BAD_GENOTYPES}, check=_arm_scores),
    Case("parlearn.many_copies.qd.search.score_loop",
         lambda: dict(task=_arm(), genotypes=_genotypes()),
         bad={"task": BAD_TASK, "genotypes": BAD_GENOTYPES}, check=_arm_scores),
    Case("parlearn.many_copies.qd.search.insert",
         lambda: dict(archive=_archive(), **_children()),
         bad={"archive": ["archive", 3, tuple(_archive()), _archive()._replace(
                              fitness=np.zeros(15, np.float32)), _odd_archive()],
              "genotypes": [_genotypes(5, 4), _genotypes(4), _nan(_genotypes())],
              "fitness": [np.zeros(4, np.float32), np.zeros((5, 1), np.float32),
                          np.full(5, np.nan, np.float32), np.full(5, np.inf, np.float32)],
              "descriptors": [_descriptors() + 0.5, _nan(_descriptors()),
                              np.zeros((5, 3), np.float32)]},
         check=_elites),
    Case("parlearn.many_copies.qd.search.insert_loop",
         lambda: dict(archive=_archive(), **_children()),
         bad={"archive": ["archive", 3, _odd_archive()],
              "genotypes": [_genotypes(5, 4), _nan(_genotypes())],
              "fitness": [np.zeros(4, np.float32), np.full(5, np.nan, np.float32)],
              "descriptors": [_descriptors() - 0.5, _nan(_descriptors())]},
         check=_elites),
    Case("parlearn.many_copies.qd.search.isoline_variation",
         lambda: dict(key=np.array([0, 7], np.uint32), x1=_genotypes(), x2=_genotypes(seed=1),
                      iso_sigma=0.01, line_sigma=0.1),
         ranges={"iso_sigma": (0.0, None), "line_sigma": (0.0, None)},
         bad={"key": [np.zeros(3, np.uint32), np.zeros(2, np.float32),
                      np.zeros((2, 2), np.uint32), 7],
              "x1": BAD_GENOTYPES[:3] + [np.ones((5, 3), np.int64)],
              "x2": [_genotypes(5, 4), _genotypes(4), _nan(_genotypes()), _genotypes() + 1]},
         check=_children_in_unit),
    # The searches compile XLA programs (per batch size and grid): refusals only; their
    # results are tested in tests/many_copies/test_qd.py. map_elites also refuses a Task of
    # one's own whose descriptors leave [0, 1] (after the first batch: the jitted steps
    # cannot look at values).
    Case("parlearn.many_copies.qd.search.map_elites",
         lambda: dict(task=_arm(), **RUN), ranges=RUN_RANGES,
         bad={"task": BAD_TASK + [_wide_task()], "budget": [15]}, run_good=False),
    Case("parlearn.many_copies.qd.qdax_engine.qdax_map_elites",
         lambda: dict(task=_arm(), **RUN), ranges=RUN_RANGES,
         bad={"task": BAD_TASK, "budget": [15]}, run_good=False),
    Case("parlearn.many_copies.qd.throughput.evals_per_second",
         lambda: dict(task=_arm(2), batch_sizes=[1, 4], repeat=1, seed=0, mode="vmap"),
         bad={"task": BAD_TASK, "batch_sizes": [[], [0], [True], [1.5], 4, "14"],
              "repeat": [0, -1], "seed": [-1], "mode": ["fast"]},
         check=_curve),  # a measurement: only that it is one, never its value
]

test_refuses, test_accepts, test_accepts_range = contract_tests(CASES)

COVERED_ELSEWHERE: dict[str, str | list[str]] = {}
EXEMPT: dict[str, str] = {}
