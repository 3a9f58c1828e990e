"""Data parallelism (lesson 11): replicas that average their gradients.

=================  =======================================================================
module             what it holds
=================  =======================================================================
``ddp``            :class:`NaiveDP`, :class:`BucketedDP` (overlapped buckets),
                   :class:`CompressedDP`, torch's DDP via :func:`make_ddp`, the serial
                   reference :func:`train_reference`, the step cost model
``dynamic_tree``   the 8-bit dynamic tree type (Dettmers 2016): its codes, the fast coders
                   and their serial references
``compression``    the compressed all-reduce on those codes, its DDP comm hook, error
                   feedback, its cost with coding and the bandwidth where 8 bits pay
``slow_link``      an EMULATED slow link (a delay per message and per byte after each
                   collective) and the emulated bandwidths either side of the crossover
``stragglers``     slow workers: order statistics of delays, backup workers (Chen et al.)
``workers``        lesson 11's measurements on real ranks and the bench rows
``explorer``       lesson 11's explorer (measured step beside the model) and the modeled
                   cluster timeline, drawn
=================  =======================================================================

The engines of ``ddp`` and the seeded :func:`parlearn.core.models.mlp` they train are
re-exported here: ``from parlearn import data_parallel as dp; dp.BucketedDP(model)``.
"""

from parlearn.core.models import mlp, mlp_param_bytes
from parlearn.multi_device.data_parallel.ddp import (
    BucketedDP,
    CompressedDP,
    NaiveDP,
    TiedMLP,
    make_ddp,
    shard,
    train_reference,
    worker_train,
)
from parlearn.multi_device.data_parallel.step_model import DPStepModel, dp_step_model

__all__ = ["NaiveDP", "BucketedDP", "CompressedDP", "make_ddp", "TiedMLP", "train_reference",
           "shard", "DPStepModel", "dp_step_model", "worker_train", "mlp", "mlp_param_bytes"]
