"""Mixture of experts and expert parallelism (lesson 18).

=============  ==========================================================================
module         what it holds
=============  ==========================================================================
``router``     token-choice top-k with capacity, expert choice, balance loss, z-loss
``layer``      :class:`MoE` and its reference loop over experts, :func:`moe_gpt`
``parallel``   expert parallelism: all-to-all dispatch and combine on real ranks, EP x DP
``cost``       all-to-all bytes, imbalance, what the capacity factor trades (modeled)
``train``      training an MoE-GPT beside the dense GPT; the workers lesson 18 runs
=============  ==========================================================================
"""

from parlearn.multi_device.moe.layer import ROUTINGS, MoE, aux_loss, moe_gpt, moe_layers
from parlearn.multi_device.moe.router import (
    Routing,
    balance_loss,
    capacity,
    expert_choice,
    token_choice,
    z_loss,
)

__all__ = ["Routing", "capacity", "token_choice", "expert_choice", "balance_loss", "z_loss",
           "MoE", "ROUTINGS", "moe_gpt", "moe_layers", "aux_loss"]
