"""The activation model: every tensor the tiny GPT's forward keeps for backward, by name.

Write ``b`` batch, ``s`` sequence, ``h`` width, ``a`` heads, ``f`` MLP width, ``V``
vocabulary. Per block of :class:`parlearn.transformer.GPT`, in float32 (4 bytes per
element), autograd keeps:

==========================  =============  ==============================================
tensor                      elements       kept by
==========================  =============  ==============================================
block input x               b s h          ln1 (LayerNorm keeps its input)
ln1 mean and 1/std          2 b s          ln1
ln1 output                  b s h          the q, k and v projections (one storage)
q and k after RoPE          2 b s h        ``q @ k^T``
softmax output p            a b s^2        softmax, and ``p @ v`` (one storage)
v                           b s h          ``p @ v``
attention output            b s h          the output projection
x after attention           b s h          ln2
ln2 mean and 1/std          2 b s          ln2
ln2 output                  b s h          the MLP's first projection(s)
GELU: its input, output     2 b s f        GELU, the down projection
(SwiGLU: gate, silu, up,    4 b s f        silu, the product, the down projection)
 product
==========================  =============  ==============================================

that is ``4 (8 b s h + a b s^2 + 2 b s f + 4 b s)`` bytes, and with ``f = 4h``
``b s h (64 + 4 a s / h) + 16 b s``. After the last block: ln_f's input and statistics,
the output layer's input (``b s h``), the log-softmax of the loss (``b s V``) and a 4-byte
scalar of ``nll_loss``. The token ids and targets are the step's inputs; the causal mask
and RoPE tables are buffers; neither is counted here.

Korthikanti et al. (2022, table 2) count ``s b h (34 + 5 a s / h)`` bytes per block for
Megatron's block in 16-bit. Ours differs in three ways, each a term: (1) no dropout, so no
masks (``s b h`` twice, ``a s^2 b``) and no dropout output of the scores (``2 a s^2 b``):
``p @ v`` keeps the softmax output itself; (2) LayerNorm statistics are counted (they
leave them out); (3) at 2 bytes per element the rest is ``32 s b h + 2 a s^2 b``, their
``34 - 2`` and ``5 - 3``. :func:`korthikanti_terms` lists their terms.

bf16 autocast (torch.amp, fp32 master weights) changes the dtypes, not the list: the
residual stream, LayerNorm inputs and the loss stay fp32; every matmul input is a bf16
copy made by autocast at each use, so the ln1 output is kept three times (once per q, k, v
projection: a fused QKV would keep it once), and the RoPE outputs (fp32, because the
tables are fp32) are kept as bf16 copies. Autocast also keeps a bf16 copy of every matmul
weight (``2 N_matmul`` bytes, kind ``weight copy``) until backward.

Recomputation (``torch.utils.checkpoint``): ``selective`` keeps the inputs of the attention
core (q, k after RoPE and v, in their own dtypes) instead of its outputs, so the ``a b s^2``
term goes; under autocast RoPE's q and k are then kept in fp32 (learned positions: bf16),
which costs more than it saves when ``a s < 2 h`` (short sequences). ``full`` keeps only
each block's input.
"""

from __future__ import annotations

from parlearn.core.checks import check_bool, check_choice, check_int
from parlearn.multi_device.transformer.model import RECOMPUTE, GPTConfig, count_params

__all__ = ["PRECISIONS", "activation_terms", "activation_bytes", "korthikanti_terms",
           "korthikanti_bytes"]

# precision -> (bytes of the residual stream / norms, bytes of matmul inputs and outputs)
PRECISIONS = {"fp64": (8, 8), "fp32": (4, 4), "bf16": (4, 2)}


def _check(cfg, batch, seq, precision, recompute):
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
    # seq may exceed cfg.max_seq: the count is of the same shapes at a longer context (no
    # activation depends on max_seq), as lesson 17 uses it to show the s^2 terms.
    batch, seq = check_int("batch", batch, lo=1), check_int("seq", seq, lo=1)
    check_choice("precision", precision, PRECISIONS)
    check_choice("recompute", recompute, RECOMPUTE)
    return batch, seq


def activation_terms(cfg: GPTConfig, batch: int, seq: int, *, precision: str = "fp32",
                     recompute: str = "none") -> list[tuple[str, int]]:
    """``[(name, bytes), ...]``: the modeled saved tensors of one forward of
    :class:`~parlearn.transformer.GPT` (module docstring), whole model, all layers.
    The ``weight copy`` term (bf16 only) is the autocast copies of the weights."""
    b, s = _check(cfg, batch, seq, precision, recompute)
    h, a, f, L, V = cfg.d_model, cfg.n_heads, cfg.ff, cfg.n_layers, cfg.vocab_size
    wide, mm = PRECISIONS[precision]
    bsh, bs = b * s * h, b * s
    casts = mm < wide  # autocast: matmul inputs are fresh low-precision copies
    if recompute == "full":
        block = [("block input x", wide * bsh)]
    else:
        block = [("block input x", wide * bsh), ("ln1 mean, 1/std", 2 * wide * bs),
                 ("ln1 output (q, k, v inputs)", (3 if casts else 1) * mm * bsh)]
        if recompute == "selective":  # fp32 under autocast when RoPE's fp32 tables promote
            qk = wide if cfg.pos == "rope" else mm
            block += [("q, k after RoPE (core inputs)", 2 * qk * bsh)]
        else:
            block += [("q, k after RoPE", 2 * mm * bsh), ("softmax output", mm * a * b * s * s)]
        block += [("v", mm * bsh), ("attention output", mm * bsh),
                  ("x after attention", wide * bsh), ("ln2 mean, 1/std", 2 * wide * bs)]
        if cfg.mlp == "swiglu":
            block += [("ln2 output (gate, up inputs)", (2 if casts else 1) * mm * bsh),
                      ("gate, silu, up, product", 4 * mm * b * s * f)]
        else:
            block += [("ln2 output (up input)", mm * bsh),
                      ("GELU input and output", 2 * mm * b * s * f)]
    terms = [(f"{name} x {L} layers", L * n) for name, n in block]
    terms += [("ln_f input", wide * bsh), ("ln_f mean, 1/std", 2 * wide * bs),
              ("output layer input", mm * bsh), ("log-softmax of the loss", wide * bs * V),
              ("nll_loss total weight", wide)]
    if casts:
        n = count_params(cfg)["matmul"] if recompute != "full" else V * h
        terms.append(("weight copy", mm * n))
    return terms


def activation_bytes(cfg: GPTConfig, batch: int, seq: int, *, precision: str = "fp32",
                     recompute: str = "none", weight_copies: bool = False) -> int:
    """Total of :func:`activation_terms`; the autocast weight copies only if asked."""
    check_bool("weight_copies", weight_copies)
    return sum(n for name, n in activation_terms(cfg, batch, seq, precision=precision,
                                                 recompute=recompute)
               if weight_copies or name != "weight copy")


def _check_korthikanti(s: int, b: int, h: int, a: int) -> tuple[int, int, int, int]:
    s, b, h, a = (check_int(n, v, lo=1) for n, v in (("s", s), ("b", b), ("h", h), ("a", a)))
    if h % a:
        raise ValueError(f"a={a} heads must divide h={h}")
    return s, b, h, a


def korthikanti_terms(s: int, b: int, h: int, a: int) -> list[tuple[str, int]]:
    """Korthikanti et al. (2022), section 4.1: bytes kept per block of Megatron's
    transformer layer in 16-bit with dropout (1-byte masks), no recomputation."""
    s, b, h, a = _check_korthikanti(s, b, h, a)
    return [("QKV input", 2 * s * b * h), ("Q and K", 4 * s * b * h),
            ("softmax output", 2 * a * s * s * b), ("softmax dropout mask", a * s * s * b),
            ("dropout output (attention over values)", 2 * a * s * s * b),
            ("V", 2 * s * b * h), ("output projection input", 2 * s * b * h),
            ("attention dropout mask", s * b * h), ("MLP input", 2 * s * b * h),
            ("GeLU input", 8 * s * b * h), ("GeLU output", 8 * s * b * h),
            ("MLP dropout mask", s * b * h), ("two LayerNorm inputs", 4 * s * b * h)]


def korthikanti_bytes(s: int, b: int, h: int, a: int) -> float:
    """Their closed form ``s b h (34 + 5 a s / h)`` bytes per block."""
    s, b, h, a = _check_korthikanti(s, b, h, a)
    return s * b * h * (34 + 5 * a * s / h)
