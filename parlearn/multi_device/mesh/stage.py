"""One rank's piece of the tiny GPT on a ``pp x dp x tp`` mesh: :class:`StageGPT`, and the
checks of a plan (:func:`check_plan`). :mod:`parlearn.mesh.composed` trains it.

A stage keeps its blocks (and the embedding, final norm, tied output layer where they
belong); every linear is cut to its tensor-parallel shard (q, k, v and the MLP's first
projections by output features, the attention output and the MLP's last projection by input
features), and Megatron's conjugate pair (``f``/``g``, or SP's gather/reduce-scatter along
the sequence) sits at the edges of each TP region.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parlearn.core.checks import check_bool, check_choice, check_int
from parlearn.multi_device.context_parallel.sequence_parallel import (
    GatherSequence,
    ScatterSequence,
)
from parlearn.multi_device.mesh.layout import MeshShape
from parlearn.multi_device.tensor_parallel.megatron import CopyToRanks, SumOverRanks
from parlearn.multi_device.transformer.model import GPT, GPTConfig, _rotate_half, attention_core

__all__ = ["COLUMN", "ROW", "check_plan", "StageGPT"]

# Linear layers split by output features (dim 0 of the weight) and by input features (dim 1).
COLUMN = ("attn.q", "attn.k", "attn.v", "mlp.up", "mlp.gate")
ROW = ("attn.o", "mlp.down")


def shard_dim(name: str) -> int | None:
    """Which dim of parameter ``name`` tensor parallelism splits (None: replicated)."""
    for part, dim in [(p, 0) for p in COLUMN] + [(p, 1) for p in ROW]:
        if f".{part}.weight" in name:
            return dim
    return None


def check_plan(cfg: GPTConfig, shape: MeshShape, batch: int, seq: int, micro_batches: int,
               sp: bool) -> None:
    """Refuse, naming the argument, a plan the mesh cannot run."""
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
    if not isinstance(shape, MeshShape):
        raise TypeError(f"shape must be a MeshShape, got {type(shape).__name__}")
    if cfg.n_layers % shape.pp:
        raise ValueError(f"shape.pp={shape.pp} must divide cfg.n_layers={cfg.n_layers}")
    if cfg.n_heads % shape.tp or cfg.ff % shape.tp:
        raise ValueError(f"shape.tp={shape.tp} must divide cfg.n_heads={cfg.n_heads} and the MLP "
                         f"width {cfg.ff}")
    if batch % (shape.dp * micro_batches):
        raise ValueError(f"batch={batch} must divide into dp={shape.dp} replicas of "
                         f"micro_batches={micro_batches} equal micro-batches")
    if seq > cfg.max_seq:
        raise ValueError(f"seq={seq} must be at most cfg.max_seq={cfg.max_seq}")
    if sp and seq % shape.tp:
        raise ValueError(f"sp=True needs seq={seq} divisible by tp={shape.tp}")


class StageGPT(nn.Module):
    """Rank ``(stage, shard)``'s piece of ``full``: its pipeline stage's blocks with every
    linear cut to its tensor-parallel shard. Parameter names are ``full``'s, so a shard
    can be put back where it came from (:func:`assemble`)."""

    def __init__(self, full: GPT, shape: MeshShape, stage: int, shard: int, *, sp: bool,
                 tp_group=None, recompute: str = "none"):
        if not isinstance(full, GPT):
            raise TypeError(f"full must be a parlearn.transformer.GPT, got {type(full).__name__}")
        if not isinstance(shape, MeshShape):
            raise TypeError(f"shape must be a MeshShape, got {type(shape).__name__}")
        stage = check_int("stage", stage, lo=0, hi=shape.pp - 1)
        shard = check_int("shard", shard, lo=0, hi=shape.tp - 1)
        check_bool("sp", sp)
        if full.cfg.n_layers % shape.pp or full.cfg.n_heads % shape.tp or full.cfg.ff % shape.tp:
            raise ValueError(f"shape={shape} must divide the model: pp into n_layers, tp into "
                             "n_heads and the MLP width")
        super().__init__()
        cfg = full.cfg
        self.cfg, self.tp, self.sp, self.group = cfg, shape.tp, sp, tp_group
        self.recompute = check_choice("recompute", recompute, ("none", "full"))
        self.first, self.last = stage == 0, stage == shape.pp - 1
        per = cfg.n_layers // shape.pp
        keep = range(stage * per, (stage + 1) * per)
        self.tok = copy.deepcopy(full.tok) if self.first or self.last else None
        self.pos = copy.deepcopy(full.pos) if self.first and full.pos is not None else None
        self.blocks = nn.ModuleDict({str(i): copy.deepcopy(full.blocks[i]) for i in keep})
        self.ln_f = copy.deepcopy(full.ln_f) if self.last else None
        for name, p in self.named_parameters():
            dim = shard_dim(name)
            if dim is not None:
                p.data = p.data.chunk(shape.tp, dim=dim)[shard].clone()
        self.heads = cfg.n_heads // shape.tp
        for name in ("mask", "cos", "sin"):
            self.register_buffer(name, getattr(full, name), persistent=False)

    def replicated(self) -> list[nn.Parameter]:
        """Parameters every tp rank holds whole (LayerNorms, embedding, positions)."""
        return [p for n, p in self.named_parameters() if shard_dim(n) is None]

    # Megatron's conjugate pair at the edges of each TP region.
    def _enter(self, h: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return h
        return GatherSequence.apply(h, self.group, 1) if self.sp else CopyToRanks.apply(
            h, self.group)

    def _leave(self, y: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return y
        return ScatterSequence.apply(y, self.group, 1) if self.sp else SumOverRanks.apply(
            y, self.group)

    def _block(self, blk: nn.Module, x: torch.Tensor) -> torch.Tensor:
        a, m = blk.attn, blk.mlp
        h = self._enter(blk.ln1(x))
        b, s, _ = h.shape
        q, k, v = (lin(h).view(b, s, self.heads, -1).transpose(1, 2) for lin in (a.q, a.k, a.v))
        if a.rope:
            cos, sin = self.cos[:s], self.sin[:s]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        y = attention_core(q, k, v, self.mask[:s, :s])
        x = x + self._leave(a.o(y.transpose(1, 2).reshape(b, s, -1)))
        h = self._enter(blk.ln2(x))
        z = m.down(F.silu(m.gate(h)) * m.up(h)) if m.swiglu else m.down(F.gelu(m.up(h)))
        return x + self._leave(z)

    def tokens(self, t: torch.Tensor, shard: int) -> torch.Tensor:
        """This rank's tokens of ``t`` (``(b, S)``): its ``S/tp`` slice under SP, else all."""
        return t.chunk(self.tp, dim=1)[shard] if self.sp and self.tp > 1 else t

    def forward(self, x: torch.Tensor, shard: int = 0, targets: torch.Tensor | None = None,
                denominator: float = 1.0) -> torch.Tensor:
        """First stage: ``x`` is the token ids ``(b, S)``; later stages: the activation from
        the stage before. Last stage returns the summed cross-entropy of this rank's tokens
        over ``denominator``; the others their output activation."""
        if self.first:
            idx = self.tokens(x, shard)
            x = self.tok(idx)
            if self.pos is not None:
                start = shard * idx.shape[1] if self.sp else 0
                x = x + self.pos(torch.arange(start, start + idx.shape[1]))
        for blk in self.blocks.values():
            if self.recompute == "full":
                # No randomness in a block: no RNG state to stash (memory no ledger sees).
                x = checkpoint(self._block, blk, x, use_reentrant=False, preserve_rng_state=False)
            else:
                x = self._block(blk, x)
        if not self.last:
            return x
        logits = F.linear(self.ln_f(x), self.tok.weight)
        tgt = self.tokens(targets, shard)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                               reduction="sum") / denominator
