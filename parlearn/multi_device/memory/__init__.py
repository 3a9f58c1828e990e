"""Where the memory of a training step goes (lesson 16), modeled and measured.

================  ========================================================================
module            what it holds
================  ========================================================================
``measured``      the tensors autograd saves, counted by storage with saved-tensor hooks;
                  the CUDA allocator's peak
``activations``   the activation model of the tiny GPT, term by term (equal to the measured
                  bytes), and Korthikanti et al.'s count for Megatron's block
``steps``         bytes per parameter after a real optimizer step, recomputation's memory
                  and time measured, fp16 underflow and the loss scaler
``diagram``       one pre-norm block drawn, its saved tensors marked from the model
``fp8``           the E4M3 and E5M2 formats, per-tensor amax scaling, a simulated FP8 matmul,
                  FP8's bytes per parameter and activation (modeled)
``calculator``    :func:`estimate`: per-GPU bytes of Llama-shaped models under ZeRO, TP,
                  PP, CP and recomputation (modeled)
================  ========================================================================
"""

from parlearn.multi_device.memory.activations import (
    PRECISIONS,
    activation_bytes,
    activation_terms,
    korthikanti_bytes,
    korthikanti_terms,
)
from parlearn.multi_device.memory.calculator import PRESETS, SCHEDULES, LlamaShape, estimate
from parlearn.multi_device.memory.diagram import BLOCK_TENSORS, draw_block
from parlearn.multi_device.memory.fp8 import (
    FP8_DTYPES,
    RECIPES,
    amax_scale,
    cast_stats,
    dequantize,
    format_info,
    fp8_activation_terms,
    quantize,
    round_trip,
    scaled_matmul,
    state_bytes_per_param,
)
from parlearn.multi_device.memory.measured import (
    Saved,
    SavedLedger,
    autocast_for,
    peak_memory,
    saved_tensors,
)
from parlearn.multi_device.memory.steps import fp16_underflow, recompute_cost, state_bytes

__all__ = ["PRECISIONS", "activation_terms", "activation_bytes", "korthikanti_terms",
           "korthikanti_bytes", "LlamaShape", "PRESETS", "SCHEDULES", "estimate", "Saved",
           "SavedLedger", "saved_tensors", "peak_memory", "autocast_for", "state_bytes",
           "recompute_cost", "fp16_underflow", "BLOCK_TENSORS", "draw_block", "FP8_DTYPES",
           "RECIPES", "format_info", "amax_scale", "quantize", "dequantize", "round_trip",
           "cast_stats", "scaled_matmul", "state_bytes_per_param", "fp8_activation_terms"]
