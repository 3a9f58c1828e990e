"""parlearn.value: EBU batched over episodes equals the paper's loop and reduces to one-step
targets at beta = 0; LS-DQN's batched per-action solve equals the joint closed form; t-soft
with nu -> inf is the plain EMA and slows an outlying update; the seeded training runs (JAX
environments) are in test_value_training.py, run in a fresh interpreter."""

import math

import numpy as np
import pytest
import torch

from parlearn.elsewhere import value as V

F64 = torch.float64


def _episodes(B=6, A=3, seed=0, max_len=11):
    g = torch.Generator().manual_seed(seed)
    eps = []
    for b in range(B):
        T = 1 if b == 0 else int(torch.randint(2, max_len + 1, (1,), generator=g))
        eps.append({"q_next": torch.randn(T, A, generator=g, dtype=F64),
                    "actions": torch.randint(0, A, (T,), generator=g),
                    "rewards": torch.randn(T, generator=g, dtype=F64),
                    "terminal": bool(b % 2)})
    return eps


def _batched(eps, beta, gamma):
    # Padding holds garbage (not zeros), so a result that leaks it shows.
    L, A = max(len(e["rewards"]) for e in eps), eps[0]["q_next"].shape[1]
    q = torch.full((len(eps), L, A), 7.0, dtype=F64)
    a = torch.ones(len(eps), L, dtype=torch.long)
    r = torch.full((len(eps), L), -3.0, dtype=F64)
    for b, e in enumerate(eps):
        T = len(e["rewards"])
        q[b, :T], a[b, :T], r[b, :T] = e["q_next"], e["actions"], e["rewards"]
    lengths = torch.tensor([len(e["rewards"]) for e in eps])
    term = torch.tensor([e["terminal"] for e in eps])
    return V.ebu_targets(q, a, r, term, lengths, beta, gamma), lengths


# --- EBU -----------------------------------------------------------------------------------

def test_ebu_loop_by_hand():
    """A 3-step episode, worked out on paper (beta = 0.5, gamma = 0.9, terminal)."""
    q = torch.tensor([[1.0, 2.0], [0.0, 4.0], [9.0, 9.0]], dtype=F64)
    a = torch.tensor([0, 0, 1])
    r = torch.tensor([1.0, 0.0, 2.0], dtype=F64)
    y = V.ebu_targets_loop(q, a, r, True, beta=0.5, gamma=0.9)
    y2 = 2.0                                   # terminal: no bootstrap
    y1 = 0.0 + 0.9 * max(0.0, 0.5 * y2 + 0.5 * 4.0)    # A_2 = 1 mixes q[1, 1]
    y0 = 1.0 + 0.9 * max(0.5 * y1 + 0.5 * 1.0, 2.0)    # A_1 = 0 mixes q[0, 0]
    torch.testing.assert_close(y, torch.tensor([y0, y1, y2], dtype=F64), rtol=0, atol=1e-15)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_ebu_batched_equals_loop_per_episode(beta):
    eps = _episodes()
    y, lengths = _batched(eps, beta, 0.97)
    for b, e in enumerate(eps):
        ref = V.ebu_targets_loop(e["q_next"], e["actions"], e["rewards"], e["terminal"],
                                 beta, 0.97)
        T = int(lengths[b])
        torch.testing.assert_close(y[b, :T], ref, rtol=0, atol=1e-13)
        assert torch.all(y[b, T:] == 0)


def test_ebu_beta_zero_is_one_step_targets():
    for e in _episodes(seed=3):
        T = len(e["rewards"])
        done = torch.zeros(T, dtype=torch.bool)
        done[-1] = e["terminal"]
        one = V.one_step_targets(e["q_next"], e["rewards"], done, 0.9)
        for y in (V.ebu_targets_loop(e["q_next"], e["actions"], e["rewards"], e["terminal"],
                                     0.0, 0.9),
                  _batched([e], 0.0, 0.9)[0][0]):
            torch.testing.assert_close(y, one, rtol=0, atol=1e-15)


def test_ebu_beta_one_backs_up_the_return_when_it_is_the_max():
    """With Q~ far below the observed returns, beta = 1 gives the discounted return."""
    T, gamma = 7, 0.9
    r = torch.ones(T, dtype=F64)
    q = torch.full((T, 2), -100.0, dtype=F64)
    y = V.ebu_targets_loop(q, torch.zeros(T, dtype=torch.long), r, True, 1.0, gamma)
    ret = torch.tensor([sum(gamma**j for j in range(T - k)) for k in range(T)], dtype=F64)
    torch.testing.assert_close(y, ret, rtol=0, atol=1e-13)


def test_ebu_inputs_untouched_and_bad_input():
    e = _episodes()[2]
    q0 = e["q_next"].clone()
    V.ebu_targets_loop(e["q_next"], e["actions"], e["rewards"], True, 0.5, 0.9)
    assert torch.equal(e["q_next"], q0)
    with pytest.raises(ValueError, match="beta"):
        V.ebu_targets_loop(e["q_next"], e["actions"], e["rewards"], True, 1.5, 0.9)
    with pytest.raises(TypeError, match="terminal"):
        V.ebu_targets_loop(e["q_next"], e["actions"], e["rewards"], 1, 0.5, 0.9)
    with pytest.raises(ValueError, match="lengths"):
        V.ebu_targets(q0[None], e["actions"][None], e["rewards"][None], torch.tensor([True]),
                      torch.tensor([len(e["rewards"]) + 1]), 0.5, 0.9)


def test_pad_episodes():
    eps = [{"obs": torch.ones(n, 4), "next_obs": torch.ones(n, 4),
            "actions": torch.ones(n, dtype=torch.long), "rewards": torch.ones(n),
            "terminal": n == 3} for n in (3, 5)]
    p = V.pad_episodes(eps)
    assert p["obs"].shape == (2, 5, 4) and p["lengths"].tolist() == [3, 5]
    assert p["terminal"].tolist() == [True, False] and p["rewards"][0, 3:].sum() == 0


# --- LS-DQN ----------------------------------------------------------------------------------

@pytest.mark.parametrize("lam", [1e-3, 1.0, 50.0])
def test_ls_batched_solve_equals_closed_form(lam):
    g = torch.Generator().manual_seed(1)
    n, d, A = 40, 5, 3
    phi = torch.randn(n, d, generator=g, dtype=F64)
    a = torch.randint(0, A, (n,), generator=g)
    y = torch.randn(n, generator=g, dtype=F64)
    w0 = torch.randn(A, d + 1, generator=g, dtype=F64)
    w = V.ls_last_layer(phi, a, y, w0, lam)
    torch.testing.assert_close(w, V.ls_last_layer_closed_form(phi, a, y, w0, lam),
                               rtol=1e-10, atol=1e-10)
    # The normal equations hold for every action's row.
    phib = torch.cat([phi, torch.ones(n, 1, dtype=F64)], 1)
    for k in range(A):
        m = a == k
        grad = phib[m].T @ (phib[m] @ w[k] - y[m]) + lam * (w[k] - w0[k])
        assert grad.abs().max() < 1e-9


def test_ls_prior_dominates_with_large_lambda_and_bad_input():
    g = torch.Generator().manual_seed(2)
    phi, a = torch.randn(20, 4, generator=g, dtype=F64), torch.randint(0, 2, (20,), generator=g)
    y, w0 = torch.randn(20, generator=g, dtype=F64), torch.randn(2, 5, generator=g, dtype=F64)
    torch.testing.assert_close(V.ls_last_layer(phi, a, y, w0, 1e12), w0, rtol=0, atol=1e-9)
    with pytest.raises(ValueError, match="w_prior"):
        V.ls_last_layer(phi, a, y, w0[:, :4], 1.0)
    with pytest.raises(ValueError, match="lam"):
        V.ls_last_layer(phi, a, y, w0, 0.0)
    with pytest.raises(ValueError, match="actions"):
        V.ls_last_layer(phi, a + 5, y, w0, 1.0)


# --- t-soft ----------------------------------------------------------------------------------

def _drift(steps=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    online = [torch.randn(6, 4, generator=g, dtype=F64), torch.randn(4, generator=g, dtype=F64)]
    path = []
    for _ in range(steps):
        online = [p + 0.1 * torch.randn(p.shape, generator=g, dtype=F64) for p in online]
        path.append(online)
    return [p.clone() for p in path[0]], path


@pytest.mark.parametrize("nu", [math.inf, 1e20])  # w - 1 = O(D / nu), D up to ~1e6 here
def test_tsoft_with_large_nu_is_the_ema(nu):
    start, path = _drift()
    ema, ts = [p.clone() for p in start], [p.clone() for p in start]
    state = V.tsoft_init(ts, 0.1)
    for online in path:
        V.ema_update(ema, online, 0.1)
        V.tsoft_update(ts, online, state, 0.1, nu)
    for a, b in zip(ema, ts, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert all(abs(t - 0.1) < 1e-10 for t in state.last_tau)


def test_tsoft_one_step_by_hand():
    t, o = [torch.zeros(4, dtype=F64)], [torch.ones(4, dtype=F64)]
    state = V.TSoftState(sigma2=[0.5], W=[9.0], last_tau=[0.1])
    V.tsoft_update(t, o, state, 0.1, nu=1.0)
    w = 2 / (1 + 1 / 0.5)                       # (nu + 1) / (nu + D), D = gap^2 / sigma^2 = 2
    rate = w / (9 + w)
    torch.testing.assert_close(t[0], torch.full((4,), rate, dtype=F64), rtol=0, atol=1e-15)
    assert abs(state.sigma2[0] - ((1 - rate) * 0.5 + rate * 1.0)) < 1e-15
    assert abs(state.W[0] - 0.9 * (9 + w)) < 1e-13 and abs(state.last_tau[0] - rate) < 1e-15


def test_tsoft_rates_do_not_depend_on_the_parameters_scale():
    start, path = _drift(steps=20)
    rates = []
    for c in (1.0, 1000.0):
        ts = [c * p for p in start]
        state = V.tsoft_init(ts, 0.1, eps=1e-30)
        seen = []
        for online in path:
            V.tsoft_update(ts, [c * p for p in online], state, 0.1, nu=1.0, eps=1e-30)
            seen.append(list(state.last_tau))
        rates.append(seen)
    assert max(abs(a - b) for ra, rb in zip(*rates, strict=True)
               for a, b in zip(ra, rb, strict=True)) < 1e-9


def test_tsoft_copies_an_outlier_slower_than_ema_and_a_usual_step_near_tau():
    start, path = _drift(steps=40)
    ts = [p.clone() for p in start]
    state = V.tsoft_init(ts, 0.1)
    for online in path:
        V.tsoft_update(ts, online, state, 0.1, nu=1.0)
    usual = state.last_tau[0]
    jump = [p + 50.0 for p in path[-1]]
    before = [p.clone() for p in ts]
    V.tsoft_update(ts, jump, state, 0.1, nu=1.0)
    moved = float((ts[0] - before[0]).abs().mean())
    assert state.last_tau[0] < 0.01 and moved < 0.01 * 50.0, (state.last_tau, moved)
    assert 0.05 < usual < 0.2, usual  # gaps like the past ones: a rate near the EMA's


def test_tsoft_bad_input():
    t = [torch.zeros(3)]
    with pytest.raises(ValueError, match="nu"):
        V.tsoft_update(t, t, V.tsoft_init(t, 0.1), 0.1, 0.0)
    with pytest.raises(ValueError, match="tau"):
        V.tsoft_init(t, 1.0)


@pytest.mark.parametrize("bad", [-1, 2, 7])
def test_ebu_refuses_actions_out_of_range(bad):
    """Action -1 used to index the last action (Python wraps it); A or beyond crashed the
    batched version with an indexing error: both refuse, naming actions."""
    q = torch.tensor([[1.0, 2.0], [0.0, 4.0], [9.0, 9.0]], dtype=F64)
    r = torch.tensor([1.0, 0.0, 2.0], dtype=F64)
    for pos in (0, 1, 2):
        a = torch.tensor([0, 0, 1])
        a[pos] = bad
        with pytest.raises(ValueError, match="actions"):
            V.ebu_targets_loop(q, a, r, True, beta=0.5, gamma=0.9)
        with pytest.raises(ValueError, match="actions"):
            V.ebu_targets(q[None], a[None], r[None], torch.tensor([True]), torch.tensor([3]),
                          0.5, 0.9)


def test_one_step_targets_refuse_broadcasting():
    q = torch.ones(4, 3, dtype=F64)
    r, done = torch.ones(4, dtype=F64), torch.zeros(4, dtype=torch.bool)
    torch.testing.assert_close(V.one_step_targets(q, r, done, 0.5), torch.full((4,), 1.5,
                                                                              dtype=F64))
    with pytest.raises(ValueError, match="rewards"):
        V.one_step_targets(q, torch.ones(1, dtype=F64), done, 0.5)
    with pytest.raises(ValueError, match="done"):
        V.one_step_targets(q, r, torch.zeros(4, 1, dtype=torch.bool), 0.5)
    with pytest.raises(TypeError, match="done"):
        V.one_step_targets(q, r, torch.zeros(4), 0.5)


def test_target_updates_refuse_mismatched_shapes():
    """add_ would broadcast a (3,) online tensor into a (2, 3) target without a word."""
    target, online = [torch.zeros(2, 3, dtype=F64)], [torch.ones(3, dtype=F64)]
    with pytest.raises(ValueError, match=r"online\[0\]"):
        V.ema_update(target, online, 0.5)
    state = V.tsoft_init(target, 0.5)
    with pytest.raises(ValueError, match=r"online\[0\]"):
        V.tsoft_update(target, online, state, 0.5, 1.0)
    assert not target[0].any()


def test_ebu_speed_reads_the_sweep_with_the_batching_model():
    from parlearn.elsewhere.value.speed import ebu_speed

    r = ebu_speed([1, 2, 4], 6, repeat=1)
    fit = r["step_fit"]
    per_step = np.divide(r["median_s"]["batched"], r["steps"])
    assert fit.ns == (1.0, 2.0, 4.0) and fit.seconds == pytest.approx(per_step.tolist())
    for b, L, s, fitted, bound in zip([1, 2, 4], r["steps"], r["loop_steps"], r["fitted"],
                                      r["modeled"], strict=True):
        assert bound == s / L
        assert fitted == pytest.approx(s * (fit.t0 + fit.c) / (L * (fit.t0 + fit.c * b)))
        assert fitted <= bound * (1 + 1e-12)  # the fit never beats the overhead bound
    one = ebu_speed([3], 6, repeat=1)
    assert one["step_fit"] is None and one["fitted"] is None and one["modeled"][0] > 0
