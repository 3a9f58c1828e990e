"""NEq: train only the neurons that are not at equilibrium (lesson 23).

Bragagnolo, Tartaglione & Grangetto, "To update or not to update? Neurons at equilibrium
in deep models", NeurIPS 2022 (arXiv 2207.09455). After every epoch, for each neuron ``i``
(one output row of a Linear layer: its weight row and its bias):

- ``phi_i^t``: the cosine similarity of the neuron's outputs on a fixed validation subset
  after epoch ``t`` and after epoch ``t-1`` (:func:`phi`);
- ``dphi_i^t = phi_i^t - phi_i^{t-1}``, with ``phi^0 = 1``: before any training a neuron is
  taken as perfectly similar to itself (the authors' code starts its buffer the same way);
- the velocity ``v_i^t = dphi_i^t - mu v_i^{t-1}``, ``v^0 = 0`` (:func:`velocity_step`, the
  paper's equation with its ``mu`` in [0, 0.5]);
- during epoch ``t+1`` neuron ``i`` is *frozen* (no gradient, no update, its optimizer state
  untouched) iff ``|v_i^t| < eps``. The test is re-run after every epoch: a frozen neuron is
  still watched, and thaws when its inputs move it.

Two backward passes give the same gradients (tested to round-off in float64):
:func:`reference_backward` is what a user would write first (full autograd, then zero the
frozen rows); :func:`masked_backward` really skips the work: a frozen row's weight gradient
is never computed, and a layer's input gradient only when some layer below still learns.
:func:`backward_flops` is its cost model, which ``torch.utils.flop_counter`` counts exactly
(:func:`count_backward_flops`). :func:`allreduce_bytes` models what a data-parallel step
would save: frozen rows have no gradient to all-reduce. The authors' code is EIDOSLAB/NEq
(read for its conventions, not copied).
"""

from parlearn.serial_chain.neq.backward import (
    allreduce_bytes,
    backward_flops,
    count_backward_flops,
    masked_backward,
    reference_backward,
)
from parlearn.serial_chain.neq.equilibrium import (
    Equilibrium,
    linear_layers,
    phi,
    velocity_step,
)
from parlearn.serial_chain.neq.training import (
    NEqRun,
    accuracy,
    bench,
    measure_backward,
    train,
)

__all__ = ["linear_layers", "phi", "velocity_step", "Equilibrium", "masked_backward",
           "reference_backward", "backward_flops", "count_backward_flops", "allreduce_bytes",
           "NEqRun", "train", "accuracy", "measure_backward", "bench"]
