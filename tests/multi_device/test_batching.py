"""parlearn.batching: the two-half cosine, the noise scale and AdaScale's gain against the
exact values of the known-covariance regression; the sub-groups on real ranks against one
process; SimiGrad's controller against its fixed point.

Monte Carlo checks are seeded; each asserts its tolerance can be met by the sample size
(a bound on the standard error) before it asserts agreement.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from parlearn import distributed as dist
from parlearn.core import datasets, models
from parlearn.multi_device import batching as bt

TIMEOUT = 60


def _mean_se(xs):
    t = torch.tensor(xs, dtype=torch.float64)
    return float(t.mean()), float(t.std()) / math.sqrt(len(xs))


# --------------------------------------------------------------------------- exact values

def test_regression_gradient_and_covariance_match_samples():
    p = bt.LinearRegressionProblem(6, h=[0.5, 1, 1.5, 2, 2.5, 3], noise=0.7, seed=1)
    w = torch.linspace(-1, 1, 6, dtype=torch.float64)
    x, y = p.sample(200_000, torch.Generator().manual_seed(2))
    g = x * (x @ w - y)[:, None]
    # mean gradient, each coordinate within 4 standard errors
    se = g.std(0) / math.sqrt(g.shape[0])
    assert bool(((g.mean(0) - p.gradient(w)).abs() < 4 * se).all())
    # covariance: every entry of the sample covariance within 4 standard errors of Sigma
    e = g - p.gradient(w)
    prods = e[:, :, None] * e[:, None, :]
    se = prods.std(0) / math.sqrt(g.shape[0])
    assert bool(((prods.mean(0) - p.covariance(w)).abs() < 4 * se).all())
    assert p.trace(w) == pytest.approx(float(torch.trace(p.covariance(w))), rel=1e-12)
    assert p.loss(w) == pytest.approx(0.5 * float(((x @ w - y) ** 2).mean()), rel=0.02)


def test_isotropic_noiseless_noise_scale_is_d_plus_one_everywhere():
    p = bt.LinearRegressionProblem(10, seed=3)
    for w in (torch.zeros(10, dtype=torch.float64), torch.ones(10, dtype=torch.float64)):
        assert p.b_simple(w) == pytest.approx(11.0, rel=1e-12)


def test_two_half_estimators_are_unbiased():
    p = bt.LinearRegressionProblem(16, h=torch.linspace(0.5, 2, 16), noise=0.5, seed=0)
    w = torch.zeros(16, dtype=torch.float64)
    stats = bt.monte_carlo_halves(p, w, batch=32, reps=4000, seed=5)
    g2, se_g2 = _mean_se([s.g2 for s in stats])
    tr, se_tr = _mean_se([s.trace for s in stats])
    exact_g2, exact_tr = float(p.gradient(w).square().sum()), p.trace(w)
    assert se_g2 < 0.05 * exact_g2 and se_tr < 0.05 * exact_tr   # the check has power
    assert abs(g2 - exact_g2) < 4 * se_g2
    assert abs(tr - exact_tr) < 4 * se_tr


@pytest.mark.parametrize("batch,reps", [(128, 2000), (256, 1000)])
def test_two_half_cosine_matches_formula_within_5_percent(batch, reps):
    # d = 64, isotropic, noiseless: B_simple = 65 exactly; cos about 0.50 and 0.66.
    p = bt.LinearRegressionProblem(64, seed=1)
    w = torch.zeros(64, dtype=torch.float64)
    stats = bt.monte_carlo_halves(p, w, batch=batch, reps=reps, seed=batch)
    m, se = _mean_se([s.cos for s in stats])
    f = bt.expected_cosine(p.b_simple(w), batch)
    assert 4 * se < 0.025 * f           # Monte Carlo error uses at most half the 5% allowed
    assert abs(m - f) < 0.05 * f


def test_estimated_noise_scale_and_cosine_are_the_same_relation():
    # Halves of equal norm: B |a-b|^2 / (4 a.b) = B (1 - cos) / (2 cos), exactly, and the
    # formula maps that estimate back to the measured cosine.
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(50, generator=gen, dtype=torch.float64)
    b = torch.randn(50, generator=gen, dtype=torch.float64) + 2 * a
    b = b * a.norm() / b.norm()
    s = bt.two_half_stats(a, b, 40)
    assert s.b_simple == pytest.approx(40 * (1 - s.cos) / (2 * s.cos), rel=1e-12)
    assert bt.expected_cosine(s.b_simple, 40) == pytest.approx(s.cos, rel=1e-12)
    bstar = bt.controller_fixed_point(7.0, 0.4)
    assert bt.expected_cosine(7.0, bstar) == pytest.approx(0.4, rel=1e-12)


def test_noise_scale_average_is_a_ratio_of_averages():
    ns = bt.NoiseScale(decay=0.5)
    ns.update(bt.HalfStats(cos=0.1, g2=1.0, trace=10.0, batch=4))
    ns.update(bt.HalfStats(cos=0.1, g2=3.0, trace=2.0, batch=4))
    # averages 0.25*1 + 0.5*3 and 0.25*10 + 0.5*2 (both started at 0)
    assert ns.b_simple == pytest.approx((0.25 * 10 + 0.5 * 2) / (0.25 * 1 + 0.5 * 3))
    neg = bt.NoiseScale()
    neg.update(bt.HalfStats(cos=-0.1, g2=-1.0, trace=1.0, batch=4))
    assert neg.b_simple == math.inf


# --------------------------------------------------------------------------- AdaScale

def test_adascale_gain_in_range_and_equal_to_closed_form():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        sigma2, g2 = (float(v) for v in torch.rand(2, generator=gen, dtype=torch.float64) * 10)
        scale = 1 + float(torch.rand(1, generator=gen)) * 63
        r = bt.adascale_gain(sigma2, g2, scale)
        assert 1 - 1e-12 <= r <= scale + 1e-12
        assert r == pytest.approx((sigma2 + g2) / (sigma2 / scale + g2), rel=1e-14)
        # the same gain from the noise scale: sigma2 = tr Sigma / b0, B_simple = tr / g2
        b0 = 8.0
        b_simple = sigma2 * b0 / g2
        assert bt.adascale_gain_from_b_simple(b_simple, b0, b0 * scale) == pytest.approx(
            r, rel=1e-12)
    assert bt.adascale_gain(0.0, 2.0, 16) == 1.0          # no noise: no gain
    assert bt.adascale_gain(3.0, 0.0, 16) == 16.0         # all noise: the full S


# --------------------------------------------------------------------------- McCandlish

def test_steps_samples_model_and_fit_recover_each_other():
    m = bt.steps_samples_model([10, 100, 1000], b_noise=100, s_min=50)
    assert m["steps"][1] == pytest.approx(100) and m["samples"][1] == pytest.approx(2 * m["e_min"])
    assert all(e == pytest.approx(b * s) for b, s, e in zip(m["batch"], m["steps"],
                                                             m["samples"], strict=True))
    fit = bt.critical_batch_fit(m["batch"], m["steps"])
    assert fit["b_crit"] == pytest.approx(100, rel=1e-9)
    assert fit["s_min"] == pytest.approx(50, rel=1e-9)
    one = bt.steps_samples_model(100, b_noise=100, s_min=50)
    assert one["steps"] == pytest.approx(100)


def test_tradeoff_model_piecewise_and_adaptive():
    # constant noise scale: the whole-run model is McCandlish's S and E
    fixed = bt.tradeoff_model([50.0] * 10, batch=25)
    ref = bt.steps_samples_model(25, b_noise=50, s_min=10)
    assert fixed["steps"] == pytest.approx(ref["steps"]) and fixed["samples"] == pytest.approx(
        ref["samples"])
    # tracking B = k b_noise: (1 + 1/k) S_min steps and (1 + k) E_min examples, any path
    path = [10.0, 20.0, 80.0, 300.0]
    k = 2 * 0.5 / (1 - 0.5)
    ada = bt.tradeoff_model(path, factor=k)
    assert ada["steps"] == pytest.approx((1 + 1 / k) * len(path))
    assert ada["samples"] == pytest.approx((1 + k) * sum(path))
    # ... indeed exactly the fixed batch k x mean(b): tracking the noise scale buys nothing
    mean_fixed = bt.tradeoff_model(path, batch=k * sum(path) / len(path))
    assert mean_fixed["steps"] == pytest.approx(ada["steps"])
    assert mean_fixed["samples"] == pytest.approx(ada["samples"])
    # B ~ sqrt(b) beats the fixed batch of equal steps on examples
    sq = bt.tradeoff_model(path, factor=10.0, power=0.5)
    b_eq = sum(path) / (sq["steps"] - len(path))       # fixed batch with the same steps
    eq = bt.tradeoff_model(path, batch=b_eq)
    assert eq["steps"] == pytest.approx(sq["steps"]) and eq["samples"] > 1.01 * sq["samples"]
    with pytest.raises(ValueError, match="exactly one"):
        bt.tradeoff_model(path)


def test_frontier_interpolates_between_measured_batches():
    rows = [{"steps": 100, "samples": 1000}, {"steps": 50, "samples": 4000},
            {"steps": None, "samples": None}]
    assert bt.frontier_samples(rows, 100) == pytest.approx(1000)
    assert bt.frontier_samples(rows, math.sqrt(100 * 50)) == pytest.approx(2000)   # log-log
    assert bt.frontier_samples(rows, 40) is None and bt.frontier_samples(rows, 120) is None


def test_noise_scale_from_loss_equals_exact_on_isotropic_problem():
    p = bt.LinearRegressionProblem(12, noise=0.3, seed=2)
    w = torch.linspace(-2, 2, 12, dtype=torch.float64)
    assert p.b_simple_from_loss(p.loss(w)) == pytest.approx(p.b_simple(w), rel=1e-12)
    with pytest.raises(ValueError, match="isotropic"):
        bt.LinearRegressionProblem(2, h=[1.0, 2.0]).b_simple_from_loss(1.0)


# --------------------------------------------------------------------------- controller

def test_controller_steps_and_rounding():
    c = bt.SimiGradController(0.5, step=0.5, start=16, min_batch=8, max_batch=40, quantum=8)
    assert c.update(0.1) == 24 and c.value == pytest.approx(24)       # grow: 16 * 1.5
    assert c.update(0.5) == 16 and c.value == pytest.approx(16)       # at target: shrink
    c.value = 21.0
    assert c.batch() == 24                                             # nearest multiple of 8
    for _ in range(20):
        c.update(0.0)
    assert c.value == 40 and c.batch() == 40                           # clamped at max
    for _ in range(20):
        c.update(1.0)
    assert c.value == 8 and c.batch() == 8


@pytest.mark.parametrize("target", [0.3, 0.5])
def test_controller_batch_converges_to_predicted_size(target):
    # Isotropic noiseless regression: B_simple = d + 1 at every w, so training does not
    # move the fixed point B* = 2 B_simple s / (1 - s).
    d = 64
    p = bt.LinearRegressionProblem(d, seed=1)
    h = bt.train(p.model(), bt.RegressionTask(p, seed=2), method="simigrad", steps=400,
                 lr=0.01, batch=16, target=target, step=0.1, lr_scaling="sqrt")
    tail = h.batch[200:]
    settled = math.exp(sum(math.log(b) for b in tail) / len(tail))
    bstar = bt.controller_fixed_point(d + 1, target)
    assert abs(settled - bstar) < 0.15 * bstar
    assert h.loss[-1] < 1e-3 * h.loss[0]       # it trained while it settled


# --------------------------------------------------------------------------- real ranks

@pytest.mark.parametrize("world_size,accum", [(2, 3), (4, 2)])
def test_subgroup_all_reduces_equal_half_means_in_one_process(world_size, accum):
    net = models.mlp([12, 16, 5], seed=1, dtype=torch.float64)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(world_size * accum * 2, 12, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (x.shape[0],), generator=gen)
    res = dist.run(bt.worker_half_gradients, world_size,
                   args=(copy.deepcopy(net), x, y, accum), timeout=TIMEOUT)
    a, b = bt.half_gradients(net, torch.nn.functional.cross_entropy, x, y)
    assert float((a - b).abs().max()) > 1e-3            # the halves really differ
    for r in res:
        assert float((r["a"] - a).abs().max()) < 1e-12
        assert float((r["b"] - b).abs().max()) < 1e-12
    n = a.numel() * 8
    assert res[0]["bytes"] == {"all_reduce": n, "batch_isend_irecv": 2 * n}
    wire = dist.ring_bytes("all_reduce", n, world_size // 2) + n
    assert bt.probe_bytes(a.numel(), world_size, 8)["probe"] == pytest.approx(wire)


def test_train_runs_equals_one_launch_per_run_and_checks_every_run_first():
    data = datasets.digits(dtype=torch.float64, n_train=300)
    task = bt.DigitsTask(data, seed=1)
    net = models.mlp([64, 16, 10], seed=0, dtype=torch.float64)
    runs = [{"method": "simigrad", "steps": 6, "lr": 0.5, "batch": 16, "target": 0.6,
             "step": 0.3, "micro": 2},
            {"method": "fixed", "steps": 5, "lr": 0.5, "batch": 8}]
    together = bt.train_runs(net, task, runs, world_size=2, timeout=TIMEOUT)
    for i, kw in enumerate(runs):
        alone = dist.run(bt.worker_train, 2, args=(copy.deepcopy(net), task, kw),
                         timeout=TIMEOUT)[0]
        got = together[i][0]
        assert got.batch == alone.batch and got.loss == alone.loss
        for k in alone.params:
            assert torch.equal(got.params[k], alone.params[k])
    # a bad second run is refused before the first one trains, naming the run
    for bad, err in (([runs[0], {"momentum": 0.9}], ValueError), ([], TypeError),
                     ([runs[0], 3], TypeError)):
        with pytest.raises(err, match="runs"):
            bt.train_runs(net, task, bad, world_size=2)
    for kw, match in (({"world_size": 0}, "world_size"), ({"world_size": True}, "world_size"),
                      ({"timeout": 0.0}, "timeout"), ({"timeout": "60"}, "timeout")):
        with pytest.raises((TypeError, ValueError), match=match):
            bt.train_runs(net, task, runs, **kw)
    with pytest.raises(TypeError, match="model"):
        bt.train_runs("net", task, runs)


@pytest.mark.parametrize("world_size,method", [(2, "simigrad"), (4, "adascale")])
def test_training_on_ranks_equals_one_process(world_size, method):
    data = datasets.digits(dtype=torch.float64, n_train=300)
    task = bt.DigitsTask(data, seed=1)
    net = models.mlp([64, 16, 10], seed=0, dtype=torch.float64)
    kw = {"method": method, "steps": 12, "lr": 0.5, "batch": 16, "base_batch": 4,
          "target": 0.6, "step": 0.3, "micro": 2}
    ranks = dist.run(bt.worker_train, world_size, args=(copy.deepcopy(net), task, kw),
                     timeout=TIMEOUT)
    ref = bt.train(copy.deepcopy(net), task, world_size=world_size, **kw)
    for h in ranks:
        assert h.batch == ref.batch
        for k in ref.params:
            assert float((h.params[k] - ref.params[k]).abs().max()) < 1e-10
    assert ref.loss[-1] < ref.loss[0]
    if method == "simigrad":
        assert len(set(ref.batch)) > 1            # the controller did move the batch
    else:
        assert len({round(v, 9) for v in ref.lr}) > 1   # the gain did move the rate
        for lr, b_simple in zip(ref.lr, ref.b_simple, strict=True):   # lr = base lr x gain
            gain = (16 / 4 if not math.isfinite(b_simple)
                    else bt.adascale_gain_from_b_simple(max(b_simple, 0.0), 4, 16))
            assert lr == pytest.approx(0.5 * gain, rel=1e-12)
            assert 0.5 <= lr <= 0.5 * 16 / 4 + 1e-12


def test_one_step_is_sgd_on_the_full_batch_mean():
    p = bt.LinearRegressionProblem(5, noise=0.3, seed=0)
    task = bt.RegressionTask(p, seed=4)
    h = bt.train(p.model(), task, method="fixed", steps=1, lr=0.1, batch=8)
    x, y = task.draw(0, 8)
    w = torch.zeros(5, dtype=torch.float64)
    g = (x * (x @ w - y)[:, None]).mean(0)
    assert torch.allclose(h.params["weight"].reshape(-1), w - 0.1 * g, rtol=0, atol=1e-14)
    assert h.samples == [8] and h.loss[1] == pytest.approx(p.loss(w - 0.1 * g))


# --------------------------------------------------------------------------- hygiene

def test_global_rng_and_grad_left_alone():
    p = bt.LinearRegressionProblem(8, seed=0)
    model = p.model()
    model.weight.grad = torch.full_like(model.weight, 7.0)
    state = torch.get_rng_state()
    x, y = p.sample(8, torch.Generator().manual_seed(0))
    bt.half_gradients(model, lambda o, t: 0.5 * (o.reshape(-1) - t).square().mean(), x, y)
    bt.train(model, bt.RegressionTask(p), steps=3, batch=8)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(model.weight.grad, torch.full_like(model.weight, 7.0))


BAD_CALLS = [
    (lambda: bt.expected_cosine(-1.0, 8), ValueError, "b_simple"),
    (lambda: bt.expected_cosine(1.0, 0), ValueError, "batch"),
    (lambda: bt.controller_fixed_point(1.0, 1.0), ValueError, "target"),
    (lambda: bt.adascale_gain(1.0, 1.0, 0.5), ValueError, "scale"),
    (lambda: bt.adascale_gain(0.0, 0.0, 2), ValueError, "undefined"),
    (lambda: bt.adascale_gain_from_b_simple(1.0, 8, 4), ValueError, "batch"),
    (lambda: bt.critical_batch_fit([1, 2], [3]), ValueError, "same length"),
    (lambda: bt.two_half_stats(torch.zeros(3), torch.zeros(4), 4), ValueError, "b"),
    (lambda: bt.two_half_stats(torch.zeros(3), torch.zeros(3), 1), ValueError, "batch"),
    (lambda: bt.SimiGradController(0.5, quantum=3), ValueError, "quantum"),
    (lambda: bt.SimiGradController(0.5, start=1), ValueError, "start"),
    (lambda: bt.SimiGradController("0.5"), TypeError, "target"),
    (lambda: bt.LinearRegressionProblem(3, h=[1, -1, 1]), ValueError, "h"),
    (lambda: bt.LinearRegressionProblem(3, h=[1, 1]), ValueError, "h"),
    (lambda: bt.NoiseScale(1.0), ValueError, "decay"),
    (lambda: bt.half_gradients(torch.nn.Linear(2, 1), torch.nn.functional.mse_loss,
                               torch.zeros(6, 2), torch.zeros(6), world_size=3), ValueError,
     "world_size"),
    (lambda: bt.probe_bytes(10, 3), ValueError, "world_size"),
    (lambda: bt.worker_train(0, 2, torch.nn.Linear(2, 1), None, {"momentum": 0.9}), ValueError,
     "momentum"),
    (lambda: bt.worker_train(0, 2, torch.nn.Linear(2, 1), None, {"world_size": 4}), ValueError,
     "world_size"),
    (lambda: bt.tradeoff_model([1.0], factor=1.0, power=0.0), ValueError, "power"),
    (lambda: bt.batch_sweep(torch.nn.Linear(2, 1), bt.RegressionTask(
        bt.LinearRegressionProblem(2)), [], [0.1], 1.0), ValueError, "empty"),
]


@pytest.mark.parametrize("call,err,word", BAD_CALLS)
def test_bad_calls_fail_fast(call, err, word):
    with pytest.raises(err, match=word):
        call()


@pytest.mark.parametrize("kw,word", [({"method": "lars"}, "method"),
                                     ({"batch": 15}, "multiple"),
                                     ({"lr_scaling": "cubic"}, "lr_scaling"),
                                     ({"base_batch": 64}, "base_batch"),
                                     ({"max_batch": 8}, "max_batch"),
                                     ({"world_size": 3}, "world_size")])
def test_bad_train_arguments_fail_before_any_step(kw, word):
    p = bt.LinearRegressionProblem(4, seed=0)
    model = p.model()
    before = model.weight.detach().clone()
    with pytest.raises((ValueError, TypeError), match=word):
        bt.train(model, bt.RegressionTask(p), **{"batch": 16, **kw})
    assert torch.equal(model.weight, before)


def test_b_noise_equals_b_simple_when_the_hessian_is_the_identity():
    d = 6
    prob = bt.LinearRegressionProblem(d, noise=0.3, seed=2)
    task = bt.RegressionTask(prob, seed=1)
    model = prob.model(torch.full((d,), 0.4, dtype=torch.float64))
    xh = d ** 0.5 * torch.eye(d, dtype=torch.float64)   # X^T X / d = I: H = I exactly
    out = bt.measure_noise_scale(model, task, batch=16, reps=20,
                                 hessian_data=(xh, torch.zeros(d, 1, dtype=torch.float64)))
    assert out["b_noise"] == pytest.approx(out["b_simple"], rel=1e-12)


def test_b_noise_uses_the_hessian_of_the_given_data():
    """Hessian-vector products against the explicit Hessian X^T X / n of the half-MSE."""
    d, batch, reps = 5, 8, 7
    prob = bt.LinearRegressionProblem(d, h=torch.linspace(0.2, 3.0, d), noise=0.5, seed=0)
    task = bt.RegressionTask(prob, seed=4)
    model = prob.model(torch.linspace(-1, 1, d, dtype=torch.float64))
    xh, yh = prob.sample(50, torch.Generator().manual_seed(9))
    H = xh.T @ xh / len(xh)
    hg = ht = 0.0
    for r in range(reps):
        x, y = task.draw(1_000_000 + r, batch)
        a, b = bt.half_gradients(model, task.loss_fn, x, y)
        hg += float(a @ H @ b)
        ht += batch * float((a - b) @ H @ (a - b)) / 4
    out = bt.measure_noise_scale(model, task, batch=batch, reps=reps, hessian_data=(xh, yh))
    assert out["b_noise"] == pytest.approx(ht / hg, rel=1e-10)
    assert model.weight.grad is None


def test_draw_probe_draws_the_plan_the_ranks_run():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    plan = bt.draw_probe(ax, 6)
    assert plan == {"a": [0, 1, 2], "b": [3, 4, 5], "swaps": [(0, 3), (1, 4), (2, 5)]}
    arcs = [a for a in ax.texts if getattr(a, "arrow_patch", None) is not None]
    assert len(arcs) == 3                                    # one swap arrow per pair
    assert sum("all-reduce on group" in t.get_text() for t in ax.texts) == 2
    plt.close(fig)
    with pytest.raises(ValueError, match="world_size"):
        bt.draw_probe(None, 3)


def test_batch_sweep_caps_runs_without_changing_a_row():
    # Each run stops at the best step count so far: the rows equal the uncapped grid's (every
    # rate to the end, fewest steps, first rate on a tie), for fewer steps trained.
    from parlearn.multi_device.batching.training import samples_to_target

    task = bt.DigitsTask(datasets.digits(), seed=0)
    net = models.mlp([64, 16, 10], seed=0)
    batches, lrs, target, steps = [8, 32], [0.1, 0.8, 0.4], 1.8, 40
    sweep = bt.batch_sweep(net, task, batches, lrs, target, steps=steps)
    uncapped = 0
    for b, row in zip(batches, sweep["rows"], strict=True):
        best = None
        for lr in lrs:
            h = bt.train(copy.deepcopy(net), task, method="fixed", batch=b, lr=lr, steps=steps,
                         target_loss=target, max_batch=b)
            uncapped += h.steps
            hit = samples_to_target(h, target)
            if hit is not None and (best is None or hit[0] < best[1]):
                best = (lr, *hit)
        assert best is not None
        assert (row["lr"], row["steps"], row["samples"]) == best
    assert sweep["trained_steps"] < uncapped
    assert sweep["full_steps"] == steps * len(batches) * len(lrs)
