"""Mixture of experts and expert parallelism (lesson 18).

=============  ==========================================================================
module         what it holds
=============  ==========================================================================
``router``     token-choice top-k with capacity, expert choice, balance loss, z-loss
``layer``      :class:`MoE` and its reference loop over experts, :func:`moe_gpt`
``parallel``   expert parallelism: all-to-all dispatch and combine on real ranks, EP x DP
``cost``       all-to-all bytes, imbalance, the capacity trade, EP against replicated
               experts (modeled)
``modern``     fine-grained and shared experts (DeepSeekMoE), balancing by a router bias
               (auxiliary-loss-free), dropless routing and the drops a capacity causes
``train``      training an MoE-GPT beside the dense GPT at equal compute per token
``workers``    EP against the single-process MoE on real ranks: one layer, training
=============  ==========================================================================
"""

from parlearn.multi_device.moe.cost import (
    all_to_all_bytes,
    capacity_trade,
    ep_pays,
    ep_vs_replicated,
    imbalance,
)
from parlearn.multi_device.moe.layer import ROUTINGS, MoE, aux_loss, moe_gpt, moe_layers
from parlearn.multi_device.moe.modern import (
    FineGrainedMoE,
    bias_update,
    drop_rates,
    fine_grained_shape,
    modern_gpt,
    per_token_reference,
)
from parlearn.multi_device.moe.parallel import (
    AllToAll,
    ExpertParallelMoE,
    mesh_groups,
    sync_grads,
    to_expert_parallel,
)
from parlearn.multi_device.moe.router import (
    Routing,
    balance_loss,
    capacity,
    expert_choice,
    token_choice,
    z_loss,
)
from parlearn.multi_device.moe.train import train_moe
from parlearn.multi_device.moe.workers import layer_check, train_check

__all__ = ["Routing", "capacity", "token_choice", "expert_choice", "balance_loss", "z_loss",
           "MoE", "ROUTINGS", "moe_gpt", "moe_layers", "aux_loss", "AllToAll", "ExpertParallelMoE",
           "mesh_groups", "to_expert_parallel", "sync_grads", "all_to_all_bytes", "imbalance",
           "capacity_trade", "ep_pays", "ep_vs_replicated", "train_moe", "layer_check",
           "train_check", "FineGrainedMoE", "bias_update", "fine_grained_shape",
           "per_token_reference", "drop_rates", "modern_gpt"]
