"""Tests of parlearn.strads: the serial reference is scikit-learn's coordinate descent, the
scheduled parallel solver reaches its optimum, the dependency filter keeps its promise, and
the gloo ranks compute what one process computes."""

import itertools
import math

import pytest
import torch

from parlearn.core.device import threads
from parlearn.serial_chain import strads as st

ALPHA = 0.1


@pytest.fixture(scope="module")
def problem():
    """A correlated design (4 groups of 25 columns, within-group correlation 0.9) on which
    Shotgun with 8 coordinates a round diverges, and scikit-learn's optimum."""
    x, y, _ = st.correlated_design(400, 100, groups=4, corr=0.9, seed=0)
    w_star, f_star = st.sklearn_lasso(x, y, ALPHA)
    return x, y, w_star, f_star


# --- the serial reference --------------------------------------------------------------

def test_cyclic_rounds_are_sklearn_coordinate_descent(problem):
    x, y, _, _ = problem
    d, epochs = x.shape[1], 5
    ours = st.solve(x, y, ALPHA, workers=1, rounds=epochs * d, schedule="cyclic")
    w_sk, f_sk = st.sklearn_lasso(x, y, ALPHA, max_iter=epochs, tol=0.0)
    assert (ours.w - w_sk).abs().max().item() < 1e-12
    assert ours.objective[-1] == pytest.approx(f_sk, rel=1e-13)
    # After a different number of epochs the iterates differ (the comparison can fail).
    w_more, _ = st.sklearn_lasso(x, y, ALPHA, max_iter=epochs + 1, tol=0.0)
    assert (ours.w - w_more).abs().max().item() > 1e-6


def test_objective_is_sklearns_scaling():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3, generator=g, dtype=torch.float64)
    y, w = torch.randn(7, generator=g, dtype=torch.float64), torch.tensor([0.5, -2.0, 0.0],
                                                                          dtype=torch.float64)
    by_hand = sum((y[i] - x[i] @ w) ** 2 for i in range(7)) / 14 + 0.3 * 2.5
    assert st.objective(x, y, w, 0.3) == pytest.approx(float(by_hand), rel=1e-14)


def test_one_coordinate_update_is_the_exact_coordinate_minimiser(problem):
    x, y, _, _ = problem
    w = torch.linspace(-0.2, 0.3, x.shape[1], dtype=torch.float64)
    n = x.shape[0]
    c = x.square().sum(0) / n
    for j in (0, 7, 55):
        r = y - x @ w
        new = st.round_update(x[:, [j]].T @ r, w[[j]], c[[j]], n, ALPHA)
        best = w.clone()
        best[j] = new[0]
        f_best = st.objective(x, y, best, ALPHA)
        for step in (1e-4, -1e-4, 1e-2, -1e-2):
            other = best.clone()
            other[j] += step
            assert st.objective(x, y, other, ALPHA) > f_best


def test_relative_gap():
    assert st.relative_gap(1.5, 1.0) == 0.5 and st.relative_gap(-0.5, -1.0) == 0.5


def test_soft_threshold():
    z = torch.tensor([-3.0, -0.5, 0.0, 0.2, 2.0], dtype=torch.float64)
    assert st.soft_threshold(z, 1.0).tolist() == [-2.0, 0.0, 0.0, 0.0, 1.0]


# --- the scheduled parallel solver -----------------------------------------------------

def test_strads_reaches_sklearns_optimum_where_shotgun_diverges(problem):
    x, y, w_star, f_star = problem
    with threads(1):
        run = st.solve(x, y, ALPHA, workers=8, rounds=2500, schedule="strads", rho=0.5, seed=1)
        shot = st.solve(x, y, ALPHA, workers=8, rounds=2500, schedule="shotgun", seed=1)
    assert not run.diverged
    assert st.relative_gap(run.objective[0], f_star) > 0.1      # it had a long way to go
    assert abs(st.relative_gap(run.objective[-1], f_star)) < 1e-6
    assert (run.w - w_star).abs().max().item() < 1e-3
    assert shot.diverged and len(shot.objective) < 2500


def test_every_strads_round_is_nearly_independent(problem):
    x, y, _, _ = problem
    corr = st.column_correlations(x.T @ x)
    for rho in (0.3, 0.95):
        run = st.solve(x, y, ALPHA, workers=8, rounds=200, schedule="strads", rho=rho, seed=2)
        for s in run.schedule:
            assert 1 <= len(s) <= 8 and len(set(s)) == len(s)
            assert all(corr[j, k] < rho for j, k in itertools.combinations(s, 2))
    # With rho above every correlation the filter keeps all 8 (it is not just refusing).
    run = st.solve(x, y, ALPHA, workers=8, rounds=20, schedule="strads", rho=1.0, seed=2)
    assert all(len(s) == 8 for s in run.schedule)


@pytest.mark.parametrize("seed", range(20))
def test_dependency_filter_never_keeps_two_above_rho(seed):
    g = torch.Generator().manual_seed(seed)
    d = 30
    a = torch.randn(d, 5, generator=g, dtype=torch.float64)
    corr = st.column_correlations(a @ a.T)
    rho = 0.2 + 0.7 * float(torch.rand(1, generator=g))
    cand = torch.randperm(d, generator=g)[:15]
    kept = st.dependency_filter(cand, corr, rho, workers=6).tolist()
    assert kept and kept[0] == int(cand[0]) and len(kept) <= 6
    assert all(corr[j, k] < rho for j, k in itertools.combinations(kept, 2))
    # Greedy and in order: every candidate passed over before the last kept one is blocked.
    pos = cand.tolist().index(kept[-1])
    assert [j for j in cand.tolist()[:pos + 1] if j in kept] == kept
    order = cand.tolist()
    for j in order[:pos]:
        if j not in kept:
            earlier = [k for k in kept if order.index(k) < order.index(j)]
            assert any(corr[j, k] >= rho for k in earlier)


def test_priorities_steer_the_draw():
    corr = torch.eye(10, dtype=torch.float64)
    last = torch.zeros(10, dtype=torch.float64)
    last[7] = 1.0
    gen = torch.Generator().manual_seed(0)
    picks = [st.strads_schedule(last, corr, 1, rho=0.5, floor=1e-12, candidates=1,
                                gen=gen).tolist() for _ in range(20)]
    assert picks == [[7]] * 20
    assert st.priorities(torch.tensor([0.0, -2.0]), 0.5).tolist() == [0.5, 4.5]


# --- the ranks -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["strads", "shotgun"])
def test_two_ranks_equal_one_process(problem, kind):
    x, y, _, _ = problem
    rk = st.run_ranks(x, y, ALPHA, world_size=2, workers=6, rounds=120, schedule=kind,
                      rho=0.5, seed=4)
    one = st.solve(x, y, ALPHA, workers=6, rounds=120, schedule=kind, rho=0.5, seed=4,
                   shards=2)
    assert rk.schedule == one.schedule
    assert (rk.w - one.w).abs().max().item() < 1e-12
    assert max(abs(a - b) for a, b in zip(rk.objective, one.objective, strict=True)) < 1e-12
    assert rk.updates == one.updates


def test_four_ranks_equal_one_process_of_the_same_schedule(problem):
    x, y, _, _ = problem
    rk = st.run_ranks(x, y, ALPHA, world_size=4, workers=8, rounds=100, schedule="strads",
                      rho=0.5, seed=5)
    one = st.solve(x, y, ALPHA, workers=8, rounds=100, schedule="strads", replay=rk.schedule)
    assert (rk.w - one.w).abs().max().item() < 1e-12
    assert rk.objective[-1] == pytest.approx(one.objective[-1], rel=1e-12)
    # A different schedule gives different weights (the comparison can fail).
    other = st.solve(x, y, ALPHA, workers=8, rounds=100, schedule="strads", seed=6)
    assert (rk.w - other.w).abs().max().item() > 1e-6


def test_ranks_report_divergence_together(problem):
    x, y, _, _ = problem
    rk = st.run_ranks(x, y, ALPHA, world_size=2, workers=16, rounds=400, schedule="shotgun",
                      seed=1)
    assert rk.diverged and len(rk.objective) < 401


# --- cost model, helpers, input checks -------------------------------------------------

def test_shotgun_limit_ends():
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(50, 6, generator=g, dtype=torch.float64))
    assert st.shotgun_limit(q) == pytest.approx(6.0, rel=1e-12)          # orthogonal
    same = torch.randn(50, 1, generator=g, dtype=torch.float64).repeat(1, 6)
    assert st.shotgun_limit(same) == pytest.approx(1.0, rel=1e-12)       # all equal


def test_round_time_model():
    assert st.round_time_model(8, 1001, 2, madd_s=1e-9, latency_s=1e-4) == pytest.approx(
        2 * 501 * 8 * 1e-9 + 2e-4)


def test_time_to_gap():
    from parlearn.serial_chain.strads.cost import _gap_at, time_to_gap

    tr = {"seconds": [0.0, 1.0, 2.0], "gap": [1.0, 1e-3, 1e-7]}
    assert time_to_gap(tr, 1e-6) == 2.0 and time_to_gap(tr, 1e-9) == math.inf
    assert _gap_at(tr, 1.5) == 1e-3


def test_bad_input_names_the_argument(problem):
    x, y, _, _ = problem
    with pytest.raises(ValueError, match="workers"):
        st.solve(x, y, ALPHA, workers=0)
    with pytest.raises(ValueError, match="schedule"):
        st.solve(x, y, ALPHA, schedule="random")
    with pytest.raises(ValueError, match="workers must be 1"):
        st.solve(x, y, ALPHA, workers=2, schedule="cyclic")
    with pytest.raises(ValueError, match="rho"):
        st.solve(x, y, ALPHA, rho=0.0)
    with pytest.raises(ValueError, match="alpha"):
        st.solve(x, y, -1.0)
    with pytest.raises(TypeError, match="y must have X's dtype"):
        st.solve(x, y.float(), ALPHA)
    with pytest.raises(ValueError, match="all-zero column"):
        st.solve(torch.zeros(5, 2, dtype=torch.float64), torch.ones(5, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError, match="replay"):
        st.solve(x, y, ALPHA, rounds=5, replay=[[0]])
    with pytest.raises(ValueError, match="corr"):
        st.correlated_design(10, 4, groups=2, corr=1.0)
    with pytest.raises(TypeError, match="seed"):
        st.run_ranks(x, y, ALPHA, seed=torch.Generator())


def test_global_state_untouched(problem):
    x, y, _, _ = problem
    before, n_threads = torch.get_rng_state(), torch.get_num_threads()
    st.solve(x, y, ALPHA, workers=4, rounds=10, schedule="strads")
    st.solve(x, y, ALPHA, workers=4, rounds=10, schedule="shotgun")
    assert torch.equal(torch.get_rng_state(), before) and torch.get_num_threads() == n_threads


def test_warm_start_at_the_optimum_stays_there(problem):
    x, y, w_star, f_star = problem
    before = w_star.clone()
    run = st.solve(x, y, ALPHA, workers=4, rounds=50, schedule="strads", w0=w_star)
    assert abs(st.relative_gap(run.objective[0], f_star)) < 1e-12
    assert abs(st.relative_gap(run.objective[-1], f_star)) < 1e-9
    assert torch.equal(w_star, before) and run.w is not w_star      # w0 itself is not modified


def test_schedules_refuse_workers_and_rho_out_of_range():
    """workers = 0 kept nothing (an empty round), rho = 0 or 1.5 is no correlation bound,
    workers > d was silently cut to d, a negative coordinate wrapped to the last one."""
    corr = torch.eye(6, dtype=torch.float64)
    cand = torch.arange(6)
    g = torch.Generator().manual_seed(0)
    last = torch.ones(6, dtype=torch.float64)
    for workers in (0, -1):
        with pytest.raises(ValueError, match="workers"):
            st.dependency_filter(cand, corr, 0.5, workers)
        with pytest.raises(ValueError, match="workers"):
            st.strads_schedule(last, corr, workers, rho=0.5, floor=1e-6, candidates=4, gen=g)
        with pytest.raises(ValueError, match="workers"):
            st.shotgun_schedule(6, workers, g)
    for rho in (0.0, 1.5, -0.1, math.nan):
        with pytest.raises(ValueError, match="rho"):
            st.dependency_filter(cand, corr, rho, 2)
        with pytest.raises(ValueError, match="rho"):
            st.strads_schedule(last, corr, 2, rho=rho, floor=1e-6, candidates=4, gen=g)
    with pytest.raises(TypeError, match="workers"):
        st.dependency_filter(cand, corr, 0.5, True)
    with pytest.raises(ValueError, match="workers"):
        st.shotgun_schedule(6, 7, g)
    with pytest.raises(ValueError, match="candidates"):
        st.dependency_filter(torch.tensor([0, -1]), corr, 0.5, 2)
    with pytest.raises(ValueError, match="candidates"):
        st.strads_schedule(last, corr, 3, rho=0.5, floor=1e-6, candidates=2, gen=g)
    x, y, _ = st.correlated_design(20, 6, groups=2, k_true=3, seed=0)
    with pytest.raises(ValueError, match=r"replay\[1\]"):
        st.solve(x, y, ALPHA, rounds=2, replay=[[0], [-1]])
    with pytest.raises(ValueError, match="workers"):
        st.solve(x, y, ALPHA, workers=7, schedule="shotgun")
    # The legal edges still run: rho = 1 and workers = d.
    assert len(st.dependency_filter(cand, corr, 1.0, 6)) == 6
    assert sorted(st.shotgun_schedule(6, 6, g).tolist()) == list(range(6))


def test_run_ranks_refuses_every_bad_argument_before_any_rank_starts(monkeypatch):
    import parlearn.distributed

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started for a call that should have been refused")

    monkeypatch.setattr(parlearn.distributed, "run", no_ranks)
    x, y, _ = st.correlated_design(20, 6, groups=2, k_true=3, seed=0)
    bad = [("workers", dict(workers=0)), ("workers", dict(workers=7)),
           ("rho", dict(rho=1.5)), ("rho", dict(rho=0.0)), ("floor", dict(floor=0.0)),
           ("candidates", dict(workers=3, candidates=2)), ("world_size", dict(world_size=0)),
           ("world_size", dict(world_size=True)), ("rounds", dict(rounds=-1)),
           ("replay", dict(rounds=2, replay=[[0], [-1]])), ("seed", dict(seed=-1)),
           ("timeout", dict(timeout=0.0)), ("timeout", dict(timeout=math.nan)),
           ("schedule", dict(schedule="random")), ("alpha", dict(alpha=0.0))]
    for name, kw in bad:
        args = dict(alpha=ALPHA, rounds=2)
        args.update(kw)
        alpha = args.pop("alpha")
        with pytest.raises((ValueError, TypeError), match=name):
            st.run_ranks(x, y, alpha, **args)
