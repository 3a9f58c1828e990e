"""FP8 training, simulated on any device: the two formats, per-tensor scaling, a scaled matmul.

FP8 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv:2209.05433) comes in
two formats: **E4M3** (4 exponent bits, 3 mantissa bits, largest value 448, no infinities:
torch's ``float8_e4m3fn``) for weights and activations, and **E5M2** (5 and 2, largest
57344) for gradients, which need range more than precision. Transformer Engine's HYBRID
recipe uses E4M3 forward and E5M2 backward.

Neither format reaches far: E4M3's normal numbers span 2^-6 to 448, five decades, so a
tensor is cast as ``fp8(x * scale)`` with one fp32 ``scale`` per tensor, chosen so that its
largest magnitude ``amax`` lands on the format's largest value (:func:`amax_scale`:
``scale = fp8_max / amax / 2^margin``, Transformer Engine's "current scaling"; its "delayed
scaling" takes ``amax`` from a history of earlier steps instead of this tensor, saving one
read). Values beyond the largest are clipped to it (saturated), as Transformer Engine does.

:func:`scaled_matmul` is the FP8 GEMM as the tensor core runs it, simulated: both operands
quantized with their own scales, multiplied exactly (a product of two 4-bit significands is
exact in fp32), accumulated in fp32, and the output divided by ``scale_a * scale_b``. Only
the rounding is simulated here, not the speed: that needs FP8 tensor cores.

Bytes (modeled): :func:`state_bytes_per_param` for the recipes' parameters, gradients and
optimizer state, and :func:`fp8_activation_terms`, the tiny GPT's activation ledger
(:func:`~parlearn.memory.activation_terms`) re-priced for FP8 linear layers.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from parlearn.core.checks import check_choice, check_float, check_int, check_tensor
from parlearn.multi_device.memory.activations import activation_terms

__all__ = ["FP8_DTYPES", "RECIPES", "format_info", "amax_scale", "quantize", "dequantize",
           "round_trip", "cast_stats", "scaled_matmul", "state_bytes_per_param",
           "fp8_activation_terms"]

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALINGS = ("amax", "none")


def format_info(dtype: torch.dtype) -> dict:
    """Read off ``torch.finfo(dtype)`` for a floating ``dtype``: ``max``, ``smallest_normal``,
    ``smallest_subnormal`` (``smallest_normal * eps``), ``mantissa_bits`` (stored fraction
    bits, ``-log2(eps)``), ``exponent_bits`` and ``bytes``."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    f = torch.finfo(dtype)
    mantissa = round(-math.log2(f.eps))
    return {"max": f.max, "smallest_normal": f.smallest_normal,
            "smallest_subnormal": f.smallest_normal * f.eps, "mantissa_bits": mantissa,
            "exponent_bits": f.bits - 1 - mantissa, "bytes": f.bits // 8}


def _fmax(fmt: str) -> float:
    return torch.finfo(FP8_DTYPES[fmt]).max


def _check_x(name: str, x) -> torch.Tensor:
    check_tensor(name, x, floating=True)
    if x.dtype in FP8_DTYPES.values():
        raise TypeError(f"{name} must be a float16/bfloat16/float32/float64 tensor, got {x.dtype}")
    return check_tensor(name, x, finite=True)


def _check_scale(scale) -> float:
    if isinstance(scale, torch.Tensor):
        check_tensor("scale", scale, ndim=0, floating=True)
        scale = scale.item()
    elif not isinstance(scale, Real) or isinstance(scale, bool):
        raise TypeError(f"scale must be a positive number or a 0-dim float tensor, got "
                        f"{scale!r} ({type(scale).__name__})")
    return check_float("scale", scale, lo=0, lo_open=True)


def amax_scale(x: torch.Tensor, fmt: str = "e4m3", *, margin: int = 0) -> float:
    """Transformer Engine's per-tensor scale, ``fp8_max / amax(|x|) / 2^margin``, rounded to
    fp32 (1.0 for an all-zero ``x``): ``x * scale`` then reaches ``fp8_max / 2^margin``."""
    x = _check_x("x", x)
    check_choice("fmt", fmt, tuple(FP8_DTYPES))
    margin = check_int("margin", margin, lo=0)
    amax = x.detach().abs().max().item() if x.numel() else 0.0
    if amax == 0:
        return 1.0
    return torch.tensor(_fmax(fmt) / amax / 2.0 ** margin, dtype=torch.float32).item()


def quantize(x: torch.Tensor, fmt: str = "e4m3", scale: float = 1.0) -> torch.Tensor:
    """``x * scale`` clipped to the format's largest value and rounded (to nearest even) to
    FP8 (``fmt`` ``"e4m3"`` or ``"e5m2"``): a ``float8`` tensor of ``x``'s shape."""
    x = _check_x("x", x)
    check_choice("fmt", fmt, tuple(FP8_DTYPES))
    scale = _check_scale(scale)
    m = _fmax(fmt)
    wide = x.detach().to(torch.promote_types(x.dtype, torch.float32))  # one rounding, to FP8
    return (wide * scale).clamp(-m, m).to(FP8_DTYPES[fmt])


def dequantize(q: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """``q / scale`` in ``dtype``: the value an FP8 tensor ``q`` made with ``scale`` stands for."""
    check_tensor("q", q)
    if q.dtype not in FP8_DTYPES.values():
        raise TypeError(f"q must be a float8_e4m3fn or float8_e5m2 tensor, got {q.dtype}")
    check_tensor("q", q.float(), finite=True)
    scale = _check_scale(scale)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return (q.float() / scale).to(dtype)


def round_trip(x: torch.Tensor, fmt: str = "e4m3", scale: float = 1.0) -> torch.Tensor:
    """``dequantize(quantize(x, fmt, scale), scale)`` in ``x``'s dtype: what survives the cast."""
    return dequantize(quantize(x, fmt, scale), scale, x.dtype)


def cast_stats(x: torch.Tensor, fmt: str = "e4m3", scale: float = 1.0) -> dict[str, float]:
    """What casting ``x`` to FP8 with ``scale`` loses: ``relative_error`` (``||round_trip(x) -
    x|| / ||x||``), and the fractions of ``x``'s nonzero entries that are ``flushed`` to 0,
    land among the ``subnormal`` numbers (fewer significant bits) or are ``saturated``
    (``|x * scale|`` past the largest value by more than half its spacing: rounding alone
    would have left the range; clipping made it the largest value)."""
    q = quantize(x, fmt, scale)
    back = dequantize(q, scale, torch.float64)
    xd = x.detach().double()
    nz = xd != 0
    n = max(int(nz.sum()), 1)
    info = format_info(FP8_DTYPES[fmt])
    spacing = 2.0 ** (math.floor(math.log2(info["max"])) - info["mantissa_bits"])
    top = info["max"] + spacing / 2  # beyond this, rounding alone leaves the range
    norm = xd.norm().item()
    return {"relative_error": (back - xd).norm().item() / norm if norm else 0.0,
            "flushed": (nz & (back == 0)).sum().item() / n,
            "subnormal": (nz & (back != 0) & (back.abs() * scale < info["smallest_normal"])
                          ).sum().item() / n,
            "saturated": ((xd * scale).abs() > top).sum().item() / n}


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, *, fmt: str = "e4m3",
                  scaling: str = "amax") -> torch.Tensor:
    """``a @ b`` (2-D) as an FP8 GEMM computes it, simulated: ``a`` and ``b`` quantized to
    ``fmt`` with per-tensor scales (``scaling="amax"``: :func:`amax_scale` of each;
    ``"none"``: scale 1), upcast, multiplied and summed in fp32, then divided by
    ``scale_a * scale_b``. Returns float32."""
    check_tensor("a", a, ndim=2)
    check_tensor("b", b, ndim=2)
    _check_x("a", a)
    _check_x("b", b)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"b must have {a.shape[1]} rows (a's columns), got shape "
                         f"{tuple(b.shape)}")
    check_choice("fmt", fmt, tuple(FP8_DTYPES))
    check_choice("scaling", scaling, SCALINGS)
    sa, sb = ((amax_scale(a, fmt), amax_scale(b, fmt)) if scaling == "amax" else (1.0, 1.0))
    qa, qb = quantize(a, fmt, sa), quantize(b, fmt, sb)
    return (qa.float() @ qb.float()) / (sa * sb)


# Bytes per parameter kept between steps, modeled. "bf16": the ZeRO paper's 2 + 2 + 12;
# "fp8": the same, plus an FP8 copy of each matmul weight cached for the step (Transformer
# Engine); "fp8 weights": the module's weights stored only in FP8 (Transformer Engine's
# fp8_model_init), master copy fp32. In both, Hopper's FP8 GEMMs may also keep each FP8
# weight's transpose (one more byte), which these counts leave out.
RECIPES: dict[str, dict[str, int]] = {
    "bf16": {"weights (bf16)": 2, "gradients (bf16)": 2, "fp32 master weights": 4,
             "Adam m, v (fp32)": 8},
    "fp8": {"weights (bf16)": 2, "FP8 weight copy": 1, "gradients (bf16)": 2,
            "fp32 master weights": 4, "Adam m, v (fp32)": 8},
    "fp8 weights": {"weights (FP8)": 1, "gradients (bf16)": 2, "fp32 master weights": 4,
                    "Adam m, v (fp32)": 8},
}


def state_bytes_per_param(recipe: str) -> dict[str, int]:
    """Modeled bytes per parameter of ``recipe`` (a key of :data:`RECIPES`), part by part,
    with their ``total``. The optimizer's 12 bytes do not shrink with FP8."""
    parts = dict(RECIPES[check_choice("recipe", recipe, tuple(RECIPES))])
    parts["total"] = sum(parts.values())
    return parts


def fp8_activation_terms(cfg, batch: int, seq: int, *, recompute: str = "none"
                         ) -> list[tuple[str, int, int]]:
    """``[(name, bf16 bytes, fp8 bytes), ...]``: the tiny GPT's activation ledger under bf16
    autocast (:func:`~parlearn.memory.activation_terms`), modeled again for FP8 linear layers
    as Transformer Engine runs them: the input of every linear layer inside the blocks is
    kept as the FP8 copy its forward GEMM made (1 byte, not 2), and so are the weight copies
    of those layers; the output layer (tied embedding) stays bf16, as do the attention core,
    norms, GELU's own input and the loss. The copy counts are bf16 autocast's."""
    terms = activation_terms(cfg, batch, seq, precision="bf16", recompute=recompute)
    head = cfg.vocab_size * cfg.d_model  # the output layer's weight, kept in bf16
    out = []
    for name, n in terms:
        if name.startswith(("ln1 output", "attention output", "ln2 output")):
            fp8 = n // 2
        elif name.startswith("GELU input and output"):
            fp8 = n // 2 + n // 4              # GELU's input bf16, its output (down's input) FP8
        elif name.startswith("gate, silu, up, product"):
            fp8 = 3 * n // 4 + n // 8          # the product (down's input) FP8
        elif name == "weight copy":
            fp8 = (n - 2 * head) // 2 + 2 * head
        else:
            fp8 = n
        out.append((name, n, fp8))
    return out
