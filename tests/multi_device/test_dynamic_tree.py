"""The fast 8-bit coders equal their serial references exactly; the coding cost model."""

from __future__ import annotations

import math

import pytest
import torch

from parlearn import distributed as dist
from parlearn.multi_device.data_parallel import compression as C
from parlearn.multi_device.data_parallel import dynamic_tree as T


def _same(y: torch.Tensor, scale: float = 1.0) -> None:
    fast, s_fast = T.quantize(y, scale=scale)
    ref, s_ref = T.quantize_reference(y, scale=scale)
    assert torch.equal(s_fast, s_ref)
    bad = (fast != ref).nonzero().flatten()[:5]
    assert bad.numel() == 0, [(float(y.flatten()[i]), int(fast.flatten()[i]),
                               int(ref.flatten()[i])) for i in bad]


def test_quantize_equals_reference_at_every_midpoint_and_its_neighbours(any_device):
    # The ties and the floats either side of each decision boundary: where a search by
    # table row plus one comparison would first go wrong (ties go to the smaller value).
    values, _ = T.sorted_codes()
    mid = (values[1:] + values[:-1]) / 2
    around = [mid]
    for direction in (math.inf, -math.inf):
        step = mid
        for _ in range(3):
            step = torch.nextafter(step, torch.full_like(step, direction))
            around.append(step)
    y = torch.cat(around + [values, torch.tensor([0.0, -0.0, 5e-324, -5e-324, 1e-300,
                                                   -1e-300, 1 + 5e-13, -1 - 5e-13],
                                                  dtype=torch.float64)])
    _same(y.to(any_device))


def test_blocked_coding_equals_reference_across_many_blocks():
    # The CPU coders work in blocks of T._BLOCK elements: the midpoints, ties and their
    # neighbours, shuffled over several blocks (the last one partial), coded by quantize
    # (explicit and absmax scales) and row by row as the all-reduce codes its chunks.
    values, _ = T.sorted_codes()
    mid = (values[1:] + values[:-1]) / 2
    near = [mid] + [torch.nextafter(mid, torch.full_like(mid, d)) for d in (2.0, -2.0)]
    base = torch.cat(near + [values])
    reps = 3 * T._BLOCK // base.numel() + 1
    gen = torch.Generator().manual_seed(3)
    y = base.repeat(reps)[torch.randperm(base.numel() * reps, generator=gen)]
    assert y.numel() > 3 * T._BLOCK and y.numel() % T._BLOCK
    _same(y)                                                  # scale 1: ties stay ties
    (fast, s), (ref, s_ref) = T.quantize(y * 4.0), T.quantize_reference(y * 4.0)
    assert torch.equal(s, s_ref) and float(s) == 4.0 and torch.equal(fast, ref)
    x32 = torch.randn(3 * T._BLOCK + 5, generator=gen) * torch.rand(1, generator=gen)
    (fast, s), (ref, s_ref) = T.quantize(x32), T.quantize_reference(x32)  # float32 in
    assert torch.equal(fast, ref) and torch.equal(s, s_ref)
    rows = torch.stack([y, -2.0 * y.flip(0)])                 # scales 1 and 2: exact
    codes, scales = T._quantize_rows(rows)
    for r in range(2):
        c, sc = T.quantize_reference(rows[r])
        assert torch.equal(codes[r], c) and torch.equal(scales[r], sc)
    # and back, every code in every block, for each output dtype
    scales = torch.tensor([0.75, 3.0e-3], dtype=torch.float64)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        back = T._dequantize_rows(codes, scales, dtype)
        assert back.dtype == dtype and back.shape == codes.shape
        for r in range(2):
            assert torch.equal(back[r], T.dequantize_reference(codes[r], scales[r], dtype))


def test_quantize_equals_reference_on_every_exponent_row():
    # Floats with every exponent that |y| <= 1 can have, random mantissas and signs:
    # every row of the lookup table that can be hit.
    gen = torch.Generator().manual_seed(1)
    n = 200_000
    exponent = torch.randint(0, 1023, (n,), generator=gen)
    mantissa = torch.randint(0, 1 << 52, (n,), generator=gen)
    sign = torch.randint(0, 2, (n,), generator=gen)
    y = ((sign << 63) | (exponent << 52) | mantissa).view(torch.float64)
    _same(y)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16,
                                   torch.bfloat16])
def test_quantize_and_dequantize_equal_reference_for_every_dtype(dtype, any_device):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 4001, generator=gen, dtype=torch.float64)
         * torch.logspace(-9, 2, 4001, dtype=torch.float64)).to(dtype).to(any_device)
    for scale in (None, float(x.abs().max()) * 1.5):
        (fast, s), (ref, s_ref) = T.quantize(x, scale=scale), T.quantize_reference(x, scale=scale)
        assert torch.equal(fast, ref) and torch.equal(s, s_ref) and fast.shape == x.shape
        for out in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
            assert torch.equal(T.dequantize(fast, s, out), T.dequantize_reference(ref, s, out))


def test_empty_and_all_zero_tensors_code_like_the_reference():
    for x in (torch.zeros(0), torch.zeros(7), torch.zeros(2, 0)):
        (a, s), (b, t) = T.quantize(x), T.quantize_reference(x)
        assert torch.equal(a, b) and torch.equal(s, t)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_chunked_coding_equals_the_reference_chunk_by_chunk(world):
    gen = torch.Generator().manual_seed(world)
    flat = torch.randn(world * 1001, generator=gen, dtype=torch.float64)
    flat[:1001] *= 1e-4                           # chunks with different scales
    if world > 2:
        flat[1001:2002] = 0.0                     # an all-zero chunk: scale 1
    fast = C._chunked_quantize(flat, world)
    ref = C._chunked_quantize(flat, world, reference=True)
    for a, b in zip(fast, ref, strict=True):
        assert torch.equal(a, b)


def test_bad_input_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="scale"):
        T.quantize(torch.tensor([2.0]), scale=1.0)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for scale in (None, 1.0):
            with pytest.raises(ValueError, match="x must not contain NaN"):
                T.quantize(torch.tensor([0.5, bad]), scale=scale)
    with pytest.raises(ValueError, match="scale"):
        T.dequantize(torch.zeros(3, dtype=torch.uint8), torch.ones(2))
    with pytest.raises(ValueError, match="quantize_s"):
        C.compressed_all_reduce_time(10, 2, dist.AlphaBeta(0, 0), quantize_s=-1.0)
    with pytest.raises(ValueError, match="world_size"):
        C.crossover_bandwidth(10, 1, 1e-5, quantize_s=0.0, dequantize_s=0.0)


def test_compressed_all_reduce_time_adds_the_coding_it_does():
    # N=4, 10 elements padded to 12: quantize 12 + 3, dequantize 2 * 12 (+ 12 + 3 with
    # error feedback's residuals)
    free = dist.AlphaBeta(0.0, 0.0)
    assert C.compressed_all_reduce_time(10, 4, free, quantize_s=1.0) == pytest.approx(15)
    assert C.compressed_all_reduce_time(10, 4, free, dequantize_s=1.0) == pytest.approx(24)
    assert C.compressed_all_reduce_time(10, 4, free, dequantize_s=1.0,
                                        error_feedback=True) == pytest.approx(39)
    ab = dist.AlphaBeta(1e-3, 1e-6)
    plain = C.compressed_all_reduce_time(10, 4, ab)
    assert C.compressed_all_reduce_time(10, 4, ab, quantize_s=2.0, dequantize_s=0.5) == \
        pytest.approx(plain + 30 + 12)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_blocked_reduction_and_decoding_equal_the_reference_bit_for_bit(world):
    # chunks of 2 blocks + 3 elements, every code in every chunk (so -0 and +0 too),
    # scales that round differently in float32: the CPU's blocked owner reduction and
    # decoding give the reference's bits; decoding into a given buffer gives the same
    gen = torch.Generator().manual_seed(world)
    m = 2 * T._BLOCK + 3
    codes = torch.randint(0, 256, (world, m), generator=gen, dtype=torch.uint8)
    codes[:, :256] = torch.arange(256, dtype=torch.uint8)
    scales = (torch.rand(world, generator=gen, dtype=torch.float64) * 3 + 1e-3).float()
    for average in (True, False):
        fast = C._sum_received(codes, scales, average, False)
        ref = C._sum_received(codes, scales, average, True)
        assert fast.dtype == torch.float64 and torch.equal(fast.view(torch.int64),
                                                           ref.view(torch.int64))
    numel = world * m - 2                  # the last chunk's padding is not decoded
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        like = torch.empty(numel, dtype=dtype)
        ref = C._decode(codes.reshape(-1), scales, like, True)
        fast = C._decode(codes.reshape(-1), scales, like, False)
        into = torch.full_like(like, float("nan"))
        assert C._decode(codes.reshape(-1), scales, like, False, into) is into
        for got in (fast, into):
            assert got.dtype == dtype and torch.equal(got, ref)


@pytest.mark.parametrize("world,numel", [(2, 10), (3, 10)])
def test_path_coding_seconds_times_the_path_in_the_models_units(world, numel, monkeypatch):
    # The two timed calls run the path's own local work (checked by spying on the
    # functions compressed_all_reduce calls); their times are divided by the element
    # counts compressed_all_reduce_time multiplies by: n (1 + 1/N) and 2 n, n padded.
    from parlearn.core import timing

    calls: list[tuple[str, tuple]] = []
    for name in ("_padded", "_chunked_quantize", "_quantize_one", "_sum_received", "_decode"):
        real = getattr(C, name)
        def spy(*a, _real=real, _name=name, **k):
            calls.append((_name, tuple(t.shape for t in a if isinstance(t, torch.Tensor))))
            return _real(*a, **k)
        monkeypatch.setattr(C, name, spy)

    def fake_compare(fns, repeat, threads):
        calls.clear()
        for f in fns.values():
            f()
        times = {"encode": 6.0, "decode": 4.0}
        return timing.Comparison({k: timing.Timing((times[k],), "cpu") for k in fns}, "encode")

    monkeypatch.setattr(timing, "compare", fake_compare)
    q, d = C.path_coding_seconds(numel, world, repeat=1)
    n = world * -(-numel // world)
    assert q == pytest.approx(6.0 / (n * (1 + 1 / world)))
    assert d == pytest.approx(4.0 / (2 * n))
    assert [c[0] for c in calls] == ["_padded", "_chunked_quantize", "_quantize_one",
                                     "_sum_received", "_decode"]
    assert calls[1][1] == ((n,),) and calls[2][1] == ((n // world,),)
    assert calls[3][1][0] == (world, n // world) and calls[4][1][0] == (n,)
    # the model then charges exactly the measured coding
    free = dist.AlphaBeta(0.0, 0.0)
    assert C.compressed_all_reduce_time(numel, world, free, quantize_s=q, dequantize_s=d) \
        == pytest.approx(10.0)


@pytest.mark.parametrize("world", [2, 8])
def test_crossover_bandwidth_is_where_the_two_models_meet(world):
    numel, alpha, q, d = 3_000_000, 2e-5, 4e-9, 1e-9
    bw = C.crossover_bandwidth(numel, world, alpha, quantize_s=q, dequantize_s=d)
    assert 0 < bw < math.inf

    def times(bandwidth: float) -> tuple[float, float]:
        ab = dist.AlphaBeta(alpha, 1 / bandwidth)
        return (C.compressed_all_reduce_time(numel, world, ab, quantize_s=q, dequantize_s=d),
                dist.collective_time("all_reduce", 4 * numel, world, ab))

    at, fp32 = times(bw)
    assert at == pytest.approx(fp32, rel=1e-9)
    slow8, slow32 = times(bw / 2)
    fast8, fast32 = times(bw * 2)
    assert slow8 < slow32 and fast8 > fast32      # 8-bit pays only below the crossover
    # free messages and free coding: fewer bytes win at every bandwidth
    assert C.crossover_bandwidth(numel, world, 0.0, quantize_s=0.0, dequantize_s=0.0) == math.inf
