import copy
import math

import numpy as np
import pytest
import torch
import zoo
from torch import nn

from parlearn.core import datasets, device
from parlearn.many_copies import dither

F = nn.functional.cross_entropy


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny ops: one intra-op thread keeps these tests fast on a busy machine."""
    with device.threads(1):
        yield


def _setup(batch=3, dtype=torch.float64, dropout_layer=0.0, device="cpu"):
    data = datasets.digits(dtype=dtype, n_train=64, device=device)
    model = dither.mlp(64, 16, 10, dtype=dtype, dropout=dropout_layer).to(device)
    return model, data.x_train[:batch], data.y_train[:batch]


def _grads(model):
    g = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return g


# --- exactness: batched copies equal the serial loop ------------------------------------


def test_no_noise_equals_plain_gradient(any_device):
    model, x, y = _setup(device=any_device)
    F(model(x), y).backward()
    ref = _grads(model)
    dither.parallel_grad(model, F, x, y, copies=5)
    for a, b in zip(_grads(model), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


@pytest.mark.parametrize("kind", dither.NOISES)
@pytest.mark.parametrize("max_rows", [16384, 7])  # 7 rows: chunks of 2, 2, 2, 1 copies
def test_batched_equals_mean_of_sequential(kind, max_rows, any_device):
    model, x, y = _setup(device=any_device)
    noise = dither.draw_noise(x, 7, dither=kind, scale=0.3, dropout=0.2,
                              generator=torch.Generator().manual_seed(1))
    l1 = dither.parallel_grad(model, F, x, y, copies=7, noise=noise, max_rows=max_rows)
    g1 = _grads(model)
    l2 = dither.sequential_grad(model, F, x, y, noise=noise)
    g2 = _grads(model)
    assert l1 == pytest.approx(l2, rel=1e-12)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_drawing_inside_equals_drawing_outside(any_device):
    model, x, y = _setup(device=any_device)
    kw = {"dither": "uniform", "scale": 0.4, "dropout": 0.3}
    dither.parallel_grad(model, F, x, y, copies=6, generator=torch.Generator().manual_seed(5),
                         **kw)
    inside = _grads(model)
    noise = dither.draw_noise(x, 6, generator=torch.Generator().manual_seed(5), **kw)
    dither.parallel_grad(model, F, x, y, copies=6, noise=noise)
    for a, b in zip(_grads(model), inside, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_chunks_hold_at_most_max_rows(monkeypatch):
    """The docstring's memory claim: inputs drawn and activations built per chunk."""
    model, x, y = _setup(batch=3)
    seen_rows, drawn = [], []
    real_draw = dither.draw_noise

    def spy_draw(x_, copies, **kw):
        drawn.append(copies)
        return real_draw(x_, copies, **kw)

    class Spy(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, rows):
            seen_rows.append(rows.shape[0])
            return self.inner(rows)

    monkeypatch.setattr(dither.gradients, "draw_noise", spy_draw)  # parallel_grad looks it up there
    dither.parallel_grad(Spy(model), F, x, y, copies=11, dither="gaussian", scale=0.2,
                         max_rows=7, generator=torch.Generator().manual_seed(0))
    assert drawn == [2, 2, 2, 2, 2, 1] and sum(drawn) == 11
    assert max(seen_rows) <= 7 and sum(seen_rows) == 33


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak memory is read on CUDA")
def test_chunking_lowers_peak_memory_on_cuda():
    dev = torch.device("cuda")
    model = dither.mlp(64, 512, 10, dtype=torch.float32).to(dev)
    x = torch.rand(8, 64, device=dev)
    y = torch.zeros(8, dtype=torch.int64, device=dev)
    peaks = {}
    for rows in (1 << 20, 256):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        dither.parallel_grad(model, F, x, y, copies=2048, dither="gaussian", scale=0.1,
                             max_rows=rows, generator=torch.Generator().manual_seed(0))
        peaks[rows] = torch.cuda.max_memory_allocated(dev) - base
        model.zero_grad(set_to_none=True)
    assert peaks[256] < 0.25 * peaks[1 << 20]


def test_accumulates_like_backward():
    model, x, y = _setup()
    dither.parallel_grad(model, F, x, y, copies=2)
    once = [p.grad.clone() for p in model.parameters()]
    dither.parallel_grad(model, F, x, y, copies=2)
    for p, g in zip(model.parameters(), once, strict=True):
        torch.testing.assert_close(p.grad, 2 * g)


# --- training trajectories, step by step, with awkward models ----------------------------


class _Tied(nn.Module):
    """Encoder and decoder share one weight; a frozen layer sits in between."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.w = nn.Parameter(torch.randn(16, 64, generator=g, dtype=torch.float64) * 0.1)
        self.frozen = nn.Linear(16, 16, dtype=torch.float64)
        with torch.no_grad():
            self.frozen.weight.copy_(torch.randn(16, 16, generator=g, dtype=torch.float64) * .2)
            self.frozen.bias.zero_()
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(64, 10, dtype=torch.float64)

    def forward(self, x):
        h = torch.relu(x @ self.w.t())
        h = torch.relu(self.frozen(h))
        return self.head(h @ self.w)


def _bn_eval_model():
    m = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
    m = m.double()
    with torch.no_grad():
        m[1].running_mean.uniform_(-0.5, 0.5)
        m[1].running_var.uniform_(0.5, 2.0)
    return m.eval()


@pytest.mark.parametrize("make", [_Tied, _bn_eval_model,
                                  lambda: dither.mlp(64, 16, 10, dtype=torch.float64)],
                         ids=["tied+frozen", "batchnorm-eval", "mlp"])
def test_sgd_trajectory_batched_equals_serial(make, any_device):
    data = datasets.digits(dtype=torch.float64, n_train=40, device=any_device)
    a = make().to(any_device)
    b = copy.deepcopy(a)
    frozen_before = {n: p.detach().clone() for n, p in a.named_parameters()
                     if not p.requires_grad}
    bn_stats = [t.clone() for t in a.buffers()]
    opt_a = torch.optim.SGD([p for p in a.parameters() if p.requires_grad], lr=0.1)
    opt_b = torch.optim.SGD([p for p in b.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        xs, ys = data.x_train[step:step + 2], data.y_train[step:step + 2]
        before = [p.detach().clone() for p in a.parameters()]
        noise = dither.draw_noise(xs, 5, dither="triangular", scale=0.3, dropout=0.25,
                                  generator=g)
        for model, opt, fn in ((a, opt_a, dither.parallel_grad),
                               (b, opt_b, dither.sequential_grad)):
            opt.zero_grad(set_to_none=True)
            kw = {"copies": 5} if fn is dither.parallel_grad else {}
            fn(model, F, xs, ys, noise=noise, **kw)
            opt.step()
        moved = [not torch.equal(p0, p.detach()) for p0, p in zip(before, a.parameters(),
                                                                  strict=True)]
        assert any(moved), f"step {step} changed nothing: the comparison would be vacuous"
        for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(pa, pb, rtol=1e-10, atol=1e-12, msg=f"{name} @ {step}")
    for name, p in a.named_parameters():
        if name in frozen_before:
            assert p.grad is None and torch.equal(p, frozen_before[name])
    for t0, t in zip(bn_stats, a.buffers(), strict=True):
        assert torch.equal(t0, t), "BatchNorm in eval mode must not update its statistics"


def test_train_matches_a_reference_loop():
    """``train('parallel')`` step by step: same init, order and noise as a plain loop."""
    data = datasets.digits(dtype=torch.float64, n_train=12)
    hist = dither.train("parallel", data, epochs=2, copies=3, dither="gaussian", scale=0.2,
                        dropout=0.1, lr=0.1, hidden=8, seed=4)
    model = dither.mlp(64, 8, 10, seed=4, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(2):
        order = torch.randperm(12, generator=g)
        running = 0.0
        for i in order:
            xs, ys = data.x_train[i:i + 1], data.y_train[i:i + 1]
            before = [p.detach().clone() for p in model.parameters()]
            noise = dither.draw_noise(xs, 3, dither="gaussian", scale=0.2, dropout=0.1,
                                      generator=g)
            opt.zero_grad(set_to_none=True)
            running += dither.sequential_grad(model, F, xs, ys, noise=noise)
            opt.step()
            assert not all(torch.equal(b, p) for b, p in zip(before, model.parameters(),
                                                             strict=True))
        losses.append(running / 12)
    assert hist.train_loss == pytest.approx(losses, rel=1e-12)
    with torch.no_grad():
        test_loss = F(model(data.x_test), data.y_test).item()
    assert hist.test_loss[-1] == pytest.approx(test_loss, rel=1e-12)


# --- the caller's global state is left alone ---------------------------------------------


def test_train_and_mlp_leave_the_global_rng_alone():
    data = datasets.digits(n_train=30)
    state = torch.get_rng_state()
    m1 = dither.mlp(64, 8, 10, seed=7)
    h1 = dither.train("single", data, epochs=1, dither="gaussian", scale=0.2, hidden=8, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(12345)  # a different global state must not change anything
    m2 = dither.mlp(64, 8, 10, seed=7)
    h2 = dither.train("single", data, epochs=1, dither="gaussian", scale=0.2, hidden=8, seed=3)
    assert h1.train_loss == h2.train_loss and h1.test_acc == h2.test_acc
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
    m3 = dither.mlp(64, 8, 10, seed=8)
    assert not torch.equal(m1[0].weight, m3[0].weight)
    m4 = dither.mlp(64, 8, 10, seed=torch.Generator().manual_seed(7))
    assert torch.equal(m1[0].weight, m4[0].weight)
    bound = 1 / math.sqrt(64)
    assert m1[0].weight.abs().max() <= bound and m1[0].weight.std() > 0.4 * bound


def _set_grads(model):
    for i, p in enumerate(model.parameters()):
        p.grad = None if i == 1 else torch.full_like(p, 0.5 + i)
    return [None if p.grad is None else (p.grad, p.grad.clone()) for p in model.parameters()]


def _assert_grads_kept(model, saved):
    for p, s in zip(model.parameters(), saved, strict=True):
        if s is None:
            assert p.grad is None
        else:
            assert p.grad is s[0] and torch.equal(p.grad, s[1])


def test_grad_variance_keeps_callers_grad_and_thread_count():
    model, x, y = _setup(batch=1)
    saved = _set_grads(model)
    with device.threads(2):
        dither.grad_variance(model, F, x, y, copies=2, draws=3, dither="gaussian", scale=0.5,
                             threads=1)
        assert torch.get_num_threads() == 2
    _assert_grads_kept(model, saved)


def test_compare_regimes_restores_thread_count():
    data = datasets.digits(n_train=4)
    with device.threads(2):
        dither.compare_regimes(data, epochs=1, batch_size=2, copies=2, hidden=4, threads=1)
        assert torch.get_num_threads() == 2


def test_throughput_keeps_grads_and_thread_count():
    model, x, y = _setup(batch=1, dtype=torch.float32)
    x = x.float()
    saved = _set_grads(model)
    before = torch.get_num_threads()
    want = 2 if before == 1 else 1
    torch.set_num_threads(want)
    try:
        r = dither.throughput(model, F, x, y, copies_list=[1, 2], repeat=1, threads=3)
        assert torch.get_num_threads() == want
        assert r["threads"] == 3 and r["copies"] == [1, 2] and len(r["speedup"]["batched"]) == 2
    finally:
        torch.set_num_threads(before)
    _assert_grads_kept(model, saved)


# --- noise: scale is the standard deviation, dropout after dither -------------------------


@pytest.mark.parametrize("kind", dither.NOISES)
def test_scale_is_the_standard_deviation(kind):
    x = torch.zeros(200_000, dtype=torch.float64)
    nz = dither.draw_noise(x, 1, dither=kind, scale=0.7,
                           generator=torch.Generator().manual_seed(0))
    s = nz.add.std().item()
    assert abs(s - 0.7) < 0.01, (kind, s)
    assert abs(nz.add.mean().item()) < 0.01
    if kind != "gaussian":
        assert nz.add.abs().max().item() <= dither.noise_half_width(kind, 0.7)


@pytest.mark.parametrize("kind", dither.NOISES)
def test_smoothed_relu_and_slope_match_monte_carlo(kind):
    g = torch.Generator().manual_seed(0)
    xs = np.linspace(-1.5, 1.5, 13)
    n = 200_000
    noise = dither._sample(kind, (n,), 0.5, g, torch.float64, "cpu").numpy()
    exact = dither.smoothed_relu(xs, 0.5, kind)
    slope = dither.smoothed_relu_slope(xs, 0.5, kind)
    for xv, ev, sv in zip(xs, exact, slope, strict=True):
        samples = np.maximum(xv + noise, 0)
        se = samples.std() / np.sqrt(n)
        assert abs(samples.mean() - ev) <= 4 * se + 1e-12, (kind, xv)
        frac = (xv + noise > 0).mean()
        assert abs(frac - sv) <= 4 * math.sqrt(max(sv * (1 - sv), 1e-12) / n) + 1e-12
    for xv in (-1.0, 0.0, 0.3):  # scalars give 0-d arrays equal to the array results
        assert dither.smoothed_relu(xv, 0.5, kind) == pytest.approx(
            dither.smoothed_relu([xv], 0.5, kind)[0], rel=1e-14)
        assert dither.smoothed_relu_slope(xv, 0.5, kind) == pytest.approx(
            dither.smoothed_relu_slope([xv], 0.5, kind)[0], rel=1e-14)
    h = 1e-6
    numeric = (dither.smoothed_relu(xs + h, 0.5, kind) - dither.smoothed_relu(xs - h, 0.5, kind))
    np.testing.assert_allclose(numeric / (2 * h), slope, atol=1e-6)


def test_parallel_grad_averages_gradients_not_activations():
    """For a loss linear in a ReLU's output the averaged gradient is the smoothed slope;
    for a squared loss it is not the gradient of the loss of the averaged activation."""
    b = nn.Parameter(torch.zeros(1, dtype=torch.float64))

    class Unit(nn.Module):
        def __init__(self):
            super().__init__()
            self.b = b

        def forward(self, x):
            return torch.relu(x + self.b)

    x = torch.tensor([[0.2]], dtype=torch.float64)
    y = torch.zeros(1, 1, dtype=torch.float64)
    n = 40_000
    dither.parallel_grad(Unit(), lambda out, t: out.mean(), x, y, copies=n,
                         dither="gaussian", scale=0.5, generator=torch.Generator().manual_seed(0))
    slope = dither.smoothed_relu_slope(0.2, 0.5).item()
    assert abs(b.grad.item() - slope) < 4 * math.sqrt(slope * (1 - slope) / n)
    b.grad = None
    target = 1.0
    dither.parallel_grad(Unit(), lambda out, t: ((out - target) ** 2).mean(), x, y, copies=n,
                         dither="gaussian", scale=0.5, generator=torch.Generator().manual_seed(0))
    smoothed = dither.smoothed_relu(0.2, 0.5).item()
    grad_of_smoothed_output = 2 * (smoothed - target) * slope
    assert abs(b.grad.item() - grad_of_smoothed_output) > 0.05


def test_dropout_comes_after_dither():
    """A dropped input is exactly zero in its copy, dither included; kept ones are scaled."""
    x = torch.rand(3, 20, dtype=torch.float64)
    nz = dither.draw_noise(x, 6, dither="gaussian", scale=0.5, dropout=0.4,
                           generator=torch.Generator().manual_seed(2))
    xs = nz.apply(x)
    dropped = nz.keep == 0
    assert dropped.any() and (~dropped).any()
    assert torch.all(xs[dropped] == 0)
    torch.testing.assert_close(xs[~dropped], ((x + nz.add) / 0.6)[~dropped], rtol=0, atol=1e-15)


def test_dropout_masks_independent_and_rate():
    x = torch.ones(4, 50, dtype=torch.float64)
    nz = dither.draw_noise(x, 32, dropout=0.3, generator=torch.Generator().manual_seed(0))
    kept = nz.keep > 0
    assert abs(kept.double().mean().item() - 0.7) < 0.02
    flat = kept.reshape(32, -1)
    assert len({tuple(r.tolist()) for r in flat}) == 32  # every copy its own mask
    assert torch.allclose(nz.keep[kept], torch.tensor(1 / 0.7, dtype=torch.float64))


def test_model_dropout_layers_differ_across_copies():
    model, x, y = _setup(batch=1, dropout_layer=0.5)
    h = model[:3](x.expand(8, -1))  # Linear, ReLU, Dropout on 8 identical copies
    assert len({tuple((r > 0).tolist()) for r in h}) > 1


def test_variance_falls_like_one_over_p():
    model, x, y = _setup(batch=1)
    v1 = dither.grad_variance(model, F, x, y, copies=1, draws=400, dither="gaussian", scale=0.5)
    v16 = dither.grad_variance(model, F, x, y, copies=16, draws=400, dither="gaussian",
                               scale=0.5, seed=1)
    assert 10 <= v1 / v16 <= 25


# --- the demodulation picture -------------------------------------------------------------


def test_half_wave_spectrum_has_dc_fundamental_and_even_harmonics_only():
    s = dither.relu_spectrum(offset=0.0, amplitude=2.0, cycles=8, samples=2048)
    mag = dict(zip(np.round(s["harmonic"], 6), s["magnitude"], strict=True))
    assert mag[0.0] == pytest.approx(2.0 / math.pi, rel=1e-4)
    assert mag[1.0] == pytest.approx(2.0 / 4, rel=1e-4)
    for k in (1, 2, 3, 4):
        assert mag[2.0 * k] == pytest.approx(2.0 / (math.pi * (4 * k * k - 1)), rel=5e-3)
    for odd in (3.0, 5.0, 7.0, 9.0):
        assert mag[odd] < 1e-12
    shifted = dither.relu_spectrum(offset=0.3, amplitude=2.0, cycles=8, samples=2048)
    assert shifted["magnitude"][np.isclose(shifted["harmonic"], 3.0)][0] > 1e-3


def test_spectrum_dither_weakens_harmonics():
    clean = dither.relu_spectrum(offset=0.0)
    smooth = dither.relu_spectrum(offset=0.0, noise="gaussian", scale=0.8, copies=4096)
    h = clean["harmonic"]
    high = (h >= 3.5) & (h <= 10.5)
    assert smooth["magnitude"][high].sum() < 0.5 * clean["magnitude"][high].sum()


# --- the regime experiment ----------------------------------------------------------------


def test_train_regimes_record_compute():
    data = datasets.digits(n_train=40)
    hb = dither.train("batch", data, epochs=2, batch_size=8)
    hp = dither.train("parallel", data, epochs=1, copies=4, dither="gaussian", scale=0.1)
    assert hb.updates == [5, 10] and hb.forwards == [40, 80]
    assert hp.updates == [40] and hp.forwards == [160]
    assert 0 <= hp.test_acc[0] <= 1 and len(hb.test_error) == 2


def test_train_records_every_k_updates_and_the_last():
    """``record_every``: a record every k updates (and after the last), with the train loss
    averaged over the examples since the previous record; the weights are the same run."""
    data = datasets.digits(dtype=torch.float64, n_train=12)
    kw = dict(epochs=2, dither="gaussian", scale=0.2, lr=0.1, hidden=8, seed=4)
    per_pass = dither.train("single", data, **kw)
    every5 = dither.train("single", data, record_every=5, **kw)
    assert per_pass.updates == [12, 24]
    assert every5.updates == [5, 10, 15, 20, 24] and every5.forwards == [5, 10, 15, 20, 24]
    assert every5.test_loss[-1] == per_pass.test_loss[-1]  # recording does not change the run
    every12 = dither.train("single", data, record_every=12, **kw)
    assert every12.updates == [12, 24] and every12.train_loss == per_pass.train_loss
    every4 = dither.train("single", data, record_every=4, **kw)
    assert every4.updates == [4, 8, 12, 16, 20, 24]
    mean4 = sum(every4.train_loss[:3]) / 3
    assert mean4 == pytest.approx(per_pass.train_loss[0], rel=1e-12)
    hb = dither.train("batch", data, epochs=3, batch_size=5, record_every=4)
    assert hb.updates == [4, 8, 9] and hb.forwards == [17, 34, 36]
    with pytest.raises(ValueError, match="record_every"):
        dither.train("single", data, record_every=0)
    r = dither.compare_regimes(data, epochs=1, batch_size=2, copies=2, hidden=8,
                               record_every=3)
    assert all(h[0].updates == [3, 6, 9, 12] for k, h in r.items() if "batch" not in k)
    assert r["batch SGD"][0].updates == [3, 6, 9, 12]


def test_compare_regimes_has_the_controls_and_every_seed():
    data = datasets.digits(n_train=16)
    r = dither.compare_regimes(data, epochs=1, batch_size=2, copies=2, hidden=8, seeds=(0, 1),
                               noises={"dither": {"dither": "uniform", "scale": 0.2},
                                       "dropout": {"dropout": 0.2}})
    assert list(r) == ["batch SGD", "single-example SGD", "batch SGD + dither",
                       "single-example SGD + dither", "parallel dither, P=2",
                       "batch SGD + dropout", "single-example SGD + dropout",
                       "parallel dropout, P=2"]
    assert all(len(h) == 2 for h in r.values())
    assert r["batch SGD"][0].updates[-1] == r["single-example SGD"][0].updates[-1] == 16
    assert r["batch SGD"][0].forwards[-1] == r["parallel dither, P=2"][0].forwards[-1] == 32
    assert r["batch SGD"][0].test_acc != r["batch SGD"][1].test_acc  # seeds differ
    s = dither.summarise(r)["single-example SGD + dropout"]
    accs = [h.test_acc[-1] for h in r["single-example SGD + dropout"]]
    assert s["mean"] == pytest.approx(np.mean(accs)) and s["n"] == 2
    assert s["std"] == pytest.approx(np.std(accs, ddof=1))


def test_paired_difference_verdicts():
    def hist(accs):
        return [dither.History("x", test_acc=[a]) for a in accs]

    r = {"a": hist([0.90, 0.91, 0.92]), "b": hist([0.80, 0.815, 0.81]),
         "c": hist([0.95, 0.85, 0.93])}
    d = dither.paired_difference(r, "a", "b")
    assert d["mean"] == pytest.approx(0.305 / 3) and d["verdict"] == "better" and d["low"] > 0
    assert dither.paired_difference(r, "b", "a")["verdict"] == "worse"
    assert dither.paired_difference(r, "a", "c")["verdict"] == "not distinguishable"
    one = {"a": hist([0.9]), "b": hist([0.1])}
    assert dither.paired_difference(one, "a", "b")["verdict"] == "not distinguishable"
    with pytest.raises(ValueError, match="regimes"):
        dither.paired_difference(r, "a", "z")


# --- bad input: refused before any work, with the argument named ------------------------


def _bad_calls():
    model, x, y = _setup()
    data = datasets.digits(n_train=20)
    nz = dither.draw_noise(x, 2, dither="gaussian", scale=0.1)
    g = torch.Generator().manual_seed(0)
    pg = dither.parallel_grad
    return [
        ("copies=0", lambda: pg(model, F, x, y, copies=0), ValueError, "copies"),
        ("copies=2.0", lambda: pg(model, F, x, y, copies=2.0), TypeError, "copies"),
        ("copies=True", lambda: pg(model, F, x, y, copies=True), TypeError, "copies"),
        ("unknown noise", lambda: pg(model, F, x, y, copies=2, dither="pink", scale=1.0),
         ValueError, "dither"),
        ("scale<0", lambda: pg(model, F, x, y, copies=2, dither="gaussian", scale=-1.0),
         ValueError, "scale"),
        ("scale=nan", lambda: pg(model, F, x, y, copies=2, dither="gaussian",
                                 scale=float("nan")), ValueError, "scale"),
        ("scale=inf", lambda: pg(model, F, x, y, copies=2, dither="gaussian",
                                 scale=float("inf")), ValueError, "scale"),
        ("scale without kind", lambda: pg(model, F, x, y, copies=2, scale=0.5), ValueError,
         "scale"),
        ("kind without scale", lambda: pg(model, F, x, y, copies=2, dither="uniform"),
         ValueError, "scale"),
        ("dropout=1", lambda: pg(model, F, x, y, copies=2, dropout=1.0), ValueError, "dropout"),
        ("dropout<0", lambda: pg(model, F, x, y, copies=2, dropout=-0.1), ValueError, "dropout"),
        ("dropout=nan", lambda: pg(model, F, x, y, copies=2, dropout=float("nan")), ValueError,
         "dropout"),
        ("noise + dither", lambda: pg(model, F, x, y, copies=2, noise=nz, dither="gaussian",
                                      scale=0.3), ValueError, "ignored"),
        ("noise + dropout", lambda: pg(model, F, x, y, copies=2, noise=nz, dropout=0.5),
         ValueError, "dropout"),
        ("noise + generator", lambda: pg(model, F, x, y, copies=2, noise=nz, generator=g),
         ValueError, "generator"),
        ("noise copies", lambda: pg(model, F, x, y, copies=3, noise=nz), ValueError, "copies"),
        ("noise for other x", lambda: pg(model, F, x[:2], y[:2], copies=2, noise=nz),
         ValueError, "noise"),
        ("noise not Noise", lambda: pg(model, F, x, y, copies=2, noise=torch.zeros(2)),
         TypeError, "noise"),
        ("float32 noise", lambda: pg(model, F, x, y, copies=2,
                                     noise=dither.draw_noise(x.float(), 2, dropout=0.5)),
         ValueError, "noise"),
        ("generator not one", lambda: pg(model, F, x, y, copies=2, generator=3), TypeError,
         "generator"),
        ("max_rows=0", lambda: pg(model, F, x, y, copies=2, max_rows=0), ValueError, "max_rows"),
        ("batch mismatch", lambda: pg(model, F, x, y[:1], copies=2), ValueError, "batch size"),
        ("empty batch", lambda: pg(model, F, x[:0], y[:0], copies=2), ValueError, "batch size"),
        ("x not tensor", lambda: pg(model, F, x.numpy(), y, copies=2), TypeError, "x"),
        ("integer x", lambda: pg(model, F, y, y, copies=2), TypeError, "x"),
        ("model not module", lambda: pg(lambda t: t, F, x, y, copies=2), TypeError, "model"),
        ("loss not callable", lambda: pg(model, 3, x, y, copies=2), TypeError, "loss_fn"),
        ("seq noise missing", lambda: dither.sequential_grad(model, F, x, y, noise=None),
         TypeError, "noise"),
        ("draw x not tensor", lambda: dither.draw_noise([1.0], 2, dropout=0.1), TypeError, "x"),
        ("draw copies=0", lambda: dither.draw_noise(x, 0, dropout=0.1), ValueError, "copies"),
        ("apply wrong x", lambda: nz.apply(x[:1]), ValueError, "shape"),
        ("gv draws=1", lambda: dither.grad_variance(model, F, x, y, copies=2, draws=1,
                                                    dither="gaussian", scale=0.1),
         ValueError, "draws"),
        ("gv no noise", lambda: dither.grad_variance(model, F, x, y, copies=2, draws=3),
         ValueError, "noise"),
        ("gv seed<0", lambda: dither.grad_variance(model, F, x, y, copies=2, draws=3,
                                                   dither="gaussian", scale=0.1, seed=-1),
         ValueError, "seed"),
        ("relu noise", lambda: dither.smoothed_relu([0.0], 1.0, "pink"), ValueError, "noise"),
        ("relu scale=0", lambda: dither.smoothed_relu([0.0], 0.0), ValueError, "scale"),
        ("relu x nan", lambda: dither.smoothed_relu([float("nan")], 1.0), ValueError, "x"),
        ("slope scale", lambda: dither.smoothed_relu_slope([0.0], -1.0), ValueError, "scale"),
        ("half width gaussian", lambda: dither.noise_half_width("gaussian", 1.0), ValueError,
         "kind"),
        ("spectrum copies, no noise", lambda: dither.relu_spectrum(copies=8), ValueError,
         "copies"),
        ("spectrum noise, no scale", lambda: dither.relu_spectrum(noise="gaussian"),
         ValueError, "scale"),
        ("spectrum samples", lambda: dither.relu_spectrum(cycles=8, samples=10), ValueError,
         "samples"),
        ("spectrum cycles", lambda: dither.relu_spectrum(cycles=0), ValueError, "cycles"),
        ("spectrum amplitude", lambda: dither.relu_spectrum(amplitude=0.0), ValueError,
         "amplitude"),
        ("spectrum offset inf", lambda: dither.relu_spectrum(offset=float("inf")), ValueError,
         "offset"),
        ("mlp hidden=0", lambda: dither.mlp(64, 0, 10), ValueError, "hidden"),
        ("mlp n_in=2.5", lambda: dither.mlp(2.5, 4, 10), TypeError, "n_in"),
        ("mlp dtype", lambda: dither.mlp(64, 4, 10, dtype=torch.int64), TypeError, "dtype"),
        ("mlp seed", lambda: dither.mlp(64, 4, 10, seed="a"), TypeError, "seed"),
        ("train regime", lambda: dither.train("minibatch", data), ValueError, "regime"),
        ("train lr=nan", lambda: dither.train("batch", data, lr=float("nan")), ValueError, "lr"),
        ("train lr=0", lambda: dither.train("batch", data, lr=0.0), ValueError, "lr"),
        ("train hidden=0", lambda: dither.train("batch", data, hidden=0), ValueError, "hidden"),
        ("train epochs=0", lambda: dither.train("batch", data, epochs=0), ValueError, "epochs"),
        ("train copies in single", lambda: dither.train("single", data, copies=4), ValueError,
         "copies"),
        ("train batch in parallel", lambda: dither.train("parallel", data, batch_size=4),
         ValueError, "batch_size"),
        ("train copies=0", lambda: dither.train("parallel", data, copies=0), ValueError,
         "copies"),
        ("train data", lambda: dither.train("batch", (x, y)), TypeError, "data"),
        ("train progress", lambda: dither.train("batch", data, progress=1), TypeError,
         "progress"),
        ("train noise", lambda: dither.train("single", data, dither="gaussian", scale=-1.0),
         ValueError, "scale"),
        ("regimes noises key", lambda: dither.compare_regimes(data, epochs=1,
                                                              noises={"d": {"sigma": 1.0}}),
         ValueError, "unknown keys"),
        ("regimes empty noise", lambda: dither.compare_regimes(data, epochs=1, noises={"d": {}}),
         ValueError, "no noise"),
        ("regimes seeds", lambda: dither.compare_regimes(data, epochs=1, seeds=()), ValueError,
         "seeds"),
        ("regimes epochs", lambda: dither.compare_regimes(data, epochs=0), ValueError, "epochs"),
        ("regimes threads", lambda: dither.compare_regimes(data, epochs=1, threads=0),
         ValueError, "threads"),
        ("gv threads", lambda: dither.grad_variance(model, F, x, y, copies=2, draws=3,
                                                    dither="gaussian", scale=0.1, threads=1.5),
         TypeError, "threads"),
        ("throughput list", lambda: dither.throughput(model, F, x, y, copies_list=[]),
         ValueError, "copies_list"),
        ("throughput p=0", lambda: dither.throughput(model, F, x, y, copies_list=[0]),
         ValueError, "copies_list"),
        ("throughput str", lambda: dither.throughput(model, F, x, y, copies_list="12"),
         TypeError, "copies_list"),
        ("throughput threads", lambda: dither.throughput(model, F, x, y, copies_list=[1],
                                                         threads=0), ValueError, "threads"),
        ("throughput repeat", lambda: dither.throughput(model, F, x, y, copies_list=[1],
                                                        repeat=0), ValueError, "repeat"),
        ("bench quick", lambda: dither.bench(torch.device("cpu"), quick="yes"), TypeError,
         "quick"),
    ]


_CALLS = _bad_calls()


@pytest.mark.parametrize("label,call,err,match", _CALLS, ids=[c[0] for c in _CALLS])
def test_bad_calls_are_refused_clearly(label, call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_refuses_batchnorm_in_train_mode():
    model = nn.Sequential(nn.Linear(64, 8), nn.BatchNorm1d(8), nn.Linear(8, 10)).double()
    _, x, y = _setup()
    with pytest.raises(ValueError, match="BatchNorm"):
        dither.parallel_grad(model, F, x, y, copies=2)
    assert all(p.grad is None for p in model.parameters())  # refused before any work
    model.eval()
    dither.parallel_grad(model, F, x, y, copies=2)


# --- the users' model zoo ------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7])
@pytest.mark.parametrize("name,dtype", zoo.cases(names=[m for m in zoo.ZOO if m != "batchnorm"]))
def test_zoo_parallel_grad_equals_sequential(name, dtype, n):
    """On every zoo model it accepts, the batched copies' gradient equals the loop over
    copies (same noise); a frozen parameter gets no .grad; the global RNG is not used."""
    a, b = zoo.build(name, dtype), zoo.build(name, dtype)
    x, y = zoo.batch(n, dtype)
    noise = dither.draw_noise(x, 3, dither="gaussian", scale=0.1,
                              generator=torch.Generator().manual_seed(0))
    with zoo.kept_state():
        la = dither.parallel_grad(a, nn.functional.cross_entropy, x, y, copies=3, noise=noise)
        lb = dither.sequential_grad(b, nn.functional.cross_entropy, x, y, noise=noise)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
    assert la == pytest.approx(lb, rel=tol["rtol"])
    for (k, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None) == (not p.requires_grad), k
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=k)


def test_zoo_batchnorm_refused_up_front():
    x, y = zoo.batch(7)
    with pytest.raises(ValueError, match="BatchNorm"):
        dither.parallel_grad(zoo.build("batchnorm"), nn.functional.cross_entropy, x, y, copies=2,
                             dither="gaussian", scale=0.1)


@pytest.mark.parametrize("name,dtype", zoo.cases(names=[m for m in zoo.ZOO if m != "batchnorm"]))
def test_zoo_grad_variance_equals_the_variance_of_sequential_gradients(name, dtype):
    """grad_variance on every zoo model it accepts equals the variance, over the same noise
    draws, of the loop over copies' gradient; .grad, the RNG and threads are left alone."""
    model, ref = zoo.build(name, dtype), zoo.build(name, dtype)
    x, y = zoo.batch(7, dtype)
    with zoo.kept_state(model):
        got = dither.grad_variance(model, nn.functional.cross_entropy, x, y, copies=3, draws=4,
                                   dither="gaussian", scale=0.1, seed=5)
    g, grads = torch.Generator().manual_seed(5), []
    params = [p for p in ref.parameters() if p.requires_grad]
    for _ in range(4):
        noise = dither.draw_noise(x, 3, dither="gaussian", scale=0.1, generator=g)
        for p in params:
            p.grad = None
        dither.sequential_grad(ref, nn.functional.cross_entropy, x, y, noise=noise)
        grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
    want = torch.stack(grads).var(dim=0).sum().item()
    assert want > 0
    assert got == pytest.approx(want, rel=1e-9 if dtype == torch.float64 else 1e-3)
