"""Dettmers' 8-bit dynamic tree data type and a compressed all-reduce built on it.

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
"""

from __future__ import annotations

import torch
import torch.distributed as tdist

from parlearn.core.checks import check_bool, check_int, check_tensor

__all__ = ["CODE_BITS", "code_table", "sorted_codes", "quantize", "dequantize",
           "quantize_linear_int8", "dequantize_linear_int8", "relative_error",
           "compressed_all_reduce", "compressed_all_reduce_reference", "ErrorFeedback",
           "dettmers8_hook", "Dettmers8HookState", "compressed_all_reduce_time"]

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


def quantize(x: torch.Tensor, *, scale: torch.Tensor | float | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)``: the nearest dynamic-tree code of each ``x / scale``.

    ``scale`` defaults to ``max |x|`` (1 for an all-zero tensor); values of ``|x / scale|``
    above 1 are refused rather than clipped. Codes are uint8 with ``x``'s shape; the
    scale is a float64 scalar tensor. Rounding is to the nearest code value (ties to the
    smaller one).
    """
    check_tensor("x", x, floating=True, finite=True)
    xd = x.detach().to(torch.float64)
    if scale is None:
        s = xd.abs().max() if xd.numel() else torch.zeros((), dtype=torch.float64)
        s = torch.where(s > 0, s, torch.ones_like(s))
    else:
        s = torch.as_tensor(scale, dtype=torch.float64, device=xd.device)
        if s.numel() != 1 or not bool(s > 0):
            raise ValueError(f"scale must be one positive number, got {scale!r}")
        s = s.reshape(())
        if xd.numel() and bool((xd.abs() > s * (1 + 1e-12)).any()):
            raise ValueError("|x| exceeds scale: the 8-bit type holds values in [-1, 1] only")
    values, codes, midpoints = _sorted_cache()
    y = (xd / s).clamp(-1.0, 1.0)       # only round-off can exceed 1 after the check above
    idx = torch.bucketize(y, midpoints.to(xd.device))
    return codes.to(xd.device)[idx], s


def dequantize(codes: torch.Tensor, scale: torch.Tensor | float,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``table[codes] * scale`` in ``dtype``."""
    check_tensor("codes", codes, dtype=torch.uint8)
    table = code_table().to(codes.device)
    s = torch.as_tensor(scale, dtype=torch.float64, device=codes.device)
    return (table[codes.long()] * s).to(dtype)


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
    return (q.to(torch.float64) * torch.as_tensor(scale, dtype=torch.float64) / 127).to(dtype)


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


class ErrorFeedback:
    """Residuals carried from one step to the next (error feedback, as in 1-bit SGD).

    ``compressed_all_reduce`` quantizes twice: each rank its own gradient (the *local*
    residual, ``x + e - D(Q(x + e))``), and each chunk's owner the reduced chunk (the
    *owner* residual). Both are kept here, keyed by the caller's ``key`` (a bucket or
    parameter name) and reset when the tensor's size changes.
    """

    def __init__(self) -> None:
        self.local: dict[object, torch.Tensor] = {}
        self.owner: dict[object, torch.Tensor] = {}

    @staticmethod
    def _get(store: dict, key: object, like: torch.Tensor) -> torch.Tensor:
        r = store.get(key)
        if r is None or r.shape != like.shape:
            r = torch.zeros_like(like, dtype=torch.float64)
            store[key] = r
        return r


def _chunked_quantize(x: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
    """``x`` (float64, length world*m) as codes (world, m), scales (world,), dequantized."""
    rows = x.view(world, -1)
    codes = torch.empty(rows.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(world, dtype=torch.float64, device=x.device)
    for j in range(world):
        codes[j], scales[j] = quantize(rows[j])
    back = torch.stack([dequantize(codes[j], scales[j], torch.float64) for j in range(world)])
    return codes, scales, back.reshape(-1)


def _padded(x: torch.Tensor, world: int) -> torch.Tensor:
    flat = x.detach().reshape(-1).to(torch.float64)
    m = -(-flat.numel() // world)
    return torch.cat([flat, flat.new_zeros(world * m - flat.numel())])


def compressed_all_reduce(x: torch.Tensor, *, average: bool = True,
                          error_feedback: ErrorFeedback | None = None, key: object = 0,
                          group=None) -> torch.Tensor:
    """Sum (or mean) of ``x`` over the ranks, sending 8-bit dynamic-tree codes only.

    Reduce-scatter style, in two collectives, on the ranks of ``group``:

    1. each rank splits ``x`` (padded to a multiple of N) into N chunks and quantizes each
       with its own absmax scale; ``all_to_all_single`` sends chunk j's codes (and scale)
       to rank j;
    2. rank j dequantizes the N codes of its chunk and adds them in rank order (float64),
       divides by N if ``average``, quantizes the result again, and
       ``all_gather_single`` gives every rank every reduced chunk's codes (and
       scales); each rank dequantizes them into the result (``x``'s dtype and shape).

    Wire bytes per rank under a ring: (N-1)/N * n codes in each step, 2(N-1)/N * n in all:
    exactly 1/4 of a float32 ring all-reduce's 2(N-1)/N * 4n, plus 2(N-1) float32 scales.
    Every rank gets the same result. ``error_feedback`` adds the residuals of both
    quantizations back in the next call with the same ``key`` (see :class:`ErrorFeedback`).
    Equals :func:`compressed_all_reduce_reference` bit for bit.
    """
    check_tensor("x", x, floating=True)
    check_bool("average", average)
    if error_feedback is not None and not isinstance(error_feedback, ErrorFeedback):
        raise TypeError("error_feedback must be an ErrorFeedback or None, got "
                        f"{type(error_feedback).__name__}")
    world = tdist.get_world_size(group)
    flat = _padded(x, world)
    m = flat.numel() // world
    if error_feedback is not None:
        flat = flat + ErrorFeedback._get(error_feedback.local, key, flat)
    codes, scales, back = _chunked_quantize(flat, world)
    if error_feedback is not None:
        error_feedback.local[key] = flat - back

    recv_codes = torch.empty_like(codes)
    recv_scales = torch.empty(world, dtype=torch.float32, device=x.device)
    tdist.all_to_all_single(recv_codes, codes, group=group)
    tdist.all_to_all_single(recv_scales, scales.to(torch.float32), group=group)

    mine = torch.zeros(m, dtype=torch.float64, device=x.device)
    for i in range(world):
        mine += dequantize(recv_codes[i], recv_scales[i].double(), torch.float64)
    if average:
        mine /= world
    if error_feedback is not None:
        mine = mine + ErrorFeedback._get(error_feedback.owner, key, mine)
    my_codes, my_scale = quantize(mine)
    if error_feedback is not None:
        error_feedback.owner[key] = mine - dequantize(my_codes, my_scale, torch.float64)

    all_codes = torch.empty(world * m, dtype=torch.uint8, device=x.device)
    all_scales = torch.empty(world, dtype=torch.float32, device=x.device)
    tdist.all_gather_single(all_codes, my_codes, group=group)
    tdist.all_gather_single(all_scales, my_scale.to(torch.float32).reshape(1), group=group)
    out = torch.cat([dequantize(all_codes[j * m:(j + 1) * m], all_scales[j].double(),
                                torch.float64) for j in range(world)])
    return out[:x.numel()].reshape(x.shape).to(x.dtype)


def compressed_all_reduce_reference(xs: list[torch.Tensor], *, average: bool = True,
                                    error_feedback: list[ErrorFeedback] | None = None,
                                    key: object = 0) -> torch.Tensor:
    """Single-process reference of :func:`compressed_all_reduce`: ``xs[r]`` is rank r's
    tensor (``error_feedback[r]`` its state); returns the result every rank gets."""
    world = len(xs)
    if world < 1:
        raise ValueError("xs must hold at least one tensor")
    for r, x in enumerate(xs):
        check_tensor(f"xs[{r}]", x, floating=True, shape=tuple(xs[0].shape))
    if error_feedback is not None and len(error_feedback) != world:
        raise ValueError(f"error_feedback must hold {world} states, got {len(error_feedback)}")
    codes, scales = [], []
    for r, x in enumerate(xs):
        flat = _padded(x, world)
        if error_feedback is not None:
            flat = flat + ErrorFeedback._get(error_feedback[r].local, key, flat)
        c, s, back = _chunked_quantize(flat, world)
        if error_feedback is not None:
            error_feedback[r].local[key] = flat - back
        codes.append(c)
        scales.append(s.to(torch.float32))
    m = codes[0].shape[1]
    chunks = []
    for j in range(world):
        mine = torch.zeros(m, dtype=torch.float64)
        for i in range(world):
            mine += dequantize(codes[i][j], scales[i][j].double(), torch.float64)
        if average:
            mine /= world
        if error_feedback is not None:
            mine = mine + ErrorFeedback._get(error_feedback[j].owner, key, mine)
        c, s = quantize(mine)
        if error_feedback is not None:
            error_feedback[j].owner[key] = mine - dequantize(c, s, torch.float64)
        chunks.append(dequantize(c, s.to(torch.float32).double(), torch.float64))
    out = torch.cat(chunks)
    return out[:xs[0].numel()].reshape(xs[0].shape).to(xs[0].dtype)


class Dettmers8HookState:
    """State of :func:`dettmers8_hook`: the process group and optional error feedback."""

    def __init__(self, group=None, *, error_feedback: bool = False) -> None:
        check_bool("error_feedback", error_feedback)
        self.group = group
        self.error_feedback = ErrorFeedback() if error_feedback else None


def dettmers8_hook(state: Dettmers8HookState, bucket) -> torch.futures.Future:
    """A DDP communication hook: each bucket averaged by :func:`compressed_all_reduce`.

    Register with ``ddp.register_comm_hook(Dettmers8HookState(), dettmers8_hook)``, beside
    torch's ``fp16_compress_hook`` and ``powerSGD_hook``. It runs synchronously inside the
    hook (the future is already complete when returned), so it overlaps nothing; error
    feedback is keyed by the bucket's index.
    """
    buf = bucket.buffer()
    out = compressed_all_reduce(buf, average=True, error_feedback=state.error_feedback,
                                key=bucket.index(), group=state.group)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(out)
    return fut


# DDP checks a hook's return annotation by identity; `from __future__ import annotations`
# turns ours into a string, so it is set to the object DDP expects.
dettmers8_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def compressed_all_reduce_time(numel: int, world_size: int, model) -> float:
    """Modeled seconds of :func:`compressed_all_reduce` on ``numel`` elements: the four
    collectives it issues, each by ``parlearn.dist.collective_time`` (ring):
    ``all_to_all_single`` and ``all_gather_single`` of ``N * ceil(numel / N)`` code bytes,
    and the same two of ``4 N`` scale bytes. The quantization arithmetic is not modeled."""
    from parlearn.dist import collective_time

    numel = check_int("numel", numel, lo=1)
    world_size = check_int("world_size", world_size, lo=1)
    if world_size == 1:
        return 0.0
    codes = world_size * -(-numel // world_size)
    return sum(collective_time(kind, n, world_size, model)
               for kind in ("all_to_all_single", "all_gather_single")
               for n in (codes, 4 * world_size))
