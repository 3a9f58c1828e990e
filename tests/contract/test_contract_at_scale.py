"""The argument contract of Part 5's modules (see harness.py)."""

from __future__ import annotations

import math

from harness import Case, contract_tests

A = "parlearn.at_scale."


def _count():
    from parlearn.at_scale.mfu import flop_count

    return flop_count("llama3-8b", 4096)


def _tiny():
    from parlearn.multi_device.memory.calculator import LlamaShape

    return LlamaShape(hidden=16, layers=2, heads=4, kv_heads=2, ffn=24, vocab=40)


def _is_dense_h100(result, kw):
    assert result == {"bfloat16": 989e12, "float32": 67e12}.get(kw["dtype"], result)


def _trusted(result, kw):
    assert result == []   # the right numerator and the dense peak: nothing to report


CASES: list[Case] = [
    Case(A + "mfu.peak_flops", lambda: dict(device="H100 SXM", dtype="bfloat16"),
         bad={"device": ["h100", "B200", 3], "dtype": ["bf16", "int8", 3]},
         check=_is_dense_h100),
    Case(A + "mfu.matmul_params", lambda: dict(shape=_tiny()),
         bad={"shape": ["llama3-1b", 3]},
         check=lambda r, kw: r == 2 * (2 * 16 * 16 + 2 * 16 * 8 + 3 * 16 * 24) + 40 * 16),
    Case(A + "mfu.flop_count",
         lambda: dict(shape=_tiny(), seq=8, attention="causal", window=None, recompute="none"),
         ranges={"seq": (1, None)},
         bad={"shape": ["llama3-1b", 3], "attention": ["flash", True],
              "window": [0, -1, 2.5], "recompute": ["some", None]},
         legal={"window": [None]},
         check=lambda r, kw: r.model >= 6 * r.matmul_params and r.hardware >= r.model),
    Case(A + "mfu.utilisation",
         lambda: dict(tokens_per_second=1e6, count=_count(), device="H100 SXM",
                      dtype="bfloat16", n_devices=512),
         ranges={"tokens_per_second": (0.0, None), "n_devices": (1, None)},
         bad={"count": [3.0, "count"], "device": ["B200"], "dtype": ["bf16"]},
         check=lambda r, kw: math.isclose(
             r, kw["tokens_per_second"] * kw["count"].model / (kw["n_devices"] * 989e12))),
    Case(A + "mfu.audit",
         lambda: dict(flops_per_token=_count().model, peak_per_device=989e12,
                      shape="llama3-8b", seq=4096, device="H100 SXM", dtype="bfloat16",
                      attention="causal", window=None, recompute="none", devices_per_node=8),
         ranges={"devices_per_node": (1, None)},
         bad={"flops_per_token": [0.0, -1.0], "peak_per_device": [0.0, -1.0],
              "shape": ["llama3-1b"], "seq": [0, -1], "attention": ["flash"],
              "recompute": ["some"], "window": [0], "device": [3, ""],
              "dtype": ["bf16", 3]},
         # an unknown device is reported (a Finding), not refused
         legal={"window": [None], "device": ["no such H100 SXM"]}, check=_trusted),
]

test_refuses, test_accepts, test_accepts_range = contract_tests(CASES)

COVERED_ELSEWHERE: dict[str, str] = {}
EXEMPT: dict[str, str] = {
    A + "mfu.FlopCount": "the record flop_count() returns; users only read its fields",
    A + "mfu.Finding": "the record audit() returns; users only read its fields",
}
