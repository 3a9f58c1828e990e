import math

import pytest
import torch

from parlearn import multigrid as mg


def _setup(N=16, width=4, smooth=1.0, h=None, conv=False, seed=0):
    st = mg.random_stack(N, width, smoothness=smooth, h=h, conv=conv, seed=seed)
    shape = (3, 2, 4, 4) if conv else (3, width)
    x0 = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return st, x0


def _err(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("conv", [False, True])
def test_serial_cases_equal_serial_forward(conv):
    st, x0 = _setup(conv=conv)
    ref = st.serial(x0)
    assert _err(mg.mgrit_forward(st, x0, cfactor=1, iters=1).states, ref) < 1e-13
    assert _err(mg.mgrit_forward(st, x0, cfactor=4, levels=1, iters=1).states, ref) < 1e-13


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("relax", ["F", "FCF"])
@pytest.mark.parametrize("conv", [False, True])
def test_exact_after_predicted_iterations_not_before(m, relax, conv):
    # the hard case (h = 1, independent weights) converges slowly, so exactness can
    # only come from the finite-step property, which guards the indexing
    st, x0 = _setup(smooth=0.0, h=1.0, conv=conv)
    ref = st.serial(x0)
    nc = st.n_layers // m
    k = nc if relax == "F" else math.ceil(nc / 2)
    exact = mg.mgrit_forward(st, x0, cfactor=m, iters=k, relax=relax)
    before = mg.mgrit_forward(st, x0, cfactor=m, iters=k - 1, relax=relax)
    assert _err(exact.states, ref) < 1e-12
    assert _err(before.states, ref) > 1e-6


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("relax", ["F", "FCF"])
def test_adjoint_exact_after_predicted_iterations(m, relax):
    st, x0 = _setup(smooth=0.0, h=1.0)
    states = st.serial(x0).detach()
    lam_out = torch.randn_like(x0)
    ref = mg.serial_adjoint(st, states, lam_out)
    nc = st.n_layers // m
    k = nc if relax == "F" else math.ceil(nc / 2)
    exact = mg.mgrit_adjoint(st, states, lam_out, cfactor=m, iters=k, relax=relax)
    before = mg.mgrit_adjoint(st, states, lam_out, cfactor=m, iters=k - 1, relax=relax)
    assert _err(exact.states, ref) < 1e-12 * max(1.0, ref.abs().max().item())
    assert _err(before.states, ref) > 1e-6


@pytest.mark.parametrize("relax", ["F", "FCF"])
def test_batched_relaxation_equals_looped(relax):
    st, x0 = _setup(N=12)
    a = mg.mgrit_forward(st, x0, cfactor=3, iters=2, relax=relax, batched=True)
    b = mg.mgrit_forward(st, x0, cfactor=3, iters=2, relax=relax, batched=False)
    assert _err(a.states, b.states) < 1e-14


def test_multilevel_v_cycle_converges_to_serial():
    st, x0 = _setup(N=32)
    ref = st.serial(x0)
    res = mg.mgrit_forward(st, x0, cfactor=2, levels=4, tol=1e-13)
    assert _err(res.states, ref) < 1e-12
    assert res.iterations <= 8


def test_smooth_weights_converge_fast_and_failure_case_does_not():
    st, x0 = _setup(N=64, width=8)
    good = mg.mgrit_forward(st, x0, cfactor=4, iters=4)
    r = good.residuals
    assert all(r[i + 1] <= r[i] / 10 for i in range(len(r) - 1))
    bad_stack, _ = _setup(N=64, width=8, smooth=0.0, h=1.0)
    bad = mg.mgrit_forward(bad_stack, x0, cfactor=4, iters=6)
    assert bad.residuals[-1] > 0.1 * bad.residuals[0]  # no useful convergence


@pytest.mark.parametrize("conv", [False, True])  # hand-batched and vmap VJPs
def test_parameter_and_input_grads_equal_autograd(conv):
    st, x0 = _setup(N=16, conv=conv)
    x = x0.clone().requires_grad_(True)
    (st.serial(x)[-1] ** 3).sum().backward()
    ref = {k: p.grad.clone() for k, p in st.params.items()}
    ref_x = x.grad.clone()
    st.zero_grad(set_to_none=True)
    lp = mg.LayerParallelResNet(st, cfactor=4, fwd_iters=None, fwd_tol=1e-13,
                                bwd_iters=None, bwd_tol=1e-13, warm_start=False)
    x2 = x0.clone().requires_grad_(True)
    (lp(x2) ** 3).sum().backward()
    for k, p in st.params.items():
        assert _err(p.grad, ref[k]) < 1e-10
    assert _err(x2.grad, ref_x) < 1e-10


def test_inexact_gradients_are_close_and_improve():
    st, x0 = _setup(N=32)
    st.zero_grad(set_to_none=True)
    (st.serial(x0)[-1] ** 2).sum().backward()
    ref = st.params["W"].grad.clone()
    errs = []
    for it in (1, 2, 3):
        st.zero_grad(set_to_none=True)
        lp = mg.LayerParallelResNet(st, cfactor=4, fwd_iters=it, bwd_iters=it, warm_start=False)
        (lp(x0) ** 2).sum().backward()
        errs.append(((st.params["W"].grad - ref).norm() / ref.norm()).item())
    assert errs[0] < 0.1 and errs[2] < errs[0]


def _train(block, x0, steps=30):
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 2).double()
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
    serial = _train(lambda_module(st_serial), x0)
    lp = mg.LayerParallelResNet(st_lp, cfactor=4, fwd_iters=1, bwd_iters=1, warm_start=True)
    parallel = _train(lp, x0)
    assert serial[-1] < 0.3 * serial[0]
    assert abs(parallel[-1] - serial[-1]) < 0.05 * serial[0]
    assert lp.last_forward.residuals[0] < 1e-2  # warm start: already nearly solved


def lambda_module(stack):
    class Serial(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = stack

        def forward(self, x):
            return self.stack.serial(x)[-1]

    return Serial()


@pytest.mark.parametrize("kw,match", [
    ({"cfactor": 1.5}, "cfactor"), ({"cfactor": 32}, "exceeds"), ({"cfactor": 3}, "divisible"),
    ({"cfactor": 2, "levels": 6}, "divisible"), ({"cfactor": 2, "relax": "CF"}, "relax"),
    ({"cfactor": 2, "iters": None}, "iters"),
])
def test_bad_settings(kw, match):
    st, x0 = _setup(N=16)
    kw.setdefault("iters", 1)
    with pytest.raises(ValueError, match=match):
        mg.mgrit_forward(st, x0, **kw)


def test_bad_stack_and_shapes():
    with pytest.raises(ValueError, match="same leading size"):
        mg.ResidualStack({"W": torch.zeros(4, 2, 2), "b": torch.zeros(3, 2)}, h=0.1)
    with pytest.raises(ValueError, match="h must be"):
        mg.ResidualStack({"W": torch.zeros(4, 2, 2)}, h=0.0)
    st, x0 = _setup(N=16)
    with pytest.raises(ValueError, match="warm_start"):
        mg.mgrit_forward(st, x0, cfactor=2, iters=1, warm_start=torch.zeros(3, 3))


def test_cost_model():
    c = mg.cost_model(1024, 8, 2, 2)
    assert c["serial_depth"] == 1024 and c["model_parallel_depth"] == 1024
    assert c["mgrit_depth"] < 1024 and c["mgrit_work"] > 1024
    assert mg.cost_model(1024, 8, 3, 2)["mgrit_depth"] < c["mgrit_depth"]
    one_device = mg.cost_model(1024, 8, 2, 2, devices=1)
    assert one_device["mgrit_depth"] == one_device["mgrit_work"]
    with pytest.raises(ValueError, match="cfactor"):
        mg.cost_model(16, 1, 2, 1)


def test_record_false_skips_residuals_but_counts_iterations():
    st, x0 = _setup(N=16)
    a = mg.mgrit_forward(st, x0, cfactor=4, iters=3, record=False)
    b = mg.mgrit_forward(st, x0, cfactor=4, iters=3)
    assert a.iterations == b.iterations == 3 and a.residuals == [] and len(b.residuals) == 4
    assert _err(a.states, b.states) == 0


def test_train_digits_serial_and_parallel_agree():
    from parlearn import datasets

    data = datasets.digits(n_train=200, dtype=torch.float64)
    kw = {"layers": 8, "width": 16, "steps": 12, "progress": False}
    serial = mg.train_digits(False, data, **kw)
    parallel = mg.train_digits(True, data, **kw)
    assert serial["step"] == parallel["step"] and serial["step"][-1] == 12
    assert serial["loss"][-1] < serial["loss"][0]
    assert abs(serial["loss"][-1] - parallel["loss"][-1]) < 0.05 * serial["loss"][0]
    assert abs(serial["test_acc"][-1] - parallel["test_acc"][-1]) <= 0.02
