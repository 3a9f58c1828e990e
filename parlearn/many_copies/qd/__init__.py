"""MAP-Elites from scratch in JAX: thousands of evaluations at once on one device.

Quality-diversity (QD) search keeps an *archive*: a grid over a descriptor space (for the
planar arm, where the hand ends up), holding in each cell the best solution ever seen
whose descriptor falls there. MAP-Elites (Mouret & Clune 2015) repeats one step:

1. **select** parents uniformly from the filled cells;
2. **vary** them with the iso+line operator (Vassiliades & Mouret 2018)
   ``x' = x1 + sigma_iso * N(0, I) + sigma_line * N(0, 1) * (x2 - x1)``;
3. **score** every child (here one ``jax.vmap`` call over the whole batch);
4. **insert**: each child goes to its cell if it beats the cell's elite, so a cell's
   fitness never goes down.

QDax (Lim et al. 2022, arXiv 2202.01258) runs step 3 for thousands of children at once on
one accelerator and reports that, at an equal number of evaluations, the batch size barely
changes the QD-score. This module measures both claims on the tasks it ships
(:func:`arm_task`, :func:`rastrigin_task`).

Serial references sit beside the parallel pieces: :func:`score_loop` (a Python loop over
the children) beside :func:`score_batch` (vmap), and :func:`insert_loop` (one child at a
time, in order) beside :func:`insert` (a scatter over the whole batch). They agree exactly.

=================  =======================================================================
module             what it holds
=================  =======================================================================
``search``         tasks, the archive, :func:`score_batch` / :func:`score_loop`,
                   :func:`insert` / :func:`insert_loop`, iso+line, :func:`map_elites`
``qdax_engine``    :func:`qdax_map_elites`: the same run through the ``qdax`` package
``throughput``     :func:`evals_per_second` (the vmap curve, measured), bench
=================  =======================================================================

JAX is imported inside the functions, so ``import parlearn.qd`` does not start it.
Everything is re-exported here.
"""

from parlearn.many_copies.qd.qdax_engine import qdax_map_elites
from parlearn.many_copies.qd.search import (
    Archive,
    MapElitesResult,
    Task,
    arm_task,
    cell_index,
    empty_archive,
    insert,
    insert_loop,
    isoline_variation,
    map_elites,
    qd_metrics,
    rastrigin_task,
    score_batch,
    score_loop,
)
from parlearn.many_copies.qd.throughput import bench, evals_per_second

__all__ = ["Task", "arm_task", "rastrigin_task", "Archive", "empty_archive", "cell_index",
           "score_batch", "score_loop", "insert", "insert_loop", "isoline_variation",
           "qd_metrics", "MapElitesResult", "map_elites", "qdax_map_elites",
           "evals_per_second", "bench"]
