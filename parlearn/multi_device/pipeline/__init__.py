"""Pipeline parallelism (lesson 13): GPipe, 1F1B and zero-bubble schedules as loops over send/recv.

A model is a chain of layers cut into ``P`` contiguous *stages*, one per rank; a batch is
cut into ``M`` *micro-batches*. Stage ``s`` runs ``F m`` (forward of micro-batch ``m``:
receive the activation from ``s-1``, compute, send to ``s+1``) and ``B m`` (backward:
receive the output gradient from ``s+1``, compute, send the input gradient to ``s-1``).

One source of truth. :func:`schedule` lists, for every rank, the order of its operations;
the real ranks (:func:`run_pipeline`, through :func:`parlearn.distributed.run`) execute exactly that
list, and the simulator (:func:`simulate`) draws the timeline of the same list from
per-stage costs (modeled).

==================  ==================================================================
module              what it holds
==================  ==================================================================
``schedules``       :class:`Op`, the GPipe, 1F1B and zero-bubble orders of each rank
                    (:func:`schedule`), the bubble ``(P-1)/(M+P-1)`` (:func:`bubble_formula`)
``simulator``       the simulator (modeled): :func:`simulate` of any orders, and two
                    pipelines in opposite directions (:func:`simulate_bidirectional`)
``partition``       stages as layer counts: the equal split, the balanced split of
                    measured layer costs (LAMP)
``runtime``         the model and the single-process reference, the stages on real gloo
                    ranks (:func:`run_pipeline`), the measured bubble, the bench rows
``zoo``             interleaved 1F1B, ZB-H2, ZB-V (and DualPipe-V, reconstructed:
                    :func:`dualpipe_v`) as :class:`Schedule` objects
                    (:func:`zoo_schedule`), :func:`validate`, the papers' bubbles
``virtual``         any :class:`Schedule` (chunks, V placement) on real gloo ranks
                    (:func:`run_schedule`)
``torch_pipeline``  the same stages through ``torch.distributed.pipelining``, and its
                    interleaved, ZB-V and DualPipe-V schedules (:func:`run_torch_zoo`);
                    torch's DualPipe-V order as our Schedule (:func:`dualpipe_v_order`)
``hydra``           several models interleaved through one pipeline (Hydra)
==================  ==================================================================

Lesson 13 uses it all; lesson 22 (:mod:`parlearn.serial_chain.local`) runs pipelined
backprop with :func:`run_pipeline` on the same ranks as its local pipeline and models both
with :func:`simulate`. The names a notebook uses are re-exported here:
``from parlearn import pipeline as pl; pl.run_pipeline("1f1b", model, x, y, 2, 4)``.
"""

from parlearn.multi_device.pipeline.hydra import hydra_reference, hydra_schedule, hydra_train
from parlearn.multi_device.pipeline.partition import (
    layer_costs,
    partition_balanced,
    partition_equal,
    split_layers,
    stage_costs,
)
from parlearn.multi_device.pipeline.runtime import (
    PipelineRun,
    _preimport,  # noqa: F401  (parlearn.serial_chain.local starts its ranks with it)
    bench,
    make_data,
    make_model,
    measured_bubble,
    reference_grads,
    run_pipeline,
    stage_op_costs,
)
from parlearn.multi_device.pipeline.schedules import (
    SCHEDULES,
    Op,
    Schedule,
    bubble_formula,
    schedule,
)
from parlearn.multi_device.pipeline.simulator import (
    Simulation,
    measured_beside_simulated,
    simulate,
    simulate_bidirectional,
)
from parlearn.multi_device.pipeline.torch_pipeline import (
    TORCH_SCHEDULES,
    TORCH_ZOO,
    dualpipe_v_order,
    run_torch_pipeline,
    run_torch_zoo,
)
from parlearn.multi_device.pipeline.virtual import run_schedule
from parlearn.multi_device.pipeline.zoo import (
    ZOO,
    dualpipe_v,
    dualpipe_v_bubble,
    in_flight_formula,
    paper_bubble,
    validate,
    zoo_schedule,
)

__all__ = ["SCHEDULES", "Op", "schedule", "bubble_formula", "Simulation", "simulate",
           "make_model", "make_data", "split_layers", "reference_grads", "PipelineRun",
           "run_pipeline", "measured_bubble", "stage_op_costs", "TORCH_SCHEDULES",
           "run_torch_pipeline",
           "partition_equal", "partition_balanced", "stage_costs", "layer_costs",
           "hydra_schedule", "hydra_train", "hydra_reference", "simulate_bidirectional",
           "bench", "Schedule", "ZOO", "zoo_schedule", "validate", "paper_bubble",
           "in_flight_formula", "run_schedule", "TORCH_ZOO", "run_torch_zoo",
           "dualpipe_v_order", "dualpipe_v", "dualpipe_v_bubble", "measured_beside_simulated"]
