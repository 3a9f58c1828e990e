"""The argument contract of lesson 18's modern MoE: fine-grained and shared experts, the
router bias and its update, dropless routing and the drops a capacity causes (see
harness.py)."""

from __future__ import annotations

import math

import torch
from harness import Case, contract_tests

from parlearn.multi_device.moe import layer as moe_layer
from parlearn.multi_device.moe import modern
from parlearn.multi_device.transformer import model as tf_model

M = "parlearn.multi_device.moe.modern."
D = torch.float64


def _fine():
    return modern.FineGrainedMoE(4, 8, 4, 2, granularity=2, shared=1, dtype=D)


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=D)


def _bias_rule(r, kw):
    c = kw["counts"].to(D)
    want = kw["bias"] + kw["rate"] * torch.sign(c.mean() - c)
    assert torch.equal(r, want)


def _equals_layer(r, kw):
    torch.testing.assert_close(r, kw["layer"](kw["x"]), atol=1e-13, rtol=0)


CASES = [
    Case(M + "fine_grained_shape",
         lambda: dict(n_experts=16, k=2, d_ff=1024, granularity=4, shared=1),
         ranges={"n_experts": (2, None), "k": (1, 16), "shared": (0, 7)},
         bad={"d_ff": [0, 1022], "granularity": [0, 3], "k": [17], "shared": [8]},
         check=lambda r, kw: r["active_width"] == kw["k"] * kw["d_ff"] and r["combinations"]
         == math.comb(r["routed"], r["top_k"])),
    Case(M + "bias_update",
         lambda: dict(bias=torch.zeros(4, dtype=D), counts=torch.tensor([5, 1, 2, 0]), rate=0.1),
         ranges={"rate": (0.0, None)},
         bad={"bias": [torch.zeros(2, 2, dtype=D), torch.zeros(4, dtype=torch.int64)],
              "counts": [torch.tensor([1, 2, 3]), torch.tensor([-1, 1, 1, 1]),
                         torch.tensor([True, False, True, True]), torch.zeros(1, 4)]},
         check=_bias_rule),
    Case(M + "FineGrainedMoE",
         lambda: dict(d_model=4, d_ff=8, n_experts=4, k=1, granularity=2, shared=1,
                      capacity_factor=None, bias_rate=0.01, groups=1, seed=0, out_std=0.02,
                      dtype=torch.float32),
         ranges={"d_model": (1, None), "n_experts": (1, None), "k": (1, 4), "shared": (0, 1),
                 "bias_rate": (0.0, None), "groups": (1, None), "seed": (0, None),
                 "out_std": (0.0, None)},
         legal={"capacity_factor": [None]},
         bad={"d_ff": [0, 7], "granularity": [0, 3], "k": [5], "capacity_factor": [0.0, -1.0],
              "dtype": [torch.int64]}),
    Case(M + "per_token_reference", lambda: dict(layer=_fine(), x=_x(2, 3, 4)),
         bad={"layer": [torch.nn.Linear(2, 2), moe_layer.MoE(4, 8, 4, 1)],
              "x": [torch.zeros(3, 5, dtype=D), torch.zeros(3, 4, dtype=torch.int64)]},
         check=_equals_layer),
    Case(M + "drop_rates",
         lambda: dict(model=_fine(), x=_x(16, 4), capacity_factors=[None, 1.0]),
         bad={"model": [torch.nn.Linear(2, 2), moe_layer.MoE(4, 8, 4, 1, routing="expert")],
              "x": [torch.zeros(3, 5, dtype=D)],
              "capacity_factors": [[0.0], [-1.0], [], "1.0", 3, [True], [math.nan]]},
         check=lambda r, kw: r[None] == 0 and 0 <= r[1.0] <= 1),
    Case(M + "modern_gpt",
         lambda: dict(cfg=tf_model.GPTConfig(d_model=8, n_heads=2, n_layers=1, max_seq=8),
                      n_experts=2, k=1, granularity=2, shared=1, capacity_factor=None,
                      bias_rate=0.01, dtype=torch.float32),
         ranges={"n_experts": (1, None), "bias_rate": (0.0, None)},
         bad={"cfg": [{"d_model": 8}], "k": [3], "granularity": [0, 3], "shared": [-1, 2],
              "capacity_factor": [0.0, -1.0], "dtype": [torch.int64]},
         legal={"capacity_factor": [None]}),
]

test_refuses, test_accepts, test_accepts_range = contract_tests(CASES)

COVERED_ELSEWHERE: dict[str, str] = {}
EXEMPT: dict[str, str] = {}
