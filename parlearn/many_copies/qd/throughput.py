"""Throughput, measured: arm evaluations per second against the batch size, and the bench.

JAX is imported inside the functions, so importing this module does not start it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np

from parlearn.core.checks import check_choice, check_int
from parlearn.many_copies.qd.search import Task, _check_task, arm_task, map_elites, score_batch

__all__ = ["evals_per_second", "bench"]


# --- throughput: the vmap curve -----------------------------------------------------------

def evals_per_second(task: Task, batch_sizes, *, repeat: int = 5, seed: int = 0,
                     mode: str = "vmap") -> dict:
    """Measured evaluations per second of scoring a batch, for each batch size.

    ``mode="vmap"``: one jitted ``vmap`` call per batch; ``mode="loop"``: a jitted single
    evaluation called once per genotype from Python (what a serial user writes).
    Compile time is excluded and reported (``compile_s``). Returns ``{"batch_sizes",
    "evals_per_s", "spread", "compile_s", "device", "mode"}``.
    """
    _check_task(task)
    mode = check_choice("mode", mode, ("vmap", "loop"))
    check_int("repeat", repeat, lo=1)
    check_int("seed", seed, lo=0)
    if isinstance(batch_sizes, str) or not isinstance(batch_sizes, Iterable):
        raise TypeError(f"batch_sizes must be a list of ints, got {batch_sizes!r}")
    sizes = [check_int("batch_sizes[i]", b, lo=1) for b in batch_sizes]
    if not sizes:
        raise ValueError("batch_sizes must hold at least one batch size")
    import jax

    from parlearn.core.timing import measure

    batched = jax.jit(lambda x: score_batch(task, x))
    single = jax.jit(task.score)
    out: dict = {"batch_sizes": sizes, "evals_per_s": [], "spread": [], "compile_s": [],
                 "device": str(jax.devices()[0]), "mode": mode}
    for i, b in enumerate(sizes):
        # Genotypes drawn by NumPy and put on the device once: a JAX draw would compile
        # one more program per batch size (a few tenths of a second each on a CPU).
        x_np = np.random.default_rng(seed + i).random((b, task.dim), dtype=np.float32)
        x = jax.device_put(x_np)
        t0 = time.perf_counter()
        if mode == "vmap":
            fn = batched.lower(x).compile()
            call = lambda fn=fn, x=x: jax.block_until_ready(fn(x))  # noqa: E731
        else:
            fn = single.lower(x[0]).compile()
            rows = [jax.device_put(row) for row in x_np]
            call = lambda fn=fn, rows=rows: jax.block_until_ready([fn(r) for r in rows])  # noqa: E731
        out["compile_s"].append(time.perf_counter() - t0)
        t = measure(call, warmup=1, repeat=repeat)
        out["evals_per_s"].append(b / t.median)
        out["spread"].append(t.spread)
    return out


def _bench_rows(quick: bool) -> list:
    """Arm scoring of ``big`` genotypes: one vmap call vs a Python loop of jitted single
    evaluations (timed interleaved); MAP-Elites QD-score at batch 64 vs 4096, same budget.

    Runs in a fresh interpreter through :func:`bench`.
    """
    import jax

    from parlearn.core.bench import Row
    from parlearn.core.timing import UNRELIABLE, compare

    task, big = arm_task(8), (1024 if quick else 4096)
    x = jax.random.uniform(jax.random.key(0), (big, task.dim))
    rows_x = list(x)
    t0 = time.perf_counter()
    single = jax.jit(task.score).lower(x[0]).compile()
    batched = jax.jit(lambda x: score_batch(task, x)).lower(x).compile()
    compile_s = time.perf_counter() - t0
    cmp = compare({"loop": lambda: jax.block_until_ready([single(r) for r in rows_x]),
                   "vmap": lambda: jax.block_until_ready(batched(x))},
                  repeat=3 if quick else 7)
    lo, hi = cmp.speedup_range("vmap")
    dev = str(jax.devices()[0])
    rows = [Row("qd", f"arm scoring, loop of {big} jit calls", f"one vmap call of {big}",
                cmp.speedup("vmap"), dev,
                detail=(f"{big / cmp.timings['loop'].median:.3g} vs "
                        f"{big / cmp.timings['vmap'].median:.3g} evals/s; IQR {lo:.1f}-{hi:.1f}x; "
                        f"compile {compile_s:.2f} s excluded"
                        + ("" if cmp.reliable else f"; WARNING: {UNRELIABLE}")))]
    budget = 4096 * (12 if quick else 100)
    small = map_elites(task, batch_size=64, budget=budget, seed=0)
    large = map_elites(task, batch_size=4096, budget=budget, seed=0)
    rel = large.qd_score[-1] / small.qd_score[-1]
    rows.append(Row("qd", "MAP-Elites batch 64", "batch 4096, same budget", float(rel), dev,
                    target="QD-score ratio within 10% (QDax)", met=bool(abs(rel - 1) <= 0.10),
                    detail=(f"ratio of QD-scores, not times; {budget} evaluations: "
                            f"{small.qd_score[-1]:.1f} vs {large.qd_score[-1]:.1f}; "
                            f"wall {small.wall_s[-1]:.2f} s vs {large.wall_s[-1]:.2f} s "
                            "(compile excluded)")))
    return rows


def bench(device, quick: bool) -> list:
    """The rows of :func:`_bench_rows`, measured in a fresh Python process (JAX must not
    start in the process that forks gloo ranks for other entries), on JAX's default
    device; ``device`` names the torch device of the other benches and is not used."""
    from parlearn.core.bench import rows_in_fresh_process

    return rows_in_fresh_process(__name__, quick)
