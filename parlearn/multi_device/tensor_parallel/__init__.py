"""Tensor parallelism (lesson 14): split layers, data movements as operators, tiling plans.

    from parlearn import tensor_parallel as tp
    tp.megatron_check(2)                       # the Megatron block on 2 real ranks
    tp.best_one_cut(8, [256, 1024, 256], 8)    # the communication-optimal cut per layer

=================  =======================================================================
module             what it holds
=================  =======================================================================
``megatron``       Megatron's ``f`` and ``g``, column- and row-parallel linear layers from
                   scratch, checked beside DTensor's ``parallelize_module`` on real ranks;
                   ``tp_roofline``, when the block stays compute-bound
``layers``         the same layers with Megatron-LM's constructor arguments (sizes, seed,
                   ``gather_output``, ``input_is_parallel``), the vocabulary-parallel
                   embedding and cross-entropy, the gather/split autograd pair
``movements``      DistDL's movements as linear operators with their adjoints (broadcast,
                   scatter, all-gather, halo exchange, transpose): in one process, the
                   dot-product test, and the same pairs on real ranks
``conv``           :class:`SpatialConv1d`: a convolution split along its positions by the
                   halo exchange; the bench rows (counted vs modeled bytes)
``plan``           SoyBean's tiling search: layers, cuts, their collectives, the one-cut
                   dynamic program against brute force, SplitBrain's hybrid
``plan_levels``    ``2^k`` devices: SoyBean's recursion against the joint optimum; an
                   Alpa-style two-level plan (pipeline stages x sharding)
``plan_hlo``       the collectives XLA inserts for a plan on a JAX mesh of fake devices
=================  =======================================================================

Everything a notebook uses, the planner's names included, is re-exported here.
"""

from parlearn.multi_device.tensor_parallel.conv import (
    SpatialConv1d,
    bench,
    halo_conv_check,
    halo_conv_worker,
    serial_conv,
)
from parlearn.multi_device.tensor_parallel.layer_check import (
    megatron_layers_check,
    megatron_layers_worker,
)
from parlearn.multi_device.tensor_parallel.layers import (
    GatherFromRanks,
    MegatronColumnParallelLinear,
    MegatronRowParallelLinear,
    SplitToRanks,
    VocabParallelEmbedding,
    serial_embedding,
    serial_linear,
    vocab_parallel_cross_entropy,
)
from parlearn.multi_device.tensor_parallel.megatron import (
    ELEMENTWISE,
    ColumnParallelLinear,
    CopyToRanks,
    MegatronMLP,
    RowParallelLinear,
    SumOverRanks,
    megatron_check,
    megatron_worker,
    serial_mlp,
    tp_roofline,
)
from parlearn.multi_device.tensor_parallel.movements import (
    MOVEMENTS,
    RANK_MOVEMENTS,
    RankAllGather,
    RankBroadcast,
    RankGather,
    RankHaloExchange,
    RankReduceScatter,
    RankRepartition,
    RankScatter,
    RankSumReduce,
    _halo,  # noqa: F401  (private: the tests check the one-process halo pair)
    _halo_add,  # noqa: F401
    dot_product_test,
    movement,
    movement_matrix,
    rank_dot_product_worker,
)
from parlearn.multi_device.tensor_parallel.plan import (
    CONV_CUTS,
    CUTS,
    Conv,
    Dense,
    best_one_cut,
    brute_force_cut,
    is_splitbrain,
    network,
    plan_collectives,
    plan_cost,
)
from parlearn.multi_device.tensor_parallel.plan_hlo import bytes_by_kind, hlo_collectives
from parlearn.multi_device.tensor_parallel.plan_levels import (
    brute_force_joint,
    joint_plan,
    plan_levels_cost,
    recursive_plan,
    two_level_plan,
)

__all__ = ["CopyToRanks", "SumOverRanks", "ColumnParallelLinear", "RowParallelLinear",
           "ELEMENTWISE", "MegatronMLP", "serial_mlp", "megatron_worker", "megatron_check",
           "tp_roofline",
           # Megatron's constructor API: layers
           "GatherFromRanks", "SplitToRanks", "MegatronColumnParallelLinear",
           "MegatronRowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "serial_linear", "serial_embedding",
           "megatron_layers_check", "megatron_layers_worker",
           "MOVEMENTS", "movement", "dot_product_test", "movement_matrix",
           "RankBroadcast", "RankSumReduce", "RankScatter", "RankGather", "RankAllGather",
           "RankReduceScatter",
           "RankHaloExchange", "RankRepartition", "RANK_MOVEMENTS", "rank_dot_product_worker",
           "SpatialConv1d", "serial_conv", "halo_conv_worker", "halo_conv_check", "bench",
           # the planner: plan, plan_levels, plan_hlo
           "Dense", "Conv", "CUTS", "CONV_CUTS", "network", "plan_collectives", "plan_cost",
           "best_one_cut", "brute_force_cut", "recursive_plan", "joint_plan",
           "brute_force_joint", "plan_levels_cost", "is_splitbrain", "hlo_collectives",
           "bytes_by_kind", "two_level_plan"]
