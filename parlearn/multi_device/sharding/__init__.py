"""Sharding the optimizer, gradients and parameters (lesson 12): weight-update sharding, ZeRO.

Plain data parallelism keeps N replicas of everything: each rank all-reduces the gradient
and then runs the same Adam update on the same full parameter vector, holding its own copy
of Adam's two moment buffers. Xu et al. (arXiv 2004.13336) observe that an all-reduce *is*
a reduce-scatter followed by an all-gather, and move the update in between:

    reduce-scatter(grad)   ->  rank r holds the summed gradient of its 1/N shard
    Adam on that shard     ->  1/N of the FLOPs and 1/N of the moment buffers
    all-gather(params)     ->  every rank has the full updated parameters again

The bytes on the wire are the same as the all-reduce's. ZeRO (Rajbhandari et al., arXiv
1910.02054) names the stages by what is sharded: stage 1 the optimizer state, stage 2 also
the gradients (each rank keeps only the gradient shard it updates), stage 3 also the
parameters (each layer's parameters are all-gathered just before its forward and again
before its backward, and freed right after). FSDP is stage 3.

===============  =====================================================================
module           what it holds
===============  =====================================================================
``zero``         :class:`ShardedAdam`, stages 0-3 from scratch on ``torch.distributed``;
                 the flat padded buffer (:class:`FlatShard`), the shard's Adam step
``training``     what to train (:class:`Spec`), the serial ``torch.optim.Adam``
                 reference, the stages on real ranks (bytes sent, held, step times),
                 the bench rows
``optimizer``    :class:`ShardedOptimizer`: ZeRO-1/2 around any torch optimizer, shaped
                 like torch's ``ZeroRedundancyOptimizer`` (param groups, schedulers)
``fsdp``         :func:`shard_module`: ZeRO-3 as a module wrapper (FSDP2's shape: any optimizer
                 steps the shards; mixed precision; accumulation with and without no_sync)
``engines``      the real engines: ``ZeroRedundancyOptimizer`` (stage 1), FSDP2 (stage 3)
``cost``         the memory and communication models of each stage (modeled)
``jax_update``   the same update in JAX with an explicit ``psum_scatter`` on fake devices
===============  =====================================================================

The names a notebook uses are re-exported here:
``from parlearn import sharding; sharding.train_sharded(sharding.Spec(), stage=2)``.
Importing it starts neither JAX nor FSDP: they are imported where they run.
"""

from parlearn.multi_device.sharding.cost import (
    PRECISIONS,
    comm_model,
    draw_stages,
    gpus_needed,
    ledger_wire_bytes,
    memory_model,
)
from parlearn.multi_device.sharding.dropin import VARIANTS, dropin_check, recipe_worker
from parlearn.multi_device.sharding.engines import train_engine
from parlearn.multi_device.sharding.fsdp import MixedPrecisionPolicy, ShardedModule, shard_module
from parlearn.multi_device.sharding.jax_update import jax_sharded_adam, jax_sharded_adam_subprocess
from parlearn.multi_device.sharding.optimizer import ShardedOptimizer, owners
from parlearn.multi_device.sharding.training import (
    Spec,
    _worker_misuse,  # noqa: F401  (tests/multi_device/test_sharding.py runs it on real ranks)
    bench,
    measure_memory,
    mlp,
    regression_data,
    step_times,
    train_serial,
    train_sharded,
)
from parlearn.multi_device.sharding.zero import (
    STAGES,
    FlatShard,
    ShardedAdam,
    adam_update,
    storage_bytes,
)

__all__ = ["STAGES", "PRECISIONS", "FlatShard", "adam_update", "ShardedAdam", "mlp",
           "regression_data", "storage_bytes", "Spec", "train_serial", "train_sharded",
           "measure_memory", "ledger_wire_bytes",
           "train_engine", "memory_model", "comm_model", "gpus_needed", "draw_stages", "step_times",
           "jax_sharded_adam",
           "jax_sharded_adam_subprocess", "bench", "ShardedOptimizer", "owners",
           "shard_module", "ShardedModule", "MixedPrecisionPolicy", "VARIANTS", "dropin_check",
           "recipe_worker"]
