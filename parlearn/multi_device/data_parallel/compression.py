"""A compressed all-reduce on Dettmers' 8-bit dynamic tree codes, its DDP hook and its cost.

Dettmers, "8-Bit Approximations for Parallelism in Deep Learning" (arXiv 1511.04561),
sends gradients between GPUs as 8-bit codes of a *dynamic tree* type; the type and its
coders are in :mod:`parlearn.multi_device.data_parallel.dynamic_tree` (re-exported here).
:func:`compressed_all_reduce_time` models the all-reduce with its coding, and
:func:`crossover_bandwidth` says below which link bandwidth the 8 bits pay.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as tdist

from parlearn.core.checks import check_bool, check_float, check_int, check_tensor
from parlearn.multi_device.data_parallel.dynamic_tree import (
    _BLOCK,
    CODE_BITS,
    _dequantize_rows,
    _gather_into,
    _quantize_rows,
    _scaled_tables,
    code_table,
    coding_seconds,
    dequantize,
    dequantize_linear_int8,
    dequantize_reference,
    quantize,
    quantize_linear_int8,
    quantize_reference,
    relative_error,
    sorted_codes,
)

__all__ = ["CODE_BITS", "code_table", "sorted_codes", "quantize", "dequantize",
           "quantize_reference", "dequantize_reference",
           "quantize_linear_int8", "dequantize_linear_int8", "relative_error",
           "compressed_all_reduce", "compressed_all_reduce_reference", "ErrorFeedback",
           "dettmers8_hook", "Dettmers8HookState", "compressed_all_reduce_time",
           "crossover_bandwidth", "modeled_step_ratio", "coding_seconds", "path_coding_seconds"]


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


def _chunked_quantize(x: torch.Tensor, world: int, reference: bool = False, *,
                      back: bool = True) -> tuple[torch.Tensor, torch.Tensor,
                                                  torch.Tensor | None]:
    """``x`` (floating, length world*m) as codes (world, m), scales (world,), dequantized
    (None unless ``back``: only error feedback needs it); ``reference`` codes chunk by
    chunk with the serial reference coders."""
    rows = x.view(world, -1)
    if not reference:
        codes, scales = _quantize_rows(rows)
        if not back:
            return codes, scales, None
        return codes, scales, _dequantize_rows(codes, scales, torch.float64).reshape(-1)
    codes = torch.empty(rows.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(world, dtype=torch.float64, device=x.device)
    for j in range(world):
        codes[j], scales[j] = quantize_reference(rows[j])
    back = torch.stack([dequantize_reference(codes[j], scales[j], torch.float64)
                        for j in range(world)])
    return codes, scales, back.reshape(-1)


def _quantize_one(x: torch.Tensor, reference: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if reference:
        return quantize_reference(x)
    codes, s = _quantize_rows(x.view(1, -1))
    return codes.view(x.shape), s[0]


def _dequantize_one(codes: torch.Tensor, scale: torch.Tensor, reference: bool
                    ) -> torch.Tensor:
    return (dequantize_reference if reference else dequantize)(codes, scale, torch.float64)


def _padded(x: torch.Tensor, world: int, dtype: torch.dtype | None = torch.float64
            ) -> torch.Tensor:
    """``x`` flat, as ``dtype`` (None: its own), zero-padded to a multiple of ``world``:
    one copy pass, or none (a view) when nothing changes."""
    numel = x.numel()
    m = -(-numel // world)
    dtype = x.dtype if dtype is None else dtype
    if world * m == numel and dtype == x.dtype:
        return x.detach().reshape(-1)
    flat = torch.empty(world * m, dtype=dtype, device=x.device)
    flat[:numel].copy_(x.detach().reshape(-1))
    flat[numel:].zero_()
    return flat


def _sum_received(codes: torch.Tensor, scales: torch.Tensor, average: bool,
                  reference: bool) -> torch.Tensor:
    """The owner's reduction: the ``world`` received chunks (``codes`` (world, m), float32
    ``scales``) dequantized and added in rank order in float64 (from zeros, as the
    reference adds them), divided by ``world`` if ``average``."""
    world, m = codes.shape
    if not reference and codes.device.type == "cpu" and m > _BLOCK:
        return _sum_received_blocked(codes, scales, average)
    mine = torch.zeros(m, dtype=torch.float64, device=codes.device)
    if reference:
        for i in range(world):
            mine += dequantize_reference(codes[i], scales[i].double(), torch.float64)
    else:   # one gather for all chunks, then the additions in rank order
        chunks = _dequantize_rows(codes, scales.double(), torch.float64)
        for i in range(world):
            mine += chunks[i]
    if average:
        mine /= world
    return mine


def _sum_received_blocked(codes: torch.Tensor, scales: torch.Tensor, average: bool
                          ) -> torch.Tensor:
    """:func:`_sum_received` on the CPU, ``_BLOCK`` elements at a time: each block of the
    result starts at zero and gets the N chunks' values added in rank order, each
    gathered from its scaled table into one cache-resident buffer (the same float64
    operations in the same order, so the same bits). The whole-tensor version
    materialised N float64 chunks (8 bytes per element each, fresh pages in every step):
    inside a DP step it ran 1.6-2.4x slower than timed alone (measured per phase, 2 gloo
    ranks, 2.4M elements)."""
    world, m = codes.shape
    tables = _scaled_tables(scales.double(), torch.float64)
    mine = torch.empty(m, dtype=torch.float64)
    tmp = torch.empty(_BLOCK, dtype=torch.float64)
    for b0 in range(0, m, _BLOCK):
        b1 = min(m, b0 + _BLOCK)
        acc, t = mine[b0:b1], tmp[:b1 - b0]
        acc.zero_()
        for i in range(world):
            acc += _gather_into(tables[i], codes[i, b0:b1], t)
        if average:
            acc /= world
    return mine


def _decode(codes: torch.Tensor, scales: torch.Tensor, like: torch.Tensor,
            reference: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The gathered chunks (``codes`` (world * m,), float32 ``scales`` (world,)) back into
    ``like``'s dtype and shape, written into ``out`` if given (contiguous, like ``like``;
    it may be ``like`` itself). The fast path gathers from tables already rounded to that
    dtype: the same float64 products, rounded once, as dequantizing to float64 and
    casting; on the CPU ``_BLOCK`` elements at a time, straight into the result."""
    world = scales.numel()
    m = codes.numel() // world
    numel = like.numel()
    if reference:
        full = torch.cat([dequantize_reference(codes[j * m:(j + 1) * m], scales[j].double(),
                                               torch.float64) for j in range(world)])
        result = full[:numel].to(like.dtype).reshape(like.shape)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    flat = out.view(-1)
    tables = _scaled_tables(scales.double(), like.dtype)
    for j in range(world):
        lo, hi = j * m, min(numel, (j + 1) * m)
        _gather_into(tables[j], codes[lo:hi], flat[lo:hi])
    return out


def compressed_all_reduce(x: torch.Tensor, *, average: bool = True,
                          error_feedback: ErrorFeedback | None = None, key: object = 0,
                          group=None, reference_coding: bool = False,
                          out: torch.Tensor | None = None) -> torch.Tensor:
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
    ``reference_coding`` codes with the serial reference coders, chunk by chunk (the
    "before" of the bench; same result). ``out`` (contiguous, ``x``'s shape, dtype and
    device; may be ``x`` itself, as torch's in-place ``all_reduce``) receives the result,
    saving a fresh buffer per call. Equals :func:`compressed_all_reduce_reference` bit
    for bit.
    """
    check_tensor("x", x, floating=True)     # finiteness: from the chunk scales below
    check_bool("average", average)
    check_bool("reference_coding", reference_coding)
    if error_feedback is not None and not isinstance(error_feedback, ErrorFeedback):
        raise TypeError("error_feedback must be an ErrorFeedback or None, got "
                        f"{type(error_feedback).__name__}")
    _check_group(group)
    if error_feedback is not None:
        try:
            hash(key)
        except TypeError:
            raise TypeError(f"key must be hashable (it names the error-feedback state), got "
                            f"{type(key).__name__}") from None
    if out is not None:
        check_tensor("out", out, dtype=x.dtype, shape=tuple(x.shape))
        if out.device != x.device:
            raise ValueError(f"out must be on x's device {x.device}, got {out.device}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    ref = reference_coding
    world = tdist.get_world_size(group)
    # Coded from x's own dtype: the coders compute x / scale in float64 from it, exactly
    # as from a float64 copy. Error feedback adds float64 residuals, so it needs the copy.
    flat = _padded(x, world, None if error_feedback is None else torch.float64)
    m = flat.numel() // world
    if error_feedback is not None:
        flat = flat + ErrorFeedback._get(error_feedback.local, key, flat)
    codes, scales, back = _chunked_quantize(flat, world, ref,
                                            back=error_feedback is not None)
    if not bool(torch.isfinite(scales).all()):      # NaN or inf in x: before any message
        raise ValueError("x must not contain NaN or infinity")
    if error_feedback is not None and back is not None:
        error_feedback.local[key] = flat - back

    recv_codes = torch.empty_like(codes)
    recv_scales = torch.empty(world, dtype=torch.float32, device=x.device)
    tdist.all_to_all_single(recv_codes, codes, group=group)
    tdist.all_to_all_single(recv_scales, scales.to(torch.float32), group=group)

    mine = _sum_received(recv_codes, recv_scales, average, ref)
    if error_feedback is not None:
        mine = mine + ErrorFeedback._get(error_feedback.owner, key, mine)
    my_codes, my_scale = _quantize_one(mine, ref)
    if error_feedback is not None:
        error_feedback.owner[key] = mine - _dequantize_one(my_codes, my_scale, ref)

    all_codes = torch.empty(world * m, dtype=torch.uint8, device=x.device)
    all_scales = torch.empty(world, dtype=torch.float32, device=x.device)
    tdist.all_gather_single(all_codes, my_codes, group=group)
    tdist.all_gather_single(all_scales, my_scale.to(torch.float32).reshape(1), group=group)
    return _decode(all_codes, all_scales, x, ref, out)


def compressed_all_reduce_reference(xs: list[torch.Tensor], *, average: bool = True,
                                    error_feedback: list[ErrorFeedback] | None = None,
                                    key: object = 0) -> torch.Tensor:
    """Single-process reference of :func:`compressed_all_reduce`, with the serial
    reference coders: ``xs[r]`` is rank r's tensor (``error_feedback[r]`` its state);
    returns the result every rank gets."""
    if isinstance(xs, str | torch.Tensor) or not isinstance(xs, list | tuple):
        raise TypeError(f"xs must be a list of tensors, one per rank, got {type(xs).__name__}")
    check_bool("average", average)
    if error_feedback is not None and (not isinstance(error_feedback, list | tuple) or not all(
            isinstance(e, ErrorFeedback) for e in error_feedback)):
        raise TypeError(f"error_feedback must be a list of ErrorFeedback or None, got "
                        f"{error_feedback!r}")
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
        c, s, back = _chunked_quantize(flat, world, reference=True)
        if error_feedback is not None:
            error_feedback[r].local[key] = flat - back
        codes.append(c)
        scales.append(s.to(torch.float32))
    m = codes[0].shape[1]
    chunks = []
    for j in range(world):
        mine = torch.zeros(m, dtype=torch.float64)
        for i in range(world):
            mine += dequantize_reference(codes[i][j], scales[i][j].double(), torch.float64)
        if average:
            mine /= world
        if error_feedback is not None:
            mine = mine + ErrorFeedback._get(error_feedback[j].owner, key, mine)
        c, s = quantize_reference(mine)
        if error_feedback is not None:
            error_feedback[j].owner[key] = mine - dequantize_reference(c, s, torch.float64)
        chunks.append(dequantize_reference(c, s.to(torch.float32).double(), torch.float64))
    out = torch.cat(chunks)
    return out[:xs[0].numel()].reshape(xs[0].shape).to(xs[0].dtype)


def _check_group(group) -> None:
    if group is not None and not isinstance(group, tdist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None (the world), "
                        f"got {group!r}")


class Dettmers8HookState:
    """State of :func:`dettmers8_hook`: the process group and optional error feedback."""

    def __init__(self, group=None, *, error_feedback: bool = False) -> None:
        _check_group(group)
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
    if not isinstance(state, Dettmers8HookState):
        raise TypeError(f"state must be a Dettmers8HookState, got {type(state).__name__}")
    if not isinstance(bucket, tdist.GradBucket):
        raise TypeError(f"bucket must be the torch.distributed.GradBucket DDP passes its comm "
                        f"hook, got {type(bucket).__name__}")
    buf = bucket.buffer()
    out = compressed_all_reduce(buf, average=True, error_feedback=state.error_feedback,
                                key=bucket.index(), group=state.group)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(out)
    return fut


# DDP checks a hook's return annotation by identity; `from __future__ import annotations`
# turns ours into a string, so it is set to the object DDP expects.
dettmers8_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def compressed_all_reduce_time(numel: int, world_size: int, model, *,
                               quantize_s: float = 0.0, dequantize_s: float = 0.0,
                               error_feedback: bool = False) -> float:
    """Modeled seconds of :func:`compressed_all_reduce` on ``numel`` elements: the four
    collectives it issues, each by ``parlearn.distributed.collective_time`` (ring; ``model`` one
    AlphaBeta, or a mapping with a link fitted for each of all_to_all and all_gather):
    ``all_to_all_single`` and ``all_gather_single`` of ``n = N * ceil(numel / N)`` code
    bytes, and the same two of ``4 N`` scale bytes; plus its coding, ``n (1 + 1/N)
    quantize_s + 2 n dequantize_s`` (it quantizes its n elements and its own chunk of
    n/N, and dequantizes the N received chunks and the n gathered elements; with
    ``error_feedback`` also its n elements and its chunk for the residuals, ``n (1 +
    1/N)`` more), with ``quantize_s`` and ``dequantize_s`` seconds per element (measured
    by :func:`coding_seconds`; 0 leaves the coding out)."""
    from parlearn.distributed import collective_time

    numel = check_int("numel", numel, lo=1)
    world_size = check_int("world_size", world_size, lo=1)
    quantize_s = check_float("quantize_s", quantize_s, lo=0)
    dequantize_s = check_float("dequantize_s", dequantize_s, lo=0)
    check_bool("error_feedback", error_feedback)
    n = world_size * -(-numel // world_size)
    own = n * (1 + 1 / world_size)
    coding = own * quantize_s + (2 * n + (own if error_feedback else 0)) * dequantize_s
    if world_size == 1:
        return coding
    return coding + sum(collective_time(kind, b, world_size, model)
                        for kind in ("all_to_all_single", "all_gather_single")
                        for b in (n, 4 * world_size))


def path_coding_seconds(numel: int, world_size: int = 2, *, repeat: int = 5, seed: int = 0,
                        threads: int | None = 1) -> tuple[float, float]:
    """Measured seconds per element ``(quantize_s, dequantize_s)`` of
    :func:`compressed_all_reduce`'s own local work on one rank, as the path runs it, in
    the units :func:`compressed_all_reduce_time` counts them: ``quantize_s`` is the
    encoding (the padded copy if any, the N chunks quantized, the owner's reduced chunk
    quantized) over ``n (1 + 1/N)`` elements, ``dequantize_s`` the decoding (the N
    received chunks dequantized and added in float64, the gathered ``n`` decoded into
    float32) over ``2 n``. So the modeled coding is this path's local work measured
    alone; :func:`coding_seconds` times the coders alone. Inside a DP step the same
    calls once ran 1.2-1.5x slower than timed alone: their whole-tensor temporaries took
    fresh pages in every step. With the owner's reduction and the decoding done block by
    block, and :class:`parlearn.data_parallel.CompressedDP` keeping one buffer, the
    in-step phases summed to within 3% of this figure (one per-phase profile on 2 quiet
    gloo ranks, 2.4M elements).

    Medians of ``repeat`` interleaved calls on ``numel`` standard normal float32 values,
    with ``threads`` intra-op threads (default 1, as each gloo rank runs; None: the
    current count; the caller's count is restored). The chunks "received" are this
    rank's own (the same sizes and work as any other rank's)."""
    from parlearn.core.timing import compare

    numel = check_int("numel", numel, lo=1)
    world = check_int("world_size", world_size, lo=1)
    repeat = check_int("repeat", repeat, lo=1)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(check_int("seed", seed,
                                                                              lo=0)))
    flat = _padded(x, world, None)
    n = flat.numel()
    codes, scales, _ = _chunked_quantize(flat, world, back=False)
    scales32 = scales.to(torch.float32)
    mine = _sum_received(codes, scales32, True, False)

    def encode():
        _chunked_quantize(_padded(x, world, None), world, back=False)
        _quantize_one(mine, False)

    def decode():
        _sum_received(codes, scales32, True, False)
        _decode(codes.reshape(-1), scales32, x, False)

    t = compare({"encode": encode, "decode": decode}, repeat=repeat, threads=threads).timings
    return t["encode"].median / (n * (1 + 1 / world)), t["decode"].median / (2 * n)


def crossover_bandwidth(numel: int, world_size: int, alpha: float, *,
                        quantize_s: float, dequantize_s: float) -> float:
    """Modeled link bandwidth (bytes/s) below which :func:`compressed_all_reduce` beats a
    float32 ring ``all_reduce`` of ``numel`` elements, with ``alpha`` seconds per message:
    both times are ``a + b beta`` (:func:`compressed_all_reduce_time` with its coding, and
    ``collective_time("all_reduce", 4 numel)``), equal at ``beta* = (a8 - a32) / (b32 -
    b8)``; returns ``1 / beta*`` (``inf`` when 8-bit wins at any bandwidth)."""
    from parlearn.distributed import AlphaBeta, collective_time

    numel = check_int("numel", numel, lo=1)
    world_size = check_int("world_size", world_size, lo=2)
    alpha = check_float("alpha", alpha, lo=0)

    def line(time_of) -> tuple[float, float]:
        a = time_of(AlphaBeta(alpha, 0.0))
        return a, time_of(AlphaBeta(alpha, 1.0)) - a

    a8, b8 = line(lambda m: compressed_all_reduce_time(
        numel, world_size, m, quantize_s=quantize_s, dequantize_s=dequantize_s))
    a32, b32 = line(lambda m: collective_time("all_reduce", 4 * numel, world_size, m))
    if a8 <= a32:
        return math.inf
    return (b32 - b8) / (a8 - a32)




def modeled_step_ratio(numel: int, world_size: int, link, *, compute_s: float,
                       quantize_s: float, dequantize_s: float) -> float:
    """Modeled fp32 / 8-bit DP step-time ratio on ``link`` (an AlphaBeta):
    ``(compute_s + collective_time("all_reduce", 4 numel)) / (compute_s +
    compressed_all_reduce_time(numel, ..., quantize_s, dequantize_s))``; above 1 the
    8 bits pay. The fp32 all-reduce is one message of all gradients (nothing overlapped),
    as the 8-bit one is."""
    from parlearn.distributed import collective_time
    from parlearn.distributed.cost import AlphaBeta

    numel = check_int("numel", numel, lo=1)
    world_size = check_int("world_size", world_size, lo=1)
    if not isinstance(link, AlphaBeta | dict):
        raise TypeError(f"link must be an AlphaBeta or a mapping of collective names to "
                        f"AlphaBeta, got {type(link).__name__}")
    compute_s = check_float("compute_s", compute_s, lo=0)
    t32 = compute_s + collective_time("all_reduce", 4 * numel, world_size, link)
    t8 = compute_s + compressed_all_reduce_time(numel, world_size, link, quantize_s=quantize_s,
                                                dequantize_s=dequantize_s)
    return t32 / t8
