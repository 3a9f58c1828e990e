"""parlearn.transformer: the tiny GPT is causal, its gradients are right (float64
gradcheck), its weights are tied, its FLOPs equal FlopCounterMode's count, and it learns."""

import pytest
import torch

from parlearn.multi_device import transformer as T


def _cfg(**kw):
    base = dict(vocab_size=11, d_model=16, n_heads=4, n_layers=2, max_seq=12)
    return T.GPTConfig(**{**base, **kw})


def _tokens(b, s, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, s), generator=g)


@pytest.mark.parametrize("pos", ["rope", "learned"])
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_output_at_t_ignores_tokens_after_t(pos, mlp):
    model = T.GPT(_cfg(pos=pos, mlp=mlp), dtype=torch.float64)
    idx = _tokens(2, 10)
    t = 4
    later = idx.clone()
    later[:, t + 1:] = (later[:, t + 1:] + 3) % 11
    a, _ = model(idx)
    b, _ = model(later)
    assert torch.equal(a[:, :t + 1], b[:, :t + 1])
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:])  # the change did reach later outputs


@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_gradcheck_of_one_block_in_float64(pos):
    model = T.GPT(_cfg(n_layers=1, d_model=8, n_heads=2, pos=pos), dtype=torch.float64)
    block = model.blocks[0]
    s = 5
    x = torch.randn(2, s, 8, dtype=torch.float64, requires_grad=True)
    args = (model.mask[:s, :s], model.cos[:s], model.sin[:s])
    assert torch.autograd.gradcheck(lambda x: block(x, *args), (x,))


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_gives_the_same_loss_and_gradients(recompute):
    model = T.GPT(_cfg(), dtype=torch.float64)
    idx, tgt = _tokens(3, 12), _tokens(3, 12, seed=1)
    _, loss = model(idx, tgt)
    ref = torch.autograd.grad(loss, list(model.parameters()))
    _, loss2 = model(idx, tgt, recompute=recompute)
    got = torch.autograd.grad(loss2, list(model.parameters()))
    assert loss2.item() == pytest.approx(loss.item(), abs=1e-14)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_tied_weights_are_one_tensor():
    model = T.GPT(_cfg())
    assert model.head_weight is model.tok.weight
    n = sum(p.numel() for p in model.parameters())
    assert n == T.count_params(model.cfg)["total"]
    _, loss = model(_tokens(2, 6), _tokens(2, 6, seed=1))
    loss.backward()
    assert model.tok.weight.grad is not None  # one gradient, from both uses


@pytest.mark.parametrize("kw", [{}, {"mlp": "swiglu"}, {"pos": "learned"}, {"d_ff": 24}])
def test_flops_per_token_equal_the_flop_counter(kw):
    cfg = _cfg(**kw)
    model = T.GPT(cfg)
    b, s = 3, 12
    idx, tgt = _tokens(b, s), _tokens(b, s, seed=1)
    assert T.measured_flops(model, idx, tgt) == b * s * T.flops_per_token(cfg, s)
    assert T.measured_flops(model, idx, tgt, backward=False) == \
        b * s * T.flops_per_token(cfg, s, backward=False)
    assert all(p.grad is None for p in model.parameters())


def test_building_a_model_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b = T.GPT(_cfg(seed=3)), T.GPT(_cfg(seed=3))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    c = T.GPT(_cfg(seed=4))
    assert not torch.equal(a.blocks[0].attn.q.weight, c.blocks[0].attn.q.weight)


def test_corpus_is_the_pydoc_text_with_a_fixed_split():
    c = T.pydoc_corpus()
    assert c.vocab_size == len(set(c.chars)) > 50
    n = len(c.train) + len(c.val)
    assert n > 300_000 and len(c.val) == n - int(n * 0.9)
    text = c.decode(c.train[:200])
    assert torch.equal(c.encode(text), c.train[:200])
    x, y = T.get_batch(c.train, 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_loss_falls_on_the_corpus():
    c = T.pydoc_corpus()
    cfg = T.GPTConfig(vocab_size=c.vocab_size, d_model=32, n_heads=4, n_layers=1, max_seq=32)
    out = T.train(cfg, steps=60, batch=16, eval_every=30, progress=False)
    assert out["val_loss"][-1] < 0.8 * torch.log(torch.tensor(c.vocab_size)).item()
    assert out["train_loss"][-1] < out["train_loss"][0] - 1.0


def test_train_threads_are_used_then_restored():
    cfg = T.GPTConfig(vocab_size=T.pydoc_corpus().vocab_size, d_model=16, n_heads=2,
                      n_layers=1, max_seq=16)
    seen = []
    before = torch.get_num_threads()
    T.train(cfg, steps=2, batch=2, eval_every=1, threads=1,
            progress=lambda f, t: seen.append(torch.get_num_threads()))
    assert seen == [1, 1] and torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"):
        T.train(cfg, steps=2, progress=False, threads=0)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("kw, match", [
    ({"d_model": 10, "n_heads": 4}, "n_heads=4 must divide d_model=10"),
    ({"d_model": 12, "n_heads": 4}, "even head dimension"),
    ({"mlp": "relu"}, "mlp must be one of"),
    ({"n_layers": 0}, "n_layers must be"),
    ({"pos": "alibi"}, "pos must be one of"),
])
def test_bad_configs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_bad_inputs_are_refused():
    model = T.GPT(_cfg())
    with pytest.raises(ValueError, match="seq=13 > cfg.max_seq=12"):
        model(_tokens(1, 13))
    with pytest.raises(ValueError, match="int64 token ids"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="recompute must be one of"):
        model(_tokens(1, 3), recompute="some")
    with pytest.raises(ValueError, match="targets must have"):
        model(_tokens(1, 3), _tokens(1, 4))
    with pytest.raises(ValueError, match="vocab_size"):
        T.train(_cfg(), steps=1, progress=False)


def test_measured_flops_leaves_an_existing_grad_as_it_was():
    """Regression: the saved .grad tensors were the same objects backward then added into,
    so a second call doubled the user's gradients."""
    from zoo import kept_state

    cfg = T.GPTConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=1, max_seq=8)
    model = T.GPT(cfg)
    idx = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(0))
    model(idx, idx)[1].backward()  # the user's own gradients, mid-accumulation
    with kept_state(model):
        T.measured_flops(model, idx, idx)
        T.measured_flops(model, idx, idx, backward=False)
