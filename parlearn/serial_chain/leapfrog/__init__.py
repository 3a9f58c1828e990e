"""Leapfrogging backprop: take the weight gradients off the critical path (lesson 20).

Reconstruction. Y. Saraiya, "Leapfrogging for parallelism in deep neural networks"
(arXiv 1801.04928) could only be read as an abstract ("a savings of 1-1/k of a
dominant term in backpropagation, where k is the number of threads (or gpus)").
parlearn implements two readings of it and says so in the lesson.

Backprop through layers does two things per layer: the error chain
``delta_{l-1} = J_l^T delta_l`` (serial) and the weight gradient ``G_l = f(delta_l, a_{l-1})``
(independent across layers once ``delta_l`` is known). The schedules here run the second
beside the first, or split the first into segments.

=============  ===========================================================================
module         what it holds
=============  ===========================================================================
``terms``      the two terms (:func:`chain_step`, :func:`weight_grads`) and the forward
               pass that records the :class:`Tape` they read
``schedules``  the backward schedules ``serial``, ``leapfrog`` (a thread pool, or CUDA
               streams) and ``segments`` (chain splitting); :func:`grad`, :func:`timeline`
``cost``       the cost model (work and span per schedule), :func:`deep_mlp`, the bench
``verdict``    :func:`shortfall`: why a measured speedup falls short of the model
``explorer``   lesson 20's explorer: :func:`explore` (one setting measured beside the model)
               and :func:`plot_explore` (its figure)
=============  ===========================================================================

Layers: the schedules work on the *modules* of the flattened ``nn.Sequential`` (a tanh is
a module with a chain step and no weight gradient); :func:`cost_model`, :func:`deep_mlp`
and the lesson count *Linear layers* (each followed by its activation). The names a
notebook uses are re-exported here: ``from parlearn import leapfrog; leapfrog.grad(...)``.
"""

from parlearn.serial_chain.leapfrog.cost import (
    bench,  # noqa: F401  (as before the split; the bench registry runs leapfrog.cost's)
    cost_model,
    deep_mlp,
)
from parlearn.serial_chain.leapfrog.explorer import explore, plot_explore
from parlearn.serial_chain.leapfrog.schedules import (
    MODES,
    WORKER_THREAD_PREFIX,
    backward,
    grad,
    timeline,
)
from parlearn.serial_chain.leapfrog.terms import (
    Tape,
    _flatten,  # noqa: F401  (private: the tests flatten models with it)
    chain_step,
    forward,
    weight_grads,
)
from parlearn.serial_chain.leapfrog.verdict import shortfall

__all__ = ["MODES", "Tape", "forward", "backward", "grad", "chain_step", "weight_grads",
           "timeline", "cost_model", "deep_mlp", "WORKER_THREAD_PREFIX", "shortfall", "explore",
           "plot_explore"]
