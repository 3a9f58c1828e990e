"""EigenGame: PCA as a game, its unbiased minibatch update, sharded over a JAX mesh.

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

Data parallelism is exact for both methods: ``M_B v = sum_r X_r^T X_r v / b`` over the
devices' row blocks ``X_r`` (a sum over rows splits into sums over blocks), one ``psum``. What
mu's linearity adds: the mean of the devices' own directions (each from its ``b / D`` rows) is
also the whole batch's direction, whereas for alpha it is the biased direction of a batch of
``b / D``. :func:`fit_sharded` runs the same updates on a 2-D mesh ``("data", "players")``
with ``jax.shard_map``: the minibatch rows are split over "data", the k players over
"players"; each step all-gathers V over "players" (every player needs the ones before it) and
psums ``X_r^T X_r V`` over "data". :func:`fit` is the
single-device serial reference it equals to round-off (float64). Computations run with JAX
64-bit mode switched on *locally* (``jax.enable_x64``), leaving the caller's config as it was.

Sources: the papers' abstracts and update equations; the full texts were not read here. The
mu and alpha directions agree with a public port of the 2022 paper's Appendix-B pseudocode
(up to the 1/b scale). The surrounding choices are ours: all players step at once with plain
SGD and a constant ``lr`` (no momentum), minibatches are dealt as below.

Minibatches: the rows are shuffled once (``seed``) and dealt into ``n // batch`` batches of
consecutive rows (the ``n mod batch`` rows left over are not used; ``fit`` reports
``rows_used``); step t uses batch ``t mod (n // batch)``. On a mesh, device r of "data"
keeps rows ``[r b / D, (r+1) b / D)`` of every batch for the whole run, as a real
data-parallel job keeps its shard.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from parlearn.core.checks import check_choice, check_float, check_int

__all__ = ["METHODS", "synthetic_data", "init_vectors", "top_eigenvectors", "direction",
           "update", "fit", "fit_sharded", "abs_cosines", "longest_streak", "minibatch_bias",
           "compare_sharded", "collective_bytes", "run_with_devices", "throughput",
           "sharded_throughput", "bench"]

METHODS = ("mu", "alpha")
"""``"mu"``: EigenGame Unloaded (unbiased); ``"alpha"``: the original EigenGame."""


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

def _data(name: str, x: Any) -> np.ndarray:
    """``x`` as a finite float64 (n, d) numpy array, or a clear error."""
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().numpy()
    if not isinstance(x, np.ndarray) and not hasattr(x, "__array__"):
        raise TypeError(f"{name} must be an array (n, d), got {type(x).__name__}")
    x = np.asarray(x)
    if x.ndim != 2 or min(x.shape) < 1:
        raise ValueError(f"{name} must be a 2-D array (n, d) with n, d >= 1, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"{name} must hold floating-point numbers, got {x.dtype}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} must not contain NaN or infinity")
    return x.astype(np.float64)


def _vectors(name: str, v: Any, d: int) -> np.ndarray:
    v = _data(name, v)
    if v.shape[0] != d:
        raise ValueError(f"{name} must have d={d} rows (one column per player), got {v.shape}")
    if v.shape[1] > d:
        raise ValueError(f"{name} has {v.shape[1]} players; at most d={d}")
    return v


def synthetic_data(n: int, d: int, *, decay: float = 0.7, seed: int = 0) -> np.ndarray:
    """``n`` centred Gaussian rows in ``d`` dimensions whose covariance has eigenvalues
    ``decay**i`` (i = 0..d-1) along random orthonormal directions.

    Distinct eigenvalues with a gap of ``1 - decay`` relative to the larger: the top
    eigenvectors are well defined. Uses ``numpy.random.default_rng(seed)`` only.
    """
    n, d = check_int("n", n, lo=2), check_int("d", d, lo=1)
    decay = check_float("decay", decay, lo=0, hi=1, lo_open=True, hi_open=True)
    seed = check_int("seed", seed, lo=0)
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    x = rng.standard_normal((n, d)) * np.sqrt(decay ** np.arange(d)) @ q.T
    return x - x.mean(axis=0)


def init_vectors(d: int, k: int, *, seed: int = 0) -> np.ndarray:
    """``k`` random unit columns in ``d`` dimensions (a (d, k) array), from ``seed``."""
    d, k = check_int("d", d, lo=1), check_int("k", k, lo=1, hi=d)
    v = np.random.default_rng(check_int("seed", seed, lo=0)).standard_normal((d, k))
    return v / np.linalg.norm(v, axis=0)


def top_eigenvectors(x: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(eigenvalues, eigenvectors)`` of ``M = X^T X / n`` from ``numpy.linalg.eigh``, the
    top ``k`` in decreasing order (vectors as the columns of a (d, k) array)."""
    x = _data("x", x)
    k = check_int("k", k, lo=1, hi=x.shape[1])
    lam, u = np.linalg.eigh(x.T @ x / x.shape[0])
    return lam[::-1][:k].copy(), u[:, ::-1][:, :k].copy()


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
# Training: the serial reference and the sharded version, side by side
# ---------------------------------------------------------------------------------------------

def _batches(x: np.ndarray, batch: int, seed: int) -> np.ndarray:
    """Shuffle the rows once and deal them into (n // batch, batch, d) minibatches."""
    perm = np.random.default_rng(seed).permutation(x.shape[0])
    count = x.shape[0] // batch
    return x[perm[:count * batch]].reshape(count, batch, x.shape[1])


def _check_fit(x, k, method, batch, lr, steps, record_every, seed, v0):
    x = _data("x", x)
    n, d = x.shape
    k = check_int("k", k, lo=1, hi=d)
    check_choice("method", method, METHODS)
    batch = n if batch is None else check_int("batch", batch, lo=1, hi=n)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    steps = check_int("steps", steps, lo=1)
    record_every = steps if record_every is None else check_int("record_every", record_every,
                                                                 lo=1, hi=steps)
    if steps % record_every:
        raise ValueError(f"steps={steps} must be a multiple of record_every={record_every}")
    seed = check_int("seed", seed, lo=0)
    v0 = init_vectors(d, k, seed=seed) if v0 is None else _vectors("v0", v0, d)
    if v0.shape[1] != k:
        raise ValueError(f"v0 must have k={k} columns, got {v0.shape[1]}")
    return x, k, batch, lr, steps, record_every, seed, v0


@functools.cache
def _serial_fit(method: str, per_record: int, records: int):
    import jax
    import jax.numpy as jnp

    def run(v0, batches, lr):
        count = batches.shape[0]
        mine = jnp.arange(v0.shape[1])

        def one_step(v, t):
            xb = batches[t % count]
            mv = xb.T @ (xb @ v) / xb.shape[0]
            return _step(v, _tangent_direction(v, mv, v, mv, mine, method), lr), None

        def chunk(v, r):
            v, _ = jax.lax.scan(one_step, v, r * per_record + jnp.arange(per_record))
            return v, v

        return jax.lax.scan(chunk, v0, jnp.arange(records))[1]

    return jax.jit(run)


@_x64
def fit(x: Any, k: int, *, method: str = "mu", batch: int | None = None, lr: float = 0.1,
        steps: int = 500, record_every: int | None = None, seed: int = 0,
        v0: Any = None) -> dict:
    """Run EigenGame on one device: every player updated at once, ``steps`` times.

    ``batch`` rows per step (default: all rows, full batch; see the module docstring for
    how batches are dealt), ``v0`` the starting vectors (default :func:`init_vectors` with
    ``seed``). Returns ``{"v": (d, k) final vectors, "snapshots": (steps // record_every,
    d, k) vectors after every ``record_every`` steps, "steps": the step count of each
    snapshot, "rows_used": rows that appear in some batch}``. The serial reference of
    :func:`fit_sharded`.
    """
    x, k, batch, lr, steps, every, seed, v0 = _check_fit(x, k, method, batch, lr, steps,
                                                          record_every, seed, v0)
    batches = _batches(x, batch, seed)
    snaps = np.asarray(_serial_fit(method, every, steps // every)(v0, batches, lr))
    return {"v": snaps[-1], "snapshots": snaps, "steps": list(range(every, steps + 1, every)),
            "rows_used": int(batches.shape[0] * batch)}


@functools.cache
def _sharded_fit(data: int, players: int, method: str, per_record: int, records: int):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    if jax.device_count() < data * players:
        raise RuntimeError(f"JAX has {jax.device_count()} device(s); a {data}x{players} mesh "
                           f"needs {data * players}: call parlearn.device.fake_jax_cpu_devices("
                           f"{data * players}) before JAX starts, or use run_with_devices")
    mesh = jax.make_mesh((data, players), ("data", "players"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:data * players])

    def run(v0, batches, lr):
        # Local view: v0 (d, k/players) this device's players; batches (count, b/data, d)
        # this device's rows of every batch; lr replicated.
        count, kl = batches.shape[0], v0.shape[1]
        b = batches.shape[1] * data                                  # the global batch
        mine = jax.lax.axis_index("players") * kl + jnp.arange(kl)

        def one_step(v, t):
            xb = batches[t % count]
            v_all = jax.lax.all_gather(v, "players", axis=1, tiled=True)   # (d, k)
            if method == "mu":
                mv = jax.lax.psum(xb.T @ (xb @ v), "data") / b    # the mean of sharded M v
                mv_all = None
            else:  # alpha also needs M v_j of the players before i
                mv_all = jax.lax.psum(xb.T @ (xb @ v_all), "data") / b
                mv = jax.lax.dynamic_slice_in_dim(mv_all, mine[0], kl, axis=1)
            return _step(v, _tangent_direction(v, mv, v_all, mv_all, mine, method), lr), None

        def chunk(v, r):
            v, _ = jax.lax.scan(one_step, v, r * per_record + jnp.arange(per_record))
            return v, v

        return jax.lax.scan(chunk, v0, jnp.arange(records))[1]

    return jax.jit(jax.shard_map(run, mesh=mesh,
                                 in_specs=(P(None, "players"), P(None, "data", None), P()),
                                 out_specs=P(None, None, "players")))


@_x64
def fit_sharded(x: Any, k: int, *, mesh_shape: tuple[int, int] = (8, 1), method: str = "mu",
                batch: int | None = None, lr: float = 0.1, steps: int = 500,
                record_every: int | None = None, seed: int = 0, v0: Any = None) -> dict:
    """:func:`fit` on a ``(data, players)`` mesh of JAX devices with ``jax.shard_map``.

    Each batch's rows are split over the ``data`` axis and the k players over ``players``
    (so ``batch`` must be a multiple of ``data`` and ``k`` of ``players``). Each step
    all-gathers the vectors over ``players`` and psums ``X_r^T X_r V`` over ``data``. Needs
    ``data * players`` devices (fake CPU devices: :func:`parlearn.device.fake_jax_cpu_devices`
    before JAX starts, or call through :func:`run_with_devices`). Same arguments and result
    as :func:`fit`, and equal to it to round-off.
    """
    if (not isinstance(mesh_shape, (tuple, list)) or len(mesh_shape) != 2):
        raise ValueError(f"mesh_shape must be (data, players), got {mesh_shape!r}")
    data = check_int("mesh_shape[0] (data)", mesh_shape[0], lo=1)
    players = check_int("mesh_shape[1] (players)", mesh_shape[1], lo=1)
    x, k, batch, lr, steps, every, seed, v0 = _check_fit(x, k, method, batch, lr, steps,
                                                          record_every, seed, v0)
    if batch % data:
        raise ValueError(f"batch={batch} must be a multiple of the data axis ({data})")
    if k % players:
        raise ValueError(f"k={k} must be a multiple of the players axis ({players})")
    batches = _batches(x, batch, seed)
    run = _sharded_fit(data, players, method, every, steps // every)
    snaps = np.asarray(run(v0, batches, lr))
    return {"v": snaps[-1], "snapshots": snaps, "steps": list(range(every, steps + 1, every)),
            "rows_used": int(batches.shape[0] * batch)}


# ---------------------------------------------------------------------------------------------
# Measures of convergence
# ---------------------------------------------------------------------------------------------

def abs_cosines(v: Any, u: Any) -> np.ndarray:
    """``|cos|`` between each player ``v[:, i]`` and eigenvector ``u[:, i]`` (1 = found it;
    the sign of an eigenvector is arbitrary). Works on one (d, k) array or a stack
    (..., d, k) of snapshots."""
    v, u = np.asarray(v, dtype=np.float64), np.asarray(u, dtype=np.float64)
    if v.shape[-2:] != u.shape[-2:]:
        raise ValueError(f"v and u must have the same (d, k) shape, got {v.shape}, {u.shape}")
    num = np.abs(np.sum(v * u, axis=-2))
    return num / (np.linalg.norm(v, axis=-2) * np.linalg.norm(u, axis=-2))


def longest_streak(v: Any, u: Any, *, angle: float = math.pi / 8) -> np.ndarray:
    """How many leading players in a row lie within ``angle`` radians of their eigenvector
    (Gemp et al.'s "longest correct eigenvector streak"); per snapshot for a stack."""
    angle = check_float("angle", angle, lo=0, hi=math.pi / 2, lo_open=True)
    ok = abs_cosines(v, u) >= math.cos(angle)
    return np.cumprod(ok, axis=-1).sum(axis=-1)


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


# ---------------------------------------------------------------------------------------------
# Parallel equals serial, on fake devices in a child process when JAX already runs here
# ---------------------------------------------------------------------------------------------

def compare_sharded(x: Any, k: int, mesh_shapes: Sequence[tuple[int, int]], **fit_kwargs
                    ) -> dict:
    """:func:`fit` and :func:`fit_sharded` on each of ``mesh_shapes`` with the same arguments.

    Returns ``{"serial": final (d, k) vectors, "sharded": {"DxP": final vectors},
    "max_abs_diff": {"DxP": max |sharded - serial| over all snapshots}}``.
    """
    ref = fit(x, k, **fit_kwargs)
    out: dict = {"serial": ref["v"], "sharded": {}, "max_abs_diff": {}}
    for shape in mesh_shapes:
        res = fit_sharded(x, k, mesh_shape=tuple(shape), **fit_kwargs)
        name = f"{shape[0]}x{shape[1]}"
        out["sharded"][name] = res["v"]
        out["max_abs_diff"][name] = float(np.abs(res["snapshots"] - ref["snapshots"]).max())
    return out


_SIZES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "s64": 8, "pred": 1}


@_x64
def collective_bytes(x: Any, k: int, *, mesh_shape: tuple[int, int], batch: int,
                     method: str = "mu") -> dict[str, int]:
    """Bytes per device of the collectives XLA compiled into one :func:`fit_sharded` step.

    Reads the compiled HLO: ``{"all-reduce": bytes, "all-gather": bytes}``, each the total
    size of the arrays those ops return on one device (float64). Needs the mesh's devices.
    """
    import re

    data, players = (check_int("mesh_shape", n, lo=1) for n in mesh_shape)
    x, k, batch, _, _, _, _, v0 = _check_fit(x, k, method, batch, 0.1, 1, 1, 0, None)
    if batch % data or k % players:
        raise ValueError(f"mesh {data}x{players}: batch={batch} must be a multiple of {data} "
                         f"and k={k} of {players}")
    run = _sharded_fit(data, players, method, 1, 1)
    text = run.lower(v0, _batches(x, batch, 0), 0.1).compile().as_text()
    out = {"all-reduce": 0, "all-gather": 0}
    for line in text.splitlines():
        m = re.search(r"=\s*(\S+)\s+(all-reduce|all-gather)(-start)?\(", line)
        if m:
            dt, dims = re.match(r"(\w+)\[([0-9,]*)\]", m.group(1)).groups()
            out[m.group(2)] += _SIZES[dt] * math.prod(int(n) for n in dims.split(",") if n)
    return out


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {"__array__": obj.tolist()}
    if isinstance(obj, dict):
        return {key: _jsonable(val) for key, val in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(val) for val in obj]
    return obj


def _from_json(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__array__"}:
            return np.asarray(obj["__array__"], dtype=np.float64)
        return {key: _from_json(val) for key, val in obj.items()}
    if isinstance(obj, list):
        return [_from_json(val) for val in obj]
    return obj


_CHILD = ("import json, sys; from parlearn import eigengame as e; "
          "a = e._from_json(json.loads(sys.stdin.read())); "
          "print(json.dumps(e._jsonable(getattr(e, a['function'])(*a['args'], **a['kwargs']))))")


def run_with_devices(n_devices: int, function: str, *args: Any, timeout: float = 300,
                     **kwargs: Any) -> Any:
    """Call ``parlearn.eigengame.<function>(*args, **kwargs)`` in a fresh Python whose JAX
    has ``n_devices`` fake CPU devices, and return its result (numpy arrays round-trip).

    The device count is fixed when JAX starts, so a notebook or test where JAX may already
    run asks a child process (a few seconds of start-up and compilation).
    """
    n_devices = check_int("n_devices", n_devices, lo=1)
    check_choice("function", function, [n for n in __all__ if n not in ("run_with_devices",
                                                                          "bench", "METHODS")])
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(n_devices), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    payload = json.dumps(_jsonable({"function": function, "args": list(args),
                                    "kwargs": kwargs}))
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=payload, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the JAX child process failed:\n{proc.stderr[-3000:]}")
    return _from_json(json.loads(proc.stdout.strip().splitlines()[-1]))


# ---------------------------------------------------------------------------------------------
# Speed: batched vs batch-1 updates, sharded vs one device (measured)
# ---------------------------------------------------------------------------------------------

_DTYPES = ("float32", "float64")


def _timed_fit(run, v0, batches, lr):
    return lambda: run(v0, batches, lr).block_until_ready()


@_x64
def throughput(x: Any, k: int, *, batch_sizes: Sequence[int] = (1, 8, 64, 512),
               samples: int = 4096, method: str = "mu", lr: float = 0.1, repeat: int = 5,
               dtype: str = "float32", seed: int = 0) -> dict:
    """Samples per second of EigenGame on one JAX device, batched vs batch-1, measured.

    For each ``b`` in ``batch_sizes`` the same ``samples`` rows go through ``samples // b``
    updates of batch ``b`` ("batched") and through ``samples`` updates of batch 1
    ("batch 1", the baseline), both one jitted ``lax.scan``; the two are timed interleaved
    (:func:`parlearn.timing.compare`, ``repeat`` repeats after a compiling warm-up).
    Returns :func:`parlearn.timing.sweep`'s dict over ``batch_sizes`` plus
    ``"samples_per_s"`` and ``"updates_per_s"`` (lists, batched, from the medians) and
    ``"batch1_samples_per_s"``. The ``speedup`` of "batched" is its samples/s over batch 1's.
    ``"threads"`` is ``"XLA's"``: XLA's own CPU thread pool does the work.
    """
    import jax.numpy as jnp

    from parlearn.core.timing import sweep

    x = _data("x", x)
    k = check_int("k", k, lo=1, hi=x.shape[1])
    sizes = [check_int("batch_sizes", b, lo=1, hi=x.shape[0]) for b in batch_sizes]
    samples = check_int("samples", samples, lo=1, hi=x.shape[0])
    if not sizes or any(samples % b for b in sizes):
        raise ValueError(f"samples={samples} must be a multiple of every batch size {sizes}")
    check_choice("method", method, METHODS)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    repeat = check_int("repeat", repeat, lo=1)
    check_choice("dtype", dtype, _DTYPES)
    seed = check_int("seed", seed, lo=0)
    xs = jnp.asarray(x[np.random.default_rng(seed).permutation(x.shape[0])[:samples]], dtype)
    v0 = jnp.asarray(init_vectors(x.shape[1], k, seed=seed), dtype)

    def runner(b):
        return _timed_fit(_serial_fit(method, samples // b, 1), v0,
                          xs.reshape(samples // b, b, x.shape[1]), lr)

    one = runner(1)
    out = sweep(sizes, lambda b: {"batch 1": one, "batched": runner(b)}, warmup=1,
                repeat=repeat)
    out["batch1_samples_per_s"] = [samples / t for t in out["median_s"]["batch 1"]]
    out["samples_per_s"] = [samples / t for t in out["median_s"]["batched"]]
    out["updates_per_s"] = [samples / b / t for b, t in zip(sizes, out["median_s"]["batched"],
                                                             strict=True)]
    # XLA runs on its own CPU thread pool; torch's thread count (what sweep records) says
    # nothing about it.
    out.update(samples=samples, method=method, dtype=dtype, device="cpu (JAX)",
               threads="XLA's")
    return out


@_x64
def sharded_throughput(x: Any, k: int, *, mesh_shapes: Sequence[tuple[int, int]] = ((8, 1),),
                       batch: int = 512, steps: int = 64, method: str = "mu", lr: float = 0.1,
                       repeat: int = 5, dtype: str = "float32", seed: int = 0) -> dict:
    """Seconds for ``steps`` updates of global batch ``batch``: one device (:func:`fit`'s
    program) vs :func:`fit_sharded`'s on each mesh, measured interleaved.

    Returns ``{"median_s": {name: s}, "spread": {name: IQR/median}, "speedup": {mesh: one
    device / mesh}, "speedup_range": {mesh: (lo, hi)}, "reliable", "samples_per_s": {name}}``
    with names ``"1 device"`` and ``"DxP mesh"``. Fake CPU devices share this machine's
    cores, so on a CPU this measures the cost of sharding, not a speedup from it.
    """
    import jax.numpy as jnp

    from parlearn.core.timing import compare

    x = _data("x", x)
    k = check_int("k", k, lo=1, hi=x.shape[1])
    batch = check_int("batch", batch, lo=1, hi=x.shape[0])
    steps = check_int("steps", steps, lo=1)
    check_choice("method", method, METHODS)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    repeat = check_int("repeat", repeat, lo=1)
    check_choice("dtype", dtype, _DTYPES)
    batches = jnp.asarray(_batches(x, batch, check_int("seed", seed, lo=0)), dtype)
    v0 = jnp.asarray(init_vectors(x.shape[1], k, seed=seed), dtype)
    cands = {"1 device": _timed_fit(_serial_fit(method, steps, 1), v0, batches, lr)}
    for data, players in mesh_shapes:
        if batch % data or k % players:
            raise ValueError(f"mesh {data}x{players}: batch={batch} must be a multiple of "
                             f"{data} and k={k} of {players}")
        cands[f"{data}x{players} mesh"] = _timed_fit(
            _sharded_fit(data, players, method, steps, 1), v0, batches, lr)
    cmp = compare(cands, warmup=1, repeat=repeat)
    meshes = [n for n in cands if n != "1 device"]
    return {"median_s": {n: t.median for n, t in cmp.timings.items()},
            "spread": {n: t.spread for n, t in cmp.timings.items()},
            "speedup": {n: cmp.speedup(n) for n in meshes},
            "speedup_range": {n: cmp.speedup_range(n) for n in meshes},
            "samples_per_s": {n: steps * batch / t.median for n, t in cmp.timings.items()},
            "reliable": cmp.reliable, "batch": batch, "steps": steps, "dtype": dtype}


def bench(device: Any, quick: bool) -> list:
    """Rows for ``python -m parlearn.bench eigengame``, measured with JAX on the CPU.

    1. samples/s of batched mu-EigenGame updates over batch-1 updates (same samples, one
       device); 2. one update step of global batch 512 on a mesh of 8 fake CPU devices over
       the same on one device. Both run in child processes (1 and 8 fake CPU devices), so
       JAX never starts in the bench process. ``device`` is not used: JAX runs on the CPU
       here (the rows say so).
    """
    from parlearn.core.bench import Row

    del device  # JAX on the CPU, see the docstring
    x = synthetic_data(4096, 64, decay=0.9, seed=0)
    k, big = 8, 256 if quick else 1024
    # JAX runs in child processes: the bench process may fork later (dist.run), and a forked
    # process with JAX running can deadlock.
    tp = run_with_devices(1, "throughput", x, k, batch_sizes=[big],
                          samples=big * 8 if quick else 4096, repeat=3 if quick else 7)
    lo, hi = tp["speedup_lo"]["batched"][0], tp["speedup_hi"]["batched"][0]
    rows = [Row(f"eigengame mu, d=64 k=8, {tp['samples']} samples", "batch-1 updates",
                f"batch-{big} updates", tp["speedup"]["batched"][0], "cpu (JAX, 1 device)",
                detail=(f"samples/s {tp['batch1_samples_per_s'][0]:.3g} -> "
                        f"{tp['samples_per_s'][0]:.3g} (IQR of ratio {lo:.1f}-{hi:.1f}x, "
                        f"float32)" + ("" if tp["reliable"] else "; timing unreliable")))]
    sh = run_with_devices(8, "sharded_throughput", x, k, mesh_shapes=[[8, 1], [4, 2]],
                          batch=512, steps=16 if quick else 64, repeat=3 if quick else 7)
    for name, ratio in sh["speedup"].items():
        a, b = sh["speedup_range"][name]
        rows.append(Row(f"eigengame mu, d=64 k=8, batch 512, {sh['steps']} steps",
                        "1 device", f"{name} (8 fake CPU devices)", ratio,
                        f"cpu, {os.cpu_count()} cores shared by 8 fake devices",
                        detail=(f"IQR {a:.2f}-{b:.2f}x; fake devices share the cores, so this "
                                "is the cost of sharding here, not a speedup"
                                + ("" if sh["reliable"] else "; timing unreliable"))))
    return rows
