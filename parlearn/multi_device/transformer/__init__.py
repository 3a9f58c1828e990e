"""The tiny GPT: Part 1's running example from lesson 16 on.

=============  ==========================================================================
module         what it holds
=============  ==========================================================================
``corpus``     the text of CPython's ``pydoc_data.topics``, char-level, fixed split
``model``      :class:`GPTConfig`, :class:`GPT` (pre-norm, causal attention written out,
               GELU/SwiGLU, RoPE/learned positions, tied embeddings), recomputation
``train``      FLOPs per token (modeled, and counted by ``FlopCounterMode``), training
=============  ==========================================================================

Lessons 16-19 train it, measure where its memory goes (:mod:`parlearn.memory`) and split it
over devices.
"""

from parlearn.multi_device.transformer.corpus import CharCorpus, get_batch, pydoc_corpus
from parlearn.multi_device.transformer.model import (
    GPT,
    RECOMPUTE,
    GPTConfig,
    attention_core,
    count_params,
)
from parlearn.multi_device.transformer.train import evaluate, flops_per_token, measured_flops, train

__all__ = ["CharCorpus", "pydoc_corpus", "get_batch", "GPTConfig", "GPT", "RECOMPUTE",
           "attention_core", "count_params", "flops_per_token", "measured_flops", "evaluate",
           "train"]
