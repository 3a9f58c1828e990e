"""parlearn.moe.modern: fine-grained and shared experts against the plain MoE and a float64
per-token loop, the router bias that moves the choice but never the gates, its update rule
against the paper's formula, dropless against capacity-factor routing."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from parlearn import moe, transformer

D = torch.float64


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


@pytest.mark.parametrize("cf,groups", [(None, 1), (1.0, 1), (0.75, 2)])
def test_granularity_one_without_shared_experts_is_the_moe_forward_and_backward(cf, groups):
    x = _x(2, 12, 8)
    a = moe.MoE(8, 16, 4, 2, capacity_factor=cf, groups=groups, seed=3, dtype=D)
    b = moe.FineGrainedMoE(8, 16, 4, 2, capacity_factor=cf, groups=groups, seed=3, dtype=D)
    names = {n for n, _ in b.named_parameters()}
    assert names - {n for n, _ in a.named_parameters()} == {"w_up_shared", "w_down_shared"}
    assert b.w_up_shared.numel() == 0  # no shared experts
    ya, yb = a(x), b(x)
    torch.testing.assert_close(yb, ya, atol=1e-15, rtol=0)
    (ya.square().sum() + a.last["balance"]).backward()
    (yb.square().sum() + b.last["balance"]).backward()
    for name in ("router.weight", "w_up", "w_down"):
        torch.testing.assert_close(b.get_parameter(name).grad, a.get_parameter(name).grad,
                                   atol=1e-15, rtol=0)
    assert b.last["dropped"] == a.last["dropped"]


def test_modern_gpt_with_granularity_one_is_moe_gpt():
    cfg = transformer.GPTConfig(d_model=8, n_heads=2, n_layers=2, max_seq=8)
    idx = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    a, b = moe.moe_gpt(cfg, 4, 1, dtype=D), moe.modern_gpt(cfg, 4, 1, dtype=D)
    torch.testing.assert_close(b(idx), a(idx), atol=1e-15, rtol=0)


@pytest.mark.parametrize("m,shared,k,groups,bias", [(1, 0, 1, 1, 0.0), (2, 0, 2, 1, 0.05),
                                                    (4, 1, 1, 2, 0.05), (4, 3, 2, 3, 0.2)])
def test_dropless_layer_equals_the_float64_per_token_loop(m, shared, k, groups, bias):
    layer = moe.FineGrainedMoE(8, 16, 4, k, granularity=m, shared=shared, groups=groups,
                               seed=1, dtype=D)
    layer.bias.copy_(bias * _x(layer.n_experts, seed=5))
    x = _x(3, 10, 8, seed=2)
    y = layer(x)
    assert layer.last["dropped"] == 0 and layer.last["capacity"] is None
    torch.testing.assert_close(y, moe.per_token_reference(layer, x), atol=1e-14, rtol=0)


def test_a_capacity_drops_what_the_dropless_layer_computes():
    layer = moe.FineGrainedMoE(8, 16, 4, 1, granularity=2, shared=1, capacity_factor=1.0,
                               seed=1, dtype=D)
    with torch.no_grad():
        layer.router.weight[0] += 1.0  # a skewed router: expert 0 overflows
    x = _x(24, 8, seed=2)
    y = layer(x)
    assert layer.last["dropped"] > 0
    ref = moe.per_token_reference(layer, x)
    wrong = (y - ref).abs().amax(1) > 1e-12
    assert int(wrong.sum()) == layer.last["dropped"]  # k routed = 1: one token per drop
    rates = moe.drop_rates(layer, x, [None, 1.0, 2.0, 1e6])
    assert rates[None] == 0 and rates[1e6] == 0
    assert rates[1.0] == layer.last["dropped"] / 24 > rates[2.0]
    # The factors and records are restored.
    assert layer.capacity_factor == 1.0 and layer.last["capacity"] is not None


def test_drop_rates_count_what_the_capacity_formula_drops():
    layer = moe.FineGrainedMoE(8, 16, 4, 2, granularity=2, seed=4, dtype=D)
    x = _x(40, 8, seed=3)
    layer(x)
    wanted = layer.last["wanted"].tolist()
    for c in (0.5, 1.0, 1.25):
        cap = moe.capacity(40, layer.n_experts, layer.k, c)
        by_formula = sum(max(w - cap, 0) for w in wanted) / sum(wanted)
        assert moe.drop_rates(layer, x, [c])[c] == by_formula


def _assert_gates_unbiased(route):
    """``route(logits, k, bias)`` must choose by ``p + bias`` and gate by ``p`` alone."""
    logits = _x(50, 6, seed=7)
    bias = 0.3 * _x(6, seed=8)
    r = route(logits, 2, bias)
    p = torch.softmax(logits, -1)
    assert torch.equal(r.expert, (p + bias).topk(2, -1).indices)
    assert torch.equal(r.gate, p.gather(1, r.expert))
    assert not torch.equal(r.expert, p.topk(2, -1).indices)  # the bias did move the choice


def test_the_bias_moves_the_choice_never_the_gates():
    _assert_gates_unbiased(lambda lg, k, b: moe.token_choice(lg, k, bias=b))
    zero = moe.token_choice(_x(20, 6), 2, 1.0, bias=torch.zeros(6, dtype=D))
    plain = moe.token_choice(_x(20, 6), 2, 1.0)
    assert torch.equal(zero.expert, plain.expert) and torch.equal(zero.gate, plain.gate)


def test_a_router_that_adds_the_bias_to_the_gates_is_caught():
    def wrong(logits, k, bias):
        r = moe.token_choice(logits, k, bias=bias)
        return type(r)(r.expert, r.gate + bias[r.expert], r.kept, r.logits, r.probs,
                       r.wanted, r.capacity)

    with pytest.raises(AssertionError):
        _assert_gates_unbiased(wrong)


def test_the_bias_carries_no_gradient_and_the_router_still_learns():
    layer = moe.FineGrainedMoE(8, 16, 4, 1, granularity=2, bias_rate=0.1, seed=0, dtype=D)
    layer.bias.copy_(_x(8, seed=1))
    layer(_x(12, 8)).sum().backward()
    assert not layer.bias.requires_grad and layer.router.weight.grad.abs().sum() > 0


def test_bias_update_is_the_papers_formula():
    bias = torch.tensor([0.0, 0.5, -0.25, 1.0], dtype=D)
    counts = torch.tensor([10, 2, 4, 4])  # mean 5
    got = moe.bias_update(bias, counts, 0.01)
    torch.testing.assert_close(got, bias + torch.tensor([-0.01, 0.01, 0.01, 0.01], dtype=D))
    assert torch.equal(moe.bias_update(bias, torch.tensor([3, 3, 3, 3]), 0.01), bias)
    assert torch.equal(bias, torch.tensor([0.0, 0.5, -0.25, 1.0], dtype=D))  # a new tensor


@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.floats(0, 1))
def test_bias_update_by_hand(counts, rate):
    bias = torch.zeros(len(counts), dtype=D)
    got = moe.bias_update(bias, torch.tensor(counts), rate).tolist()
    mean = sum(counts) / len(counts)
    want = [rate * ((mean > c) - (mean < c)) for c in counts]
    assert got == pytest.approx(want, abs=0)


def test_update_bias_uses_the_last_loads_and_steers_tokens_away_from_the_busiest():
    layer = moe.FineGrainedMoE(8, 16, 4, 1, bias_rate=0.05, seed=0, dtype=D)
    with torch.no_grad():
        layer.router.weight[0] += 0.5
    x = _x(64, 8)
    layer(x)
    before = layer.last["wanted"].clone()
    busiest = int(before.argmax())
    for _ in range(5):
        layer.update_bias()
        layer(x)
    assert layer.bias[busiest] < 0 and layer.last["wanted"][busiest] < before[busiest]
    with pytest.raises(ValueError, match="forward first"):
        moe.FineGrainedMoE(8, 16, 4, 1).update_bias()


def test_fine_grained_experts_keep_parameters_and_flops_and_multiply_combinations():
    s = moe.fine_grained_shape(16, 2, 1024, granularity=4, shared=1)
    assert (s["routed"], s["top_k"], s["width"]) == (63, 7, 256)
    assert s["active_width"] == 2 * 1024
    assert s["combinations"] == math.comb(63, 7) and s["coarse_combinations"] == 120
    coarse = moe.MoE(8, 16, 4, 2, seed=0)
    fine = moe.FineGrainedMoE(8, 16, 4, 2, granularity=4, shared=2, seed=0)
    experts = sum(p.numel() for n, p in fine.named_parameters() if n != "router.weight")
    assert experts == coarse.w_up.numel() + coarse.w_down.numel()
    assert fine.k * fine.d_ff + fine.w_up_shared.shape[1] == coarse.k * coarse.d_ff


def test_train_moe_with_the_bias_balances_and_the_defaults_are_unchanged():
    corpus = transformer.pydoc_corpus()
    cfg = transformer.GPTConfig(vocab_size=corpus.vocab_size, d_model=16, n_heads=2,
                                n_layers=1, max_seq=16)
    same = dict(steps=30, batch=8, eval_every=30, corpus=corpus, balance=0.0)
    plain = moe.train_moe(cfg, 4, **same)
    m1 = moe.train_moe(cfg, 4, granularity=1, shared=0, bias_rate=0.0, **same)
    assert m1["train_loss"] == plain["train_loss"]
    biased = moe.train_moe(cfg, 4, bias_rate=0.02, **same)
    bias = moe.moe_layers(biased["model"])[0].bias
    assert bias.abs().sum() > 0
    assert sum(biased["imbalance"][-10:]) < sum(plain["imbalance"][-10:])
    fine = moe.train_moe(cfg, 4, granularity=2, shared=1, **same)
    assert fine["params"] == plain["params"] + 16 * 3  # the router's 7 rows against 4
    with pytest.raises(ValueError, match="bias_rate"):
        moe.train_moe(cfg, 0, bias_rate=0.1, **same)
