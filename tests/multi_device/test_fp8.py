"""parlearn.memory.fp8: exact where FP8 is exact (representable values, power-of-two scales),
E4M3's rounding bound, the scale really used, clipping, the simulated scaled matmul, and the
modeled bytes."""

import pytest
import torch

from parlearn.multi_device import memory as M
from parlearn.multi_device import transformer as T


def _all_finite(dtype):
    """Every finite value of an FP8 format, from its 256 bit patterns."""
    v = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return v[torch.isfinite(v)]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_representable_value_round_trips_exactly(fmt):
    v = _all_finite(M.FP8_DTYPES[fmt])
    assert len(v) == (254 if fmt == "e4m3" else 248)   # e4m3fn: 2 NaNs; e5m2: 2 inf, 6 NaN
    assert torch.equal(M.round_trip(v, fmt), v)
    assert torch.equal(M.dequantize(M.quantize(v, fmt)), v)


def test_format_info_reads_the_formats():
    e4, e5, bf = (M.format_info(d) for d in (torch.float8_e4m3fn, torch.float8_e5m2,
                                            torch.bfloat16))
    assert (e4["max"], e4["smallest_normal"], e4["smallest_subnormal"]) == (448, 2**-6, 2**-9)
    assert (e4["mantissa_bits"], e4["exponent_bits"], e4["bytes"]) == (3, 4, 1)
    assert (e5["max"], e5["smallest_normal"], e5["smallest_subnormal"]) == (57344, 2**-14, 2**-16)
    assert (e5["mantissa_bits"], e5["exponent_bits"]) == (2, 5)
    assert (bf["mantissa_bits"], bf["exponent_bits"], bf["bytes"]) == (7, 8, 2)
    finite = _all_finite(torch.float8_e4m3fn)
    assert finite.max() == e4["max"] and finite[finite > 0].min() == e4["smallest_subnormal"]


@pytest.mark.parametrize("k", [-20, -3, 0, 5, 14])
def test_a_power_of_two_scale_commutes_with_rounding(k):
    x = torch.randn(2000, generator=torch.Generator().manual_seed(k + 100)) * 3.0
    s = 2.0 ** k
    assert torch.equal(M.round_trip(x, "e4m3", s), M.round_trip(x * s, "e4m3") / s)
    assert torch.equal(M.quantize(x, "e4m3", s).float(), M.quantize(x * s, "e4m3").float())
    # where x and x*s are both normal and in range, the scale changes nothing
    ok = (x.abs() * min(s, 1) >= 2**-6) & (x.abs() * max(s, 1) <= 448)
    assert ok.sum() > 0 or k in (-20, 14)
    assert torch.equal(M.round_trip(x, "e4m3", s)[ok], M.round_trip(x, "e4m3")[ok])


@pytest.mark.parametrize("fmt, bound", [("e4m3", 2.0**-4), ("e5m2", 2.0**-3)])
def test_rounding_of_normal_values_is_within_half_an_ulp(fmt, bound):
    info = M.format_info(M.FP8_DTYPES[fmt])
    lo, hi = info["smallest_normal"], info["max"]
    x = torch.exp(torch.empty(20000, dtype=torch.float64).uniform_(
        float(torch.log(torch.tensor(lo))), float(torch.log(torch.tensor(hi))),
        generator=torch.Generator().manual_seed(0)))
    x = torch.cat([x, -x])
    rel = ((M.round_trip(x, fmt) - x).abs() / x.abs()).max().item()
    assert rel <= bound
    # and it is nearly reached (the worst case, just below 1 + half an ulp, is u / (1 + u)):
    # the bound is the format's, not a loose one
    assert rel > 0.97 * bound / (1 + bound)


def test_the_scale_is_used_small_gradients_flush_without_it():
    g = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e-4
    plain = M.cast_stats(g, "e4m3")
    assert plain["flushed"] == 1.0 and plain["relative_error"] == 1.0
    s = M.amax_scale(g, "e4m3")
    assert s * g.abs().max().item() == pytest.approx(448, rel=1e-6)
    scaled = M.cast_stats(g, "e4m3", s)
    assert scaled["flushed"] == 0 and scaled["saturated"] == 0
    assert scaled["relative_error"] < 2.0**-4
    assert (M.round_trip(g, "e4m3", s) != 0).all()
    assert not torch.equal(M.quantize(g, "e4m3", s).float(), M.quantize(g, "e4m3").float())
    # a 0-dim tensor scale is the same scale
    assert torch.equal(M.round_trip(g, "e4m3", torch.tensor(s)), M.round_trip(g, "e4m3", s))


def test_amax_scale_margin_and_zero():
    x = torch.tensor([0.5, -7.0, 2.0])
    assert M.amax_scale(x, "e4m3") == 64.0
    assert M.amax_scale(x, "e4m3", margin=2) == 16.0
    assert M.amax_scale(torch.zeros(3)) == 1.0


def test_values_beyond_the_range_are_clipped_and_counted():
    x = torch.tensor([1.0, 450.0, 463.0, 500.0, -1e6, 1e-3])
    assert M.round_trip(x, "e4m3").tolist() == [1.0, 448.0, 448.0, 448.0, -448.0, 2.0**-9]
    st = M.cast_stats(x, "e4m3")
    assert st["saturated"] == pytest.approx(2 / 6)   # 450 and 463 round to 448 anyway
    assert st["subnormal"] == pytest.approx(1 / 6) and st["flushed"] == 0
    e5 = M.round_trip(torch.tensor([1e6, -1e6]), "e5m2")
    assert e5.tolist() == [57344.0, -57344.0]          # clipped, not inf


def test_scaled_matmul_is_exact_on_representable_operands():
    vals = torch.tensor([0.0, 0.5, -1.0, 1.5, -2.0, 3.0, -0.75])
    g = torch.Generator().manual_seed(0)
    a = vals[torch.randint(0, 7, (5, 6), generator=g)]
    b = vals[torch.randint(0, 7, (6, 4), generator=g)]
    a[0, 0], b[0, 0] = 3.5, -3.5                   # amax 3.5: scale 448 / 3.5 = 128, exact
    assert M.amax_scale(a) == 128.0
    for scaling in ("amax", "none"):
        assert torch.equal(M.scaled_matmul(a, b, scaling=scaling), a @ b)


def test_scaled_matmul_error_small_with_scales_large_without():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 128, generator=g), torch.randn(128, 32, generator=g) * 1e-3
    ref = x.double() @ w.double()
    err = {s: ((M.scaled_matmul(x, w, scaling=s).double() - ref).norm() / ref.norm()).item()
           for s in ("amax", "none")}
    assert err["amax"] < 2.0**-4
    assert err["none"] > 0.5          # w * 1 sits among E4M3's subnormals and zeros
    out = M.scaled_matmul(x, w)
    assert out.dtype == torch.float32 and out.shape == (64, 32)


def test_refusals_name_the_argument():
    x = torch.ones(3)
    for call, name in [(lambda: M.quantize(torch.arange(3)), "x"),
                       (lambda: M.quantize(x, scale=True), "scale"),
                       (lambda: M.quantize(x, scale=0.0), "scale"),
                       (lambda: M.quantize(x, fmt="e3m4"), "fmt"),
                       (lambda: M.amax_scale(x, margin=True), "margin"),
                       (lambda: M.amax_scale(torch.tensor([1.0, float("inf")])), "x"),
                       (lambda: M.dequantize(x), "q"),
                       (lambda: M.scaled_matmul(torch.ones(2, 3), torch.ones(2, 3)), "b"),
                       (lambda: M.scaled_matmul(torch.ones(2, 3), torch.ones(3, 2),
                                                scaling="delayed"), "scaling")]:
        with pytest.raises((TypeError, ValueError), match=name):
            call()


def test_state_bytes_per_param():
    assert {r: M.state_bytes_per_param(r)["total"] for r in M.RECIPES} == {
        "bf16": 16, "fp8": 17, "fp8 weights": 15}


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_fp8_activation_terms_reprice_the_linear_inputs(mlp, recompute):
    cfg = T.GPTConfig(vocab_size=23, d_model=32, n_heads=4, n_layers=2, max_seq=16, mlp=mlp)
    rows = M.fp8_activation_terms(cfg, 3, 16, recompute=recompute)
    bf16 = M.activation_terms(cfg, 3, 16, precision="bf16", recompute=recompute)
    assert [(n, b) for n, b, _ in rows] == bf16
    got = {n.split(" x ")[0]: (b, f) for n, b, f in rows}
    for name in ("ln1 output (q, k, v inputs)", "attention output"):
        if recompute != "full":
            assert got[name][1] * 2 == got[name][0]
    assert got["output layer input"][0] == got["output layer input"][1]   # the head stays bf16
    bsf, L = 3 * 16 * cfg.ff, cfg.n_layers
    if recompute != "full" and mlp == "gelu":   # GELU's input in bf16, its output in FP8
        assert got["GELU input and output"] == (L * 2 * 2 * bsf, L * (2 + 1) * bsf)
    if recompute != "full" and mlp == "swiglu":  # the product (down's input) in FP8
        assert got["gate, silu, up, product"] == (L * 4 * 2 * bsf, L * (3 * 2 + 1) * bsf)
    head = cfg.vocab_size * cfg.d_model
    n_mm = T.count_params(cfg)["matmul"] if recompute != "full" else head
    assert got["weight copy"] == (2 * n_mm, (n_mm - head) + 2 * head)
