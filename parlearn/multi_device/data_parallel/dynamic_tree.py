"""Dettmers' 8-bit dynamic tree data type: its 256 codes, and the coders.

Dettmers, "8-Bit Approximations for Parallelism in Deep Learning" (arXiv 1511.04561),
sends gradients between GPUs as 8-bit codes of a *dynamic tree* type: a sign bit, then
an exponent written as a run of zero bits ended by a one (the *indicator* bit), then the
bits left over index a linear bisection tree of fractions. Big exponents (small numbers)
eat fraction bits, so the type trades precision for range as a float does, but with a
variable split.

Reconstruction (we worked from the paper's description, not its code; the details below
are our choices where the description leaves room):

    bit 7      sign s
    bits 6..   z zero bits (0 <= z <= 6), then the indicator bit 1
    the rest   f = 6 - z fraction bits, read as an integer k in [0, 2**f)
    value      (-1)**s * 10**(-z) * (0.1 + 0.9 * (k + 1) / 2**f)

so exponent z covers (10**-(z+1), 10**-z] with 2**f linearly spaced values whose top one
is exactly 10**-z (the leaves of a bisection tree of (0.1, 1], each leaf stored by its
upper end). That gives +-1 exactly. The two codes with no indicator bit (a full run of 7
zeros) are 0 (sign 0) and -1e-7 (sign 1, the next decade, so that all 256 codes are
distinct). 127 + 127 + 2 = 256 codes.

Values are scaled by the tensor's (or chunk's) absolute maximum before encoding, so the
largest magnitude maps to +-1 exactly.

Each coder has its serial reference beside it: :func:`quantize_reference` is a binary
search per element over the 255 midpoints between sorted code values, :func:`quantize` one
table lookup on the float64's top bits and one comparison (equal to it exactly);
:func:`dequantize` is one gather from the 256 scaled values. :func:`coding_seconds`
measures both. The all-reduce built on them is in
:mod:`parlearn.multi_device.data_parallel.compression`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from parlearn.core.checks import check_float, check_int, check_tensor

if TYPE_CHECKING:
    from parlearn.core.timing import Comparison

__all__ = ["CODE_BITS", "code_table", "sorted_codes", "quantize", "dequantize",
           "quantize_reference", "dequantize_reference", "quantize_linear_int8",
           "dequantize_linear_int8", "relative_error", "coding_seconds"]

CODE_BITS = 8


def _value_of_code(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    rest = code & 0x7F
    if rest == 0:
        return 0.0 if sign > 0 else -1e-7
    z = 7 - rest.bit_length()           # zeros between the sign and the indicator bit
    f = 6 - z                           # fraction bits after the indicator
    k = rest & ((1 << f) - 1)
    return sign * 10.0 ** (-z) * (0.1 + 0.9 * (k + 1) / 2 ** f)


_TABLE: torch.Tensor | None = None


def code_table() -> torch.Tensor:
    """The 256 values, float64, indexed by the 8-bit code (``table[code]``)."""
    global _TABLE
    if _TABLE is None:
        _TABLE = torch.tensor([_value_of_code(c) for c in range(256)], dtype=torch.float64)
    return _TABLE.clone()


def sorted_codes() -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, codes)``: the table sorted by value, and the code of each sorted value."""
    table = code_table()
    values, order = torch.sort(table)
    return values, order.to(torch.uint8)


_SORTED: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _sorted_cache() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    global _SORTED
    if _SORTED is None:
        values, codes = sorted_codes()
        midpoints = (values[1:] + values[:-1]) / 2
        _SORTED = (values, codes, midpoints)
    return _SORTED


def _scale_of(scale, device) -> torch.Tensor:
    """``scale`` (a positive finite number, or a tensor holding one) as a float64 scalar;
    a bool, a string, NaN or a sequence is refused."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must be one number, got {scale.numel()} values")
        if scale.dtype == torch.bool or scale.is_complex():
            raise TypeError(f"scale must be a real number, got a {scale.dtype} tensor")
        s = scale.detach().to(device=device, dtype=torch.float64).reshape(())
        if not bool(torch.isfinite(s)) or not bool(s > 0):
            raise ValueError(f"scale must be a positive finite number, got {float(s)}")
        return s
    value = check_float("scale", scale, lo=0, lo_open=True)
    return torch.tensor(value, dtype=torch.float64, device=device)


def _check_dtype(dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return dtype


def _check_scale(xd: torch.Tensor, scale: torch.Tensor | float | None) -> torch.Tensor:
    """The float64 scalar scale: ``max |x|`` (1 for an all-zero tensor) or ``scale``,
    refused unless positive and at least ``max |x|`` (to round-off)."""
    if scale is None:
        s = xd.abs().max() if xd.numel() else torch.zeros((), dtype=torch.float64)
        return torch.where(s > 0, s, torch.ones_like(s))
    s = _scale_of(scale, xd.device)
    if xd.numel() and bool((xd.abs() > s * (1 + 1e-12)).any()):
        raise ValueError("|x| exceeds scale: the 8-bit type holds values in [-1, 1] only")
    return s


def quantize_reference(x: torch.Tensor, *, scale: torch.Tensor | float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Serial reference of :func:`quantize`: a binary search per element
    (``torch.bucketize``) over the 255 midpoints between the sorted code values."""
    check_tensor("x", x, floating=True, finite=True)
    xd = x.detach().to(torch.float64)
    s = _check_scale(xd, scale)
    values, codes, midpoints = _sorted_cache()
    y = (xd / s).clamp(-1.0, 1.0)       # only round-off can exceed 1 after the check above
    idx = torch.bucketize(y, midpoints.to(xd.device))
    return codes.to(xd.device)[idx], s


# The fast search reads a float64's top 20 bits (sign, 11 exponent bits, 8 mantissa bits)
# as the row of a table. A row is an interval of floats at most 2**-8 (0.4%) wide,
# relative; neighbouring midpoints are at least 1.4% apart, so a row holds at most one
# midpoint (checked when the table is built) and `#{midpoints < y}` is the row's count
# plus one comparison: no binary search.
_KEY_SHIFT = 44
_KEY_MASK = (1 << 20) - 1
_LOOKUP: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _lookup(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows, midpoints + [inf], codes)`` on ``device``: ``rows[key]`` counts the
    midpoints below every float64 whose top 20 bits are ``key``."""
    if device not in _LOOKUP:
        _, codes, mid = _sorted_cache()
        keys = torch.arange(1 << 20, dtype=torch.int64)
        low = (keys << _KEY_SHIFT).view(torch.float64)
        high = ((keys << _KEY_SHIFT) | ((1 << _KEY_SHIFT) - 1)).view(torch.float64)
        negative = keys >= (1 << 19)        # sign bit set: the row's floats run downwards
        first = torch.nan_to_num(torch.where(negative, high, low), nan=0.0)
        last = torch.nan_to_num(torch.where(negative, low, high), nan=0.0)
        rows = torch.searchsorted(mid, first, right=False)
        if int((torch.searchsorted(mid, last, right=True) - rows).max()) > 1:
            raise RuntimeError("a table row holds two midpoints: the fast search is invalid")
        padded = torch.cat([mid, mid.new_tensor([float("inf")])])
        _LOOKUP[device] = (rows.to(torch.int32).to(device), padded.to(device),
                           codes.to(device))
    return _LOOKUP[device]


# On the CPU the coders run in blocks of this many elements: the half-dozen temporaries of
# a block stay in cache, where whole-tensor temporaries (MBs each, fresh pages every call)
# made the lookup 2-2.5x slower (measured, 1 thread, 2.4M elements).
_BLOCK = 1 << 16


def _codes_of_scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The code nearest each ``x.to(float64) / scale`` (ties to the smaller value), for a
    1-D ``x`` and a float64 scalar ``scale``, as :func:`quantize_reference` picks it after
    its clamp to [-1, 1]: the rows at and beyond +-1 already count all (or no)
    midpoints, so no clamp is needed. On the CPU ``_BLOCK`` elements at a time, every
    step written into buffers allocated once (18% faster than fresh temporaries per
    block, measured, 1 thread); elsewhere in one block."""
    rows, mid, codes = _lookup(x.device)
    n = x.numel()
    block = max(1, min(n, _BLOCK) if x.device.type == "cpu" else n)
    out = torch.empty(n, dtype=torch.uint8, device=x.device)
    y = torch.empty(block, dtype=torch.float64, device=x.device)
    key = torch.empty(block, dtype=torch.int64, device=x.device)
    below = torch.empty(block, dtype=torch.int32, device=x.device)
    at = torch.empty(block, dtype=torch.float64, device=x.device)
    above = torch.empty(block, dtype=torch.bool, device=x.device)
    for b0 in range(0, n, block):
        k = min(block, n - b0)
        yb, kb, bb, ab, cb = y[:k], key[:k], below[:k], at[:k], above[:k]
        yb.copy_(x[b0:b0 + k]).div_(scale)
        # the top 20 bits as a row: a contiguous int64 shift (a strided shift of the high
        # 32-bit words, half the bytes, measured 2.5x slower on the CPU)
        torch.bitwise_right_shift(yb.view(torch.int64), _KEY_SHIFT, out=kb)
        kb.bitwise_and_(_KEY_MASK)
        # index_select, not t[idx]: the 1-D gather is 2-3x faster than advanced indexing
        torch.index_select(rows, 0, kb, out=bb)
        torch.index_select(mid, 0, bb, out=ab)
        torch.lt(ab, yb, out=cb)
        torch.index_select(codes, 0, bb.add_(cb), out=out[b0:b0 + k])
    return out


def _gather_into(table: torch.Tensor, codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[i] = table[codes[i]]`` for 1-D uint8 ``codes`` and a 1-D ``out`` of their
    length; on the CPU ``_BLOCK`` elements at a time (each block's int32 index stays in
    cache), elsewhere in one gather. Returns ``out``."""
    n = codes.numel()
    step = _BLOCK if codes.device.type == "cpu" else max(1, n)
    for b0 in range(0, n, step):
        b1 = min(n, b0 + step)
        torch.index_select(table, 0, codes[b0:b1].to(torch.int32), out=out[b0:b1])
    return out


def quantize(x: torch.Tensor, *, scale: torch.Tensor | float | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)``: the nearest dynamic-tree code of each ``x / scale``.

    ``scale`` defaults to ``max |x|`` (1 for an all-zero tensor); values of ``|x / scale|``
    above 1 are refused rather than clipped. Codes are uint8 with ``x``'s shape; the
    scale is a float64 scalar tensor. Rounding is to the nearest code value (ties to the
    smaller one). One table lookup on the float64's bits and one comparison per element;
    equals :func:`quantize_reference` (a binary search) exactly.
    """
    if scale is not None:
        check_tensor("x", x, floating=True, finite=True)
        xd = x.detach().to(torch.float64)
        s = _check_scale(xd, scale)
        return _codes_of_scaled(xd.reshape(-1), s).view(x.shape), s
    check_tensor("x", x, floating=True)
    # max |x| from one min/max pass in x's own dtype (exact in float64 later); NaN or inf
    # in x make it non-finite, which replaces a separate isfinite pass over x
    if x.numel():
        lo, hi = torch.aminmax(x.detach())
        s = torch.maximum(-lo, hi).to(torch.float64)
    else:
        s = torch.zeros((), dtype=torch.float64, device=x.device)
    if not bool(torch.isfinite(s)):
        raise ValueError("x must not contain NaN or infinity")
    s = torch.where(s > 0, s, torch.ones_like(s))
    return _codes_of_scaled(x.detach().reshape(-1), s).view(x.shape), s


def dequantize_reference(codes: torch.Tensor, scale: torch.Tensor | float,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Serial reference of :func:`dequantize`: ``table[codes] * scale`` element by
    element in float64, then ``dtype``."""
    check_tensor("codes", codes, dtype=torch.uint8)
    s = _scale_of(scale, codes.device)
    _check_dtype(dtype)
    table = code_table().to(codes.device)
    return (table[codes.long()] * s).to(dtype)


def _scaled_tables(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``table * scale`` in ``dtype`` for each scale (shape ``scales.shape + (256,)``):
    the same float64 products the reference forms per element, formed 256 at a time."""
    table = code_table().to(scales.device)
    return (scales.to(torch.float64)[..., None] * table).to(dtype)


def dequantize(codes: torch.Tensor, scale: torch.Tensor | float,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``table[codes] * scale`` in ``dtype``, as one gather from the 256 scaled values;
    equals :func:`dequantize_reference` exactly."""
    check_tensor("codes", codes, dtype=torch.uint8)
    s = _scale_of(scale, codes.device)
    _check_dtype(dtype)
    return _dequantize_rows(codes.reshape(1, -1), s.reshape(1), dtype).view(codes.shape)


def quantize_linear_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain baseline: ``round(127 x / absmax)`` as int8, and the scale."""
    check_tensor("x", x, floating=True, finite=True)
    xd = x.detach().to(torch.float64)
    s = xd.abs().max() if xd.numel() else torch.zeros((), dtype=torch.float64)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(xd / s * 127).to(torch.int8), s


def dequantize_linear_int8(q: torch.Tensor, scale: torch.Tensor | float,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale / 127`` in ``dtype``."""
    check_tensor("q", q, dtype=torch.int8)
    s = _scale_of(scale, q.device)
    _check_dtype(dtype)
    return (q.to(torch.float64) * s / 127).to(dtype)


def relative_error(magnitudes: torch.Tensor, kind: str = "dynamic_tree") -> torch.Tensor:
    """``|Q(x) - x| / |x|`` for each positive ``x`` in ``magnitudes`` (scale fixed to 1).

    ``kind`` is ``"dynamic_tree"`` or ``"linear_int8"``. The scale is 1 so the error is
    that of the type itself at ``|x| / absmax = x``.
    """
    check_tensor("magnitudes", magnitudes, floating=True, finite=True)
    if bool((magnitudes <= 0).any()) or bool((magnitudes > 1).any()):
        raise ValueError("magnitudes must lie in (0, 1]")
    x = magnitudes.to(torch.float64)
    if kind == "dynamic_tree":
        c, s = quantize(x, scale=1.0)
        back = dequantize(c, s, torch.float64)
    elif kind == "linear_int8":
        back = torch.round(x * 127) / 127
    else:
        raise ValueError(f"kind must be one of ['dynamic_tree', 'linear_int8'], got {kind!r}")
    return (back - x).abs() / x


def _quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of floating ``rows`` quantized with its own absmax scale (float64):
    equals :func:`quantize` row by row."""
    if rows.shape[1]:
        # row by row: aminmax(dim=1) ran 5x slower than on a flat view (measured, 1 thread);
        # the max of |values| is one of them, so it is exact in their dtype
        s = torch.stack([torch.maximum(-lo, hi) for lo, hi in map(torch.aminmax, rows)])
        s = s.to(torch.float64)
    else:
        s = torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
    s = torch.where(s == 0, torch.ones_like(s), s)    # keeps NaN and inf for the caller
    codes = torch.stack([_codes_of_scaled(r, s_r) for r, s_r in zip(rows, s, strict=True)])
    return codes.view(rows.shape), s


def _dequantize_rows(codes: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """Row j of ``codes`` dequantized with ``scales[j]``, from the stacked scaled tables:
    equals :func:`dequantize` row by row. On the CPU a row is gathered block by block
    from its own 256 values (``_BLOCK`` elements at a time, temporaries in cache)."""
    tables = _scaled_tables(scales, dtype)
    if codes.device.type == "cpu" and codes.shape[1] > _BLOCK:
        out = torch.empty(codes.shape, dtype=dtype)
        for j in range(codes.shape[0]):
            _gather_into(tables[j], codes[j], out[j])
        return out
    offsets = 256 * torch.arange(codes.shape[0], dtype=torch.int32, device=codes.device)
    index = (codes.to(torch.int32) + offsets[:, None]).reshape(-1)
    return tables.reshape(-1).index_select(0, index).view(codes.shape)


def coding_seconds(numel: int = 2**21, *, repeat: int = 5, seed: int = 0,
                   threads: int | None = None) -> Comparison:
    """Measured on this machine's CPU with ``threads`` intra-op threads (None: torch's
    current count; the caller's count is restored): seconds per call of
    :func:`quantize` and :func:`dequantize` (float32 in and out) and of their serial
    references, on ``numel`` standard normal values, interleaved in one run. Returns the
    :class:`parlearn.core.timing.Comparison`; divide by ``numel`` for seconds per
    element, and ``4 * numel`` bytes by a time for a throughput."""
    from parlearn.core.timing import compare

    numel = check_int("numel", numel, lo=1)
    repeat = check_int("repeat", repeat, lo=1)
    check_int("seed", seed, lo=0)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    codes, s = quantize(x)
    return compare({"quantize_reference": lambda: quantize_reference(x),
                    "quantize": lambda: quantize(x),
                    "dequantize_reference": lambda: dequantize_reference(codes, s),
                    "dequantize": lambda: dequantize(codes, s)},
                   baseline="quantize_reference", repeat=repeat, threads=threads)
