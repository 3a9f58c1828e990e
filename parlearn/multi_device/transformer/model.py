"""A decoder-only GPT small enough to read in one sitting and to train on a laptop CPU.

Pre-norm blocks (LayerNorm, then attention or MLP, then the residual add), causal
multi-head attention written out (scores, mask, softmax, weighted values: every tensor
autograd keeps is one a learner can name), a GELU or SwiGLU MLP, RoPE or learned
positions, and an output layer tied to the token embedding. Linear layers have no bias,
as in Llama and PaLM. The same code runs in float64 (for gradcheck), float32, and under
bf16 autocast.

Recomputation is a forward argument: ``recompute="selective"`` wraps the attention core
(scores -> softmax -> weighted values) in ``torch.utils.checkpoint`` so its ``s x s``
tensors are recomputed in backward instead of kept; ``"full"`` wraps each whole block, so
only the block inputs are kept (Korthikanti et al. 2022 call these selective and full
activation recomputation).

Weights are drawn from the config's ``seed`` with a private generator: building a model
never moves the caller's global RNG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parlearn.core.checks import check_choice, check_int, check_tensor

__all__ = ["GPTConfig", "GPT", "RECOMPUTE", "attention_core", "count_params"]

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`. ``d_ff`` defaults to ``4 * d_model``."""

    vocab_size: int = 103
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    max_seq: int = 64
    mlp: str = "gelu"
    pos: str = "rope"
    d_ff: int | None = None
    seed: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "max_seq"):
            check_int(name, getattr(self, name), lo=1)
        check_choice("mlp", self.mlp, ("gelu", "swiglu"))
        check_choice("pos", self.pos, ("rope", "learned"))
        if self.d_ff is not None:
            check_int("d_ff", self.d_ff, lo=1)
        check_int("seed", self.seed, lo=0)
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.pos == "rope" and self.head_dim % 2:
            raise ValueError(f"pos='rope' needs an even head dimension, got "
                             f"d_model / n_heads = {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ff(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff


def check_config(cfg) -> GPTConfig:
    """``cfg`` if it is a :class:`GPTConfig` (its fields are checked when it is built)."""
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig, got {cfg!r} ({type(cfg).__name__})")
    return cfg


def check_device(name: str, value) -> torch.device:
    """``value`` as a ``torch.device`` (a device or a string torch parses)."""
    if not isinstance(value, torch.device | str):
        raise TypeError(f"{name} must be a torch.device or a string, got {value!r}")
    try:
        return torch.device(value)
    except RuntimeError as e:
        raise ValueError(f"{name} must name a device torch knows, got {value!r}: {e}") from e


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
                   ) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + causal mask) v`` on ``(b, heads, s, d)`` tensors;
    ``mask`` is True where a query must not see a key."""
    q = check_tensor("q", q, ndim=4, floating=True)
    # dtypes may differ: under autocast q, k (rotated by fp32 tables) meet a bf16 v
    check_tensor("k", k, shape=tuple(q.shape), floating=True)
    check_tensor("v", v, shape=tuple(q.shape[:-1]) + (None,), floating=True)
    s = q.shape[-2]
    check_tensor("mask", mask, dtype=torch.bool)
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (s, s):
        raise ValueError(f"mask must end in ({s}, {s}) (queries x keys), got "
                         f"{tuple(mask.shape)}")
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h = cfg.d_model
        self.n_heads = cfg.n_heads
        self.rope = cfg.pos == "rope"
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))

    def forward(self, x, mask, cos, sin, selective: bool):
        b, s, _ = x.shape
        q, k, v = (lin(x).view(b, s, self.n_heads, -1).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        if self.rope:  # rotate each (even, odd) half-pair by its position's angle
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if selective:
            # Nothing in forward is random (no dropout): there is no RNG state to replay,
            # and stashing one (5 KB per call on the CPU) would hold memory no ledger sees.
            y = checkpoint(attention_core, q, k, v, mask, use_reentrant=False,
                           preserve_rng_state=False)
        else:
            y = attention_core(q, k, v, mask)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))  # -1: h, or h/tp under torch TP


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.up = nn.Linear(cfg.d_model, cfg.ff, bias=False)
        self.gate = nn.Linear(cfg.d_model, cfg.ff, bias=False) if self.swiglu else None
        self.down = nn.Linear(cfg.ff, cfg.d_model, bias=False)

    def forward(self, x):
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn, self.mlp = Attention(cfg), MLP(cfg)

    def forward(self, x, mask, cos, sin, selective: bool = False):
        x = x + self.attn(self.ln1(x), mask, cos, sin, selective)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``GPT(cfg)(idx, targets=None, recompute="none")`` -> ``(logits, loss)``.

    ``idx`` and ``targets`` are ``(batch, seq)`` token ids with ``seq <= cfg.max_seq``;
    ``loss`` is the mean cross-entropy (None without targets)."""

    def __init__(self, cfg: GPTConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        check_config(cfg)
        check_choice("dtype", dtype, (torch.float32, torch.float64))
        if device is not None:
            check_device("device", device)
        self.cfg = cfg
        # torch's initialisers draw from the global RNG: draw, then put the user's state back
        # (_init_weights overwrites every value from the config's own seed). Building on the
        # meta device would avoid the draws too, but its first use imports torch's
        # reference ops, seconds in every freshly started rank.
        with torch.random.fork_rng(devices=[]):
            self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos = nn.Embedding(cfg.max_seq, cfg.d_model) if cfg.pos == "learned" else None
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.ln_f = nn.LayerNorm(cfg.d_model)
        self.to(device=device or "cpu", dtype=dtype)
        self._init_weights()

    @property
    def head_weight(self) -> torch.Tensor:
        return self.tok.weight  # tied: the output layer is the embedding, one tensor

    def _init_weights(self) -> None:
        cfg = self.cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2's scaled residual projections
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith((".o.weight", ".down.weight")):
                    std = out_std
                elif p.ndim == 1:
                    p.fill_(0.0 if name.endswith("bias") else 1.0)
                    continue
                else:
                    std = 0.02
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * std)
        s, d = cfg.max_seq, cfg.head_dim
        dev, dt = self.tok.weight.device, self.tok.weight.dtype
        self.register_buffer("mask", torch.ones(s, s, dtype=torch.bool, device=dev).triu(1),
                             persistent=False)
        self.register_buffer("positions", torch.arange(s, device=dev), persistent=False)
        inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos().to(dev, dt), persistent=False)
        self.register_buffer("sin", ang.sin().to(dev, dt), persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                recompute: str = "none"):
        check_choice("recompute", recompute, RECOMPUTE)
        if idx.ndim != 2 or idx.dtype != torch.long:
            raise ValueError(f"idx must be (batch, seq) int64 token ids, got "
                             f"{tuple(idx.shape)} {idx.dtype}")
        b, s = idx.shape
        if s > self.cfg.max_seq:
            raise ValueError(f"idx has seq={s} > cfg.max_seq={self.cfg.max_seq}")
        x = self.tok(idx)
        if self.pos is not None:
            x = x + self.pos(self.positions[:s])
        mask, cos, sin = self.mask[:s, :s], self.cos[:s], self.sin[:s]
        for block in self.blocks:
            if recompute == "full":
                x = checkpoint(block, x, mask, cos, sin, use_reentrant=False,
                               preserve_rng_state=False)  # no randomness: see above
            else:
                x = block(x, mask, cos, sin, recompute == "selective")
        logits = F.linear(self.ln_f(x), self.head_weight)
        if targets is None:
            return logits, None
        if targets.shape != idx.shape:
            raise ValueError(f"targets must have idx's shape {tuple(idx.shape)}, got "
                             f"{tuple(targets.shape)}")
        loss = F.cross_entropy(logits.reshape(b * s, -1), targets.reshape(b * s))
        return logits, loss


def count_params(cfg: GPTConfig) -> dict[str, int]:
    """Parameters of :class:`GPT` ``(cfg)`` by kind, counted from the config alone:
    ``embedding`` (tied with the output layer), ``positions``, ``attention``, ``mlp``,
    ``norms``, and ``total``; ``matmul`` is what multiplies activations in a matmul
    (every linear, the tied output layer included)."""
    check_config(cfg)
    h, L, f, V = cfg.d_model, cfg.n_layers, cfg.ff, cfg.vocab_size
    attn = 4 * h * h
    mlp = (3 if cfg.mlp == "swiglu" else 2) * h * f
    out = {"embedding": V * h, "positions": cfg.max_seq * h if cfg.pos == "learned" else 0,
           "attention": L * attn, "mlp": L * mlp, "norms": (2 * L + 1) * 2 * h}
    out["total"] = sum(out.values())
    out["matmul"] = L * (attn + mlp) + V * h
    return out
