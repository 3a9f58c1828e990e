"""Weight-update sharding in JAX: the same Adam update with an explicit ``psum_scatter``.

:func:`jax_sharded_adam` runs the update on a mesh of fake CPU devices against the
unsharded one and counts the collectives XLA compiled; :func:`jax_sharded_adam_subprocess`
runs it in a fresh interpreter, since JAX fixes its device count when it starts. JAX is
imported inside the functions: importing this module does not start it.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

from parlearn.core.checks import check_float, check_int

__all__ = ["jax_sharded_adam", "jax_sharded_adam_subprocess"]


# ---------------------------------------------------------------------------------------------
# JAX: the same update with an explicit psum_scatter on a mesh
# ---------------------------------------------------------------------------------------------

def _check_args(n_devices, n_in, n_out, batch, steps, lr, seed) -> None:
    for name, v in (("n_devices", n_devices), ("n_in", n_in), ("n_out", n_out),
                    ("batch", batch), ("steps", steps)):
        check_int(name, v, lo=1)
    check_float("lr", lr, lo=0, lo_open=True)
    check_int("seed", seed, lo=0)


def jax_sharded_adam(n_devices: int = 8, *, n_in: int = 13, n_out: int = 3, batch: int = 4,
                     steps: int = 3, lr: float = 1e-2, seed: int = 0) -> dict:
    """Weight-update sharding in JAX on ``n_devices`` devices, against the unsharded update.

    A linear model ``y = x W`` with ``W`` flattened and padded to a multiple of N. Inside
    ``jax.shard_map`` each device takes the gradient of its own batch slice, the gradients
    are ``psum_scatter``-ed (each device gets the sum of its 1/N slice), Adam runs on the
    slice, and ``all_gather`` rebuilds ``W``. The reference is one unsharded Adam step on
    the whole batch. Needs ``n_devices`` JAX devices (on CPU: ``JAX_NUM_CPU_DEVICES`` set
    before JAX starts, see :func:`jax_sharded_adam_subprocess`). Runs in float64 mode.

    Returns ``{"max_abs_diff", "n_devices", "numel", "padded", "collectives": {op: count},
    "hlo_shapes": {op: [shape text, ...]}}`` from the compiled HLO of one sharded step.
    """
    _check_args(n_devices, n_in, n_out, batch, steps, lr, seed)
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    if jax.device_count() < n_devices:
        raise RuntimeError(f"JAX has {jax.device_count()} device(s), need {n_devices}: set "
                           f"JAX_NUM_CPU_DEVICES={n_devices} before JAX starts, or call "
                           "jax_sharded_adam_subprocess")
    mesh = jax.make_mesh((n_devices,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n_devices])
    numel = n_in * n_out
    padded = math.ceil(numel / n_devices) * n_devices
    b1, b2, eps = 0.9, 0.999, 1e-8

    def loss(flat_w, x, y):
        w = flat_w[:numel].reshape(n_in, n_out)
        return jnp.mean((x @ w - y) ** 2)

    def adam(p, g, m, v, t):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr / (1 - b1 ** t) * m / (jnp.sqrt(v) / jnp.sqrt(1 - b2 ** t) + eps)
        return p, m, v

    def sharded_step(w, m, v, x, y, t):
        # w replicated (padded); m, v: this device's 1/N slice; x, y: this device's batch.
        g = jax.grad(loss)(w, x, y)            # the local gradient: check_vma=False, no psum
        g = jax.lax.psum_scatter(g, "d", scatter_dimension=0, tiled=True) / n_devices
        i = jax.lax.axis_index("d")
        w_mine = jax.lax.dynamic_slice_in_dim(w, i * (padded // n_devices), padded // n_devices)
        w_mine, m, v = adam(w_mine, g, m, v, t)
        return jax.lax.all_gather(w_mine, "d", tiled=True), m, v

    step = jax.jit(jax.shard_map(sharded_step, mesh=mesh,
                                 in_specs=(P(), P("d"), P("d"), P("d"), P("d"), P()),
                                 out_specs=(P(), P("d"), P("d")), check_vma=False))

    @jax.jit
    def full_step(w, m, v, x, y, t):
        return adam(w, jax.grad(loss)(w, x, y), m, v, t)

    key = jax.random.PRNGKey(seed)
    kw, kx, ky = jax.random.split(key, 3)
    w0 = jnp.zeros(padded).at[:numel].set(jax.random.normal(kw, (numel,)))
    ws, wf = w0, w0
    ms = vs = mf = vf = jnp.zeros(padded)
    x_all = jax.random.normal(kx, (steps, n_devices * batch, n_in))
    y_all = jax.random.normal(ky, (steps, n_devices * batch, n_out))
    # Compile once: the executable that runs the steps is the one whose HLO is counted.
    compiled = step.lower(ws, ms, vs, x_all[0], y_all[0], jnp.float64(1)).compile()
    diff, moved = 0.0, 0.0
    for t in range(1, steps + 1):
        x, y = x_all[t - 1], y_all[t - 1]
        ws_new, ms, vs = compiled(ws, ms, vs, x, y, jnp.float64(t))
        wf_new, mf, vf = full_step(wf, mf, vf, x, y, jnp.float64(t))
        moved = max(moved, float(jnp.max(jnp.abs(wf_new - wf))))
        ws, wf = ws_new, wf_new
        diff = max(diff, float(jnp.max(jnp.abs(ws - wf))))
    counts, shapes = _hlo_collectives(compiled.as_text())
    return {"max_abs_diff": diff, "max_update": moved, "n_devices": n_devices, "numel": numel,
            "padded": padded, "collectives": counts, "hlo_shapes": shapes}


_HLO_OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")


def _hlo_collectives(hlo: str) -> tuple[dict[str, int], dict[str, list[str]]]:
    """Count the collective instructions of compiled HLO text, with their result shapes."""
    counts = {op: 0 for op in _HLO_OPS}
    shapes: dict[str, list[str]] = {op: [] for op in _HLO_OPS}
    for line in hlo.splitlines():
        if "=" not in line:
            continue
        lhs, rhs = line.split("=", 1)
        rhs = rhs.strip()
        for op in _HLO_OPS:
            # "%x = f64[13]{0} reduce-scatter(...)" or the async "-start" form; "-done" is the
            # same collective's second half and is not counted again.
            head = rhs.split("(", 1)[0]
            if head.endswith(f" {op}") or head.endswith(f" {op}-start"):
                counts[op] += 1
                shapes[op].append(head.rsplit(" ", 1)[0])
    return counts, shapes


def jax_sharded_adam_subprocess(n_devices: int = 8, *, timeout: float = 120, **kwargs) -> dict:
    """:func:`jax_sharded_adam` in a fresh Python with ``JAX_NUM_CPU_DEVICES=n_devices``.

    The device count is fixed when JAX starts, so a notebook or test where JAX may already
    run asks a child process (about 2-5 s of start-up).
    """
    import inspect
    import json

    check_float("timeout", timeout, lo=0, lo_open=True)
    # Check here what the child would refuse, so a bad argument names itself, not a child's
    # traceback (and costs no interpreter start).
    try:
        bound = inspect.signature(jax_sharded_adam).bind(n_devices, **kwargs)
    except TypeError as e:
        raise TypeError(f"jax_sharded_adam_subprocess: {e}") from None
    bound.apply_defaults()
    _check_args(**bound.arguments)
    # The folder that holds the parlearn package: this file is parlearn/multi_device/sharding/.
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(n_devices), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    code = ("import json, sys; from parlearn.sharding import jax_sharded_adam; "
            "print(json.dumps(jax_sharded_adam(**json.loads(sys.argv[1]))))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps({"n_devices": n_devices,
                                                                   **kwargs})],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the JAX child process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
