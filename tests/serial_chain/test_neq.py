"""Tests of parlearn.neq: the equilibrium test by hand, the skipping backward against the
reference, frozen rows untouched, eps = 0 is plain training, counted FLOPs = the model."""

import math

import pytest
import torch
import torch.nn.functional as F
import zoo

from parlearn.core.models import mlp
from parlearn.serial_chain import neq


def _data(n=80, d=6, classes=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=dtype)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y


def _masks(widths, frozen_layers=(), seed=0):
    """Random active masks; layers listed in ``frozen_layers`` wholly frozen."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, m in enumerate(widths[1:]):
        a = torch.rand(m, generator=g) < 0.5
        a[0] = True  # at least one active, at least one frozen
        a[-1] = False
        out.append(torch.zeros(m, dtype=torch.bool) if i in frozen_layers else a)
    return out


# --- the equilibrium test, by hand --------------------------------------------------------

def test_phi_is_the_per_neuron_cosine_with_the_silent_conventions():
    prev = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 1.0]])
    cur = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    # neuron 0: (1,0).(1,1)/sqrt2; neuron 1: (0,2).(1,1)/(2 sqrt2); 2: both silent; 3: one.
    want = torch.tensor([2 ** -0.5, 2 ** -0.5, 1.0, 0.0], dtype=torch.float64)
    assert torch.allclose(neq.phi(prev, cur), want, rtol=0, atol=1e-15)


def test_velocity_equals_a_hand_computation():
    # Three epochs of one layer with two neurons, mu = 0.5, phi^0 = 1, v^0 = 0.
    outs = [torch.tensor([[1.0, 1.0], [0.0, 1.0]]),        # before training
            torch.tensor([[1.0, 1.0], [1.0, 1.0]]),        # after epoch 1
            torch.tensor([[1.0, 1.0], [1.0, 1.0]]),        # after epoch 2 (no change)
            torch.tensor([[1.0, -1.0], [1.0, 1.0]])]       # after epoch 3
    state = neq.Equilibrium.start([outs[0]], eps=0.1, mu=0.5)
    r = 2 ** -0.5
    # neuron 0: phi = r, 1, 1 -> dphi = r-1, 1-r, 0; v = r-1, (1-r) - .5(r-1), 0 - .5 v2
    # neuron 1: phi = 1, 1, 0 -> dphi = 0, 0, -1;   v = 0, 0, -1
    v1 = [r - 1, 0.0]
    v2 = [(1 - r) - 0.5 * (r - 1), 0.0]
    v3 = [-0.5 * v2[0], -1.0]
    for out, want in zip(outs[1:], [v1, v2, v3], strict=True):
        state.update([out])
        assert torch.allclose(state.velocity[0], torch.tensor(want, dtype=torch.float64),
                              rtol=0, atol=1e-15)
        assert state.active[0].tolist() == [abs(w) >= 0.1 for w in want]
    assert state.active[0].tolist() == [True, True]  # |v3| = (0.44, 1) >= eps
    # eps = 0 freezes nothing, not even a neuron whose velocity is exactly 0
    same = torch.tensor([[1.0], [0.0]])
    zero = neq.Equilibrium.start([same], eps=0.0, mu=0.5)
    zero.update([same.clone()])
    assert zero.velocity[0].item() == 0.0 and zero.active[0].all()
    assert neq.velocity_step(torch.tensor([2.0]), torch.tensor([1.0]), 0.25).item() == 0.5


# --- the skipping backward equals the reference -------------------------------------------

@pytest.mark.parametrize("frozen_layers", [(), (0,), (1,), (0, 1), (0, 1, 2, 3)])
def test_masked_backward_equals_reference(frozen_layers):
    widths = [6, 9, 8, 7, 5]
    net = mlp(widths, seed=1, dtype=torch.float64)
    x, y = _data()
    active = _masks(widths, frozen_layers)
    l1, g1 = neq.reference_backward(net, x, y, active)
    l2, g2 = neq.masked_backward(net, x, y, active)
    assert l1 == l2
    for a, b in zip(g1, g2, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-13)
    # and the reference really is autograd with frozen rows zeroed
    full = torch.autograd.grad(F.cross_entropy(net(x), y), list(net.parameters()))
    for i, a in enumerate(active):
        assert torch.equal(g1[2 * i][a], full[2 * i][a])
        assert not g1[2 * i][~a].any() and not g1[2 * i + 1][~a].any()
    assert all(p.grad is None for p in net.parameters())


def test_counted_flops_equal_the_model():
    widths = [6, 9, 8, 7, 5]
    net = mlp(widths, seed=1, dtype=torch.float64)
    x, y = _data()
    cases = [_masks(widths), _masks(widths, (0,)), _masks(widths, (0, 1)),
             _masks(widths, (1, 2)), _masks(widths, (0, 1, 2, 3)),
             [torch.ones(m, dtype=torch.bool) for m in widths[1:]]]
    for active in cases:
        counts = [int(a.sum()) for a in active]
        assert neq.count_backward_flops(net, x, y, active) == neq.backward_flops(
            widths, len(x), counts), counts
    full = neq.backward_flops(widths, len(x), widths[1:])
    assert neq.count_backward_flops(net, x, y, cases[0], skip=False) == full
    # by hand: 2*80*(9*6) + 2*80*(8*9)*2 + 2*80*(7*8)*2 + 2*80*(5*7)*2
    assert full == 160 * (54 + 2 * 72 + 2 * 56 + 2 * 35)


# --- training: frozen rows stay put, eps = 0 is plain training ------------------------------

def test_frozen_neurons_are_bit_identical_across_an_epoch():
    widths = [6, 16, 16, 5]
    net = mlp(widths, seed=2, dtype=torch.float64)
    x, y = _data(n=120)
    run2 = neq.train(net, x, y, x[:40], epochs=2, eps=0.05, mu=0.5, lr=0.2, momentum=0.9,
                     weight_decay=1e-3, batch=16)
    assert 0 < run2.frozen_total[1] < 1, run2.frozen_total  # the case is not vacuous
    run3 = neq.train(net, x, y, x[:40], epochs=3, eps=0.05, mu=0.5, lr=0.2, momentum=0.9,
                     weight_decay=1e-3, batch=16)
    # The first two epochs of run3 are run2 (same seed), so epoch 3's mask is run3's state
    # after epoch 2, which is |velocity| < eps of the velocity recorded after epoch 2.
    before = neq.linear_layers(run2.model)
    after = neq.linear_layers(run3.model)
    for i, (b, a, v) in enumerate(zip(before, after, run3.velocity[1], strict=True)):
        frozen = v.abs() < 0.05
        assert torch.equal(a.weight[frozen], b.weight[frozen])
        assert torch.equal(a.bias[frozen], b.bias[frozen])
        for j in (2 * i, 2 * i + 1):  # and their momentum: no update of any kind
            assert torch.equal(run3.momentum[j][frozen], run2.momentum[j][frozen])
        assert not torch.equal(a.weight[~frozen], b.weight[~frozen])
    assert run3.frozen[2] == [1 - (v.abs() >= 0.05).double().mean().item()
                              for v in run3.velocity[1]]


def test_eps_zero_is_plain_training_exactly():
    widths = [6, 12, 10, 5]
    net = mlp(widths, seed=3, dtype=torch.float64)
    x, y = _data(n=70)
    run = neq.train(net, x, y, x[:20], epochs=3, eps=0.0, lr=0.1, momentum=0.9,
                    weight_decay=1e-3, batch=16, seed=4)
    assert run.frozen_total == [0.0, 0.0, 0.0]
    ref = mlp(widths, seed=3, dtype=torch.float64)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3,
                          foreach=False)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        for idx in torch.randperm(len(x), generator=gen).split(16):
            opt.zero_grad()
            F.cross_entropy(ref(x[idx]), y[idx]).backward()
            opt.step()
    for p, q in zip(run.model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert run.flops == run.flops_full


def test_skip_and_reference_training_agree_and_input_model_is_untouched():
    widths = [6, 16, 16, 5]
    net = mlp(widths, seed=2, dtype=torch.float64)
    saved = [p.clone() for p in net.parameters()]
    x, y = _data(n=120)
    kw = dict(epochs=4, eps=0.05, mu=0.5, lr=0.2, batch=16)
    a = neq.train(net, x, y, x[:40], skip=True, **kw)
    b = neq.train(net, x, y, x[:40], skip=False, **kw)
    assert a.frozen == b.frozen and max(a.frozen_total) > 0
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-12)
    assert all(f < g for f, g in zip(a.flops[1:], a.flops_full[1:], strict=True)
               if f != g) and b.flops == b.flops_full
    assert all(torch.equal(p, s) for p, s in zip(net.parameters(), saved, strict=True))


def test_allreduce_bytes_model():
    got = neq.allreduce_bytes([4, 3, 2], [1, 2], world_size=4, element_size=4)
    assert got["payload"] == (1 * 5 + 2 * 4) * 4
    assert got["full_payload"] == (3 * 5 + 2 * 4) * 4
    assert got["wire"] == pytest.approx(2 * 3 / 4 * got["payload"])


def test_measure_backward_reports_the_flop_model_and_runs_both():
    widths = [16, 12, 12, 4]
    cmp, model = neq.measure_backward(widths, 8, 0.5, repeat=1)
    assert set(cmp.timings) == {"full", "masked"}
    assert model == neq.backward_flops(widths, 8, widths[1:]) / neq.backward_flops(
        widths, 8, [6, 6, 4])
    with pytest.raises(ValueError, match="frozen"):
        neq.measure_backward(widths, 8, 1.5)


# --- bad input ---------------------------------------------------------------------------

def test_bad_input_fails_fast():
    net = mlp([6, 4, 3], seed=0, dtype=torch.float64)
    x, y = _data(n=10, classes=3)
    with pytest.raises(ValueError, match="eps"):
        neq.train(net, x, y, x, epochs=1, eps=-1.0)
    with pytest.raises(ValueError, match="mu"):
        neq.train(net, x, y, x, epochs=1, eps=0.1, mu=1.5)
    with pytest.raises(ValueError, match="x_val"):
        neq.train(net, x, y, x[:, :3], epochs=1, eps=0.1)
    with pytest.raises(TypeError, match="nn.Sequential"):
        neq.train(torch.nn.Linear(6, 3), x, y, x, epochs=1, eps=0.1)
    with pytest.raises(ValueError, match="active"):
        neq.masked_backward(net, x, y, [torch.ones(4, dtype=torch.bool)])
    with pytest.raises(TypeError, match=r"active\[1\]"):
        neq.masked_backward(net, x, y, [torch.ones(4, dtype=torch.bool), torch.ones(3)])
    with pytest.raises(ValueError, match=r"active\[i\]"):
        neq.backward_flops([6, 4, 3], 8, [5, 1])


# --- the users' model zoo ------------------------------------------------------------------

NEQ_ZOO = ["relu", "gelu", "tanh", "silu", "no_bias", "frozen", "layernorm_no_affine"]
NEQ_REFUSED = {"tied": (ValueError, "tied"), "layernorm": (TypeError, "LayerNorm"),
               "batchnorm": (TypeError, "BatchNorm1d"), "conv": (TypeError, "Conv2d")}


@pytest.mark.parametrize("name,dtype", zoo.cases(names=NEQ_ZOO))
def test_zoo_eps_zero_equals_torch_sgd_and_frozen_never_moves(name, dtype):
    """eps = 0 is plain SGD: equal to torch.optim.SGD on the same minibatches (prime size 7,
    a last minibatch of 1) for every zoo model NEq accepts; a frozen layer never moves."""
    model = zoo.build(name, dtype)
    x, y = zoo.batch(15, dtype)
    with zoo.kept_state(model):
        run = neq.train(model, x, y, x[:5], epochs=2, eps=0.0, lr=0.1, momentum=0.9,
                        weight_decay=1e-3, batch=7, seed=4)
    ref = zoo.build(name, dtype)
    before = zoo.frozen(ref)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1,
                          momentum=0.9, weight_decay=1e-3, foreach=False)
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):
        for idx in torch.randperm(len(x), generator=gen).split(7):
            opt.zero_grad()
            F.cross_entropy(ref(x[idx]), y[idx]).backward()
            opt.step()
    tol = dict(rtol=0, atol=0) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(run.model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, **tol, msg=n)
    zoo.assert_frozen_unmoved(run.model, before)
    if name == "frozen":
        assert all(f[0] == 1.0 for f in run.frozen)  # reported as frozen, every epoch


@pytest.mark.parametrize("name", NEQ_ZOO)
def test_zoo_masked_backward_equals_reference(name):
    model = zoo.build(name, torch.float64)
    x, y = zoo.batch(13)
    layers = neq.linear_layers(model)
    g = torch.Generator().manual_seed(0)
    active = [torch.rand(m.out_features, generator=g) < 0.5 for m in layers]
    with zoo.kept_state(model):
        la, ga = neq.masked_backward(model, x, y, active)
        lb, gb = neq.reference_backward(model, x, y, active)
    assert la == pytest.approx(lb, rel=1e-12)
    for a, b in zip(ga, gb, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    if name == "frozen":
        assert not ga[0].any() and not ga[1].any()
    if name == "no_bias":
        assert ga[1] is None


@pytest.mark.parametrize("name,dtype", zoo.cases(dtypes=(torch.float64,), names=NEQ_ZOO))
def test_zoo_training_with_freezing_skip_equals_reference(name, dtype):
    model = zoo.build(name, dtype)
    x, y = zoo.batch(13, dtype)
    before = zoo.frozen(model)
    kw = dict(epochs=3, eps=0.05, mu=0.5, lr=0.2, momentum=0.5, batch=7)
    with zoo.kept_state(model):
        a = neq.train(model, x, y, x[:7], skip=True, **kw)
        b = neq.train(model, x, y, x[:7], skip=False, **kw)
    assert a.frozen == b.frozen
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    zoo.assert_frozen_unmoved(a.model, before)


@pytest.mark.parametrize("name", sorted(NEQ_REFUSED))
def test_zoo_models_neq_cannot_handle_are_refused_up_front(name):
    kind, what = NEQ_REFUSED[name]
    x, y = zoo.batch(7)
    with pytest.raises(kind, match=what):
        neq.train(zoo.build(name), x, y, x, epochs=1, eps=0.1)


def test_empty_validation_set_is_refused():
    """With no validation outputs every phi is 1 and every neuron would freeze silently."""
    net = mlp([6, 4, 3], seed=0, dtype=torch.float64)
    x, y = _data(n=10, classes=3)
    with pytest.raises(ValueError, match="x_val"):
        neq.train(net, x, y, x[:0], epochs=2, eps=0.1)
    with pytest.raises(ValueError, match="x"):
        neq.train(net, x[:0], y[:0], x, epochs=2, eps=0.1)


def test_equilibrium_refuses_bad_outputs_naming_them():
    """start() and update() check outputs (layers of (examples, neurons) floats; update:
    the same layers and shapes as before), eps and mu, before any state changes."""
    good = [torch.rand(4, 3, dtype=torch.float64)]
    for bad in ([], "o", [torch.rand(4)], [torch.arange(4).reshape(2, 2)]):
        with pytest.raises((TypeError, ValueError), match="outputs"):
            neq.Equilibrium.start(bad, eps=0.1, mu=0.5)
    for name, kw in (("eps", dict(eps=-0.1, mu=0.5)), ("mu", dict(eps=0.1, mu=1.5)),
                     ("eps", dict(eps=math.nan, mu=0.5)), ("mu", dict(eps=0.1, mu=True))):
        with pytest.raises((TypeError, ValueError), match=name):
            neq.Equilibrium.start(good, **kw)
    state = neq.Equilibrium.start(good, eps=0.1, mu=0.5)
    for bad in ([], good * 2, [torch.rand(4, 2, dtype=torch.float64)]):
        with pytest.raises((TypeError, ValueError), match="outputs"):
            state.update(bad)
    assert state.outputs is good  # nothing changed by the refused updates
