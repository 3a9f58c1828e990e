"""Work, depth and Amdahl's law; the simplest parallelism there is: batching.

A computation's *work* W is the total number of operations; its *depth* D
(span, critical path) is the longest chain of operations that must run one after
another. With p workers no schedule takes less than ``max(W/p, D)`` (the work and
span laws), and a greedy schedule takes at most ``W/p + D`` (Brent's theorem).
Amdahl's law is the same idea in fractions: if a fraction ``s`` of the serial time
cannot be parallelised, the speedup on p workers is

    S(p) = 1 / (s + (1 - s) / p)   ->   1/s as p -> infinity.

Gustafson's law asks the other question: grow the problem with p, keeping the parallel
time fixed, and the scaled speedup is ``s + (1 - s) p`` (:func:`gustafson`), where ``s`` is
now the serial fraction of the time *on p workers*. :func:`sum_graph` and
:func:`work_depth` build and count the two ways of summing n numbers (chain, tree).

On one device the cheapest parallelism is batching: n independent matmuls as one
``torch.bmm`` call instead of a Python loop of n calls. Its cost model
(:func:`batching_model`): a call costs ``alpha`` seconds of overhead and a product of
two ``s x s`` matrices ``beta s^3`` seconds of arithmetic, so

    loop: n (alpha + beta s^3)        bmm: alpha + n beta s^3,

and :func:`fit_batching_model` fits ``alpha`` and ``beta`` to a measured sweep. At one size
this is :mod:`parlearn.core.overhead`'s ``t(n) = t0 + c n`` (``t0 = alpha``, ``c = beta s^3``),
the model Parts 3 and 4 fit to their batched-vs-looped measurements.

The roofline (Williams, Waterman & Patterson 2009) bounds a kernel by the device's two
rates: ``attainable FLOP/s = min(peak FLOP/s, I * bytes/s)`` (:func:`roofline`), where the
arithmetic intensity ``I`` is FLOPs per byte moved to and from memory; one ``s x s``
product reads two matrices and writes one, so ``I = 2 s^3 / (3 s^2 b) = 2 s / (3 b)`` for
``b``-byte elements (:func:`matmul_intensity`). :func:`measure_roofline` measures both roofs
on this device and where batched matmuls of each size land under them.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from parlearn.core.bench import Row
from parlearn.core.checks import (
    check_choice,
    check_device,
    check_float,
    check_int,
    check_ints,
    check_seed,
    check_tensor,
)
from parlearn.core.timing import UNRELIABLE, _quartiles, compare, measure, sweep

__all__ = [
    "amdahl", "gustafson", "sum_graph", "work_depth", "brent_bounds", "looped_matmul",
    "batched_matmul", "random_batch", "sweep_batching",
    "batching_model", "fit_batching_model", "roofline", "matmul_intensity", "measure_roofline",
    "roofline_bound",
]


def _holds_bool(value) -> bool:
    if isinstance(value, bool | np.bool_):
        return True
    if isinstance(value, list | tuple):
        return any(_holds_bool(v) for v in value)
    return False


def _real_array(name: str, value) -> np.ndarray:
    """``value`` as a float array; bools (also in a list), non-numbers and NaN/inf are refused."""
    if _holds_bool(value):   # np.asarray([True, 2.5]) would be [1.0, 2.5]: a bool as a number
        raise TypeError(f"{name} must be a real number or an array of them, got a bool in "
                        f"{value!r}")
    arr = np.asarray(value)
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer)
                                 or np.issubdtype(arr.dtype, np.floating)):
        raise TypeError(f"{name} must be a real number or an array of them, got {value!r}")
    arr = arr.astype(float)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return arr


def amdahl(serial_fraction, workers):
    """Modeled speedup ``1 / (s + (1 - s) / p)``; broadcasts over numpy arrays."""
    s, p = _fraction_and_workers(serial_fraction, workers)
    return 1.0 / (s + (1.0 - s) / p)


def _fraction_and_workers(serial_fraction, workers):
    s = _real_array("serial_fraction", serial_fraction)
    p = _real_array("workers", workers)
    if np.any((s < 0) | (s > 1)):
        raise ValueError(f"serial_fraction must lie in [0, 1], got {serial_fraction!r}")
    if np.any(p < 1):
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    return s, p


def gustafson(serial_fraction, workers):
    """Modeled scaled speedup ``s + (1 - s) p`` (Gustafson 1988): the problem grows with
    ``p`` and ``s`` is the serial fraction of the time on ``p`` workers; broadcasts."""
    s, p = _fraction_and_workers(serial_fraction, workers)
    return s + (1.0 - s) * p


def sum_graph(n: int, shape: str) -> dict:
    """The graph of summing ``n`` inputs ``x0..x{n-1}``: ``shape="chain"`` adds them one after
    another (``s1 = x0 + x1``, ``s2 = s1 + x2``, ...), ``"tree"`` adds pairs, then pairs of
    pairs (an odd one out waits a level). Returns ``{"leaves", "ops", "edges", "pos"}``:
    input names, operation names, ``(from, to)`` edges ("to needs from") and an (x, y) per
    node for drawing (inputs at y = 0, each operation one level above its deeper input)."""
    n = check_int("n", n, lo=2)
    check_choice("shape", shape, ("chain", "tree"))
    leaves = [f"x{i}" for i in range(n)]
    pos = {v: (float(i), 0.0) for i, v in enumerate(leaves)}
    ops, edges = [], []
    if shape == "chain":
        acc = leaves[0]
        for i in range(1, n):
            v = f"s{i}"
            ops.append(v)
            edges += [(acc, v), (leaves[i], v)]
            pos[v] = (float(i), float(i))
            acc = v
        return {"leaves": leaves, "ops": ops, "edges": edges, "pos": pos}
    level = leaves
    while len(level) > 1:
        nxt = []
        for j in range(0, len(level) - 1, 2):
            a, b, v = level[j], level[j + 1], f"t{len(ops)}"
            ops.append(v)
            edges += [(a, v), (b, v)]
            pos[v] = ((pos[a][0] + pos[b][0]) / 2, max(pos[a][1], pos[b][1]) + 1)
            nxt.append(v)
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return {"leaves": leaves, "ops": ops, "edges": edges, "pos": pos}


def work_depth(edges, ops) -> tuple[int, int]:
    """``(W, D)`` of a graph: ``W`` the number of operation nodes, ``D`` the number of
    operation nodes on the longest path. ``edges`` are ``(from, to)`` pairs, ``ops`` the
    operation nodes (any other node is an input and costs nothing)."""
    if isinstance(edges, (str, bytes)) or not hasattr(edges, "__iter__"):
        raise TypeError(f"edges must be a sequence of (from, to) pairs, got {edges!r}")
    edges = list(edges)
    if not all(isinstance(e, tuple | list) and len(e) == 2 for e in edges):
        raise ValueError(f"edges must hold (from, to) pairs, got {edges!r}")
    if isinstance(ops, (str, bytes)) or not hasattr(ops, "__iter__"):
        raise TypeError(f"ops must be a collection of node names, got {ops!r}")
    ops = set(ops)
    if not ops:
        raise ValueError("ops must name at least one operation node")
    succ: dict = {}
    indeg: dict = dict.fromkeys(ops, 0)
    for a, b in edges:
        succ.setdefault(a, []).append(b)
        indeg.setdefault(a, 0)
        indeg[b] = indeg.get(b, 0) + 1
    # Kahn's order: a node's depth is final once all its predecessors were seen.
    depth = {v: 0 for v in indeg}
    ready = [v for v, k in indeg.items() if k == 0]
    seen = 0
    while ready:
        v = ready.pop()
        seen += 1
        depth[v] += v in ops
        for w in succ.get(v, ()):
            depth[w] = max(depth[w], depth[v])
            indeg[w] -= 1
            if indeg[w] == 0:
                ready.append(w)
    if seen < len(indeg):
        raise ValueError("edges must form an acyclic graph; some nodes lie on a cycle")
    return len(ops), max(depth[v] for v in ops)


def brent_bounds(work: float, depth: float, workers: int) -> tuple[float, float]:
    """Modeled time on p workers, in units of one op: ``(max(W/p, D), W/p + D)``.

    The first is the work/span lower bound (no schedule is faster), the second Brent's
    upper bound for a greedy schedule.
    """
    work = check_float("work", work, lo=0)
    depth = check_float("depth", depth, lo=0)
    workers = check_int("workers", workers, lo=1)
    if work < depth:
        raise ValueError(f"work must be >= depth, got work={work}, depth={depth}")
    return max(work / workers, depth), work / workers + depth


def random_batch(n: int, size: int, *, device: str | torch.device = "cpu",
                 seed: int | torch.Generator = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two stacks of ``n`` random ``size x size`` matrices, drawn from ``seed`` (an int or a
    CPU ``torch.Generator``, never the global RNG), moved to ``device``."""
    n = check_int("n", n, lo=1)
    size = check_int("size", size, lo=1)
    seed = check_seed("seed", seed)
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    a = torch.randn(n, size, size, generator=g)
    b = torch.randn(n, size, size, generator=g)
    return a.to(device), b.to(device)


def _check_pair(a, b) -> None:
    check_tensor("a", a, ndim=3)
    check_tensor("b", b, ndim=3)
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1] or a.shape[0] == 0:
        raise ValueError(f"a and b must be (n, i, k) and (n, k, j) with n >= 1; got "
                         f"{tuple(a.shape)}, {tuple(b.shape)}")
    if a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"a and b must share dtype and device, got {a.dtype} on {a.device} and "
                         f"{b.dtype} on {b.device}")


def looped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Serial reference: one ``a[i] @ b[i]`` call per matrix."""
    _check_pair(a, b)
    return torch.stack([a[i] @ b[i] for i in range(a.shape[0])])


def batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All ``n`` products in one ``torch.bmm`` call."""
    _check_pair(a, b)
    return torch.bmm(a, b)


def sweep_batching(counts, size: int, *, device: str | torch.device = "cpu", repeat: int = 5,
                   seed: int = 0, threads: int | None = None) -> dict:
    """Measure loop vs ``bmm`` for each ``n`` in ``counts`` (interleaved, per ``n``).

    ``threads=t`` runs with ``t`` torch intra-op threads and restores the caller's count
    (``None``: the caller's count as it is). Returns ``{"n", "loop_s", "bmm_s",
    "speedup", "speedup_lo", "speedup_hi", "loop_spread", "bmm_spread", "device",
    "threads", "reliable", "size"}``: medians in seconds, the spread of each (IQR over
    median), ``speedup`` = loop time / bmm time with the IQR of the per-repeat ratios, and
    ``reliable`` False when a spread was too wide to read (all measured).
    """
    counts = check_ints("counts", counts, lo=1)
    size = check_int("size", size, lo=1)
    repeat = check_int("repeat", repeat, lo=1)
    seed = check_int("seed", seed, lo=0)
    if threads is not None:
        threads = check_int("threads", threads, lo=1)

    def candidates(n):
        a, b = random_batch(n, size, device=device, seed=seed)
        return {"loop": partial(looped_matmul, a, b), "bmm": partial(batched_matmul, a, b)}

    r = sweep(counts, candidates, repeat=repeat, device=device, threads=threads)
    return {"n": counts, "loop_s": r["median_s"]["loop"], "bmm_s": r["median_s"]["bmm"],
            "speedup": r["speedup"]["bmm"], "speedup_lo": r["speedup_lo"]["bmm"],
            "speedup_hi": r["speedup_hi"]["bmm"], "loop_spread": r["spread"]["loop"],
            "bmm_spread": r["spread"]["bmm"], "device": r["device"], "threads": r["threads"],
            "reliable": r["reliable"], "size": size}


def batching_model(n, size: int, alpha: float, beta: float) -> dict:
    """Modeled seconds of ``n`` products of ``size x size`` matrices.

    ``alpha``: overhead of one call (s); ``beta``: arithmetic per ``size^3`` (s), so
    ``loop_s = n (alpha + beta size^3)``, ``bmm_s = alpha + n beta size^3`` and
    ``speedup = loop_s / bmm_s``, which grows towards ``1 + alpha / (beta size^3)``.
    ``n`` may be an array.
    """
    n = _real_array("n", n)
    # n may be fractional: the model is a smooth curve, which lessons draw on a dense grid.
    if np.any(n < 1):
        raise ValueError(f"n must be >= 1 (or an array of such), got {n!r}")
    size = check_int("size", size, lo=1)
    alpha = check_float("alpha", alpha, lo=0)
    beta = check_float("beta", beta, lo=0)
    if alpha == beta == 0:
        raise ValueError("alpha and beta cannot both be 0")
    work = beta * float(size) ** 3
    loop, bmm = n * (alpha + work), alpha + n * work
    return {"n": n, "loop_s": loop, "bmm_s": bmm, "speedup": loop / bmm}


def fit_batching_model(result: dict) -> dict:
    """Fit ``alpha`` and ``beta`` of :func:`batching_model` to a :func:`sweep_batching` result.

    Least squares on both measured series at once, each point weighted by 1 / its
    measured time (so every point counts by its relative error), with ``alpha, beta >= 0``
    (a negative cost has no meaning: when the unconstrained fit gives one, the other is
    fitted alone). Returns ``{"alpha", "beta", "size"}`` in seconds.
    """
    if not isinstance(result, dict) or not {"n", "loop_s", "bmm_s", "size"} <= set(result):
        raise TypeError("result must be a dict from basics.sweep_batching")
    n = _real_array("result['n']", result["n"])
    loop = _real_array("result['loop_s']", result["loop_s"])
    bmm = _real_array("result['bmm_s']", result["bmm_s"])
    if np.any(loop <= 0) or np.any(bmm <= 0):
        raise ValueError("result['loop_s'] and result['bmm_s'] (measured times) must be > 0")
    s3 = float(check_int("result['size']", result["size"], lo=1)) ** 3
    # Columns: alpha, beta. Rows: loop n(alpha + beta s^3), then bmm alpha + n beta s^3.
    a = np.vstack([np.column_stack([n, n * s3]), np.column_stack([np.ones_like(n), n * s3])])
    t = np.concatenate([loop, bmm])
    a_w, t_w = a / t[:, None], np.ones_like(t)
    coef, *_ = np.linalg.lstsq(a_w, t_w, rcond=None)
    if np.any(coef < 0):
        one = [(float(a_w[:, j] @ t_w / (a_w[:, j] @ a_w[:, j])), j) for j in (0, 1)]
        coef = np.zeros(2)
        best = min(one, key=lambda cj: float(np.sum((a_w[:, cj[1]] * cj[0] - t_w) ** 2)))
        coef[best[1]] = best[0]
    return {"alpha": float(coef[0]), "beta": float(coef[1]), "size": int(result["size"])}


def roofline(intensity, peak_flops: float, bandwidth: float):
    """Modeled attainable FLOP/s ``min(peak_flops, intensity * bandwidth)`` (Williams et al.
    2009): ``intensity`` in FLOPs per byte (> 0; broadcasts over arrays), ``peak_flops`` in
    FLOP/s and ``bandwidth`` in bytes/s, both > 0. The roofs meet at the ridge
    ``peak_flops / bandwidth``: below it a kernel is memory-bound, above it compute-bound."""
    i = _real_array("intensity", intensity)
    if np.any(i <= 0):
        raise ValueError(f"intensity must be > 0 (FLOPs per byte), got {intensity!r}")
    peak = check_float("peak_flops", peak_flops, lo=0, lo_open=True)
    bw = check_float("bandwidth", bandwidth, lo=0, lo_open=True)
    return np.minimum(peak, i * bw)


def matmul_intensity(size, element_bytes: int = 4):
    """FLOPs per byte of one ``size x size`` product that reads both operands and writes
    the result once: ``2 s^3 / (3 s^2 element_bytes) = 2 s / (3 element_bytes)`` (``s/6``
    in float32, ``s/3`` in bfloat16). ``size`` may be an array of whole numbers >= 1."""
    s = _real_array("size", size)
    if np.any(s < 1) or np.any(s != np.round(s)):
        raise ValueError(f"size must be a whole number >= 1 (or an array of them), got {size!r}")
    b = check_int("element_bytes", element_bytes, lo=1)
    return 2.0 * s / (3.0 * b)


def measure_roofline(sizes, *, working_set: int = 2**26, peak_size: int = 512, repeat: int = 5,
                     device: str | torch.device = "cpu", threads: int | None = 1,
                     seed: int = 0) -> dict:
    """Measure the two roofs of ``device`` and where float32 batched matmuls sit under them.

    Roofs (measured, sustained rates rather than datasheet peaks), each the best rate any
    measured kernel reached, so that no point lies above them: ``peak_flops``, the FLOP/s of
    the fastest repeat of one ``peak_size`` square matmul (``2 s^3`` FLOPs) or of any point's
    bmm; ``bandwidth``, the bytes/s of the fastest repeat of copying ``working_set`` bytes
    (read + write: twice the bytes copied, as ``parlearn.card`` counts it) or of any point's
    bmm (its FLOP/s over its intensity). ``peak_from`` and ``bandwidth_from`` name the
    kernel that set each roof. Points (measured): for each ``s`` in ``sizes`` one
    ``torch.bmm`` of ``n`` products of ``s x s`` matrices, ``n`` chosen so that the two
    operands and the result hold about ``working_set`` bytes (more than the caches, so they
    stream from memory); its FLOP/s is ``2 n s^3 / median time`` at intensity
    :func:`matmul_intensity` ``(s, 4)``. ``threads`` as in :func:`sweep_batching` (default
    1, the thread policy's). ``ridge_range`` is the ridge ``peak_flops / bandwidth`` taken
    at the quartiles of the matmul's and the copy's repeats (lowest: copy's lower quartile
    over the matmul's upper one; highest: the other way round), relative to their medians'
    ridge and applied to the ridge of the roofs returned: the run's own spread of the ridge.
    Returns ``{"sizes", "n", "intensity", "flops", "spread", "peak_flops", "bandwidth",
    "peak_from", "bandwidth_from", "ridge_range", "device", "threads", "reliable"}``.
    """
    sizes = check_ints("sizes", sizes, lo=1)
    working_set = check_int("working_set", working_set, lo=1024)
    peak_size = check_int("peak_size", peak_size, lo=1)
    repeat = check_int("repeat", repeat, lo=1)
    seed = check_int("seed", seed, lo=0)
    if threads is not None:
        threads = check_int("threads", threads, lo=1)
    device = check_device("device", device)
    timings = []
    a, b = random_batch(1, peak_size, device=device, seed=seed)
    peak = measure(partial(torch.mm, a[0], b[0]), repeat=repeat, device=device, threads=threads)
    timings.append(peak)
    src = torch.ones(working_set // 4, device=device)
    dst = torch.empty_like(src)
    copy = measure(partial(dst.copy_, src), repeat=repeat, device=device, threads=threads)
    timings.append(copy)
    ns, flops, spread = [], [], []
    fl = 2.0 * peak_size**3
    peaks = [(fl / min(peak.times), f"{peak_size}x{peak_size} matmul")]
    bws = [(2.0 * src.numel() * 4 / min(copy.times), f"{working_set / 2**20:g} MiB copy")]
    for s in sizes:
        n = max(1, working_set // (3 * 4 * s * s))
        a, b = random_batch(n, s, device=device, seed=seed)
        t = measure(partial(torch.bmm, a, b), repeat=repeat, device=device, threads=threads)
        timings.append(t)
        ns.append(n)
        flops.append(2.0 * n * s**3 / t.median)
        spread.append(t.spread)
        best = 2.0 * n * s**3 / min(t.times)
        peaks.append((best, f"bmm s={s}"))
        bws.append((best / float(matmul_intensity(s, 4)), f"bmm s={s}"))
    peak_flops, peak_from = max(peaks, key=lambda x: x[0])
    bandwidth, bandwidth_from = max(bws, key=lambda x: x[0])
    mm_lo, mm_hi = _quartiles(sorted(peak.times))
    cp_lo, cp_hi = _quartiles(sorted(copy.times))
    mid = copy.median / peak.median                  # the ridge of the medians, up to a constant
    ridge = peak_flops / bandwidth
    return {"sizes": sizes, "n": ns, "intensity": matmul_intensity(sizes, 4).tolist(),
            "flops": flops, "spread": spread, "peak_flops": peak_flops, "bandwidth": bandwidth,
            "peak_from": peak_from, "bandwidth_from": bandwidth_from,
            "ridge_range": (ridge * min(1.0, cp_lo / mm_hi / mid),
                            ridge * max(1.0, cp_hi / mm_lo / mid)),
            "device": device.type,
            "threads": peak.threads, "reliable": all(t.reliable for t in timings)}


def roofline_bound(intensity, ridge_range, margin: float = 2.0) -> list[str]:
    """Which roof bounds each ``intensity`` (FLOPs per byte, > 0), read against a ridge known
    only within ``ridge_range = (lo, hi)`` (``0 < lo <= hi``, e.g. ``measure_roofline``'s):
    ``"memory"`` below ``lo / margin``, ``"compute"`` above ``hi * margin``, otherwise
    ``"near the ridge"``. ``margin >= 1`` covers what one run's spread does not: on a busy
    machine the ridge moves between runs, and a label should not flip with it (two runs
    can only disagree between "memory" and "compute" if their ridges differ by ``margin**2``).
    """
    i = _real_array("intensity", intensity).reshape(-1)
    if np.any(i <= 0):
        raise ValueError(f"intensity must be > 0 (FLOPs per byte), got {intensity!r}")
    if isinstance(ridge_range, (str, bytes)) or len(np.shape(ridge_range)) != 1 \
            or len(ridge_range) != 2:
        raise TypeError(f"ridge_range must be a pair (lo, hi), got {ridge_range!r}")
    lo = check_float("ridge_range[0]", ridge_range[0], lo=0, lo_open=True)
    hi = check_float("ridge_range[1]", ridge_range[1], lo=lo)
    m = check_float("margin", margin, lo=1)
    return ["memory" if x < lo / m else "compute" if x > hi * m else "near the ridge" for x in i]


def bench(device: torch.device, quick: bool) -> list[Row]:
    """Measured loop vs bmm rows; on CPU both run one intra-op thread (the thread policy)."""
    rows = []
    threads = 1 if device.type == "cpu" else None
    for n, size in ((256, 16), (64, 64)) if quick else ((1024, 16), (256, 64), (64, 256)):
        a, b = random_batch(n, size, device=device)
        cmp = compare({"loop": partial(looped_matmul, a, b), "bmm": partial(batched_matmul, a, b)},
                      warmup=2, repeat=5 if quick else 15, device=device, threads=threads)
        lo, hi = cmp.speedup_range("bmm")
        detail = f"{cmp.threads} thread(s); IQR {lo:.2f}-{hi:.2f}"
        rows.append(Row(f"basics n={n} {size}x{size}", "python loop", "torch.bmm",
                        cmp.speedup("bmm"), str(device), "", None,
                        detail if cmp.reliable else f"{detail}; WARNING: {UNRELIABLE}"))
    return rows
