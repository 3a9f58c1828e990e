"""Multiplicative-update NMF: parallel = entry-by-entry, monotone, as good as scikit-learn."""

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.decomposition import NMF
from sklearn.exceptions import ConvergenceWarning

from parlearn.core import device
from parlearn.elsewhere import nmf


@pytest.fixture(autouse=True)
def _one_thread():
    with device.threads(1):
        yield


def _data(f=30, n=40, rank=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(f, rank, generator=g, dtype=torch.float64)
            @ torch.rand(rank, n, generator=g, dtype=torch.float64)
            + 0.05 * torch.rand(f, n, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("update_w", [True, False])
def test_parallel_step_equals_entry_by_entry_loop(update_w):
    v = _data(6, 5)
    w, h = nmf.random_init(v, 3, seed=1)
    par = nmf.mu_step(v, w, h, update_w=update_w)
    ser = nmf.mu_step_loop(v, w, h, update_w=update_w)
    for a, b in zip(par, ser, strict=True):
        assert torch.allclose(a, b, rtol=1e-13, atol=0)
    assert not torch.equal(par[1], h)  # it moved


def test_objective_never_increases():
    v = _data()
    for seed in range(3):
        hist = nmf.nmf(v, 6, steps=300, seed=seed)["objective"]
        steps = np.diff(hist)
        assert (steps <= 1e-12 * hist[0]).all(), steps.max()
        assert hist[-1] < 0.2 * hist[0]


def test_same_iterates_as_scikit_learn_mu():
    """Same init, same solver: scikit-learn's ``mu`` (W then H each step) lands on our
    iterate; its tiny denominator epsilon is the only difference."""
    v = _data()
    w0, h0 = nmf.random_init(v, 5, seed=0)
    ours = nmf.nmf(v, init=(w0, h0), steps=100)
    sk = NMF(5, init="custom", solver="mu", beta_loss="frobenius", max_iter=100, tol=0.0)
    w_sk = sk.fit_transform(v.numpy(), W=w0.numpy().copy(), H=h0.numpy().copy())
    assert np.allclose(ours["w"].numpy(), w_sk, rtol=1e-5, atol=1e-9)
    assert np.allclose(ours["h"].numpy(), sk.components_, rtol=1e-5, atol=1e-9)


def test_solution_quality_matches_scikit_learn_default_solver():
    """Relative error ||V - WH|| / ||V|| within 3% of scikit-learn's coordinate descent run to
    a tight tolerance (multiplicative updates converge slowly near the end: 3000 steps)."""
    v = _data(seed=4)
    sk = NMF(5, init="random", random_state=0, max_iter=5000, tol=1e-12)
    with warnings.catch_warnings():  # a tolerance this tight is meant to use every iteration
        warnings.simplefilter("ignore", ConvergenceWarning)
        w = sk.fit_transform(v.numpy())
    sk_rel = float(np.linalg.norm(v.numpy() - w @ sk.components_) / np.linalg.norm(v.numpy()))
    ours = min(nmf.nmf(v, 5, steps=3000, seed=s)["objective"][-1] for s in range(3))
    ours_rel = float(np.sqrt(2 * ours) / v.norm())
    assert ours_rel <= 1.03 * sk_rel, (ours_rel, sk_rel)


def test_fixed_dictionary_stays_fixed():
    v = _data()
    w, h = nmf.random_init(v, 4, seed=0)
    out = nmf.nmf(v, init=(w, h), steps=20, update_w=False)
    assert torch.equal(out["w"], w)
    assert np.all(np.diff(out["objective"]) <= 1e-12 * out["objective"][0])


def test_dictionary_update_lets_a_small_dictionary_convert_better():
    corpus = nmf.make_corpus(500, seed=0)
    train = {k: v[:, :400] for k, v in corpus.items()}
    test = {k: v[:, 400:] for k, v in corpus.items()}
    small = nmf.exemplar_dictionary(train, 12, seed=0)
    updated = nmf.update_dictionary(train, small, steps=200)
    e_small = nmf.conversion_error(test, small)
    e_updated = nmf.conversion_error(test, updated)
    assert e_updated < 0.7 * e_small, (e_updated, e_small)
    assert np.all(np.diff(updated["objective"]) <= 1e-12 * updated["objective"][0])


def test_bad_input_is_refused():
    v = _data()
    with pytest.raises(ValueError, match="v must be nonnegative"):
        nmf.nmf(-v, 3)
    with pytest.raises(ValueError, match="give k"):
        nmf.nmf(v)
    with pytest.raises(ValueError, match="k must be"):
        nmf.random_init(v, 0)
    w, h = nmf.random_init(v, 3)
    with pytest.raises(ValueError, match="shapes"):
        nmf.nmf(v, init=(w, h[:, :5]))
    with pytest.raises(TypeError, match="v must be a floating"):
        nmf.nmf(v.long(), 3)


@st.composite
def _with_zero_lines(draw):
    """Nonnegative V (float64) with some all-zero rows and columns (possibly all of them)."""
    f, n = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    v = torch.rand(f, n, generator=g, dtype=torch.float64)
    rows = draw(st.lists(st.integers(0, f - 1), max_size=f))
    cols = draw(st.lists(st.integers(0, n - 1), max_size=n))
    v[rows] = 0
    v[:, cols] = 0
    return v, draw(st.integers(1, 4)), draw(st.booleans())


@settings(max_examples=40, deadline=None)
@given(case=_with_zero_lines())
def test_zero_rows_and_columns_stay_finite_and_monotone(case):
    """An all-zero row of V zeroes a row of W after one step, and then that row's
    denominator is 0: the update must keep it 0 (as scikit-learn does), never NaN."""
    v, k, update_w = case
    w0, h0 = nmf.random_init(v, k, seed=1)
    out = nmf.nmf(v, init=(w0, h0), steps=12, update_w=update_w)
    hist = np.array(out["objective"])
    assert np.isfinite(hist).all(), hist
    assert torch.isfinite(out["w"]).all() and torch.isfinite(out["h"]).all()
    assert (np.diff(hist) <= 1e-12 * max(hist[0], 1.0)).all(), np.diff(hist).max()


def test_zero_row_and_column_equal_scikit_learn():
    v = _data(8, 9)
    v[2] = 0
    v[:, 5] = 0
    w0, h0 = nmf.random_init(v, 3, seed=0)
    ours = nmf.nmf(v, init=(w0, h0), steps=30)
    sk = NMF(3, init="custom", solver="mu", beta_loss="frobenius", max_iter=30, tol=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        w_sk = sk.fit_transform(v.numpy(), W=w0.numpy().copy(), H=h0.numpy().copy())
    assert torch.isfinite(ours["w"]).all()
    assert np.allclose(ours["w"].numpy(), w_sk, rtol=1e-5, atol=1e-9)
    assert np.allclose(ours["h"].numpy(), sk.components_, rtol=1e-5, atol=1e-9)
    par = nmf.mu_step(v, ours["w"], ours["h"])
    ser = nmf.mu_step_loop(v, ours["w"], ours["h"])
    for a, b in zip(par, ser, strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=0)
