import copy
import threading

import pytest
import torch
import zoo
from torch import nn

from parlearn.core import device
from parlearn.serial_chain import leapfrog

CE = nn.functional.cross_entropy
MSE = nn.functional.mse_loss


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


def _bn_eval(dtype):
    """BatchNorm in eval mode with running statistics far from any batch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 5),
                          nn.BatchNorm1d(5), nn.Linear(5, 3)).to(dtype)
    for m in model:
        if isinstance(m, nn.BatchNorm1d):
            m.running_mean.uniform_(-2, 2)
            m.running_var.uniform_(0.2, 3)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -1, 1)
    return model.eval()


def _frozen(dtype):
    """A frozen layer, a frozen bias and a frozen LayerNorm weight among trainable ones."""
    model = _mlp(dtype, layers=3)
    model[0].requires_grad_(False)
    model[2].bias.requires_grad_(False)
    model[6].weight.requires_grad_(False)
    return model


def _tied(dtype):
    """One Linear used twice, and a weight shared by two other Linears."""
    torch.manual_seed(0)
    shared = nn.Linear(6, 6)
    a, b = nn.Linear(6, 6), nn.Linear(6, 6)
    b.weight = a.weight
    return nn.Sequential(shared, nn.Tanh(), shared, nn.ReLU(), a, nn.Tanh(), b,
                         nn.Linear(6, 3)).to(dtype)


CASES = {
    "mlp": (_mlp, (6, 12)),
    "cnn": (_cnn, (6, 1, 8, 8)),
    "bn_eval": (_bn_eval, (7, 6)),
    "frozen": (_frozen, (5, 12)),
    "tied": (_tied, (5, 6)),
}
SCHEDULES = [("serial", 1), ("leapfrog", 2), ("leapfrog", 3), ("segments", 2), ("segments", 3)]


def _reference(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = CE(model(x), y)
    loss.backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_grads(model, ref, tol):
    for p, g in zip(model.parameters(), ref, strict=True):
        if g is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, g, rtol=tol, atol=tol)


def _workers_alive():
    return [t for t in threading.enumerate()
            if t.name.startswith(leapfrog.WORKER_THREAD_PREFIX) and t.is_alive()]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("arch", sorted(CASES))
@pytest.mark.parametrize("mode,workers", SCHEDULES)
def test_equals_autograd(any_device, arch, dtype, tol, mode, workers):
    build, shape = CASES[arch]
    model = build(dtype).to(any_device)
    x = torch.randn(*shape, dtype=dtype, device=any_device)
    y = torch.randint(0, 3, (shape[0],), device=any_device)
    ref_loss, ref = _reference(model, x, y)
    loss = leapfrog.grad(model, CE, x, y, workers=workers, mode=mode)
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
    _assert_grads(model, ref, tol)


def test_frozen_parameters_get_no_grad():
    model = _frozen(torch.float64)
    x, y = torch.randn(4, 12, dtype=torch.float64), torch.randint(0, 3, (4,))
    leapfrog.grad(model, CE, x, y, workers=2)
    assert model[0].weight.grad is None and model[0].bias.grad is None
    assert model[2].bias.grad is None and model[6].weight.grad is None
    assert model[2].weight.grad is not None and model[6].bias.grad is not None


@pytest.mark.parametrize("mode", ["serial", "leapfrog"])
def test_batchnorm_train_mode_is_exact(any_device, mode):
    model = _conv1d_bn(torch.float64).to(any_device).train()
    x = torch.randn(5, 2, 8, dtype=torch.float64, device=any_device)
    y = torch.randint(0, 3, (5,), device=any_device)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _, ref = _reference(model, x, y)
    model.load_state_dict(state)  # undo the reference pass's running-stat update
    leapfrog.grad(model, CE, x, y, workers=2, mode=mode)
    _assert_grads(model, ref, 1e-10)


def test_segments_refuses_batchnorm_train():
    model = _conv1d_bn(torch.float64).train()
    x, y = torch.randn(5, 2, 8, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises(ValueError, match="BatchNorm1d"):
        leapfrog.grad(model, CE, x, y, workers=2, mode="segments")


@pytest.mark.parametrize("mode", leapfrog.MODES)
def test_accumulates_in_place_like_autograd(any_device, mode):
    model = _tied(torch.float64).to(any_device)
    x = torch.randn(4, 6, dtype=torch.float64, device=any_device)
    y = torch.randint(0, 3, (4,), device=any_device)
    _, ref = _reference(model, x, y)
    for p in model.parameters():  # a caller's own .grad, which must be added to, not replaced
        p.grad = torch.full_like(p, 0.5)
    held = [p.grad for p in model.parameters()]
    leapfrog.grad(model, CE, x, y, mode=mode)
    leapfrog.grad(model, CE, x, y, mode=mode)
    for p, g, h in zip(model.parameters(), ref, held, strict=True):
        assert p.grad is h
        torch.testing.assert_close(p.grad, 0.5 + 2 * g, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("arch", ["bn_eval", "frozen", "tied"])
@pytest.mark.parametrize("mode,workers", [("leapfrog", 2), ("segments", 3)])
def test_training_trajectory_step_by_step(any_device, arch, mode, workers):
    build, shape = CASES[arch]
    ref_model = build(torch.float64).to(any_device)
    model = copy.deepcopy(ref_model)
    if arch == "tied":  # deepcopy keeps the ties; check it so the test means something
        assert model[0] is model[2] and model[4].weight is model[6].weight
    opt_ref = torch.optim.SGD(ref_model.parameters(), lr=0.3, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for _step in range(4):
        x = torch.randn(*shape, dtype=torch.float64, generator=gen).to(any_device)
        y = torch.randint(0, 3, (shape[0],), generator=gen).to(any_device)
        before = [p.detach().clone() for p in model.parameters()]
        opt_ref.zero_grad()
        CE(ref_model(x), y).backward()
        opt_ref.step()
        opt.zero_grad()
        leapfrog.grad(model, CE, x, y, workers=workers, mode=mode)
        opt.step()
        moved = [not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)]
        assert any(moved), "the step changed nothing: the comparison would be vacuous"
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
        for p, b in zip(model.parameters(), before, strict=True):
            if not p.requires_grad:  # frozen parameters never move
                assert torch.equal(p, b)


@pytest.mark.parametrize("mode", leapfrog.MODES)
@pytest.mark.parametrize("layers,workers,batch", [(1, 2, 4), (3, 1, 4), (2, 8, 4), (4, 2, 1)])
def test_edge_cases(any_device, mode, layers, workers, batch):
    torch.manual_seed(1)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(layers)]).double().to(any_device)
    x = torch.randn(batch, 6, dtype=torch.float64, device=any_device)
    y = torch.randint(0, 6, (batch,), device=any_device)
    _, ref = _reference(model, x, y)
    leapfrog.grad(model, CE, x, y, workers=workers, mode=mode)
    _assert_grads(model, ref, 1e-10)


def test_weight_grads_match_autograd_per_layer(any_device):
    torch.manual_seed(0)
    layers = [nn.Linear(5, 4), nn.Conv1d(2, 3, 3, stride=2, padding=1), nn.LayerNorm(4),
              nn.BatchNorm1d(3).eval()]
    inputs = [(3, 5), (2, 2, 9), (3, 2, 4), (4, 3, 6)]
    for layer, shape in zip(layers, inputs, strict=True):
        layer = layer.double().to(any_device)
        if isinstance(layer, nn.BatchNorm1d):
            layer.running_mean.uniform_(-1, 1)
            layer.running_var.uniform_(0.5, 2)
        a = torch.randn(*shape, dtype=torch.float64, device=any_device)
        out = layer(a)
        delta = torch.randn_like(out)
        ref = torch.autograd.grad(out, list(layer.parameters()), delta)
        got = dict((id(p), g) for p, g in leapfrog.weight_grads(layer, a, delta))
        for p, r in zip(layer.parameters(), ref, strict=True):
            torch.testing.assert_close(got[id(p)], r, rtol=1e-10, atol=1e-12)


# --- threads, RNG, .grad: nothing of the caller's is changed -----------------------------


@pytest.mark.parametrize("mode,workers,per", [("leapfrog", 2, None), ("segments", 3, None),
                                              ("leapfrog", 2, 1), ("serial", 1, 2)])
@pytest.mark.parametrize("caller_threads", [1, 3])
def test_thread_count_restored_and_pool_closed(mode, workers, per, caller_threads):
    model = _mlp(torch.float64)
    x, y = torch.randn(4, 12, dtype=torch.float64), torch.randint(0, 3, (4,))
    with device.threads(caller_threads):
        leapfrog.grad(model, CE, x, y, workers=workers, mode=mode, threads_per_worker=per)
        assert torch.get_num_threads() == caller_threads
        leapfrog.timeline(model, CE, x, y, workers=workers, mode=mode, threads_per_worker=per)
        assert torch.get_num_threads() == caller_threads
    assert not _workers_alive()


@pytest.mark.parametrize("mode", ["leapfrog", "segments"])
def test_failing_task_restores_threads_and_joins_workers(monkeypatch, mode):
    model = _mlp(torch.float64)
    x, y = torch.randn(4, 12, dtype=torch.float64), torch.randint(0, 3, (4,))
    real = leapfrog.weight_grads

    def failing(layer, a, delta):
        if layer is model[2]:
            raise ArithmeticError("injected failure in a weight-gradient task")
        return real(layer, a, delta)

    monkeypatch.setattr(leapfrog.schedules, "weight_grads", failing)  # the caller looks it up
    with device.threads(3):
        with pytest.raises(ArithmeticError, match="injected"):
            leapfrog.grad(model, CE, x, y, workers=3, mode=mode)
        assert torch.get_num_threads() == 3
    assert not _workers_alive()
    assert all(p.grad is None for p in model.parameters())


def test_workers_use_the_threads_asked_for(monkeypatch):
    seen = []
    real = leapfrog.weight_grads

    def spy(layer, a, delta):
        seen.append(torch.get_num_threads())
        return real(layer, a, delta)

    monkeypatch.setattr(leapfrog.schedules, "weight_grads", spy)  # the caller looks it up
    model = _mlp(torch.float64)
    x, y = torch.randn(4, 12, dtype=torch.float64), torch.randint(0, 3, (4,))
    with device.threads(4):
        leapfrog.grad(model, CE, x, y, workers=2)  # same total: 4 // 2 each
        assert set(seen) == {2}
        seen.clear()
        leapfrog.grad(model, CE, x, y, workers=2, threads_per_worker=3)
        assert set(seen) == {3}
        seen.clear()
        leapfrog.grad(model, CE, x, y, mode="serial", threads_per_worker=1)
        assert set(seen) == {1}


def test_deep_mlp_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a = leapfrog.deep_mlp(3, 8, seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    b = leapfrog.deep_mlp(3, 8, seed=torch.Generator().manual_seed(5))
    c = leapfrog.deep_mlp(3, 8, seed=6)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert not torch.equal(a[0].weight, c[0].weight)
    bound = 8 ** -0.5
    assert all(p.abs().max() <= bound for p in a.parameters())
    assert a[0].weight.std() > bound / 3  # not left at zero or a constant


def test_grad_and_timeline_leave_global_rng_alone():
    model = _mlp(torch.float64)  # no dropout: the model's own forward draws nothing
    x, y = torch.randn(4, 12, dtype=torch.float64), torch.randint(0, 3, (4,))
    state = torch.get_rng_state()
    for mode in leapfrog.MODES:
        leapfrog.grad(model, CE, x, y, mode=mode)
        leapfrog.timeline(model, CE, x, y, mode=mode)
    assert torch.equal(torch.get_rng_state(), state)


# --- bad input: refused before any work, naming the argument -----------------------------

_M = _mlp(torch.float64)
_X, _Y = torch.randn(4, 12, dtype=torch.float64), torch.randint(0, 3, (4,))
_LIN = nn.Linear(4, 3)
_A, _D = torch.randn(5, 4), torch.randn(5, 3)
BAD_CALLS = {
    "workers=0": (lambda: leapfrog.grad(_M, CE, _X, _Y, workers=0), ValueError, "workers"),
    "workers=2.0": (lambda: leapfrog.grad(_M, CE, _X, _Y, workers=2.0), TypeError, "workers"),
    "workers=True": (lambda: leapfrog.grad(_M, CE, _X, _Y, workers=True), TypeError, "workers"),
    "mode": (lambda: leapfrog.grad(_M, CE, _X, _Y, mode="pipelined"), ValueError, "mode"),
    "threads_per_worker=0": (lambda: leapfrog.grad(_M, CE, _X, _Y, threads_per_worker=0),
                             ValueError, "threads_per_worker"),
    "not Sequential": (lambda: leapfrog.grad(nn.Linear(12, 3), CE, _X, _Y), TypeError,
                       "nn.Sequential"),
    "empty Sequential": (lambda: leapfrog.grad(nn.Sequential(), CE, _X, _Y), ValueError,
                         "at least one layer"),
    "LSTM": (lambda: leapfrog.grad(nn.Sequential(nn.Linear(12, 12), nn.LSTM(12, 3)), CE, _X, _Y),
             ValueError, "layer 1 .*LSTM"),
    "loss not scalar": (lambda: leapfrog.grad(_M, lambda o, t: o.sum(1), _X, _Y), ValueError,
                        "scalar"),
    "loss_fn not callable": (lambda: leapfrog.grad(_M, "ce", _X, _Y), TypeError, "loss_fn"),
    "x not tensor": (lambda: leapfrog.grad(_M, CE, _X.tolist(), _Y), TypeError, "x"),
    "x int": (lambda: leapfrog.grad(_M, CE, _X.long(), _Y), TypeError, "x"),
    "x wrong dtype": (lambda: leapfrog.grad(_M, CE, _X.float(), _Y), ValueError, "dtype"),
    "x wrong width": (lambda: leapfrog.grad(_M, CE, _X[:, :5], _Y), ValueError, "in_features"),
    "x empty batch": (lambda: leapfrog.grad(_M, CE, _X[:0], _Y[:0]), ValueError, "batch"),
    "y wrong batch": (lambda: leapfrog.grad(_M, CE, _X, _Y[:3]), ValueError, "y"),
    "backward tape": (lambda: leapfrog.backward("tape"), TypeError, "tape"),
    "backward accumulate": (lambda: leapfrog.backward(leapfrog.forward(_M, CE, _X, _Y),
                                                      accumulate=1), TypeError, "accumulate"),
    "timeline warmup=-3": (lambda: leapfrog.timeline(_M, CE, _X, _Y, warmup=-3), ValueError,
                           "warmup"),
    "timeline warmup=True": (lambda: leapfrog.timeline(_M, CE, _X, _Y, warmup=True), TypeError,
                             "warmup"),
    "weight_grads wrong input width": (lambda: leapfrog.weight_grads(_LIN, torch.randn(5, 6), _D),
                                       ValueError, "in_features"),
    "weight_grads wrong delta": (lambda: leapfrog.weight_grads(_LIN, _A, torch.randn(5, 4)),
                                 ValueError, "delta"),
    "weight_grads wrong batch": (lambda: leapfrog.weight_grads(_LIN, _A, _D[:4]), ValueError,
                                 "delta"),
    "weight_grads dtype mix": (lambda: leapfrog.weight_grads(_LIN, _A, _D.double()), ValueError,
                               "dtype"),
    "weight_grads LSTM": (lambda: leapfrog.weight_grads(nn.LSTM(4, 3), _A, _D), ValueError,
                          "LSTM"),
    "weight_grads not module": (lambda: leapfrog.weight_grads("lin", _A, _D), TypeError, "layer"),
    "weight_grads conv channels": (lambda: leapfrog.weight_grads(
        nn.Conv1d(2, 3, 3), torch.randn(2, 4, 9), torch.randn(2, 3, 7)), ValueError, "a must"),
    "weight_grads conv out size": (lambda: leapfrog.weight_grads(
        nn.Conv1d(2, 3, 3), torch.randn(2, 2, 9), torch.randn(2, 3, 9)), ValueError, "delta"),
    "weight_grads layernorm": (lambda: leapfrog.weight_grads(
        nn.LayerNorm(4), torch.randn(2, 5), torch.randn(2, 5)), ValueError, "normalized_shape"),
    "weight_grads batchnorm": (lambda: leapfrog.weight_grads(
        nn.BatchNorm1d(4), torch.randn(2, 5), torch.randn(2, 5)), ValueError, "channels"),
    "chain_step l": (lambda: leapfrog.chain_step(leapfrog.forward(_M, CE, _X, _Y), 99, _X),
                     ValueError, "l must"),
    "chain_step delta": (lambda: leapfrog.chain_step(leapfrog.forward(_M, CE, _X, _Y), 1,
                                                     _X[:, :3]), ValueError, "delta"),
    "cost_model layers=4.5": (lambda: leapfrog.cost_model(4.5, 4, 4, 2, "serial"), TypeError,
                              "layers"),
    "cost_model layers=0": (lambda: leapfrog.cost_model(0, 4, 4, 2, "serial"), ValueError,
                            "layers"),
    "cost_model width=True": (lambda: leapfrog.cost_model(4, True, 4, 2, "serial"), TypeError,
                              "width"),
    "cost_model batch=-1": (lambda: leapfrog.cost_model(4, 4, -1, 2, "serial"), ValueError,
                            "batch"),
    "cost_model workers=-2": (lambda: leapfrog.cost_model(4, 4, 4, -2, "serial"), ValueError,
                              "workers"),
    "cost_model mode": (lambda: leapfrog.cost_model(4, 4, 4, 2, "brent"), ValueError, "mode"),
    "deep_mlp layers=2.5": (lambda: leapfrog.deep_mlp(2.5, 4), TypeError, "layers"),
    "deep_mlp width=0": (lambda: leapfrog.deep_mlp(2, 0), ValueError, "width"),
    "deep_mlp seed=-1": (lambda: leapfrog.deep_mlp(2, 4, seed=-1), ValueError, "seed"),
    "deep_mlp seed=1.5": (lambda: leapfrog.deep_mlp(2, 4, seed=1.5), TypeError, "seed"),
    "deep_mlp dtype": (lambda: leapfrog.deep_mlp(2, 4, dtype=torch.int64), TypeError, "dtype"),
    "deep_mlp activation": (lambda: leapfrog.deep_mlp(2, 4, activation=torch.tanh), TypeError,
                            "activation"),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_calls_are_refused_clearly(name):
    call, exc, match = BAD_CALLS[name]
    with pytest.raises(exc, match=match):
        call()


def test_bad_calls_do_no_work():
    """A refused call leaves .grad and BatchNorm's running statistics as they were."""
    model = _conv1d_bn(torch.float64).train()
    x, y = torch.randn(5, 2, 8, dtype=torch.float64), torch.randint(0, 3, (5,))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for kw in ({"workers": 0}, {"mode": "x"}, {"threads_per_worker": -1}):
        with pytest.raises(ValueError):
            leapfrog.grad(model, CE, x, y, **kw)
    with pytest.raises(ValueError):
        leapfrog.grad(model, CE, x, y[:2])
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(p.grad is None for p in model.parameters())


# --- timeline and cost model ---------------------------------------------------------


def test_timeline_records_every_task(any_device):
    model = _mlp(torch.float64, layers=4).to(any_device)
    x = torch.randn(4, 12, dtype=torch.float64, device=any_device)
    y = torch.randint(0, 3, (4,), device=any_device)
    layers = leapfrog._flatten(model)
    n_layers = len(layers)
    with_params = sum(any(True for _ in m.parameters()) for m in layers)
    ev = leapfrog.timeline(model, CE, x, y, workers=2, mode="leapfrog")
    labels = [e[1] for e in ev]
    assert sum(lbl.startswith("wgrad") for lbl in labels) == with_params  # none for activations
    assert sum(lbl.startswith("chain") for lbl in labels) == n_layers - 1
    assert all(e[3] >= e[2] for e in ev)
    assert [e[2] for e in ev] == sorted(e[2] for e in ev)
    host = [e[0].endswith("(host enqueue)") for e in ev]
    assert all(host) if any_device.type == "cuda" else not any(host)
    assert all(p.grad is None for p in model.parameters())
    seg = leapfrog.timeline(model, CE, x, y, workers=2, mode="segments")
    assert any(e[1].startswith("transfer") for e in seg)
    assert any(e[1].startswith("boundary") for e in seg)


def test_cost_model_counts_what_the_schedule_does():
    """The model's Linear-layer chain steps and weight gradients are the schedule's tasks."""
    L = 6
    model = leapfrog.deep_mlp(L, 4, dtype=torch.float64)
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    layers = leapfrog._flatten(model)
    ev = leapfrog.timeline(model, MSE, x, y, workers=2, mode="leapfrog")
    linear_chain = [e for e in ev if e[1].startswith("chain")
                    and isinstance(layers[int(e[1].split()[1]) - 1], nn.Linear)]
    wgrads = [e for e in ev if e[1].startswith("wgrad")]
    m = leapfrog.cost_model(L, 4, 3, 2, "leapfrog")
    assert len(linear_chain) == m["chain_steps"] == L - 1
    assert len(wgrads) == L


def test_cost_model():
    L, w, B = 32, 64, 16
    c = 2.0 * B * w * w
    s = leapfrog.cost_model(L, w, B, 1, "serial")
    assert s["chain_steps"] == L - 1 and s["depth"] == s["work"] == (2 * L - 1) * c
    assert s["speedup"] == s["speedup_limit"] == 1
    for k in (2, 4, 8, 1024):
        lf = leapfrog.cost_model(L, w, B, k, "leapfrog")
        assert lf["wgrad_term"] == pytest.approx(s["wgrad_term"] / k)
        assert lf["work"] == s["work"] and lf["depth"] == L * c
        assert lf["lower_bound"] == max(lf["depth"], lf["work"] / k)
        # Amdahl: the chain is half the work, so the limit is 2 - 1/L whatever k.
        assert lf["speedup_limit"] == pytest.approx(2 - 1 / L)
        assert lf["speedup"] <= lf["speedup_limit"] + 1e-12
        seg = leapfrog.cost_model(L, w, B, k, "segments")
        S = min(k, L)
        n = -(-L // S)
        assert seg["chain_steps"] == (S - 1) + n - 1
        assert seg["work"] > s["work"]  # chain splitting buys depth with extra work
    two = leapfrog.cost_model(L, w, B, 2, "leapfrog")
    assert two["speedup"] == pytest.approx((2 * L - 1) / L)  # already at the cap at k = 2
    narrow = leapfrog.cost_model(64, 2, 8, 16, "segments")
    assert narrow["speedup"] > 1  # very narrow layers: chain splitting can pay


# --- the users' model zoo ------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["leapfrog", "segments"])
@pytest.mark.parametrize("name,dtype", zoo.cases(names=[n for n in zoo.ZOO if n != "conv"]))
def test_zoo_grad_equals_autograd(name, dtype, mode):
    """Every chain-shaped zoo model (frozen, tied, bias-free, LayerNorm, BatchNorm in train
    mode, other activations): the schedule's .grad equals torch's backward (a frozen
    parameter gets none), and the global RNG and thread count are left alone. Segments
    refuses BatchNorm in train mode up front."""
    model, ref = zoo.build(name, dtype), zoo.build(name, dtype)
    x, y = zoo.batch(7, dtype)
    if mode == "segments" and name == "batchnorm":
        with pytest.raises(ValueError, match="BatchNorm"):
            leapfrog.grad(model, nn.functional.cross_entropy, x, y, workers=2, mode=mode)
        return
    nn.functional.cross_entropy(ref(x), y).backward()
    with zoo.kept_state():
        leapfrog.grad(model, nn.functional.cross_entropy, x, y, workers=2, mode=mode)
    tol = dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=n)
    for b, c in zip(model.buffers(), ref.buffers(), strict=True):
        torch.testing.assert_close(b, c, **tol)


def test_zoo_conv_model_refused_naming_the_layer():
    x, y = zoo.batch(7)
    with pytest.raises(ValueError, match="Unflatten"):
        leapfrog.grad(zoo.build("conv"), nn.functional.cross_entropy, x, y)
