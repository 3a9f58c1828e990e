"""EigenGame: PCA as a game, each player's direction, and its unbiased minibatch update.

Top-k PCA of data ``X`` (n x d, centred) is the eigendecomposition of the second-moment
matrix ``M = X^T X / n``. EigenGame (Gemp et al., ICLR 2021, arXiv 2010.00554) makes each
eigenvector a *player*: player i holds a unit vector ``v_i`` and is rewarded for the
variance it captures, ``v_i^T M v_i``, and penalised for aligning with the players before
it (j < i). The top-k eigenvectors are the game's unique strict Nash equilibrium, and the
players can all move at once. Each step of every player is

    direction   Delta_i                    (below, two versions)
    tangent     g_i = Delta_i - (v_i^T Delta_i) v_i   (the Riemannian gradient on the sphere)
    step        v_i <- v_i + lr * g_i
    retract     v_i <- v_i / ||v_i||                  (back onto the unit sphere)

``"alpha"`` (alpha-EigenGame, 2021) uses half the gradient of player i's utility
``v_i^T M v_i - sum_{j<i} (v_i^T M v_j)^2 / (v_j^T M v_j)``:

    Delta_i = M v_i - sum_{j<i} (v_i^T M v_j) / (v_j^T M v_j) * M v_j

``"mu"`` (mu-EigenGame, "EigenGame Unloaded", Gemp et al., ICLR 2022, arXiv 2102.04152)
replaces ``M v_j / (v_j^T M v_j)`` by ``v_j`` (equal when v_j is a unit eigenvector):

    Delta_i = M v_i - sum_{j<i} (v_i^T M v_j) v_j

The mu direction is *linear in M*. With a minibatch estimate ``M_B = X_B^T X_B / b`` (which
has mean M) its expectation is therefore exactly the full-batch direction: the minibatch
update is unbiased. The alpha direction divides by ``v_j^T M_B v_j`` and multiplies two
M_B's, so its minibatch mean differs from the full-batch direction (biased, by O(1/b)).
:func:`minibatch_bias` measures both by Monte Carlo. (The retraction is nonlinear, so a
*step* is unbiased only to first order in ``lr``; the claim is about the direction.)

Computations run with JAX 64-bit mode switched on *locally* (``jax.enable_x64``, see
``_x64``), leaving the caller's config as it was; JAX is imported inside the functions.

Sources: the papers' abstracts and update equations; the full texts were not read here. The
mu and alpha directions agree with a public port of the 2022 paper's Appendix-B pseudocode
(up to the 1/b scale). The surrounding choices are ours: all players step at once with plain
SGD and a constant ``lr`` (no momentum), minibatches are dealt as in
:mod:`parlearn.many_copies.eigengame.training`.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from parlearn.core.checks import check_choice, check_float, check_int
from parlearn.many_copies.eigengame.inputs import _data, _vectors

__all__ = ["METHODS", "direction", "update", "minibatch_bias"]

METHODS = ("mu", "alpha")
"""``"mu"``: EigenGame Unloaded (unbiased); ``"alpha"``: the original EigenGame."""


# ---------------------------------------------------------------------------------------------
# The update: direction, tangent projection, step, retraction (pure jnp, traced by jit)
# ---------------------------------------------------------------------------------------------

def _tangent_direction(v, mv, v_all, mv_all, mine, method: str):
    """Riemannian directions of the players ``mine`` (global indices, shape (kl,)).

    ``v`` (d, kl) are those players' vectors and ``mv = M v``; ``v_all`` (d, k) all players
    (``mv_all = M v_all``, only read by alpha). Returns (d, kl).
    """
    import jax.numpy as jnp

    earlier = jnp.arange(v_all.shape[1])[:, None] < mine[None, :]       # (k, kl): j < i
    if method == "mu":
        coef = (v_all.T @ mv) * earlier                                   # v_j^T M v_i
        delta = mv - v_all @ coef
    else:
        coef = (mv_all.T @ v) / jnp.sum(v_all * mv_all, axis=0)[:, None] * earlier
        delta = mv - mv_all @ coef
    return delta - v * jnp.sum(v * delta, axis=0)      # drop the part along v_i


def _step(v, g, lr):
    import jax.numpy as jnp

    w = v + lr * g
    return w / jnp.linalg.norm(w, axis=0)


def _serial_direction(v, x, method: str):
    import jax.numpy as jnp

    mv = x.T @ (x @ v) / x.shape[0]
    return _tangent_direction(v, mv, v, mv, jnp.arange(v.shape[1]), method)


@functools.cache
def _jitted_direction(method: str):
    import jax

    return jax.jit(functools.partial(_serial_direction, method=method))


def _x64(fn):
    """Run ``fn`` with JAX's 64-bit mode on, restoring the caller's setting afterwards."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import jax

        with jax.enable_x64(True):
            return fn(*args, **kwargs)
    return wrapper


@_x64
def direction(v: Any, x: Any, method: str = "mu") -> np.ndarray:
    """The tangent (Riemannian) direction ``g`` of every player for the batch ``x``
    (``M_B = x^T x / b``), as a (d, k) float64 array. See the module docstring."""
    check_choice("method", method, METHODS)
    x = _data("x", x)
    v = _vectors("v", v, x.shape[1])
    return np.asarray(_jitted_direction(method)(v, x))


@_x64
def update(v: Any, x: Any, lr: float, method: str = "mu") -> np.ndarray:
    """One EigenGame step of all players on the batch ``x``: ``normalise(v + lr * g)``."""
    check_choice("method", method, METHODS)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    x = _data("x", x)
    v = _vectors("v", v, x.shape[1])
    return np.asarray(_step(v, _jitted_direction(method)(v, x), lr))


# ---------------------------------------------------------------------------------------------
# The bias of the minibatch directions, measured by Monte Carlo
# ---------------------------------------------------------------------------------------------

@functools.cache
def _bias_sums(method: str, batch: int, samples: int):
    import jax
    import jax.numpy as jnp

    def run(v, x, key):
        def one(carry, key_s):
            idx = jax.random.randint(key_s, (batch,), 0, x.shape[0])
            g = _serial_direction(v, x[idx], method)
            return (carry[0] + g, carry[1] + g * g), None

        zero = jnp.zeros_like(v)
        return jax.lax.scan(one, (zero, zero), jax.random.split(key, samples))[0]

    return jax.jit(run)


@_x64
def minibatch_bias(v: Any, x: Any, *, batch: int, samples: int = 4000, method: str = "mu",
                   seed: int = 0) -> dict:
    """Monte Carlo test of ``E[direction(v, X_B)] == direction(v, X)``.

    Draws ``samples`` minibatches of ``batch`` rows of ``x`` uniformly with replacement (so
    ``E[M_B] = M`` exactly), computes each one's direction, and compares their mean with the
    full-batch direction, coordinate by coordinate, in units of the standard error of the
    mean. Returns ``{"full", "mean", "se"}`` ((d, k) arrays), ``"z" = (mean - full) / se``,
    ``"max_abs_z"``, ``"bias_norm" = ||mean - full||_F``, ``"se_norm" = sqrt(sum se^2)`` (what
    ``bias_norm`` would be from noise alone) and ``"full_norm"``.
    """
    import jax

    check_choice("method", method, METHODS)
    x = _data("x", x)
    v = _vectors("v", v, x.shape[1])
    batch = check_int("batch", batch, lo=1)
    samples = check_int("samples", samples, lo=2)
    seed = check_int("seed", seed, lo=0)
    full = np.asarray(_jitted_direction(method)(v, x))
    s1, s2 = _bias_sums(method, batch, samples)(v, x, jax.random.PRNGKey(seed))
    mean = np.asarray(s1) / samples
    var = np.maximum(np.asarray(s2) / samples - mean ** 2, 0.0) * samples / (samples - 1)
    se = np.sqrt(var / samples)
    z = (mean - full) / np.where(se > 0, se, np.inf)
    return {"full": full, "mean": mean, "se": se, "z": z, "max_abs_z": float(np.abs(z).max()),
            "bias_norm": float(np.linalg.norm(mean - full)),
            "se_norm": float(np.sqrt(np.sum(se ** 2))), "full_norm": float(np.linalg.norm(full))}
