"""MFU's numerator and denominator, and the auditor on planted mistakes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from parlearn.at_scale import mfu as M  # the module
from parlearn.multi_device.memory.calculator import LlamaShape

TINY = LlamaShape(hidden=16, layers=2, heads=4, kv_heads=2, ffn=24, vocab=40)


class _Block(nn.Module):
    def __init__(self, m: LlamaShape):
        super().__init__()
        h, kd = m.hidden, m.kv_heads * m.head_dim
        self.m = m
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False), nn.Linear(h, kd, bias=False),
                                          nn.Linear(h, kd, bias=False), nn.Linear(h, h, bias=False))
        self.gate, self.up = nn.Linear(h, m.ffn, bias=False), nn.Linear(h, m.ffn, bias=False)
        self.down = nn.Linear(m.ffn, h, bias=False)
        self.n1, self.n2 = nn.RMSNorm(h), nn.RMSNorm(h)

    def forward(self, x):
        b, s, h = x.shape
        m, hd = self.m, self.m.head_dim
        y = self.n1(x)
        q = self.q(y).view(b, s, m.heads, hd).transpose(1, 2)
        rep = m.heads // m.kv_heads
        k = self.k(y).view(b, s, m.kv_heads, hd).transpose(1, 2).repeat_interleave(rep, 1)
        v = self.v(y).view(b, s, m.kv_heads, hd).transpose(1, 2).repeat_interleave(rep, 1)
        att = (q @ k.transpose(-1, -2)).masked_fill(
            torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        x = x + self.o((att @ v).transpose(1, 2).reshape(b, s, h))
        y = self.n2(x)
        return x + self.down(nn.functional.silu(self.gate(y)) * self.up(y))


class _Llama(nn.Module):
    def __init__(self, m: LlamaShape):
        super().__init__()
        self.emb = nn.Embedding(m.vocab, m.hidden)
        self.blocks = nn.ModuleList(_Block(m) for _ in range(m.layers))
        self.norm, self.head = nn.RMSNorm(m.hidden), nn.Linear(m.hidden, m.vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def test_matmul_params_are_the_linear_layers_and_n_params_everything():
    model = _Llama(TINY)
    linear = sum(p.numel() for mod in model.modules() if isinstance(mod, nn.Linear)
                 for p in mod.parameters())
    assert M.matmul_params(TINY) == linear
    assert TINY.n_params() == sum(p.numel() for p in model.parameters())


def test_full_convention_equals_what_torch_counts_in_a_full_scores_forward_and_backward():
    from torch.utils.flop_counter import FlopCounterMode

    seq, batch = 12, 3
    model = _Llama(TINY).double()
    ids = torch.randint(0, TINY.vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        model(ids).square().mean().backward()
    count = M.flop_count(TINY, seq, attention="full")
    assert counter.get_total_flops() == pytest.approx(batch * seq * count.model, rel=1e-12)


@pytest.mark.parametrize("seq, window", [(1, None), (7, None), (16, 5), (16, 16), (16, 40),
                                         (9, 1)])
def test_mean_keys_is_the_mask_averaged_over_queries(seq, window):
    i = torch.arange(seq)
    causal = i[None, :] <= i[:, None]
    band = causal if window is None else causal & (i[:, None] - i[None, :] < window)
    count = M.flop_count(TINY, seq, window=window)
    assert count.mean_keys == pytest.approx(band.double().sum(1).mean().item(), rel=1e-12)
    attn_fwd = 4 * TINY.layers * TINY.hidden * count.mean_keys
    assert count.attention == pytest.approx(3 * attn_fwd)
    assert count.model == pytest.approx(6 * M.matmul_params(TINY) + 3 * attn_fwd)


def test_recomputation_is_hardware_flops_not_model_flops():
    base = M.flop_count(TINY, 32)
    sel = M.flop_count(TINY, 32, recompute="selective")
    full = M.flop_count(TINY, 32, recompute="full")
    assert base.model == sel.model == full.model == base.hardware
    assert sel.hardware == pytest.approx(base.model + base.attention / 3)
    assert full.hardware == pytest.approx(base.model * 4 / 3)


def test_mfu_and_peaks():
    c = M.flop_count("llama3-8b", 4096)
    got = M.utilisation(1e6, c, device="H100 SXM", dtype="bfloat16", n_devices=512)
    assert got == pytest.approx(1e6 * c.model / (512 * 989e12))
    with pytest.raises(ValueError, match="device"):
        M.peak_flops("B200", "bfloat16")
    with pytest.raises(ValueError, match="dtype"):
        M.peak_flops("A100 SXM", "float8")
    with pytest.raises(TypeError, match="count"):
        M.utilisation(1.0, 3.0, device="H100 SXM", dtype="bfloat16", n_devices=1)


RUN = dict(shape="llama3-8b", seq=8192, device="H100 SXM", dtype="bfloat16")


def _audit(flops=None, peak=989e12, **kw):
    run = {**RUN, **kw}
    right = M.flop_count(run["shape"], run["seq"], attention=run.get("attention", "causal"),
                         window=run.get("window"), recompute=run.get("recompute", "none"))
    return M.audit(flops_per_token=right.model if flops is None else flops(right),
                   peak_per_device=peak, **run)


def test_the_right_figures_pass():
    assert _audit() == []
    assert _audit(attention="full", window=2048) == []
    assert _audit(recompute="full") == []


SHAPE = M._shape("llama3-8b")
PLANTED = {
    "all parameters in 6N": (lambda r: r.model + 6 * (SHAPE.n_params() - r.matmul_params), {}),
    "input embedding in 6N": (lambda r: r.model + 6 * SHAPE.vocab * SHAPE.hidden, {}),
    "norm parameters in 6N": (lambda r: r.model + 6 * (65 * SHAPE.hidden), {}),
    "recomputation counted": (lambda r: r.hardware, {"recompute": "selective"}),
    "attention counted as full": (
        lambda r: M.flop_count("llama3-8b", 8192, attention="full").model, {}),
    "sliding window ignored": (
        lambda r: M.flop_count("llama3-8b", 8192).model, {"window": 1024}),
}


@pytest.mark.parametrize("mistake", sorted(PLANTED))
def test_each_planted_numerator_mistake_is_named(mistake):
    flops, kw = PLANTED[mistake]
    found = _audit(flops, **kw)
    assert [f.kind for f in found] == ["numerator"], found
    assert mistake in found[0].message and found[0].factor > 1


@pytest.mark.parametrize("peak, words", [(2 * 989e12, "sparse"), (1979e12 * 2, "sparse FP8"),
                                         (8 * 989e12, "node"), (123e12, "unrecognised")])
def test_each_planted_denominator_mistake_is_named(peak, words):
    found = _audit(peak=peak)
    assert len(found) == 1 and found[0].kind == "denominator", found
    assert words in found[0].message


def test_the_datasheets_printed_1979_is_named_as_both_readings():
    """H100's datasheet prints 1,979 TFLOP/s for bf16 with sparsity and for dense FP8: one
    finding names both, with the factor against the dense bf16 peak."""
    found = _audit(peak=1979e12)
    assert len(found) == 1
    assert "sparse" in found[0].message and "FP8" in found[0].message
    assert found[0].factor == pytest.approx(989e12 / 1979e12)


def test_an_unknown_device_given_another_cards_peak_is_named():
    found = _audit(peak=312e12, device="Some new GPU")
    assert len(found) == 1 and "A100 SXM" in found[0].message and math.isnan(found[0].factor)


def test_an_unrecognised_numerator_is_reported_with_its_ratio():
    found = _audit(lambda r: 1.5 * r.model)
    assert found[0].message.startswith("unrecognised") and found[0].factor == pytest.approx(1.5)


def test_the_planners_flops_pass_the_audit():
    """The planner's model FLOPs for Llama 3 8B are this module's count in PaLM's
    convention: no embedding, no norms (it used to count every parameter)."""
    from parlearn.multi_device.mesh.planner import LlamaWorkload

    work = LlamaWorkload("llama3-8b", batch=64, seq=4096)
    per_token = 3 * work.forward_flops() / (64 * 4096)
    assert M.audit(flops_per_token=per_token, peak_per_device=989e12, shape="llama3-8b",
                   seq=4096, device="H100 SXM", dtype="bfloat16", attention="full") == []
    old = per_token + 6 * (SHAPE.n_params() - SHAPE.matmul_params())
    found = M.audit(flops_per_token=old, peak_per_device=989e12, shape="llama3-8b", seq=4096,
                    device="H100 SXM", dtype="bfloat16", attention="full")
    assert [f.message.split(":")[0] for f in found] == ["all parameters in 6N"]
    assert found[0].factor == pytest.approx(1.061, abs=1e-3)   # MFU 6.1% too high
