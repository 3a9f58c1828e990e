import numpy as np
import pytest
import torch
from torch import nn

from parlearn import datasets, dither

F = nn.functional.cross_entropy


def _setup(batch=3, dtype=torch.float64, dropout_layer=0.0):
    data = datasets.digits(dtype=dtype, n_train=64)
    model = dither.mlp(64, 16, 10, dtype=dtype, dropout=dropout_layer)
    return model, data.x_train[:batch], data.y_train[:batch]


def _grads(model):
    g = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return g


def test_no_noise_equals_plain_gradient():
    model, x, y = _setup()
    F(model(x), y).backward()
    ref = _grads(model)
    dither.parallel_grad(model, F, x, y, copies=5)
    for a, b in zip(_grads(model), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


@pytest.mark.parametrize("kind", dither.NOISES)
@pytest.mark.parametrize("max_rows", [16384, 7])  # 7 rows forces chunking
def test_batched_equals_mean_of_sequential(kind, max_rows):
    model, x, y = _setup()
    noise = dither.draw_noise(x, 8, dither=kind, scale=0.3, dropout=0.2,
                              generator=torch.Generator().manual_seed(1))
    l1 = dither.parallel_grad(model, F, x, y, copies=8, noise=noise, max_rows=max_rows)
    g1 = _grads(model)
    l2 = dither.sequential_grad(model, F, x, y, noise=noise)
    g2 = _grads(model)
    assert l1 == pytest.approx(l2, rel=1e-12)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_accumulates_like_backward():
    model, x, y = _setup()
    dither.parallel_grad(model, F, x, y, copies=2)
    once = [p.grad.clone() for p in model.parameters()]
    dither.parallel_grad(model, F, x, y, copies=2)
    for p, g in zip(model.parameters(), once, strict=True):
        torch.testing.assert_close(p.grad, 2 * g)


def test_variance_falls_like_one_over_p():
    model, x, y = _setup(batch=1)
    v1 = dither.grad_variance(model, F, x, y, copies=1, draws=400, dither="gaussian", scale=0.5)
    v16 = dither.grad_variance(model, F, x, y, copies=16, draws=400, dither="gaussian",
                               scale=0.5, seed=1)
    assert 10 <= v1 / v16 <= 25


@pytest.mark.parametrize("kind", dither.NOISES)
def test_smoothed_relu_matches_monte_carlo(kind):
    g = torch.Generator().manual_seed(0)
    xs = np.linspace(-1.5, 1.5, 13)
    n = 200_000
    noise = dither._sample(kind, (n,), 0.7, g, torch.float64, "cpu").numpy()
    exact = dither.smoothed_relu(xs, 0.7, kind)
    for xv, ev in zip(xs, exact, strict=True):
        samples = np.maximum(xv + noise, 0)
        se = samples.std() / np.sqrt(n)
        assert abs(samples.mean() - ev) <= 4 * se + 1e-12, (kind, xv)


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


def test_refuses_batchnorm_in_train_mode():
    model = nn.Sequential(nn.Linear(64, 8), nn.BatchNorm1d(8), nn.Linear(8, 10)).double()
    _, x, y = _setup()
    with pytest.raises(ValueError, match="BatchNorm"):
        dither.parallel_grad(model, F, x, y, copies=2)
    model.eval()
    dither.parallel_grad(model, F, x, y, copies=2)


@pytest.mark.parametrize("kw,match", [
    ({"copies": 0}, "copies"), ({"copies": 2, "dither": "pink", "scale": 1.0}, "dither"),
    ({"copies": 2, "dither": "gaussian", "scale": -1.0}, "scale"),
    ({"copies": 2, "scale": 0.5}, "scale"), ({"copies": 2, "dropout": 1.0}, "dropout"),
    ({"copies": 2, "dropout": -0.1}, "dropout"),
])
def test_bad_inputs(kw, match):
    model, x, y = _setup()
    with pytest.raises(ValueError, match=match):
        dither.parallel_grad(model, F, x, y, **kw)


def test_bad_shapes_and_regime():
    model, x, y = _setup()
    with pytest.raises(ValueError, match="batch size"):
        dither.parallel_grad(model, F, x, y[:1], copies=2)
    with pytest.raises(ValueError, match="regime"):
        dither.train("minibatch", datasets.digits())
    with pytest.raises(ValueError, match="noise"):
        dither.smoothed_relu([0.0], 1.0, "pink")


def test_spectrum_dither_weakens_harmonics():
    clean = dither.relu_spectrum(offset=0.0, scale=0.0)
    smooth = dither.relu_spectrum(offset=0.0, scale=0.8, copies=4096)
    h = clean["harmonic"]
    high = (h >= 3.5) & (h <= 10.5)
    assert smooth["magnitude"][high].sum() < 0.5 * clean["magnitude"][high].sum()


def test_train_regimes_record_compute():
    data = datasets.digits(n_train=40)
    hb = dither.train("batch", data, epochs=2, batch_size=8, progress=False)
    hp = dither.train("parallel", data, epochs=1, copies=4, dither="gaussian", scale=0.1,
                      progress=False)
    assert hb.updates == [5, 10] and hb.forwards == [40, 80]
    assert hp.updates == [40] and hp.forwards == [160]
    assert 0 <= hp.test_acc[0] <= 1 and len(hb.test_error) == 2
