"""parlearn.memory: saved-activation bytes measured equal the model to the byte, for
several shapes, precisions and recomputation modes; Korthikanti's count; bytes per
parameter; fp16 underflow and the scaler; the calculator's Llama figures and refusals."""

import itertools

import pytest
import torch

from parlearn.multi_device import memory as M
from parlearn.multi_device import transformer as T

SHAPES = [dict(d_model=32, n_heads=4, n_layers=1),
          dict(d_model=48, n_heads=3, n_layers=2, mlp="swiglu", pos="learned"),
          dict(d_model=16, n_heads=2, n_layers=3, pos="learned", d_ff=40)]


@pytest.mark.parametrize("shape, bs, precision, recompute", list(itertools.product(
    SHAPES, [(2, 8), (3, 16)], ["fp32", "bf16", "fp64"], ["none", "selective", "full"])))
def test_measured_saved_bytes_equal_the_model(shape, bs, precision, recompute):
    cfg = T.GPTConfig(vocab_size=23, max_seq=16, **shape)
    model = T.GPT(cfg, dtype=torch.float64 if precision == "fp64" else torch.float32)
    g = torch.Generator().manual_seed(0)
    b, s = bs
    idx, tgt = torch.randint(0, 23, (b, s), generator=g), torch.randint(0, 23, (b, s), generator=g)
    ledger, loss = M.saved_tensors(model, idx, tgt, recompute=recompute,
                                   autocast=torch.bfloat16 if precision == "bf16" else None)
    terms = dict(M.activation_terms(cfg, b, s, precision=precision, recompute=recompute))
    assert ledger.bytes("activation") == M.activation_bytes(cfg, b, s, precision=precision,
                                                            recompute=recompute)
    assert ledger.bytes("weight copy") == terms.get("weight copy", 0)
    assert ledger.bytes("input") == 2 * b * s * 8  # token ids and targets, int64
    loss.backward()  # the ledger's hooks gave every tensor back intact


def test_recomputation_changes_measured_bytes_as_modeled():
    cfg = T.GPTConfig(vocab_size=23, d_model=32, n_heads=4, n_layers=2, max_seq=64)
    model = T.GPT(cfg)
    idx = torch.randint(0, 23, (2, 64), generator=torch.Generator().manual_seed(0))
    got = {m: M.saved_tensors(model, idx, idx, recompute=m)[0].bytes("activation")
           for m in ("none", "selective", "full")}
    # selective drops exactly the softmax outputs: 4 a b s^2 bytes per layer
    assert got["none"] - got["selective"] == cfg.n_layers * 4 * 4 * 2 * 64 * 64
    assert got["full"] < got["selective"] < got["none"]


def test_korthikanti_terms_sum_to_their_closed_form():
    for s, b, h, a in [(2048, 1, 4096, 32), (128, 4, 768, 12), (7, 3, 10, 5)]:
        assert sum(n for _, n in M.korthikanti_terms(s, b, h, a)) == \
            pytest.approx(M.korthikanti_bytes(s, b, h, a), rel=1e-15)
    assert M.korthikanti_bytes(1, 1, 1, 1) == 39  # 34 + 5


def test_bytes_per_parameter_after_a_real_adam_step():
    cfg = T.GPTConfig(vocab_size=23, d_model=16, n_heads=2, n_layers=1, max_seq=8)
    model = T.GPT(cfg)
    opt = torch.optim.Adam(model.parameters())
    idx = torch.randint(0, 23, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    opt.step()
    got = M.state_bytes(model, opt)
    n_tensors = len(list(model.parameters()))
    n = T.count_params(cfg)["total"]
    assert got["params"] == 4 and got["grads"] == 4  # amp: fp32 master weights and grads
    assert got["optimizer"] == pytest.approx(8 + 4 * n_tensors / n)  # m, v, and step scalars


def test_fp16_gradients_underflow_without_a_scaler_and_survive_with_one():
    r = M.fp16_underflow()
    assert r["zero_fraction"]["fp32"] == 0
    assert r["zero_fraction"]["fp16"] == 1.0  # every weight gradient flushed to zero
    assert r["zero_fraction"]["fp16 + scaler"] == 0
    assert r["relative_error"]["fp16 + scaler"] < 1e-2
    assert r["master_dtype"] == r["grad_dtype"] == torch.float32


def test_llama3_parameter_counts_match_the_published_sizes():
    assert M.PRESETS["llama3-8b"].n_params() == pytest.approx(8.03e9, rel=0.01)
    assert M.PRESETS["llama3-70b"].n_params() == pytest.approx(70.6e9, rel=0.01)
    assert M.PRESETS["llama3-405b"].n_params() == pytest.approx(405.9e9, rel=0.01)


def test_calculator_accounting():
    base = M.estimate("llama3-8b", 1, 4096)
    n = M.PRESETS["llama3-8b"].n_params() - 4096  # the final norm is left out
    assert base["params"] == pytest.approx(2 * n, rel=1e-6)
    assert base["optimizer"] == pytest.approx(12 * n, rel=1e-6)
    z3 = M.estimate("llama3-8b", 1, 4096, zero_stage=3, dp=8)
    assert z3["params"] + z3["grads"] + z3["optimizer"] == pytest.approx(
        (base["params"] + base["grads"] + base["optimizer"]) / 8)
    sel = M.estimate("llama3-8b", 1, 4096, recompute="selective")
    full = M.estimate("llama3-8b", 1, 4096, recompute="full")
    assert full["activations"] < sel["activations"] < base["activations"]
    gpipe = M.estimate("llama3-8b", 1, 4096, pp=4, micro_batches=8, schedule="gpipe")
    one = M.estimate("llama3-8b", 1, 4096, pp=4, micro_batches=8, schedule="1f1b")
    assert gpipe["activations"] == pytest.approx(2 * one["activations"])  # 8 vs 4 in flight
    cp = M.estimate("llama3-8b", 1, 8192, cp=2, recompute="selective")
    assert cp["activations"] == pytest.approx(
        M.estimate("llama3-8b", 1, 4096, recompute="selective")["activations"])


def test_full_recomputation_counts_the_block_being_rebuilt():
    # full keeps each block's input, and during the backward one block at a time is rebuilt
    # with all its activations (none's): that transient must be in the total
    m, s, b, tp = M.PRESETS["llama3-8b"], 8192, 4, 8
    none = M.estimate(m, b, s, tp=tp)["activations"]
    for pp, mb in ((1, 1), (4, 8)):
        full = M.estimate(m, b, s, tp=tp, pp=pp, micro_batches=mb, recompute="full")
        kept = m.layers // pp * min(pp, mb) * 2 * s * b * m.hidden / tp
        assert full["activations"] == pytest.approx(kept + none / m.layers)


@pytest.mark.parametrize("kw, match", [
    (dict(tp=3), "tp=3 must divide heads"),
    (dict(pp=5), "pp=5 must divide layers"),
    (dict(cp=3), "cp=3 must divide seq"),
    (dict(batch=-1), "batch must be"),
    (dict(recompute="half"), "recompute must be one of"),
    (dict(schedule="zb"), "schedule must be one of"),
    (dict(zero_stage=4), "zero_stage must be one of"),
])
def test_calculator_refuses_bad_configs(kw, match):
    args = {"batch": 1, "seq": 4096, **kw}
    with pytest.raises(ValueError, match=match):
        M.estimate("llama3-8b", args.pop("batch"), args.pop("seq"), **args)


def test_llama_shape_refuses_heads_not_dividing_hidden():
    with pytest.raises(ValueError, match="heads=3 must divide hidden=64"):
        M.LlamaShape(64, 2, 3, 1, 128, 100)
    with pytest.raises(ValueError, match="model must be one of"):
        M.estimate("llama4", 1, 16)


def test_peak_memory_is_none_without_an_allocator_counter_and_bad_models_are_refused():
    assert M.peak_memory(lambda: None, "cpu") is None
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        M.saved_tensors(lambda x: x, torch.zeros(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_memory_on_cuda_is_at_least_the_saved_activations():
    cfg = T.GPTConfig(vocab_size=23, d_model=64, n_heads=4, n_layers=2, max_seq=64)
    model = T.GPT(cfg, device="cuda")
    idx = torch.randint(0, 23, (8, 64), device="cuda")
    ledger, loss = M.saved_tensors(model, idx, idx)
    del loss

    def step():
        model(idx, idx)[1].backward()

    assert M.peak_memory(step, "cuda") >= ledger.bytes("activation")


def test_ledger_of_a_users_model_with_a_frozen_layer_and_a_layernorm():
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 3))
    net[0].requires_grad_(False)  # frozen: its input needs no gradient, so it keeps nothing
    x = torch.randn(5, 4)
    ledger, out = M.saved_tensors(net, x)
    # LayerNorm keeps its input and mean/rstd; tanh keeps its output; the last linear keeps
    # that same output (one storage): 5x8 + 2x5 + 5x8 floats.
    assert ledger.bytes("activation") == 4 * (5 * 8 + 2 * 5 + 5 * 8)
    assert ledger.bytes("input") == 0  # x needs no gradient: nothing keeps it
    out.sum().backward()
    assert net[0].weight.grad is None and net[3].weight.grad is not None


class _TwoInputs(torch.nn.Module):
    """A user's model called with its target as a keyword, the way a loss-returning model is."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, target=None):
        out = self.lin(x)
        return out, torch.nn.functional.mse_loss(out, target)


def test_a_target_saved_for_backward_counts_as_input_whether_positional_or_keyword():
    net, x, y = _TwoInputs(), torch.randn(5, 4), torch.randn(5, 3)
    positional = M.saved_tensors(net, x, y)[0].by_kind()
    keyword = M.saved_tensors(net, x, target=y)[0].by_kind()
    assert keyword == positional
    assert keyword["input"] >= y.numel() * y.element_size()  # mse_loss keeps the target


def test_a_model_without_parameters_runs_on_its_inputs_device():
    x = torch.randn(6, 2, requires_grad=True)
    ledger, out = M.saved_tensors(torch.nn.Tanh(), x)
    assert ledger.by_kind()["activation"] == x.numel() * 4  # tanh keeps its output
    assert ledger.bytes("parameter") == 0 and out.shape == x.shape


def test_recompute_cost_leaves_an_existing_grad_as_it_was():
    """Regression: the ledger's backward added into the very .grad tensors it had saved."""
    from zoo import kept_state

    cfg = T.GPTConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=1, max_seq=8)
    model = T.GPT(cfg)
    idx = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(0))
    model(idx, idx)[1].backward()
    with kept_state(model):
        M.recompute_cost(model, idx, idx, repeat=1, threads=1)


def test_bf16_copies_of_conv_weights_are_weight_copies_not_activations():
    """Regression: only 2-D weights were recognised, so autocast's bf16 copy of a conv's
    4-D weight was counted as an activation."""
    from zoo import batch, build

    net = build("conv", torch.float32)
    x, _ = batch(7, torch.float32)
    x.requires_grad_(True)
    ledger, out = M.saved_tensors(net, x, autocast=torch.bfloat16)
    conv, lin = net[1].weight, net[4].weight
    by_shape = ledger.by_shape("weight copy")
    assert by_shape == {(tuple(conv.shape), torch.bfloat16): conv.numel() * 2,
                        (tuple(lin.t().shape), torch.bfloat16): lin.numel() * 2}
    assert (tuple(conv.shape), torch.bfloat16) not in ledger.by_shape("activation")
    out.float().sum().backward()


def test_recomputing_gpt_stashes_no_rng_state_the_ledger_cannot_see(monkeypatch):
    """Regression: torch.utils.checkpoint's default stashes torch.get_rng_state() (5,056 B
    on the CPU) per call, outside the saved-tensor hooks: full recompute held ~2.6x the
    ledger's bytes. The GPT has nothing random to replay and stashes nothing."""
    stashed = []
    real = torch.get_rng_state

    def counting():
        state = real()
        stashed.append(state.numel() * state.element_size())
        return state

    cfg = T.GPTConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=2, max_seq=8)
    model = T.GPT(cfg)
    idx = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(torch, "get_rng_state", counting)
    for mode in ("selective", "full"):
        ledger, loss = M.saved_tensors(model, idx, idx, recompute=mode)
        loss.backward()
        assert stashed == [], f"recompute={mode!r} stashed {sum(stashed)} B of RNG state"
        assert ledger.bytes("activation") == M.activation_bytes(cfg, 2, 8, precision="fp32",
                                                                recompute=mode)


def test_draw_block_marks_what_each_recompute_mode_keeps():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3)
    none, sel, full = (M.draw_block(ax, m) for ax, m in zip(axes, T.RECOMPUTE, strict=True))
    assert len(none) == 11 and "softmax output" in none and "GELU input and output" in none
    assert set(none) - set(sel) == {"softmax output"}     # selective drops the s^2 term only
    assert full == ["block input x"]
    orange = [p for p in axes[1].patches if p.get_facecolor()[:3] != (0.88, 0.88, 0.88)]
    assert len(orange) == len(sel)
    plt.close(fig)
    with pytest.raises(ValueError, match="recompute"):
        M.draw_block(None, "some")
