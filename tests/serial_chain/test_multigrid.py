import math
import warnings
from functools import partial

import pytest
import torch

from parlearn.serial_chain import multigrid as mg


def _setup(N=16, width=4, smooth=1.0, h=None, conv=False, seed=0, device="cpu"):
    st = mg.random_stack(N, width, smoothness=smooth, h=h, conv=conv, seed=seed).to(device)
    shape = (3, 2, 4, 4) if conv else (3, width)
    x0 = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return st, x0.to(device)


def _err(a, b):
    return (a - b).abs().max().item()


def _exact_k(N, m, relax):
    return N // m if relax == "F" else math.ceil(N / (2 * m))


# --- exactness: parallel == serial -------------------------------------------------------


@pytest.mark.parametrize("conv", [False, True])
def test_serial_reference_and_baseline_agree(conv, any_device):
    st, x0 = _setup(conv=conv, device=any_device)
    ref = st.serial(x0)
    net = mg.SerialResNet(st)
    assert _err(net(x0), ref[-1]) < 1e-13
    # the baseline owns per-layer copies of the same weights, not views of the stack
    assert len(list(net.parameters())) == 2 * st.n_layers
    for k, v in net.stacked().items():
        assert torch.equal(v, st.params[k].detach())
        assert v.data_ptr() != st.params[k].data_ptr()


@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("cfactor", [1, 2, 4])
def test_one_level_solves_from_any_warm_start(conv, cfactor, any_device):
    st, x0 = _setup(conv=conv, device=any_device)
    ref = st.serial(x0)
    junk = torch.full_like(ref, 7.0)
    for warm in (None, junk):
        res = mg.mgrit_forward(st, x0, cfactor=cfactor, levels=1, iters=1, warm_start=warm)
        assert _err(res.states, ref) < 1e-13 and res.iterations == 1
    res = mg.mgrit_forward(st, x0, cfactor=cfactor, levels=1, tol=1e-12, warm_start=junk)
    assert res.converged and res.iterations == 1 and _err(res.states, ref) < 1e-13


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("relax", ["F", "FCF"])
@pytest.mark.parametrize("conv", [False, True])
def test_exact_after_predicted_iterations_not_before(m, relax, conv, any_device):
    # the hard case (h = 1, independent weights) converges slowly, so exactness can
    # only come from the finite-step property, which guards the indexing
    st, x0 = _setup(smooth=0.0, h=1.0, conv=conv, device=any_device)
    ref = st.serial(x0)
    k = _exact_k(st.n_layers, m, relax)
    assert mg.exact_iterations(st.n_layers, m, 2, relax) == k
    exact = mg.mgrit_forward(st, x0, cfactor=m, iters=k, relax=relax)
    before = mg.mgrit_forward(st, x0, cfactor=m, iters=k - 1, relax=relax)
    assert _err(exact.states, ref) < 1e-12
    assert _err(before.states, ref) > 1e-6


@pytest.mark.parametrize("N,m,levels", [(16, 2, 3), (32, 2, 5), (64, 4, 3)])
@pytest.mark.parametrize("relax", ["F", "FCF"])
def test_multilevel_exact_after_the_same_bound(N, m, levels, relax, any_device):
    st, x0 = _setup(N=N, smooth=0.0, h=1.0, device=any_device)
    ref = st.serial(x0)
    k = mg.exact_iterations(N, m, levels, relax)
    assert k == _exact_k(N, m, relax)
    scale = ref.abs().max().item()
    exact = mg.mgrit_forward(st, x0, cfactor=m, levels=levels, iters=k, relax=relax)
    before = mg.mgrit_forward(st, x0, cfactor=m, levels=levels, iters=k - 1, relax=relax)
    assert _err(exact.states, ref) < 1e-12 * scale
    assert _err(before.states, ref) > 1e-8 * scale


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("relax", ["F", "FCF"])
def test_adjoint_exact_after_predicted_iterations(m, relax, any_device):
    st, x0 = _setup(smooth=0.0, h=1.0, device=any_device)
    states = st.serial(x0).detach()
    lam_out = torch.randn(x0.shape, dtype=x0.dtype,
                          generator=torch.Generator().manual_seed(2)).to(any_device)
    ref = mg.serial_adjoint(st, states, lam_out)
    k = _exact_k(st.n_layers, m, relax)
    exact = mg.mgrit_adjoint(st, states, lam_out, cfactor=m, iters=k, relax=relax)
    before = mg.mgrit_adjoint(st, states, lam_out, cfactor=m, iters=k - 1, relax=relax)
    assert _err(exact.states, ref) < 1e-12 * max(1.0, ref.abs().max().item())
    assert _err(before.states, ref) > 1e-6
    one = mg.mgrit_adjoint(st, states, lam_out, cfactor=m, levels=1, iters=1)
    assert _err(one.states, ref) < 1e-12 * max(1.0, ref.abs().max().item())


def test_serial_adjoint_equals_autograd():
    st, x0 = _setup()
    x = x0.clone().requires_grad_(True)
    lam_out = torch.randn(x0.shape, dtype=x0.dtype, generator=torch.Generator().manual_seed(3))
    (st.serial(x)[-1] * lam_out).sum().backward()
    lams = mg.serial_adjoint(st, st.serial(x0).detach(), lam_out)
    assert _err(lams[0], x.grad) < 1e-13


@pytest.mark.parametrize("relax", ["F", "FCF"])
def test_batched_relaxation_equals_looped(relax, any_device):
    st, x0 = _setup(N=12, device=any_device)
    a = mg.mgrit_forward(st, x0, cfactor=3, iters=2, relax=relax, batched=True)
    b = mg.mgrit_forward(st, x0, cfactor=3, iters=2, relax=relax, batched=False)
    assert _err(a.states, b.states) < 1e-14


@pytest.mark.parametrize("conv", [False, True])
def test_fast_forward_steps_equal_the_plain_step_function(conv):
    from parlearn.serial_chain.multigrid.layer_parallel import _forward_step, _ForwardSteps
    from parlearn.serial_chain.multigrid.solver import _serial_solve

    st, x0 = _setup(N=16, conv=conv)
    fast = _ForwardSteps(st, 2)
    gen = torch.Generator().manual_seed(3)
    for level, steps in ((0, slice(0, 16, 2)), (0, slice(1, 16, 2)), (1, slice(0, 8, 1)),
                         (2, slice(1, 4, 2)), (0, slice(5, 6))):
        k = len(range(steps.start, steps.stop, steps.step or 1))
        X = torch.randn(k, *x0.shape, dtype=x0.dtype, generator=gen)
        for _ in range(2):  # the second call reuses the cached views
            assert _err(fast(level, steps, X), _forward_step(st, 2, level, steps, X)) < 1e-14
    for level in (0, 2):  # the serial sweep against the solver's plain loop
        n = 16 // 2**level
        g = torch.randn(n + 1, *x0.shape, dtype=x0.dtype, generator=gen)
        u1, u2 = torch.zeros_like(g), torch.zeros_like(g)
        fast.serial_solve(level, u1, g)
        _serial_solve(partial(_forward_step, st, 2), u2, g, level)
        assert _err(u1, u2) < 1e-14


@pytest.mark.parametrize("relax", ["F", "FCF"])
@pytest.mark.parametrize("levels", [2, 3])
def test_skipping_the_repeated_f_relaxation_changes_nothing(relax, levels):
    from parlearn.serial_chain.multigrid.solver import _cycle

    st, x0 = _setup(N=32)
    res = mg.mgrit_forward(st, x0, cfactor=2, levels=levels, iters=3, relax=relax,
                           record=False)
    g = torch.zeros(33, *x0.shape, dtype=x0.dtype)
    g[0] = x0
    u = g[:1].expand_as(g).clone()
    with torch.no_grad():
        for _ in range(3):  # every cycle with its first F-relaxation
            _cycle(partial(mg.layer_parallel._forward_step, st, 2), u, g, 0, levels, 2,
                   relax, True)
    assert _err(res.states, u) < 1e-14


def test_multilevel_v_cycle_converges_to_serial(any_device):
    st, x0 = _setup(N=32, device=any_device)
    ref = st.serial(x0)
    res = mg.mgrit_forward(st, x0, cfactor=2, levels=4, tol=1e-13)
    assert res.converged and _err(res.states, ref) < 1e-12
    assert res.iterations <= 8


def test_smooth_weights_converge_fast_and_failure_case_does_not():
    st, x0 = _setup(N=64, width=8)
    x0 = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    good = mg.mgrit_forward(st, x0, cfactor=4, iters=4)
    r = good.residuals
    assert all(r[i + 1] <= r[i] / 10 for i in range(len(r) - 1))
    bad_stack, _ = _setup(N=64, width=8, smooth=0.0, h=1.0)
    bad = mg.mgrit_forward(bad_stack, x0, cfactor=4, iters=6)
    assert bad.residuals[-1] > 0.1 * bad.residuals[0]  # no useful convergence


@pytest.mark.parametrize("levels", [2, 3])
def test_smooth_adjoint_converges_fast_like_the_forward(levels):
    # exactness alone does not see a wrong coarse step; convergence speed does
    st, _ = _setup(N=64, width=8)
    x0 = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    states = st.serial(x0).detach()
    lam = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for res in (mg.mgrit_forward(st, x0, cfactor=4, levels=levels, iters=3),
                mg.mgrit_adjoint(st, states, lam, cfactor=4, levels=levels, iters=3)):
        r = res.residuals  # over 1e5 smaller after 3 iterations here; a wrong coarse step: ~400
        assert r[3] <= 1e-4 * r[0] and all(r[i + 1] < r[i] for i in range(3)), r


@pytest.mark.parametrize("conv", [False, True])  # hand-batched and vmap VJPs
def test_parameter_and_input_grads_equal_the_serial_baseline(conv, any_device):
    st, x0 = _setup(N=16, conv=conv, device=any_device)
    net = mg.SerialResNet(st)
    x = x0.clone().requires_grad_(True)
    (net(x) ** 3).sum().backward()
    ref = net.stacked("grads")
    lp = mg.LayerParallelResNet(st, cfactor=4, fwd_iters=None, fwd_tol=1e-13,
                                bwd_iters=None, bwd_tol=1e-13, warm_start=False)
    x2 = x0.clone().requires_grad_(True)
    (lp(x2) ** 3).sum().backward()
    assert lp.last_forward.converged and lp.last_backward.converged
    for k, p in st.params.items():
        assert _err(p.grad, ref[k]) < 1e-10
    assert _err(x2.grad, x.grad) < 1e-10


def test_backward_accumulates_into_a_callers_grad_like_autograd():
    st, x0 = _setup()
    lp = mg.LayerParallelResNet(st, cfactor=4, levels=1, fwd_iters=1, bwd_iters=1)
    lp(x0).sum().backward()
    once = {k: p.grad.clone() for k, p in st.params.items()}
    lp(x0).sum().backward()
    for k, p in st.params.items():
        assert _err(p.grad, 2 * once[k]) < 1e-13


@pytest.mark.parametrize("levels,kw", [
    (1, {"fwd_iters": 1, "bwd_iters": 1}),
    (2, {"fwd_iters": None, "fwd_tol": 1e-13, "bwd_iters": None, "bwd_tol": 1e-13}),
    (2, {"fwd_iters": 4, "bwd_iters": 4, "relax": "F"}),  # = exact_iterations(16, 4, 2, "F")
])
def test_warm_start_never_returns_stale_output(levels, kw, any_device):
    st, x0 = _setup(device=any_device)
    net = mg.SerialResNet(st)
    lp = mg.LayerParallelResNet(st, cfactor=4, levels=levels, warm_start=True, **kw)
    x1 = x0 + 1.0
    first = lp(x0)
    assert _err(first, net(x0)) < 1e-12
    for x in (x1, x0 * -2.0):  # new inputs of the same shape: the warm start is used
        out = lp(x)
        assert _err(out, net(x)) < 1e-12
        assert _err(out, first) > 1e-3
    # backward uses this input's states: gradients equal the baseline's for x
    st.zero_grad(set_to_none=True)
    xg = x1.clone().requires_grad_(True)
    lp(xg).square().sum().backward()
    xs = x1.clone().requires_grad_(True)
    net(xs).square().sum().backward()
    assert _err(xg.grad, xs.grad) < 1e-10
    for k, v in net.stacked("grads").items():
        assert _err(st.params[k].grad, v) < 1e-10


def test_warm_start_is_kept_per_input_shape():
    st, x0 = _setup()
    lp = mg.LayerParallelResNet(st, cfactor=4, fwd_iters=1, bwd_iters=1, warm_start=True)
    for _ in range(3):
        lp(x0)
    warm = lp.last_forward
    lp(torch.zeros(5, 4, dtype=torch.float64))  # another batch shape must not evict it
    lp(x0)
    assert lp.last_forward.residuals[0] <= warm.residuals[-1] * 1.0001
    lp.reset_warm_start()
    lp(x0)
    assert lp.last_forward.residuals[0] > 10 * warm.residuals[-1]


def test_inexact_gradients_are_close_and_improve():
    st, x0 = _setup(N=32)
    net = mg.SerialResNet(st)
    (net(x0) ** 2).sum().backward()
    ref = net.stacked("grads")["W"]
    errs = []
    for it in (1, 2, 3):
        st.zero_grad(set_to_none=True)
        lp = mg.LayerParallelResNet(st, cfactor=4, fwd_iters=it, bwd_iters=it, warm_start=False)
        (lp(x0) ** 2).sum().backward()
        errs.append(((st.params["W"].grad - ref).norm() / ref.norm()).item())
    assert errs[0] < 0.1 and errs[2] < errs[0]


def _train(block, x0, steps=30):
    head = torch.nn.Linear(4, 2).double()
    with torch.no_grad():
        head.weight.copy_(torch.linspace(-1, 1, 8, dtype=torch.float64).view(2, 4))
        head.bias.zero_()
    opt = torch.optim.SGD([*block.parameters(), *head.parameters()], lr=0.5)
    y = torch.tensor([0, 1, 0])
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(block(x0)), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_trains_like_serial_inside_a_model_with_warm_start():
    st_serial, x0 = _setup(N=16)
    st_lp, _ = _setup(N=16)
    serial = _train(mg.SerialResNet(st_serial), x0)
    lp = mg.LayerParallelResNet(st_lp, cfactor=4, fwd_iters=1, bwd_iters=1, warm_start=True)
    parallel = _train(lp, x0)
    assert serial[-1] < 0.3 * serial[0]
    assert abs(parallel[-1] - serial[-1]) < 0.05 * serial[0]
    assert lp.last_forward.residuals[0] < 1e-2  # warm start: already nearly solved


# --- stopping ---------------------------------------------------------------------------


def test_tol_zero_without_record_runs_and_reports():
    st, x0 = _setup()
    with pytest.warns(mg.ConvergenceWarning, match="did not reach tol=0"):
        res = mg.mgrit_forward(st, x0, cfactor=4, tol=0.0, record=False)
    assert res.converged is False and res.tol == 0.0
    assert res.iterations == mg.exact_iterations(16, 4, 2, "FCF")
    assert _err(res.states, st.serial(x0)) < 1e-13  # exact up to round-off nonetheless


def test_unreached_tolerance_is_flagged_and_reached_one_is_not():
    st, x0 = _setup(N=64, smooth=0.0, h=1.0)
    with pytest.warns(mg.ConvergenceWarning):
        res = mg.mgrit_forward(st, x0, cfactor=4, iters=3, tol=1e-10)
    assert res.converged is False and res.iterations == 3 and res.residuals[-1] > 1e-10
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ok = mg.mgrit_forward(st, x0, cfactor=4, tol=1e-8)
        plain = mg.mgrit_forward(st, x0, cfactor=4, iters=3)
    assert ok.converged is True and ok.residuals[-1] <= 1e-8
    assert plain.converged is None


def test_record_false_skips_residuals_but_counts_iterations():
    st, x0 = _setup(N=16)
    a = mg.mgrit_forward(st, x0, cfactor=4, iters=3, record=False)
    b = mg.mgrit_forward(st, x0, cfactor=4, iters=3)
    assert a.iterations == b.iterations == 3 and a.residuals == [] and len(b.residuals) == 4
    assert _err(a.states, b.states) == 0


# --- cost model: counts what the step function sees ---------------------------------------


def _counted(st, m):
    calls = []
    base = partial(mg._forward_step, st, m)

    def step(level, steps, X):
        calls.append(X.shape[0])
        return base(level, steps, X)
    return step, calls


@pytest.mark.parametrize("N,m,levels,iters,relax", [
    (64, 4, 2, 2, "F"), (64, 4, 2, 2, "FCF"), (64, 2, 4, 3, "FCF"), (48, 4, 2, 1, "F"),
    (54, 3, 3, 2, "F"), (16, 4, 1, 2, "FCF"), (32, 8, 2, 3, "FCF"),
])
@pytest.mark.parametrize("record", [False, True])
def test_cost_model_counts_every_step_call(N, m, levels, iters, relax, record):
    st, x0 = _setup(N=N)
    g = torch.zeros(N + 1, *x0.shape, dtype=x0.dtype)
    g[0] = x0
    step, calls = _counted(st, m)
    mg.mgrit(step, g, cfactor=m, levels=levels, iters=iters, relax=relax, record=record)
    for P in (None, 1, 3):
        c = mg.cost_model(N, m, levels, iters, relax=relax, record=record, devices=P)
        assert c["mgrit_work"] == sum(calls)
        want = len(calls) if P is None else sum(math.ceil(k / P) for k in calls)
        assert c["mgrit_depth"] == want


def test_cost_model_matches_a_counter_on_the_stack_and_the_issue_example(monkeypatch):
    st, x0 = _setup(N=64)
    seen = []
    from parlearn.serial_chain.multigrid.layer_parallel import _ForwardSteps as steps
    call, serial = steps.__call__, steps.serial_solve

    def counting(self, level, idx, X):
        seen.append(X.shape[0])
        return call(self, level, idx, X)

    def counting_serial(self, level, u, g):
        seen.extend([1] * (u.shape[0] - 1))  # the coarsest level's sweep: n calls of one
        return serial(self, level, u, g)
    monkeypatch.setattr(steps, "__call__", counting)
    monkeypatch.setattr(steps, "serial_solve", counting_serial)
    mg.mgrit_forward(st, x0, cfactor=4, iters=2, relax="F", record=False)
    # the issue's example counted 288 = 2 x 144; the second iteration now skips its first
    # F-relaxation (3 calls of 16 steps), which recomputed the first iteration's last one
    assert sum(seen) == 288 - 48 == mg.cost_model(64, 4, 2, 2, relax="F")["mgrit_work"]
    seen.clear()
    lp = mg.LayerParallelResNet(st, cfactor=4, fwd_iters=2, bwd_iters=3, relax="F",
                                warm_start=False, record=False)
    lp(x0).sum().backward()
    fwd_bwd = mg.cost_model(64, 4, 2, 2, relax="F", bwd_iters=3)
    # the adjoint's steps go through batched VJPs, not the forward's steps: count these
    assert sum(seen) == mg.cost_model(64, 4, 2, 2, relax="F")["mgrit_work"]
    bwd = mg.cost_model(64, 4, 2, 3, relax="F")
    assert fwd_bwd["mgrit_work"] == 240 + bwd["mgrit_work"] + 64
    assert fwd_bwd["serial_depth"] == 128


def test_calibrated_cost_model_sums_each_calls_time():
    st, x0 = _setup(N=64)
    g = torch.zeros(65, *x0.shape, dtype=x0.dtype)
    g[0] = x0
    for m, levels, iters in ((4, 3, 2), (2, 4, 3), (8, 2, 1)):
        step, calls = _counted(st, m)
        mg.mgrit(step, g, cfactor=m, levels=levels, iters=iters, record=False)
        t = {k: 1e-6 * (3 + k) + 1e-7 * k * k for k in set(calls)}
        c = mg.cost_model(64, m, levels, iters, call_time=t.__getitem__)
        assert c["mgrit_seconds"] == pytest.approx(sum(t[k] for k in calls), rel=1e-12)
        assert c["serial_seconds"] == pytest.approx(64 * t[1], rel=1e-12)
        cal = mg.calibrate(st, x0, cfactor=m, levels=levels, repeat=1)
        assert set(cal) == set(calls) | {64} and all(v > 0 for v in cal.values())
    with pytest.raises(ValueError, match="call_time"):
        mg.cost_model(64, 4, 2, 1, bwd_iters=1, call_time=lambda k: 1.0)
    with pytest.raises(ValueError, match="call_time"):
        mg.cost_model(64, 4, 2, 1, call_time=lambda k: -1.0)
    with pytest.raises(TypeError, match="call_time"):
        mg.cost_model(64, 4, 2, 1, call_time=3.0)


def test_cost_model_shape():
    c = mg.cost_model(1024, 8, 2, 2)
    assert c["serial_depth"] == 1024 and c["model_parallel_depth"] == 1024
    assert c["mgrit_depth"] < 1024 and c["mgrit_work"] > 1024
    assert mg.cost_model(1024, 8, 3, 2)["mgrit_depth"] < c["mgrit_depth"]
    one_device = mg.cost_model(1024, 8, 2, 2, devices=1)
    assert one_device["mgrit_depth"] == one_device["mgrit_work"]
    assert mg.cost_model(64, 4, 1, 1)["speedup"] == 1.0


# --- training ---------------------------------------------------------------------------


def _data():
    from parlearn.core import datasets

    return datasets.digits(n_train=200, dtype=torch.float64)


def test_train_digits_exact_iterations_follow_serial_step_by_step():
    # 16 layers, m = 4, FCF: exact after 2 iterations, so with iters=2 forward AND
    # backward the parallel trajectory is the serial one to round-off, every step;
    # one backward iteration (or one forward) would leave inexact gradients
    data = _data()
    kw = {"layers": 16, "width": 8, "steps": 10, "cfactor": 4, "iters": 2, "progress": False}
    serial = mg.train_digits(False, data, **kw)
    parallel = mg.train_digits(True, data, **kw)
    assert serial["step"] == parallel["step"] == list(range(1, 11))
    assert serial["loss"][-1] < serial["loss"][0]
    assert all(abs(a - b) < 1e-9 for a, b in zip(serial["loss"], parallel["loss"], strict=True))
    assert parallel["fwd_iterations"] == parallel["bwd_iterations"] == [2] * 10
    assert serial["fwd_iterations"] == []
    inexact = mg.train_digits(True, data, **{**kw, "iters": 1})
    gap = max(abs(a - b) for a, b in zip(serial["loss"], inexact["loss"], strict=True))
    assert 1e-6 < gap < 0.05 * serial["loss"][0]  # inexact, but trains alike
    assert abs(serial["test_acc"][-1] - inexact["test_acc"][-1]) <= 0.03


def test_train_digits_leaves_the_global_rng_alone_and_is_seeded():
    data = _data()
    kw = {"layers": 4, "width": 8, "steps": 3, "cfactor": 2, "progress": False}
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = mg.train_digits(True, data, **kw)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = mg.train_digits(True, data, **kw)
    c = mg.train_digits(True, data, seed=1, **kw)
    d = mg.train_digits(True, data, seed=torch.Generator().manual_seed(1), **kw)
    assert a["loss"] == b["loss"] and c["loss"] == d["loss"] and a["loss"] != c["loss"]
    assert torch.equal(torch.random.get_rng_state(), before)


def test_no_function_touches_the_global_rng():
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    st = mg.random_stack(8, 4, seed=3)
    mg.SerialResNet(st)
    mg.random_stack(8, 4, conv=True, seed=torch.Generator().manual_seed(0))
    assert torch.equal(torch.random.get_rng_state(), before)


# --- bad input: refused before any work, naming the argument ---------------------------

_ST, _X = _setup(N=16)
_S = _ST.serial(_X).detach()


def _step(level, steps, X):
    return X


BAD_CALLS = {
    "mgrit_forward levels=0": (lambda: mg.mgrit_forward(_ST, _X, cfactor=2, levels=0, iters=1),
                               ValueError, "levels"),
    "mgrit_forward levels=1.0": (lambda: mg.mgrit_forward(_ST, _X, cfactor=2, levels=1.0,
                                                          iters=1), TypeError, "levels"),
    "mgrit_forward cfactor=1.5": (lambda: mg.mgrit_forward(_ST, _X, cfactor=1.5, iters=1),
                                  TypeError, "cfactor"),
    "mgrit_forward cfactor=True": (lambda: mg.mgrit_forward(_ST, _X, cfactor=True, iters=1),
                                   TypeError, "cfactor"),
    "mgrit_forward cfactor=1 levels=2": (lambda: mg.mgrit_forward(_ST, _X, cfactor=1, iters=1),
                                         ValueError, "cfactor=1"),
    "mgrit_forward cfactor=0 levels=1": (lambda: mg.mgrit_forward(_ST, _X, cfactor=0, levels=1,
                                                                  iters=1), ValueError, "cfactor"),
    "mgrit_forward cfactor>N": (lambda: mg.mgrit_forward(_ST, _X, cfactor=32, iters=1),
                                ValueError, "exceeds"),
    "mgrit_forward not divisible": (lambda: mg.mgrit_forward(_ST, _X, cfactor=3, iters=1),
                                    ValueError, "divisible"),
    "mgrit_forward too deep": (lambda: mg.mgrit_forward(_ST, _X, cfactor=2, levels=6, iters=1),
                               ValueError, "divisible"),
    "mgrit_forward relax": (lambda: mg.mgrit_forward(_ST, _X, cfactor=2, relax="CF", iters=1),
                            ValueError, "relax"),
    "mgrit_forward no stop": (lambda: mg.mgrit_forward(_ST, _X, cfactor=2), ValueError, "iters"),
    "mgrit_forward iters=-1": (lambda: mg.mgrit_forward(_ST, _X, cfactor=2, iters=-1),
                               ValueError, "iters"),
    "mgrit_forward iters=2.0": (lambda: mg.mgrit_forward(_ST, _X, cfactor=2, iters=2.0),
                                TypeError, "iters"),
    "mgrit_forward tol=-1": (lambda: mg.mgrit_forward(_ST, _X, cfactor=2, tol=-1.0),
                             ValueError, "tol"),
    "mgrit_forward tol=nan": (lambda: mg.mgrit_forward(_ST, _X, cfactor=2, tol=math.nan),
                              ValueError, "tol"),
    "mgrit_forward levels=1 tol=-1": (lambda: mg.mgrit_forward(_ST, _X, cfactor=1, levels=1,
                                                               tol=-1.0), ValueError, "tol"),
    "mgrit_forward levels=1 relax": (lambda: mg.mgrit_forward(_ST, _X, cfactor=1, levels=1,
                                                              iters=1, relax="X"),
                                     ValueError, "relax"),
    "mgrit_forward x0 width": (lambda: mg.mgrit_forward(_ST, torch.zeros(3, 5, dtype=torch.float64),
                                                        cfactor=2, iters=1), ValueError, "x0"),
    "mgrit_forward x0 float32": (lambda: mg.mgrit_forward(_ST, _X.float(), cfactor=2, iters=1),
                                 TypeError, "x0"),
    "mgrit_forward x0 int": (lambda: mg.mgrit_forward(_ST, torch.zeros(3, 4, dtype=torch.long),
                                                      cfactor=2, iters=1), TypeError, "x0"),
    "mgrit_forward x0 list": (lambda: mg.mgrit_forward(_ST, [[0.0] * 4], cfactor=2, iters=1),
                              TypeError, "x0"),
    "mgrit_forward stack": (lambda: mg.mgrit_forward(torch.nn.Linear(4, 4), _X, cfactor=2,
                                                     iters=1), TypeError, "stack"),
    "mgrit_forward warm_start": (lambda: mg.mgrit_forward(_ST, _X, cfactor=2, iters=1,
                                                          warm_start=torch.zeros(3, 3)),
                                 ValueError, "warm_start"),
    "mgrit_forward batched=1": (lambda: mg.mgrit_forward(_ST, _X, cfactor=2, iters=1, batched=1),
                                TypeError, "batched"),
    "mgrit_forward record=None": (lambda: mg.mgrit_forward(_ST, _X, cfactor=2, iters=1,
                                                           record=None), TypeError, "record"),
    "mgrit step": (lambda: mg.mgrit(3, torch.zeros(5, 2), cfactor=2, iters=1), TypeError, "step"),
    "mgrit g 1-d": (lambda: mg.mgrit(_step, torch.zeros(5), cfactor=2, iters=1), ValueError, "g"),
    "mgrit g int": (lambda: mg.mgrit(_step, torch.zeros(5, 2, dtype=torch.long), cfactor=2,
                                     iters=1), TypeError, "g"),
    "residual shapes": (lambda: mg.residual(_step, torch.zeros(5, 2), torch.zeros(4, 2)),
                        ValueError, "g"),
    "residual level": (lambda: mg.residual(_step, torch.zeros(5, 2), torch.zeros(5, 2), -1),
                       ValueError, "level"),
    "exact_iterations relax": (lambda: mg.exact_iterations(16, 4, 2, "C"), ValueError, "relax"),
    "exact_iterations n": (lambda: mg.exact_iterations(0, 4), ValueError, "n_layers"),
    "mgrit_adjoint lam_out shape": (lambda: mg.mgrit_adjoint(_ST, _S, torch.zeros(3, 5,
                                                             dtype=torch.float64), cfactor=2,
                                                             iters=1), ValueError, "lam_out"),
    "mgrit_adjoint states shape": (lambda: mg.mgrit_adjoint(_ST, _S[:-1], _X, cfactor=2,
                                                            iters=1), ValueError, "states"),
    "mgrit_adjoint iters": (lambda: mg.mgrit_adjoint(_ST, _S, _X, cfactor=2, iters=None),
                            ValueError, "iters"),
    "serial_adjoint lam_out": (lambda: mg.serial_adjoint(_ST, _S, _X[:2]), ValueError, "lam_out"),
    "serial_adjoint lam_out dtype": (lambda: mg.serial_adjoint(_ST, _S, _X.float()),
                                     ValueError, "lam_out"),
    "parameter_grads lams": (lambda: mg.parameter_grads(_ST, _S, _S[:, :2]), ValueError, "lams"),
    "LayerParallelResNet stack": (lambda: mg.LayerParallelResNet("stack"), TypeError, "stack"),
    "LayerParallelResNet fwd_iters=0": (lambda: mg.LayerParallelResNet(_ST, fwd_iters=0),
                                        ValueError, "fwd_iters"),
    "LayerParallelResNet bwd_tol=inf": (lambda: mg.LayerParallelResNet(_ST, bwd_tol=math.inf),
                                        ValueError, "bwd_tol"),
    "LayerParallelResNet both None": (lambda: mg.LayerParallelResNet(_ST, fwd_iters=None),
                                      ValueError, "fwd_iters"),
    "LayerParallelResNet warm_start": (lambda: mg.LayerParallelResNet(_ST, warm_start="yes"),
                                       TypeError, "warm_start"),
    "LayerParallelResNet relax": (lambda: mg.LayerParallelResNet(_ST, relax="FF"),
                                  ValueError, "relax"),
    "LayerParallelResNet cfactor": (lambda: mg.LayerParallelResNet(_ST, cfactor=5),
                                    ValueError, "divisible"),
    "LayerParallelResNet input": (lambda: mg.LayerParallelResNet(_ST)(torch.zeros(3, 7,
                                                                     dtype=torch.float64)),
                                  ValueError, "x0"),
    "SerialResNet stack": (lambda: mg.SerialResNet(torch.nn.Linear(2, 2)), TypeError, "stack"),
    "SerialResNet stacked": (lambda: mg.SerialResNet(_ST).stacked("grad"), ValueError, "what"),
    "ResidualStack sizes": (lambda: mg.ResidualStack({"W": torch.zeros(4, 2, 2),
                                                      "b": torch.zeros(3, 2)}, h=0.1),
                            ValueError, "same leading size"),
    "ResidualStack h=0": (lambda: mg.ResidualStack({"W": torch.zeros(4, 2, 2),
                                                    "b": torch.zeros(4, 2)}, h=0.0),
                          ValueError, "h must"),
    "ResidualStack h=inf": (lambda: mg.ResidualStack({"W": torch.zeros(4, 2, 2),
                                                      "b": torch.zeros(4, 2)}, h=math.inf),
                            ValueError, "h must"),
    "ResidualStack W not square": (lambda: mg.ResidualStack({"W": torch.zeros(4, 2, 3),
                                                             "b": torch.zeros(4, 2)}, h=0.1),
                                   ValueError, "params\\['W'\\]"),
    "ResidualStack b width": (lambda: mg.ResidualStack({"W": torch.zeros(4, 2, 2),
                                                        "b": torch.zeros(4, 3)}, h=0.1),
                              ValueError, "params\\['b'\\]"),
    "ResidualStack int params": (lambda: mg.ResidualStack({"W": torch.zeros(4, 2, 2,
                                                                            dtype=torch.long)},
                                                          h=0.1, fn=lambda x, p: x),
                                 TypeError, "params"),
    "ResidualStack empty": (lambda: mg.ResidualStack({}, h=0.1), ValueError, "params"),
    "ResidualStack fn": (lambda: mg.ResidualStack({"W": torch.zeros(4, 2, 2)}, h=0.1, fn=3),
                         TypeError, "fn"),
    "random_stack smoothness": (lambda: mg.random_stack(8, 4, smoothness=1.5), ValueError,
                                "smoothness"),
    "random_stack n_layers": (lambda: mg.random_stack(0, 4), ValueError, "n_layers"),
    "random_stack width float": (lambda: mg.random_stack(8, 4.5), TypeError, "width"),
    "random_stack h": (lambda: mg.random_stack(8, 4, h=-1.0), ValueError, "h"),
    "random_stack scale": (lambda: mg.random_stack(8, 4, scale=0.0), ValueError, "scale"),
    "random_stack kernel even": (lambda: mg.random_stack(8, 4, conv=True, kernel=2), ValueError,
                                 "kernel"),
    "random_stack dtype": (lambda: mg.random_stack(8, 4, dtype=torch.int64), TypeError, "dtype"),
    "random_stack seed": (lambda: mg.random_stack(8, 4, seed=-1), ValueError, "seed"),
    "random_stack conv=1": (lambda: mg.random_stack(8, 4, conv=1), TypeError, "conv"),
    "cost_model N float": (lambda: mg.cost_model(4.5, 2, 2, 1), TypeError, "N"),
    "cost_model iters=0": (lambda: mg.cost_model(16, 4, 2, 0), ValueError, "iters"),
    "cost_model devices=0": (lambda: mg.cost_model(16, 4, 2, 1, devices=0), ValueError,
                             "devices"),
    "cost_model devices=-2": (lambda: mg.cost_model(16, 4, 2, 1, devices=-2), ValueError,
                              "devices"),
    "cost_model relax": (lambda: mg.cost_model(16, 4, 2, 1, relax="FCFCF"), ValueError, "relax"),
    "cost_model cfactor=1": (lambda: mg.cost_model(16, 1, 2, 1), ValueError, "cfactor"),
    "cost_model record": (lambda: mg.cost_model(16, 4, 2, 1, record="no"), TypeError, "record"),
    "cost_model bwd_iters": (lambda: mg.cost_model(16, 4, 2, 1, bwd_iters=0), ValueError,
                             "bwd_iters"),
    "train_digits parallel": (lambda: mg.train_digits(1, None), TypeError, "parallel"),
    "train_digits data": (lambda: mg.train_digits(True, None), TypeError, "data"),
    "bench device": (lambda: mg.bench("cpu", True), TypeError, "device"),
    "bench quick": (lambda: mg.bench(torch.device("cpu"), 1), TypeError, "quick"),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_calls_are_refused_clearly(name):
    call, exc, match = BAD_CALLS[name]
    with pytest.raises(exc, match=match):
        call()


def test_bad_train_digits_arguments_do_no_work():
    data = _data()
    for kw, exc, match in (({"layers": 0}, ValueError, "layers"), ({"lr": math.nan}, ValueError,
                           "lr"), ({"steps": 0}, ValueError, "steps"),
                           ({"layers": 10, "cfactor": 4}, ValueError, "divisible"),
                           ({"iters": 0}, ValueError, "iters"), ({"seed": 1.5}, TypeError, "seed"),
                           ({"relax": "C"}, ValueError, "relax")):
        with pytest.raises(exc, match=match):
            mg.train_digits(True, data, progress=False, **kw)


def test_bench_row_flags_a_speedup_above_the_modeled_limit():
    from parlearn.core.timing import Comparison, Timing

    def cmp(serial_s, mgrit_s):
        return Comparison({"serial": Timing((serial_s,) * 3, "cpu", 1),
                           "mgrit": Timing((mgrit_s,) * 3, "cpu", 1)}, "serial", "cpu")
    above = mg._ratio_row("b", "serial", "mgrit", cmp(3.0, 1.0), 2.0, "cpu", "x")
    below = mg._ratio_row("b", "serial", "mgrit", cmp(1.0, 1.0), 2.0, "cpu", "x")
    assert above.ratio == 3.0 and "ABOVE THE MODELED LIMIT" in above.detail
    assert "ABOVE" not in below.detail and "modeled limit 2.0x" in below.detail
