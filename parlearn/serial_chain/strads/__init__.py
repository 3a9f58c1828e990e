"""STRADS: scheduled model-parallel coordinate descent for the Lasso (lesson 25).

Coordinate descent updates one weight at a time: a serial chain. Updating ``P`` weights at
once from the same residual (Shotgun) is parallel but each update ignores the others, and
correlated coordinates overshoot together and can diverge. STRADS (Lee, Kim, Zheng, Ho,
Gibson, Xing 2014) schedules the round: draw coordinates by how much they moved lately,
keep a nearly independent set (``|x_j^T x_k| < rho``), update those in parallel.

=========  ===============================================================================
module     what it holds
=========  ===============================================================================
``solver`` the Lasso objective (scikit-learn's scaling), :func:`sklearn_lasso` (the serial
           engine), the schedules (cyclic, Shotgun, STRADS with its priorities and
           dependency filter), :func:`solve`: the rounds in one process
``ranks``  :func:`run_ranks`: the same rounds on real gloo ranks, rows sharded, one
           all-reduce of partial sums ``x_j^T r`` a round
``cost``   the modeled time of a round, the runs against wall time, the bench rows
=========  ===============================================================================

``from parlearn import strads as st; st.solve(X, y, 0.05, workers=8, schedule="strads")``.
"""

from parlearn.serial_chain.strads.cost import bench, round_time_model, shotgun_limit, timed_runs
from parlearn.serial_chain.strads.ranks import run_ranks, strads_rank
from parlearn.serial_chain.strads.solver import (
    SCHEDULES,
    LassoRun,
    column_correlations,
    correlated_design,
    cyclic_schedule,
    dependency_filter,
    objective,
    priorities,
    relative_gap,
    round_update,
    shotgun_schedule,
    sklearn_lasso,
    soft_threshold,
    solve,
    strads_schedule,
)

__all__ = ["SCHEDULES", "LassoRun", "correlated_design", "objective", "relative_gap",
           "soft_threshold", "sklearn_lasso", "column_correlations", "priorities",
           "dependency_filter", "strads_schedule", "shotgun_schedule", "cyclic_schedule",
           "round_update", "solve", "run_ranks", "strads_rank", "shotgun_limit",
           "round_time_model", "timed_runs", "bench"]
