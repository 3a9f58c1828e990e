"""EigenGame's speed, measured: batched vs batch-1 updates, sharded vs one device, bench rows.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from parlearn.core.checks import check_choice, check_float, check_int
from parlearn.many_copies.eigengame.devices import run_with_devices
from parlearn.many_copies.eigengame.game import METHODS, _x64
from parlearn.many_copies.eigengame.inputs import _data, init_vectors, synthetic_data
from parlearn.many_copies.eigengame.training import (
    _batches,
    _check_devices,
    _fits_mesh,
    _mesh,
    _serial_fit,
    _sharded_fit,
)

__all__ = ["throughput", "sharded_throughput", "bench"]

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
    x = _data("x", x)
    k = check_int("k", k, lo=1, hi=x.shape[1])
    if isinstance(batch_sizes, str) or not isinstance(batch_sizes, Iterable):
        raise TypeError(f"batch_sizes must be a list of ints, got {batch_sizes!r}")
    sizes = [check_int("batch_sizes", b, lo=1, hi=x.shape[0]) for b in batch_sizes]
    samples = check_int("samples", samples, lo=1, hi=x.shape[0])
    if not sizes:
        raise ValueError("batch_sizes must hold at least one batch size")
    if any(samples % b for b in sizes):
        raise ValueError(f"samples={samples} must be a multiple of every batch size {sizes}")
    check_choice("method", method, METHODS)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    repeat = check_int("repeat", repeat, lo=1)
    check_choice("dtype", dtype, _DTYPES)
    seed = check_int("seed", seed, lo=0)
    import jax.numpy as jnp

    from parlearn.core.timing import sweep

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
    x = _data("x", x)
    k = check_int("k", k, lo=1, hi=x.shape[1])
    batch = check_int("batch", batch, lo=1, hi=x.shape[0])
    steps = check_int("steps", steps, lo=1)
    check_choice("method", method, METHODS)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    repeat = check_int("repeat", repeat, lo=1)
    check_choice("dtype", dtype, _DTYPES)
    seed = check_int("seed", seed, lo=0)
    if isinstance(mesh_shapes, str) or not isinstance(mesh_shapes, list | tuple):
        raise TypeError(f"mesh_shapes must be a list of (data, players) pairs, got "
                        f"{mesh_shapes!r}")
    meshes = [_mesh("mesh_shapes[i]", shape) for shape in mesh_shapes]
    for mesh in meshes:
        _fits_mesh("mesh_shapes[i]", mesh, batch, k)
        _check_devices(*mesh)
    import jax.numpy as jnp

    from parlearn.core.timing import compare

    batches = jnp.asarray(_batches(x, batch, seed), dtype)
    v0 = jnp.asarray(init_vectors(x.shape[1], k, seed=seed), dtype)
    cands = {"1 device": _timed_fit(_serial_fit(method, steps, 1), v0, batches, lr)}
    for data, players in meshes:
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
