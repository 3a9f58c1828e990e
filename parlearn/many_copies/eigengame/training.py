"""EigenGame training: the serial reference :func:`fit` and :func:`fit_sharded` on a JAX mesh.

Data parallelism is exact for both methods: ``M_B v = sum_r X_r^T X_r v / b`` over the
devices' row blocks ``X_r`` (a sum over rows splits into sums over blocks), one ``psum``. What
mu's linearity adds: the mean of the devices' own directions (each from its ``b / D`` rows) is
also the whole batch's direction, whereas for alpha it is the biased direction of a batch of
``b / D``. :func:`fit_sharded` runs the same updates on a 2-D mesh ``("data", "players")``
with ``jax.shard_map``: the minibatch rows are split over "data", the k players over
"players"; each step all-gathers V over "players" (every player needs the ones before it) and
psums ``X_r^T X_r V`` over "data". :func:`fit` is the
single-device serial reference it equals to round-off (float64), both with JAX's 64-bit
mode switched on locally (see :mod:`parlearn.many_copies.eigengame.game`).

Minibatches: the rows are shuffled once (``seed``) and dealt into ``n // batch`` batches of
consecutive rows (the ``n mod batch`` rows left over are not used; ``fit`` reports
``rows_used``); step t uses batch ``t mod (n // batch)``. On a mesh, device r of "data"
keeps rows ``[r b / D, (r+1) b / D)`` of every batch for the whole run, as a real
data-parallel job keeps its shard.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from parlearn.core.checks import check_choice, check_float, check_int
from parlearn.many_copies.eigengame.game import METHODS, _step, _tangent_direction, _x64
from parlearn.many_copies.eigengame.inputs import _data, _vectors, init_vectors

__all__ = ["fit", "fit_sharded"]

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


def _mesh(name: str, shape: Any) -> tuple[int, int]:
    """``shape`` as a ``(data, players)`` pair of ints >= 1, or an error naming ``name``."""
    if isinstance(shape, str) or not isinstance(shape, tuple | list) or len(shape) != 2:
        raise ValueError(f"{name} must be (data, players), got {shape!r}")
    return (check_int(f"{name}[0] (data)", shape[0], lo=1),
            check_int(f"{name}[1] (players)", shape[1], lo=1))


def _fits_mesh(name: str, mesh: tuple[int, int], batch: int, k: int) -> None:
    """The rows of a batch split over ``data``, the k players over ``players``."""
    data, players = mesh
    if batch % data:
        raise ValueError(f"batch={batch} must be a multiple of the data axis of {name}="
                         f"{tuple(mesh)} ({data})")
    if k % players:
        raise ValueError(f"k={k} must be a multiple of the players axis of {name}="
                         f"{tuple(mesh)} ({players})")


def _check_devices(data: int, players: int) -> None:
    """A ``data x players`` mesh needs that many JAX devices (fixed when JAX starts)."""
    import jax

    if jax.device_count() < data * players:
        raise RuntimeError(f"JAX has {jax.device_count()} device(s); a {data}x{players} mesh "
                           f"needs {data * players}: call parlearn.device.fake_jax_cpu_devices("
                           f"{data * players}) before JAX starts, or use run_with_devices")


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

    _check_devices(data, players)
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
    data, players = _mesh("mesh_shape", mesh_shape)
    x, k, batch, lr, steps, every, seed, v0 = _check_fit(x, k, method, batch, lr, steps,
                                                          record_every, seed, v0)
    _fits_mesh("mesh_shape", (data, players), batch, k)
    batches = _batches(x, batch, seed)
    run = _sharded_fit(data, players, method, every, steps // every)
    snaps = np.asarray(run(v0, batches, lr))
    return {"v": snaps[-1], "snapshots": snaps, "steps": list(range(every, steps + 1, every)),
            "rows_used": int(batches.shape[0] * batch)}
