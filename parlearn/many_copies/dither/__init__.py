"""Parallel dither and dropout (lesson 30): P noisy copies of each example, one batched pass.

    from parlearn import dither
    dither.parallel_grad(model, loss_fn, x, y, copies=64, dither="gaussian", scale=0.1)

=================  =======================================================================
module             what it holds
=================  =======================================================================
``noise``          dither (uniform, Gaussian, triangular; ``scale`` its std) and dropout
                   masks for P copies: :class:`Noise`, :func:`draw_noise`
``gradients``      :func:`parallel_grad` (the copies in one batched forward/backward),
                   its serial reference :func:`sequential_grad`, :func:`grad_variance`
``demodulation``   a dithered ReLU in closed form (:func:`smoothed_relu`, its slope) and
                   the harmonics it makes from a sinusoid (:func:`relu_spectrum`)
``regimes``        the lesson's experiment: :func:`train` (three update schemes, each
                   clean or noisy) on a seeded :func:`mlp`, :func:`compare_regimes`
                   (the five regimes of the lesson) over seeds, the statistics,
                   :func:`throughput` and the bench rows
=================  =======================================================================

A reconstruction from the abstracts of Simpson (arXiv 1508.07130, 1509.05173); the
``gradients`` module says what was read and what is ours. Its whole public API is
re-exported here: ``dither.draw_noise``, ``dither.train``, ...
"""

from parlearn.many_copies.dither.demodulation import (
    relu_spectrum,
    smoothed_relu,
    smoothed_relu_slope,
)
from parlearn.many_copies.dither.gradients import (
    LossFn,  # noqa: F401 (a type alias, not in __all__)
    grad_variance,
    parallel_grad,
    sequential_grad,
)
from parlearn.many_copies.dither.noise import (
    NOISES,
    Noise,
    _sample,  # noqa: F401 (private; the tests reach it as dither._sample)
    draw_noise,
    noise_half_width,
)
from parlearn.many_copies.dither.regimes import (
    REGIMES,
    History,
    bench,
    compare_regimes,
    mlp,
    paired_difference,
    summarise,
    throughput,
    train,
)

__all__ = [
    "NOISES",
    "REGIMES",
    "Noise",
    "noise_half_width",
    "draw_noise",
    "parallel_grad",
    "sequential_grad",
    "smoothed_relu",
    "smoothed_relu_slope",
    "relu_spectrum",
    "mlp",
    "History",
    "train",
    "grad_variance",
    "compare_regimes",
    "summarise",
    "paired_difference",
    "throughput",
    "bench",
]
