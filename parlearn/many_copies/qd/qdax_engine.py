"""The same MAP-Elites run through the ``qdax`` package (needs the ``[massive]`` extra).

JAX and qdax are imported inside the function, so importing this module starts neither.
"""

from __future__ import annotations

import functools
import time

import numpy as np

from parlearn.many_copies.qd.search import (
    Archive,
    MapElitesResult,
    Task,
    _check_run,
    qd_metrics,
    score_batch,
)

__all__ = ["qdax_map_elites"]


def qdax_map_elites(task: Task, *, batch_size: int, budget: int, cells_per_dim: int = 32,
                    iso_sigma: float = 0.005, line_sigma: float = 0.05, seed: int = 0,
                    records: int = 20) -> MapElitesResult:
    """The same run with the ``qdax`` package's MAP-Elites (needs the ``[massive]`` extra).

    Same task, grid, operator and budget as :func:`map_elites`; its QD-score is computed
    with this module's :func:`qd_metrics`, so the two are directly comparable.
    """
    steps = _check_run(task, batch_size, budget, cells_per_dim, iso_sigma, line_sigma, seed,
                       records)
    try:
        from qdax.core.containers.mapelites_repertoire import compute_euclidean_centroids
        from qdax.core.emitters.mutation_operators import isoline_variation as qdax_isoline
        from qdax.core.emitters.standard_emitters import MixingEmitter
        from qdax.core.map_elites import MAPElites
    except ImportError as err:
        raise ImportError("qdax_map_elites needs qdax: pip install 'parlearn[massive]'") from err
    import jax
    import jax.numpy as jnp

    def scoring(genotypes, key):
        fitness, desc = score_batch(task, genotypes)
        return fitness, desc, {}

    def metrics(repertoire):
        return qd_metrics(Archive(repertoire.fitnesses.reshape(-1), repertoire.genotypes,
                                  repertoire.descriptors), task.fitness_floor)

    variation = functools.partial(qdax_isoline, iso_sigma=iso_sigma, line_sigma=line_sigma,
                                  minval=0.0, maxval=1.0)
    emitter = MixingEmitter(mutation_fn=None, variation_fn=variation, variation_percentage=1.0,
                            batch_size=batch_size)
    algo = MAPElites(scoring_function=scoring, emitter=emitter, metrics_function=metrics)
    centroids = compute_euclidean_centroids((cells_per_dim,) * task.n_desc, 0.0, 1.0)
    key = jax.random.key(seed)
    key, k_init, k_algo = jax.random.split(key, 3)
    x0 = jax.random.uniform(k_init, (batch_size, task.dim))
    repertoire, emitter_state, _ = algo.init(x0, centroids, k_algo)

    def run_steps(repertoire, emitter_state, key, n):
        def body(_, carry):
            rep, es, k = carry
            k, sub = jax.random.split(k)
            rep, es, _ = algo.update(rep, es, sub)
            return rep, es, k
        repertoire, emitter_state, key = jax.lax.fori_loop(
            0, n, body, (repertoire, emitter_state, key))
        return repertoire, emitter_state, key, metrics(repertoire)

    t0 = time.perf_counter()
    compiled = jax.jit(run_steps).lower(repertoire, emitter_state, key, 1).compile()
    compile_s = time.perf_counter() - t0
    bounds = np.linspace(0, steps, min(records, steps) + 1).round().astype(int)
    m = metrics(repertoire)
    evals, qd, cov, wall = [batch_size], [float(m["qd_score"])], [float(m["coverage"])], [0.0]
    t0 = time.perf_counter()
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        repertoire, emitter_state, key, m = compiled(repertoire, emitter_state, key,
                                                     int(stop - start))
        qd.append(float(m["qd_score"]))
        wall.append(time.perf_counter() - t0)
        cov.append(float(m["coverage"]))
        evals.append(batch_size * (1 + int(stop)))
    archive = Archive(jnp.asarray(repertoire.fitnesses).reshape(-1), repertoire.genotypes,
                      repertoire.descriptors)
    return MapElitesResult(archive, np.array(evals), np.array(qd), np.array(cov),
                           np.array(wall), compile_s, batch_size, str(jax.devices()[0]),
                           engine="qdax")
