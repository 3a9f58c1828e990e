import pytest
import torch
from torch import nn

from parlearn import leapfrog


def _mlp(dtype, layers=5, width=12):
    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh() if i % 2 else nn.ReLU()]
    mods += [nn.LayerNorm(width), nn.Linear(width, 3)]
    return nn.Sequential(*mods).to(dtype)


def _cnn(dtype):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.GELU(), nn.Conv2d(4, 4, 3, stride=2),
        nn.ReLU(), nn.Flatten(), nn.Dropout(0.3), nn.Linear(4 * 3 * 3, 5),
        nn.Sequential(nn.SiLU(), nn.Linear(5, 3)),
    ).to(dtype).eval()


def _conv1d_bn(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.BatchNorm1d(3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(3 * 8, 3)).to(dtype)


CASES = {
    "mlp": (_mlp, (6, 12)),
    "cnn": (_cnn, (6, 1, 8, 8)),
}
CE = nn.functional.cross_entropy


def _reference(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = CE(model(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("arch", sorted(CASES))
@pytest.mark.parametrize("mode,workers", [("serial", 1), ("leapfrog", 2), ("leapfrog", 3),
                                          ("segments", 2), ("segments", 3)])
def test_equals_autograd(arch, dtype, tol, mode, workers):
    build, shape = CASES[arch]
    model = build(dtype)
    x = torch.randn(*shape, dtype=dtype)
    y = torch.randint(0, 3, (shape[0],))
    ref_loss, ref = _reference(model, x, y)
    loss = leapfrog.grad(model, CE, x, y, workers=workers, mode=mode)
    assert torch.allclose(loss, ref_loss, rtol=tol, atol=tol)
    for p, g in zip(model.parameters(), ref, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", ["serial", "leapfrog"])
def test_batchnorm_train_mode_is_exact(mode):
    model = _conv1d_bn(torch.float64).train()
    x = torch.randn(5, 2, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _, ref = _reference(model, x, y)
    model.load_state_dict(state)  # undo the reference pass's running-stat update
    leapfrog.grad(model, CE, x, y, workers=2, mode=mode)
    for p, g in zip(model.parameters(), ref, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-10)


def test_segments_refuses_batchnorm_train():
    model = _conv1d_bn(torch.float64).train()
    x, y = torch.randn(5, 2, 8, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises(ValueError, match="BatchNorm1d"):
        leapfrog.grad(model, CE, x, y, workers=2, mode="segments")


@pytest.mark.parametrize("mode", leapfrog.MODES)
def test_accumulates_like_autograd(mode):
    model = _mlp(torch.float64)
    x, y = torch.randn(4, 12, dtype=torch.float64), torch.randint(0, 3, (4,))
    _, ref = _reference(model, x, y)
    leapfrog.grad(model, CE, x, y, mode=mode)
    leapfrog.grad(model, CE, x, y, mode=mode)
    for p, g in zip(model.parameters(), ref, strict=True):
        torch.testing.assert_close(p.grad, 2 * g, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", leapfrog.MODES)
@pytest.mark.parametrize("layers,workers,batch", [(1, 2, 4), (3, 1, 4), (2, 8, 4), (4, 2, 1)])
def test_edge_cases(mode, layers, workers, batch):
    torch.manual_seed(1)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(layers)]).double()
    x, y = torch.randn(batch, 6, dtype=torch.float64), torch.randint(0, 6, (batch,))
    _, ref = _reference(model, x, y)
    leapfrog.grad(model, CE, x, y, workers=workers, mode=mode)
    for p, g in zip(model.parameters(), ref, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-12)


def test_bad_inputs():
    model = _mlp(torch.float64)
    x, y = torch.randn(4, 12, dtype=torch.float64), torch.randint(0, 3, (4,))
    with pytest.raises(ValueError, match="workers"):
        leapfrog.grad(model, CE, x, y, workers=0)
    with pytest.raises(ValueError, match="mode"):
        leapfrog.grad(model, CE, x, y, mode="pipelined")
    with pytest.raises(TypeError, match="nn.Sequential"):
        leapfrog.grad(nn.Linear(12, 3), CE, x, y)
    with pytest.raises(ValueError, match="layer 1 .*LSTM"):
        leapfrog.grad(nn.Sequential(nn.Linear(12, 12), nn.LSTM(12, 3)), CE, x, y)
    with pytest.raises(ValueError, match="scalar"):
        leapfrog.grad(model, lambda o, t: o.sum(1), x, y)


def test_timeline_records_every_task():
    model = _mlp(torch.float64, layers=4)
    x, y = torch.randn(4, 12, dtype=torch.float64), torch.randint(0, 3, (4,))
    layers = leapfrog._flatten(model)
    n_layers = len(layers)
    with_params = sum(any(True for _ in m.parameters()) for m in layers)
    ev = leapfrog.timeline(model, CE, x, y, workers=2, mode="leapfrog")
    labels = [e[1] for e in ev]
    assert sum(lbl.startswith("wgrad") for lbl in labels) == with_params  # none for activations
    assert sum(lbl.startswith("chain") for lbl in labels) == n_layers - 1
    assert all(e[3] >= e[2] for e in ev)
    assert all(p.grad is None for p in model.parameters())
    seg = leapfrog.timeline(model, CE, x, y, workers=2, mode="segments")
    assert any(e[1].startswith("transfer") for e in seg)
    assert any(e[1].startswith("boundary") for e in seg)


def test_cost_model():
    L, w, B = 32, 64, 16
    s = leapfrog.cost_model(L, w, B, 1, "serial")
    assert s["chain_steps"] == L and s["depth"] == s["work"]
    for k in (2, 4, 8):
        lf = leapfrog.cost_model(L, w, B, k, "leapfrog")
        assert lf["wgrad_term"] == pytest.approx(s["wgrad_term"] / k)
        assert lf["work"] == s["work"] and lf["depth"] < s["depth"]
        seg = leapfrog.cost_model(L, w, B, k, "segments")
        assert seg["chain_steps"] == L // k + k
        assert seg["work"] > s["work"]  # chain splitting buys depth with extra work
    with pytest.raises(ValueError, match="layers"):
        leapfrog.cost_model(0, 4, 4, 2, "serial")
