"""Local learning: layer groups that learn without waiting for the backward pass (lesson 22).

Backprop *locks* a network (Jaderberg et al. 2017): block ``k`` cannot run its forward
before block ``k-1`` has (forward locking), cannot update before the whole forward and the
backward down to it are done (update locking), and the backward itself is a serial chain
(backward locking; lesson 20). Local learning gives every block its own learning signal,
so block ``k`` updates as soon as its own forward is done. Three ways to make that signal:
local heads (``rule="heads"``), local critics (``rule="critics"``) and Hebbian feedback
weights (``rule="hebbian"``, or ``"fixed"`` for feedback alignment).

=========  ===============================================================================
module     what it holds
=========  ===============================================================================
``net``    :class:`LocalNet` (blocks with heads), :func:`make_net`, :func:`as_sequential`,
           and :class:`FeedbackLinear`: a Linear layer whose backward uses ``R``, not ``W^T``
``rules``  one block's local step and global backprop's; the serial reference
           :func:`train` in an explicit order of updates; :func:`run_local`, the same
           updates as an asynchronous pipeline on real ranks; :func:`compare_rules`
``cost``   the cost model against backprop and pipelined backprop (through
           :func:`parlearn.pipeline.simulate`), the measured op costs, the bench rows
=========  ===============================================================================

The names a notebook uses are re-exported here:
``from parlearn import local as lo; lo.train(lo.make_net([64, 32, 10], 2), x, y, "heads")``.
"""

from parlearn.serial_chain.local.cost import bench, block_costs, cost_model, local_orders
from parlearn.serial_chain.local.net import (
    FeedbackLinear,
    LocalNet,
    as_sequential,
    feedback_angle,
    make_net,
)
from parlearn.serial_chain.local.rules import (
    LOCAL_RULES,
    ORDERS,
    RULES,
    LocalRun,
    TrainResult,
    accuracy,
    backprop_step,
    compare_rules,
    local_step,
    minibatches,
    run_local,
    train,
    update_order,
)

__all__ = ["RULES", "LOCAL_RULES", "ORDERS", "FeedbackLinear", "LocalNet", "make_net",
           "as_sequential", "feedback_angle", "minibatches", "update_order", "backprop_step",
           "local_step", "train", "TrainResult", "accuracy", "LocalRun", "run_local",
           "local_orders", "block_costs", "cost_model", "compare_rules", "bench"]
