"""Does it fit? A per-GPU memory calculator for Llama-shaped models, modeled.

:func:`estimate` adds, per GPU:

- weights, gradients, optimizer states: :func:`parlearn.sharding.memory_model`'s ZeRO
  accounting (bytes per parameter from ``parlearn.sharding.PRECISIONS``: fp32 Adam 4+4+8,
  bf16 mixed precision 2+2+12), on the parameters this GPU holds after tensor parallelism
  (``tp`` shards every block matrix and the vocabulary) and pipeline parallelism (``pp``
  stages of ``L / pp`` blocks; the first stage also holds the embedding, the last the output
  layer: the larger of the two is reported);
- activations of the first pipeline stage, which holds the most micro-batches in flight:
  ``M`` for GPipe (all of them), ``min(P, M)`` for 1F1B. Per block and micro-batch, in
  16-bit without dropout (the count of :mod:`parlearn.memory.activations` at 2 bytes per
  element, generalised to grouped-query attention with ``k`` key/value heads of width
  ``d``; Llama uses RMSNorm, whose statistics are left out):

      2 s b (2h + h + h + 2kd + h + h + 4f) + 2 a b s s_k        (none)

  the second term, the softmax output, goes with ``selective`` recomputation (as with
  FlashAttention, which never stores it); ``full`` keeps only each block's input ``2 s b h``,
  plus, once, the block the backward is rebuilding: one block and micro-batch of ``none``
  (its score matrix included), alive while that block's gradients are computed.
  Tensor parallelism with sequence parallelism divides everything by ``tp`` (Korthikanti
  et al. 2022); context parallelism gives each GPU ``s / cp`` tokens, with keys of length
  ``s_k = s`` for its queries (ring attention visits every key block).
- the output layer's logits in fp32 for the loss, ``4 b s V / tp``, on the last stage
  (counted with the first when ``pp = 1``).

Everything is an estimate: no allocator fragmentation, no temporary buffers, no
communication buffers, no CUDA context (about 1 GB on real GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

from parlearn.core.checks import check_bool, check_choice, check_int
from parlearn.multi_device.sharding import PRECISIONS, memory_model

__all__ = ["LlamaShape", "PRESETS", "estimate", "SCHEDULES"]

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-style decoder: RMSNorm, grouped-query attention, SwiGLU, untied output."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False

    def __post_init__(self):
        for name in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab"):
            check_int(name, getattr(self, name), lo=1)
        check_bool("tied", self.tied)
        if self.hidden % self.heads:
            raise ValueError(f"heads={self.heads} must divide hidden={self.hidden}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} must divide heads={self.heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def block_params(self) -> int:
        h, kd = self.hidden, self.kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kd + 3 * h * self.ffn + 2 * h

    def n_params(self) -> int:
        emb = self.vocab * self.hidden
        return self.layers * self.block_params() + emb * (1 if self.tied else 2) + self.hidden

    def matmul_params(self) -> int:
        """The parameters that multiply activations (``6 N`` counts these): q, k, v, o and
        the SwiGLU MLP's three matrices per layer, and the output layer (tied or not). Not
        the input embedding (a lookup) nor the norms (elementwise)."""
        h, kd = self.hidden, self.kv_heads * self.head_dim
        return self.layers * (2 * h * h + 2 * h * kd + 3 * h * self.ffn) + self.vocab * h


# Shapes from Meta's Llama 3 model cards / "The Llama 3 Herd of Models" (2024), table 3.
PRESETS: dict[str, LlamaShape] = {
    "llama3-8b": LlamaShape(4096, 32, 32, 8, 14336, 128256),
    "llama3-70b": LlamaShape(8192, 80, 64, 8, 28672, 128256),
    "llama3-405b": LlamaShape(16384, 126, 128, 8, 53248, 128256),
}


def _activations(m: LlamaShape, b: int, s: int, s_k: int, recompute: str) -> float:
    h, f, kd, a = m.hidden, m.ffn, m.kv_heads * m.head_dim, m.heads
    if recompute == "full":
        return 2 * s * b * h
    out = 2 * s * b * (6 * h + 2 * kd + 4 * f)
    if recompute == "none":
        out += 2 * a * b * s * s_k
    return out


def estimate(model: LlamaShape | str, batch: int, seq: int, *, precision: str = "bf16-mixed",
             zero_stage: int = 0, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1,
             recompute: str = "none", schedule: str = "1f1b", micro_batches: int = 1
             ) -> dict[str, float]:
    """Modeled bytes per GPU (module docstring): ``{"params", "grads", "optimizer",
    "activations", "logits", "total", "gpus"}``. ``batch`` is the micro-batch per GPU,
    ``micro_batches`` the number per step (what the pipeline keeps in flight)."""
    if isinstance(model, str):
        model = PRESETS[check_choice("model", model, PRESETS)]
    if not isinstance(model, LlamaShape):
        raise TypeError(f"model must be a LlamaShape or a preset name, got "
                        f"{type(model).__name__}")
    batch, seq = check_int("batch", batch, lo=1), check_int("seq", seq, lo=1)
    check_choice("precision", precision, PRECISIONS)
    check_choice("zero_stage", zero_stage, (0, 1, 2, 3))
    dp, tp, pp, cp = (check_int(n, v, lo=1) for n, v in
                      (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)))
    check_choice("recompute", recompute, ("none", "selective", "full"))
    check_choice("schedule", schedule, SCHEDULES)
    micro_batches = check_int("micro_batches", micro_batches, lo=1)
    if model.heads % tp or model.kv_heads % tp:
        raise ValueError(f"tp={tp} must divide heads={model.heads} and "
                         f"kv_heads={model.kv_heads}")
    if model.layers % pp:
        raise ValueError(f"pp={pp} must divide layers={model.layers}")
    if seq % cp:
        raise ValueError(f"cp={cp} must divide seq={seq}")
    blocks = model.layers // pp
    emb = model.vocab * model.hidden / tp
    stage_params = blocks * model.block_params() / tp + (emb if pp > 1 or model.tied else 2 * emb)
    states = memory_model(round(stage_params), dp, zero_stage, precision)
    in_flight = micro_batches if schedule == "gpipe" else min(pp, micro_batches)
    act = blocks * in_flight * _activations(model, batch, seq // cp, seq, recompute) / tp
    if recompute == "full":   # the block being recomputed during the backward, one at a time
        act += _activations(model, batch, seq // cp, seq, "none") / tp
    logits = 4 * batch * (seq // cp) * model.vocab / tp
    out = {"params": states["params"], "grads": states["grads"],
           "optimizer": states["optimizer"], "activations": act, "logits": logits}
    out["total"] = sum(out.values())
    out["gpus"] = dp * tp * pp * cp
    return out
