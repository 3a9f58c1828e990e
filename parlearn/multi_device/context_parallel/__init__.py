"""Long sequences: sequence parallelism, Ulysses and ring attention (lesson 17).

=====================  ==================================================================
module                 what it holds
=====================  ==================================================================
``blocks``             layouts (contiguous, zig-zag), block attention with its
                       log-sum-exp, the online-softmax merge, the block backward, causal
                       work per rank
``ring``               ring attention from send/recv, its backward a second ring
``ulysses``            DeepSpeed-Ulysses: all-to-all sequence <-> heads
``allgather``          Llama 3's context parallelism: all-gather K and V, local attention
``sequence_parallel``  Megatron SP: g / g-bar as all-gather / reduce-scatter inside TP
``cost``               bytes, messages and activation memory per rank per scheme (modeled)
``diagrams``           the ring's steps, Ulysses' all-to-all, the zig-zag tiles, drawn
``workers``            the checks on real ranks against full attention in one process
``gpt``                the tiny GPT trained with each sequence sharded over the ranks
=====================  ==================================================================
"""

from parlearn.multi_device.context_parallel.allgather import allgather_attention
from parlearn.multi_device.context_parallel.blocks import (
    LAYOUTS,
    block_attention,
    block_backward,
    causal_work,
    full_attention,
    idle_fraction,
    merge,
    shard_chunks,
    shard_index,
)
from parlearn.multi_device.context_parallel.cost import (
    COST_SCHEMES,
    attention_memory,
    hiding_shard,
    scheme_cost,
    timeline_summary,
)
from parlearn.multi_device.context_parallel.diagrams import draw_ring, draw_ulysses, draw_zigzag
from parlearn.multi_device.context_parallel.gpt import (
    cp_forward,
    cp_train,
    cp_train_runs,
    cp_train_worker,
    serial_train,
)
from parlearn.multi_device.context_parallel.ring import RingAttention, ring_attention
from parlearn.multi_device.context_parallel.sequence_parallel import (
    GatherSequence,
    ScatterSequence,
    SequenceParallelBlock,
    TensorParallelBlock,
    serial_block,
    sp_block_worker,
)
from parlearn.multi_device.context_parallel.ulysses import AllToAll, ulysses_attention
from parlearn.multi_device.context_parallel.workers import (
    SCHEMES,
    attention_check,
    attention_checks,
    attention_inputs,
    attention_worker,
    layout_timing,
    layout_timing_worker,
    saved_bytes,
    torch_cp_worker,
)

__all__ = ["LAYOUTS", "shard_chunks", "shard_index", "full_attention", "block_attention",
           "merge", "block_backward", "causal_work", "idle_fraction", "RingAttention",
           "ring_attention", "AllToAll", "ulysses_attention",
           "allgather_attention", "GatherSequence",
           "ScatterSequence", "SequenceParallelBlock", "TensorParallelBlock", "serial_block",
           "sp_block_worker", "SCHEMES", "attention_inputs", "attention_worker",
           "attention_check", "attention_checks", "layout_timing",
           "layout_timing_worker", "saved_bytes",
           "COST_SCHEMES", "scheme_cost", "attention_memory", "hiding_shard",
           "timeline_summary", "draw_ring", "draw_ulysses", "draw_zigzag", "cp_forward",
           "serial_train", "cp_train", "cp_train_worker",
           "cp_train_runs", "torch_cp_worker"]
