"""Batches that adapt (lesson 15): two-half gradient similarity (SimiGrad), noise scale, AdaScale.

Data parallelism (lesson 11) makes a larger batch cost no more wall time per step, as long
as there are ranks to spread it over. Whether a larger batch saves *steps* depends on how
noisy the gradient is. Per-example gradients ``g_i = G + e_i`` with mean ``G`` (the true
gradient) and covariance ``Sigma``; the mean of ``B`` of them has covariance ``Sigma / B``.

===============  ======================================================================
module           what it holds
===============  ======================================================================
``noise_scale``  the closed forms (noise scale, the halves' expected cosine, AdaScale's
                 gain, McCandlish's steps-examples model) and the estimates from two
                 half-batch gradients (:class:`HalfStats`, :class:`NoiseScale`)
``tasks``        linear regression with a known gradient covariance, and digits
``halves``       the two half-batch gradients: in one process, and on two sub-groups of
                 real ranks; the probe's wire bytes (``diagram`` draws the probe)
``training``     SimiGrad's controller (a reconstruction) and the training loop for a
                 fixed batch, SimiGrad or AdaScale, in one process or on real ranks
``tradeoff``     what adapting buys: the trade-off modeled, the fixed-batch frontier
                 measured, the bench rows
===============  ======================================================================

Serial references and their parallel versions side by side: :func:`half_gradients` (one
process) vs :func:`worker_half_gradients` (sub-groups on real ranks); :func:`train` (one
process) vs :func:`worker_train` (real ranks, the same sampling), equal to round-off.
The names a notebook uses are re-exported here:
``from parlearn import batching as bt; bt.train(model, task, method="simigrad")``.
"""

from parlearn.multi_device.batching.diagram import draw_probe
from parlearn.multi_device.batching.halves import (
    half_gradients,
    half_groups,
    probe_bytes,
    worker_half_gradients,
)
from parlearn.multi_device.batching.noise_scale import (
    HalfStats,
    NoiseScale,
    adascale_gain,
    adascale_gain_from_b_simple,
    controller_fixed_point,
    critical_batch_fit,
    expected_cosine,
    measure_noise_scale,
    monte_carlo_halves,
    steps_samples_model,
    two_half_stats,
)
from parlearn.multi_device.batching.tasks import DigitsTask, LinearRegressionProblem, RegressionTask
from parlearn.multi_device.batching.tradeoff import (
    batch_sweep,
    bench,
    frontier_samples,
    tradeoff_model,
)
from parlearn.multi_device.batching.training import (
    LR_SCALINGS,
    METHODS,
    History,
    SimiGradController,
    samples_to_target,
    train,
    train_runs,
    worker_train,
)

__all__ = ["expected_cosine", "controller_fixed_point", "adascale_gain",
           "adascale_gain_from_b_simple", "steps_samples_model", "critical_batch_fit",
           "HalfStats", "two_half_stats", "NoiseScale", "SimiGradController",
           "LinearRegressionProblem", "RegressionTask", "DigitsTask", "half_gradients",
           "half_groups", "worker_half_gradients", "draw_probe", "METHODS", "LR_SCALINGS",
           "History",
           "train", "worker_train", "train_runs", "probe_bytes", "samples_to_target",
           "monte_carlo_halves",
           "measure_noise_scale", "batch_sweep", "tradeoff_model", "frontier_samples", "bench"]
