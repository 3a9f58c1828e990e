"""Tests of parlearn.duality: SVT against its closed form and its optimality, the variational
form of the nuclear norm, gradient descent reaching the convex optimum, the K-branch objective
against its definition, and the batched branches against the loop over branches."""

import pytest
import torch

from parlearn.serial_chain import duality as du

SPECTRUM = [3.0, 2.0, 1.2, 0.3, 0.1]
LAM = 0.6   # thresholds the last two singular values: svt(M) has rank 3


@pytest.fixture
def m():
    return du.make_target(SPECTRUM, 6, 5, seed=0)


# --- the convex problem --------------------------------------------------------------------

def test_svt_value_is_the_hand_computed_closed_form():
    # M = diag(3, 2, 0.5), lam = 1: W* = diag(2, 1, 0); the value is
    # (1/2)(1 + 1 + 0.25) + 1 * (2 + 1) = 4.125 (fit term + lam * nuclear norm)
    m = torch.diag(torch.tensor([3.0, 2.0, 0.5], dtype=torch.float64))
    assert torch.allclose(du.svt(m, 1.0), torch.diag(torch.tensor([2.0, 1.0, 0.0],
                                                                  dtype=torch.float64)))
    assert du.svt_value(m, 1.0) == pytest.approx(4.125, abs=1e-14)


def test_svt_attains_its_closed_form_value(m):
    w = du.svt(m, LAM)
    assert du.convex_objective(w, m, LAM) == pytest.approx(du.svt_value(m, LAM), abs=1e-12)
    assert du.numerical_rank(w) == 3


def test_nothing_beats_svt(m):
    """Convexity: no perturbation of the SVT point, small or large, lowers the objective."""
    best = du.svt_value(m, LAM)
    g = torch.Generator().manual_seed(1)
    w = du.svt(m, LAM)
    for scale in (1e-4, 1e-2, 1.0):
        for _ in range(20):
            d = torch.randn(w.shape, generator=g, dtype=w.dtype) * scale
            assert du.convex_objective(w + d, m, LAM) >= best - 1e-12


def test_svt_subgradient_certificate(m):
    """Optimality condition: M - W* = lam (U_r V_r^T + Z), Z orthogonal to W*'s singular
    spaces with spectral norm <= 1."""
    w = du.svt(m, LAM)
    u, s, vh = torch.linalg.svd(w)
    r = du.numerical_rank(w)
    z = (m - w) / LAM - u[:, :r] @ vh[:r]
    assert torch.linalg.matrix_norm(z, ord=2) <= 1 + 1e-12
    assert (u[:, :r].T @ z).abs().max() < 1e-12 and (z @ vh[:r].T).abs().max() < 1e-12


# --- factorisations ------------------------------------------------------------------------

def test_nuclear_norm_is_the_least_two_factor_weight_decay(m):
    w = du.svt(m, LAM)
    u, v = du.balanced_factors(w, 2)
    assert torch.allclose(u @ v, w, atol=1e-13)
    assert 0.5 * (u.pow(2).sum() + v.pow(2).sum()) == pytest.approx(du.nuclear_norm(w), abs=1e-12)
    g = torch.Generator().manual_seed(2)
    for _ in range(20):   # any other factorisation U G, G^-1 V costs at least as much
        a = torch.randn(u.shape[1], u.shape[1], generator=g, dtype=w.dtype)
        u2, v2 = u @ a, torch.linalg.solve(a, v)
        assert 0.5 * (u2.pow(2).sum() + v2.pow(2).sum()) >= du.nuclear_norm(w) - 1e-10


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_standard_min_norm_closed_form(m, depth):
    w = du.svt(m, LAM)
    fs = du.balanced_factors(w, depth)
    prod = fs[0]
    for f in fs[1:]:
        prod = prod @ f
    assert torch.allclose(prod, w, atol=1e-12)
    assert 0.5 * sum(float(f.pow(2).sum()) for f in fs) == pytest.approx(
        du.standard_min_norm(w, depth), abs=1e-12)
    assert du.standard_dual(w, depth) <= du.standard_min_norm(w, depth) + 1e-12


def test_standard_gap_is_zero_at_two_layers_or_rank_one_and_positive_otherwise(m):
    w = du.svt(m, LAM)
    assert du.standard_dual(w, 2) == pytest.approx(du.standard_min_norm(w, 2), abs=1e-12)
    one = du.make_target([2.0], 4, 3, seed=0)
    assert du.standard_dual(one, 3) == pytest.approx(du.standard_min_norm(one, 3), abs=1e-12)
    # rank 3, depth 3: sum s^(2/3) > (sum s)^(2/3), so a strict gap
    assert du.standard_min_norm(w, 3) - du.standard_dual(w, 3) > 0.5


# --- the K-branch network ------------------------------------------------------------------

def _by_definition(ws, m, lam, reg):
    """The objective written out with loops: every branch's product, every layer's norm."""
    depth, k = len(ws), ws[0].shape[0]
    out, r = torch.zeros_like(m), 0.0
    for b in range(k):
        prod = torch.eye(m.shape[0], dtype=m.dtype)
        for layer in range(depth):
            prod = prod @ ws[layer][b]
            fro = float(torch.sqrt((ws[layer][b] ** 2).sum()))
            r += 0.5 * fro**2 if reg == "weight_decay" else fro**depth / depth
        out = out + prod
    return 0.5 * float(((out - m) ** 2).sum()) + lam * r


@pytest.mark.parametrize("reg", du.REGULARISERS)
@pytest.mark.parametrize("depth,branches", [(2, 1), (3, 4), (4, 2)])
def test_objective_equals_its_definition(m, reg, depth, branches):
    ws = du.init_branches(6, 5, depth=depth, branches=branches, width=3, scale=1.3, seed=4)
    got = float(du.objective(ws, m, LAM, reg))
    assert got == pytest.approx(_by_definition(ws, m, LAM, reg), rel=1e-13)


def test_the_two_regularisers_agree_at_depth_two(m):
    ws = du.init_branches(6, 5, depth=2, branches=3, width=2, scale=1.0, seed=5)
    assert float(du.regulariser(ws, "parallel")) == pytest.approx(
        float(du.regulariser(ws, "weight_decay")), rel=1e-14)
    ws3 = du.init_branches(6, 5, depth=3, branches=3, width=2, scale=1.0, seed=5)
    assert abs(float(du.regulariser(ws3, "parallel") - du.regulariser(ws3, "weight_decay"))) > 1e-3


def test_batched_branches_equal_the_loop(any_device):
    ws = [w.to(any_device) for w in
          du.init_branches(7, 4, depth=4, branches=5, width=3, scale=1.0, seed=6)]
    a, b = du.end_to_end(ws), du.end_to_end_loop(ws)
    assert a.device.type == any_device.type
    assert (a - b).abs().max() < 1e-13 and a.abs().max() > 1e-3


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_rank_one_branches_reach_the_bound(m, depth):
    for k in (1, 2, 3, 5):
        ws = du.rank_one_branches(m, LAM, depth=depth, branches=k, width=2)
        value = float(du.objective(ws, m, LAM, "parallel"))
        assert value == pytest.approx(du.branch_upper_bound(m, LAM, k), abs=1e-12)
    assert du.branch_upper_bound(m, LAM, 3) == pytest.approx(du.svt_value(m, LAM), abs=1e-14)
    assert du.branch_upper_bound(m, LAM, 2) > du.svt_value(m, LAM) + 0.1


# --- gradient descent ----------------------------------------------------------------------

def test_gradient_descent_on_two_factors_reaches_svt(m):
    run = du.train(m, LAM, depth=2, branches=1, reg="weight_decay", steps=1500, lr=0.1, seed=0)
    best = du.svt_value(m, LAM)
    assert -1e-12 <= run.final - best < 1e-4
    assert du.numerical_rank(run.matrix, 1e-4) == du.numerical_rank(du.svt(m, LAM)) == 3
    assert (run.matrix - du.svt(m, LAM)).abs().max() < 1e-3
    assert run.values[0] > best + 1.0   # it did start away from the optimum


def test_parallel_branches_close_the_gap_and_one_branch_does_not(m):
    best = du.svt_value(m, LAM)
    wide = du.train(m, LAM, depth=3, branches=3, steps=1500, lr=0.1, seed=0)
    assert -1e-12 <= wide.final - best < 1e-4
    assert du.numerical_rank(wide.matrix, 1e-4) == 3
    for seed in (0, 1):   # the true gap of K=1 < rank is positive; gradient descent is above it
        one = du.train(m, LAM, depth=3, branches=1, steps=600, lr=0.1, seed=seed)
        assert one.final > best + 0.1


def test_train_is_reproducible_and_leaves_global_state_alone(m):
    state = torch.get_rng_state()
    a = du.train(m, LAM, depth=3, branches=2, steps=20, lr=0.1, seed=3)
    b = du.train(m, LAM, depth=3, branches=2, steps=20, lr=0.1, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a.weights, b.weights, strict=True))
    assert a.steps[-1] == 20 and a.values[-1] == a.final


def test_gap_table_rows(m):
    rows = du.gap_table(m, LAM, depths=[2, 3], branch_counts=[1, 3], seeds=[0], steps=300,
                        lr=0.1)
    assert [(r["depth"], r["branches"]) for r in rows] == [(2, 1), (2, 3), (3, 1), (3, 3)]
    for r in rows:
        assert r["gap"] == pytest.approx(r["trained"] - r["convex"])
        assert r["gap"] >= -1e-12 and r["rank_svt"] == 3
        assert r["drop"] >= -1e-12 and isinstance(r["converged"], bool)


def test_gap_table_flags_a_run_still_falling(m):
    # depth 4 with a fourth, superfluous branch: the extra branch shrinks only slowly, so
    # after 600 steps the objective is still falling and the point is not a converged value
    rows = du.gap_table(m, LAM, depths=[4], branch_counts=[2, 4], seeds=[0], steps=600, lr=0.1)
    stuck, falling = rows
    assert stuck["converged"] and stuck["gap"] > 0.1          # K < r: a real gap, GD stationary
    assert not falling["converged"] and falling["drop"] > 1e-3 * falling["gap"] > 0
    # with no tolerance at all, only a run that does not move at all counts as converged
    strict = du.gap_table(m, LAM, depths=[4], branch_counts=[4], seeds=[0], steps=600, lr=0.1,
                          converged_tol=0.0)
    assert not strict[0]["converged"]
    with pytest.raises(ValueError, match="converged_tol"):
        du.gap_table(m, LAM, depths=[2], branch_counts=[1], seeds=[0], steps=10,
                     converged_tol=-1.0)


# --- bad input -----------------------------------------------------------------------------

def test_bad_input_names_the_argument(m):
    with pytest.raises(ValueError, match="lam"):
        du.svt(m, -1.0)
    with pytest.raises(ValueError, match="depth"):
        du.standard_min_norm(m, 1)
    with pytest.raises(ValueError, match="reg"):
        du.objective(du.init_branches(6, 5, depth=2, branches=1, width=2), m, 0.1, reg="l1")
    with pytest.raises(ValueError, match="m must have shape"):
        du.objective(du.init_branches(6, 4, depth=2, branches=1, width=2), m, 0.1)
    with pytest.raises(ValueError, match="do not chain"):
        du.end_to_end([torch.zeros(2, 3, 4), torch.zeros(3, 4, 5)])
    with pytest.raises(TypeError, match="weights"):
        du.end_to_end(torch.zeros(2, 3, 4))
    with pytest.raises(TypeError, match="branches"):
        du.train(m, 0.1, branches=2.0)
    with pytest.raises(ValueError, match="spectrum"):
        du.make_target([1.0] * 7, 6, 5)
    with pytest.raises(ValueError, match="m must not contain NaN"):
        du.svt_value(torch.full((2, 2), float("nan"), dtype=torch.float64), 0.1)
