"""EigenGame's JAX tests, in a child pytest with 8 fake CPU devices (fresh_process in
tests/conftest.py: JAX must not start in the main pytest process, whose later tests fork,
and the device count must be set before JAX starts). They check that the updates converge
to eigh's eigenvectors, that the mu minibatch direction is unbiased while alpha's is not
(Monte Carlo, in standard errors), and that the sharded run on 8 devices equals the
single-device run to round-off."""

import numpy as np
import pytest
import torch

from parlearn.many_copies import eigengame as E

pytestmark = pytest.mark.fresh_process(env={"JAX_NUM_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu",
                                            "XLA_FLAGS": None})

X = E.synthetic_data(1000, 10, decay=0.6, seed=0)
K = 4
LAM, U = E.top_eigenvectors(X, K)


def _direction_loop(v, x, method):
    """The module docstring's formulas, one player at a time (numpy, float64)."""
    m = x.T @ x / x.shape[0]
    out = np.zeros_like(v)
    for i in range(v.shape[1]):
        delta = m @ v[:, i]
        for j in range(i):
            if method == "mu":
                delta = delta - (v[:, i] @ m @ v[:, j]) * v[:, j]
            else:
                delta = delta - (v[:, i] @ m @ v[:, j]) / (v[:, j] @ m @ v[:, j]) * (m @ v[:, j])
        out[:, i] = delta - (v[:, i] @ delta) * v[:, i]
    return out


@pytest.mark.parametrize("method", E.METHODS)
def test_direction_equals_the_formula_written_out(method):
    v = E.init_vectors(10, K, seed=3)
    xb = X[:37]
    np.testing.assert_allclose(E.direction(v, xb, method), _direction_loop(v, xb, method),
                               rtol=0, atol=1e-13)


@pytest.mark.parametrize("method", E.METHODS)
def test_direction_is_tangent_and_vanishes_at_the_eigenvectors(method):
    v = E.init_vectors(10, K, seed=1)
    g = E.direction(v, X, method)
    assert np.abs(np.sum(v * g, axis=0)).max() < 1e-14      # Riemannian: orthogonal to v_i
    assert np.abs(g).max() > 1e-2
    # The eigenvectors are the Nash equilibrium: no player wants to move.
    assert np.abs(E.direction(U, X, method)).max() < 1e-12
    w = E.update(v, X[:50], 0.3, method)
    np.testing.assert_allclose(np.linalg.norm(w, axis=0), 1.0, rtol=0, atol=1e-14)


@pytest.mark.parametrize("method", E.METHODS)
def test_full_batch_fit_finds_eighs_eigenvectors(method):
    res = E.fit(X, K, method=method, lr=0.5, steps=400, record_every=100, seed=0)
    cos = E.abs_cosines(res["v"], U)
    assert cos.min() > 0.99, cos
    assert E.abs_cosines(res["snapshots"][0], U).min() < cos.min()   # it got there by moving
    assert E.longest_streak(res["v"], U) == K


def test_minibatch_mu_fit_finds_eighs_eigenvectors():
    res = E.fit(X, K, method="mu", batch=100, lr=0.05, steps=3000, seed=0)
    assert res["rows_used"] == 1000
    assert E.abs_cosines(res["v"], U).min() > 0.99


def test_mu_minibatch_direction_is_unbiased_and_alphas_is_not():
    v = E.init_vectors(10, K, seed=1)
    mu = E.minibatch_bias(v, X, batch=4, samples=20000, method="mu", seed=0)
    alpha = E.minibatch_bias(v, X, batch=4, samples=20000, method="alpha", seed=0)
    # 40 coordinates: |z| > 5 by chance has probability ~2e-5 for an unbiased estimate.
    assert mu["max_abs_z"] < 5, mu["max_abs_z"]
    assert mu["bias_norm"] < 2 * mu["se_norm"]
    assert alpha["max_abs_z"] > 20, alpha["max_abs_z"]
    assert alpha["bias_norm"] > 10 * alpha["se_norm"]
    # alpha's bias is O(1/b): four times the batch, about a quarter of the bias.
    alpha16 = E.minibatch_bias(v, X, batch=16, samples=20000, method="alpha", seed=0)
    assert 3 < alpha["bias_norm"] / alpha16["bias_norm"] < 5.3


@pytest.mark.parametrize("method", E.METHODS)
def test_sharded_fit_on_one_device_equals_serial(method):
    kw = {"batch": 50, "lr": 0.3, "steps": 40, "record_every": 10, "seed": 2, "method": method}
    out = E.compare_sharded(X, K, [(1, 1)], **kw)
    assert out["max_abs_diff"]["1x1"] < 1e-13


def test_eight_devices_equal_one_device():
    """The sharded fit on this process's 8 devices (every mesh shape) equals the serial fit
    here and (mu) in a separate process whose JAX has 1 device, to round-off, after 120 steps
    that really moved."""
    import jax

    assert jax.device_count() == 8
    x = E.synthetic_data(512, 12, decay=0.7, seed=0)
    kw = {"batch": 32, "lr": 0.3, "steps": 120, "record_every": 40, "seed": 3}
    for method, shapes in (("mu", [(8, 1), (4, 2), (2, 4), (1, 8)]), ("alpha", [(2, 4)])):
        out = E.compare_sharded(x, 8, shapes, method=method, **kw)
        # One child for mu only (start-up costs seconds); alpha against this process's serial.
        one_device = (E.run_with_devices(1, "fit", x, 8, method=method, **kw)["v"]
                      if method == "mu" else out["serial"])
        assert np.abs(out["serial"] - E.init_vectors(12, 8, seed=3)).max() > 0.5
        assert np.abs(out["serial"] - one_device).max() < 1e-13
        for name, v in out["sharded"].items():
            assert out["max_abs_diff"][name] < 1e-12, (method, name, out["max_abs_diff"])
            assert np.abs(v - one_device).max() < 1e-12, (method, name)


def test_compiled_step_moves_the_modeled_bytes():
    """The psum reduces d x k/P numbers (mu) or d x k (alpha); the all-gather returns d x k."""
    x = E.synthetic_data(64, 12, seed=0)
    for method, reduced in (("mu", 12 * 4 * 8), ("alpha", 12 * 8 * 8)):
        got = E.collective_bytes(x, 8, mesh_shape=(4, 2), batch=32, method=method)
        assert got == {"all-reduce": reduced, "all-gather": 12 * 8 * 8}, method


def test_fit_sharded_without_enough_devices_says_how_to_get_them():
    with pytest.raises(RuntimeError, match="fake_jax_cpu_devices"):
        E.fit_sharded(X, K, mesh_shape=(16, 1), batch=48, steps=2)


def test_throughput_reports_measured_rates():
    r = E.throughput(X, K, batch_sizes=(1, 10), samples=100, repeat=2)
    assert r["values"] == [1, 10] and len(r["samples_per_s"]) == 2
    assert all(s > 0 for s in r["samples_per_s"] + r["updates_per_s"])
    assert r["updates_per_s"][1] == pytest.approx(r["samples_per_s"][1] / 10)


def test_caller_rng_and_jax_config_are_untouched():
    import jax

    np_state = np.random.get_state()[1].copy()  # noqa: NPY002 (the caller's global RNG)
    torch_state = torch.get_rng_state().clone()
    x64 = jax.config.jax_enable_x64
    E.fit(X, K, batch=100, steps=5, seed=4)
    E.minibatch_bias(E.init_vectors(10, K), X, batch=4, samples=10)
    E.synthetic_data(10, 3, seed=1)
    assert (np.random.get_state()[1] == np_state).all()  # noqa: NPY002
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert jax.config.jax_enable_x64 == x64


V = E.init_vectors(10, K)
BAD = [
    (E.fit, (X, 11), {}, ValueError, "k must be"),
    (E.fit, (X, 0), {}, ValueError, "k must be"),
    (E.fit, (X, K), {"method": "beta"}, ValueError, "method must be one of"),
    (E.fit, (X, K), {"batch": 1001}, ValueError, "batch must be"),
    (E.fit, (X, K), {"lr": 0.0}, ValueError, "lr must be"),
    (E.fit, (X, K), {"steps": 10, "record_every": 3}, ValueError, "multiple of record_every"),
    (E.fit, (X, K), {"v0": np.ones((9, K))}, ValueError, "d=10 rows"),
    (E.fit, (X, K), {"v0": V[:, :2]}, ValueError, "k=4 columns"),
    (E.fit, (X[:, :, None], K), {}, ValueError, "2-D array"),
    (E.fit, (np.ones((5, 3), dtype=int), 2), {}, TypeError, "floating-point"),
    (E.fit, ("data", K), {}, TypeError, "must be an array"),
    (E.fit, (np.full((5, 3), np.nan), 2), {}, ValueError, "NaN"),
    (E.fit, (X, K), {"seed": -1}, ValueError, "seed must be"),
    (E.fit_sharded, (X, K), {"mesh_shape": (8,)}, ValueError, "mesh_shape must be"),
    (E.fit_sharded, (X, K), {"mesh_shape": (3, 1), "batch": 40}, ValueError, "multiple of the"),
    (E.fit_sharded, (X, K), {"mesh_shape": (1, 3)}, ValueError, "multiple of the players"),
    (E.direction, (V, X), {"method": "mu "}, ValueError, "method must be one of"),
    (E.update, (V, X, -1.0), {}, ValueError, "lr must be"),
    (E.minibatch_bias, (V, X), {"batch": 0}, ValueError, "batch must be"),
    (E.minibatch_bias, (V, X), {"batch": 4, "samples": 1}, ValueError, "samples must be"),
    (E.abs_cosines, (V, V[:, :2]), {}, ValueError, "same"),
    (E.longest_streak, (V, V), {"angle": 2.0}, ValueError, "angle must be"),
    (E.synthetic_data, (10, 3), {"decay": 1.0}, ValueError, "decay must be"),
    (E.init_vectors, (3, 4), {}, ValueError, "k must be"),
    (E.throughput, (X, K), {"batch_sizes": (3,), "samples": 100}, ValueError, "multiple"),
    (E.throughput, (X, K), {"dtype": "float16", "samples": 8, "batch_sizes": (1,)}, ValueError,
     "dtype must be one of"),
    (E.run_with_devices, (8, "os.system"), {}, ValueError, "function must be one of"),
    (E.run_with_devices, (1, "synthetic_data", object()), {}, TypeError, "as JSON"),
    (E.compare_sharded, (X, K, [(1, 1)]), {"step": 2}, TypeError, "fit does not take"),
    (E.collective_bytes, (X, K), {"mesh_shape": (3, 1), "batch": 40}, ValueError, "multiple"),
]


@pytest.mark.parametrize("fn, args, kwargs, err, match", BAD,
                         ids=[f"{b[0].__name__}-{i}" for i, b in enumerate(BAD)])
def test_bad_calls_fail_fast(fn, args, kwargs, err, match):
    with pytest.raises(err, match=match):
        fn(*args, **kwargs)
