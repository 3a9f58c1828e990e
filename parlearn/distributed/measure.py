"""Measure collectives on real ranks and fit the alpha-beta model to them.

    from parlearn.distributed import measure_alpha_beta
    measure_alpha_beta(world_size=2)      # AlphaBeta(alpha=..., beta=...) of this machine

:func:`sweep_collective` times collectives (median and quartiles of the slowest rank, over
interleaved repeats) at a sweep of payload sizes; :func:`measure_alpha_beta` fits
:func:`parlearn.dist.cost.fit_alpha_beta` to such a sweep. :func:`ring_vs_gloo` is lesson 10's
study of the ring from send/recv against ``all_reduce`` over sizes and world sizes, and
:func:`other_load` says how much CPU other programs took while something ran. :func:`bench`
is the ``dist`` group of ``python -m parlearn.bench``.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from parlearn.core.bench import Row
from parlearn.core.checks import check_callable, check_choice, check_int, check_ints
from parlearn.core.timing import SPREAD_LIMIT, Timing
from parlearn.distributed import collectives
from parlearn.distributed.cost import AlphaBeta, collective_time, fit_alpha_beta
from parlearn.distributed.launch import default_backend, run

__all__ = ["DEFAULT_SIZES", "STUDY_SIZES", "sweep_collective", "measure_alpha_beta",
           "measure_links", "other_load", "ring_vs_gloo", "bench"]


# Payload sizes (bytes) of the default sweep: 64 B to 4 MiB, four per decade or so.
DEFAULT_SIZES = tuple(int(2 ** (k / 2)) // 4 * 4 for k in range(12, 45))


# Payload sizes (bytes) of :func:`ring_vs_gloo`: 64 KiB to 64 MiB, a factor 4 apart.
STUDY_SIZES = tuple(1 << k for k in range(16, 27, 2))
# Cores' worth of CPU that other programs may use during a measurement before we say so.
LOAD_LIMIT = 0.25


def _busy_seconds() -> tuple[float, float] | None:
    """(CPU seconds every core of the machine has spent busy since boot, CPU seconds this
    process and its waited-for children have used); None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(v) for v in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait.
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    own = sum(getattr(resource.getrusage(who), f) for who in
              (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for f in ("ru_utime", "ru_stime"))
    return busy, own


def other_load(fn: Callable[[], object]) -> tuple[object, float | None]:
    """``(fn(), load)``: ``load`` is the CPU that programs *other than this process and the
    children it waited for* (the ranks :func:`parlearn.distributed.run` starts and joins) used
    while ``fn`` ran, in cores (busy CPU-seconds of the machine from /proc/stat minus our
    own from ``getrusage``, over the wall time). The ranks' own work is not load: 2 ranks
    keep 2 cores busy by themselves. None where /proc/stat is missing (not Linux)."""
    check_callable("fn", fn)
    before, t0 = _busy_seconds(), time.perf_counter()
    value = fn()
    after, wall = _busy_seconds(), time.perf_counter() - t0
    if before is None or after is None or wall <= 0:
        return value, None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return value, max(others, 0.0) / wall


def _where(backend: str) -> str:
    return "GPUs" if backend == "nccl" else f"CPU, {os.cpu_count()} cores"


def _label(backend: str, world_size: int) -> str:
    return f"{world_size} {backend} ranks on {_where(backend)}"


def sweep_collective(kinds: Sequence[str] = ("all_reduce",), sizes: Sequence[int] = DEFAULT_SIZES,
                     world_size: int = 2, *, repeat: int = 5, warmup: int = 1,
                     backend: str | None = None, timeout: float = 30) -> dict:
    """Measure ``kinds`` (each of :data:`parlearn.collectives.TIMED_KINDS`) at payload
    ``sizes`` (bytes of float32) on ``world_size`` real ranks, interleaved repeat by repeat.
    ``all_gather``, ``reduce_scatter`` and ``all_to_all`` need sizes that are multiples of
    ``4 * world_size`` bytes (equal chunks per rank).

    A repeat's time is the slowest rank's (a collective is done when its last rank is).
    Returns ``{"sizes", "world_size", "device", "reliable", "median_s": {kind: [...]},
    "q1_s", "q3_s", "spread": {kind: [...]}}``; ``spread`` is the interquartile range over
    the median, and ``reliable`` is False when any spread exceeds
    :data:`parlearn.timing.SPREAD_LIMIT`.
    """
    kinds = [check_choice("kinds", k, collectives.TIMED_KINDS)
             for k in collectives._sequence("kinds", kinds)]
    sizes = [check_int("sizes", n, lo=4) for n in collectives._sequence("sizes", sizes)]
    world_size = check_int("world_size", world_size, lo=2)
    repeat, warmup = check_int("repeat", repeat, lo=1), check_int("warmup", warmup, lo=0)
    chunked = [k for k in kinds if k in ("all_gather", "reduce_scatter", "all_to_all")]
    odd = [n for n in sizes if (n // 4) % world_size]
    if chunked and odd:  # checked here too, so the error comes before any rank starts
        raise ValueError(f"sizes {odd}: {chunked} cut the payload into {world_size} equal "
                         f"float32 chunks; use multiples of {4 * world_size} bytes")
    backend = default_backend(world_size) if backend is None else backend
    per_rank = run(collectives.time_collectives, world_size, backend=backend, timeout=timeout,
                   args=(tuple(kinds), tuple(sizes), repeat, warmup))
    out: dict = {"sizes": [n // 4 * 4 for n in sizes], "world_size": world_size,
                 "device": _label(backend, world_size), "median_s": {}, "q1_s": {}, "q3_s": {},
                 "spread": {}}
    for kind in kinds:
        for n in out["sizes"]:
            slowest = [max(ts) for ts in zip(*(r[kind][n] for r in per_rank), strict=True)]
            t = Timing(tuple(slowest), out["device"], threads=1)
            q = sorted(slowest)
            out["median_s"].setdefault(kind, []).append(t.median)
            out["q1_s"].setdefault(kind, []).append(q[len(q) // 4])
            out["q3_s"].setdefault(kind, []).append(q[(3 * len(q)) // 4])
            out["spread"].setdefault(kind, []).append(t.spread)
    out["reliable"] = all(s <= SPREAD_LIMIT for v in out["spread"].values() for s in v)
    return out


def _model_kind(kind: str) -> str:
    return "all_reduce" if kind == "ring_all_reduce" else kind


def measure_alpha_beta(world_size: int = 2, sizes: Sequence[int] = DEFAULT_SIZES,
                       repeat: int = 5, *, kind: str = "all_reduce", backend: str | None = None,
                       timeout: float = 30) -> AlphaBeta:
    """This machine's alpha and beta: :func:`sweep_collective` of ``kind`` on real ranks,
    then :func:`fit_alpha_beta` of the medians to the ring formula of ``kind``."""
    sweep = sweep_collective((kind,), sizes, world_size, repeat=repeat, backend=backend,
                             timeout=timeout)
    return fit_alpha_beta(sweep["sizes"], sweep["median_s"][kind], kind=_model_kind(kind),
                          world_size=world_size)


def measure_links(world_size: int = 2, sizes: Sequence[int] = DEFAULT_SIZES, repeat: int = 5,
                  *, kinds: Sequence[str] = ("all_reduce", "all_to_all", "all_gather"),
                  backend: str | None = None, timeout: float = 30) -> dict[str, AlphaBeta]:
    """One alpha-beta fit per collective: ``{kind: AlphaBeta}`` from one interleaved
    :func:`sweep_collective` of ``kinds``, each fitted to its own ring formula. Pass it
    as ``model`` to :func:`parlearn.distributed.collective_time` (or anything that prices
    collectives with it) to price each collective with its own fit: an engine implements
    each its own way (over a dozen sweeps on our 2-core machine, gloo's CPU all_gather
    fitted 0.45-1.1 times the bandwidth of its all_reduce, typically 0.7), so one
    all_reduce fit can misprice the others."""
    if isinstance(kinds, str) or not kinds:
        raise ValueError(f"kinds must be a non-empty sequence of kinds, got {kinds!r}")
    sweep = sweep_collective(tuple(kinds), sizes, world_size, repeat=repeat, backend=backend,
                             timeout=timeout)
    return {k: fit_alpha_beta(sweep["sizes"], sweep["median_s"][k], kind=_model_kind(k),
                              world_size=world_size) for k in kinds}


def _quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile), as :class:`parlearn.timing.Timing` takes them."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    lo, mid, hi = statistics.quantiles(xs, n=4, method="inclusive")
    return lo, mid, hi


def ring_vs_gloo(sizes: Sequence[int] = STUDY_SIZES, world_sizes: Sequence[int] = (2, 3, 4),
                 repeat: int = 7, *, warmup: int = 1, backend: str = "gloo",
                 timeout: float = 60, seed: int = 0,
                 progress: Callable[[int, int], object] | None = None) -> dict:
    """Ring all-reduce from send/recv (:func:`parlearn.distributed.collectives.ring_all_reduce`)
    against ``torch.distributed.all_reduce``, measured interleaved on real ranks: for each
    world size a fresh run of :func:`parlearn.distributed.collectives.ring_vs_gloo_times` (every
    repeat times both on the same tensor, a barrier before each, the order swapped every
    repeat; one intra-op thread per rank, which :func:`parlearn.distributed.run` sets so that the
    ranks do not fight over the cores with their own thread pools).

    A repeat's time is the slowest rank's. For every world size ``N`` and size ``n``
    (bytes of float32) it reports the median and quartiles of each, and of the per-repeat
    ratio ``all_reduce time / ring time`` (> 1: the ring from send/recv is faster). The
    model beside them: :func:`parlearn.distributed.cost.fit_alpha_beta` of the ring formula
    ``2(N-1) alpha + 2(N-1)/N n beta`` fitted, per world size, to the medians of each
    implementation on this run (gloo's own all_reduce also runs a ring on CPU, see lesson
    10), and the ratio of the two fitted times. ``load`` is :func:`other_load` of each
    world size's run, in cores.

    Returns ``{"sizes", "world_sizes", "device", "backend", "repeat", "torch_threads",
    "os_threads", "load": [per N], "max_diff": [N][size], "max_abs": [N][size],
    "median_s": {"all_reduce"|"ring_all_reduce": [N][size]}, "q1_s", "q3_s",
    "times_s": {impl: [N][size][repeat]} (the slowest rank's seconds of every repeat),
    "ratio": [N][size], "ratio_q1", "ratio_q3", "fit": {impl: [AlphaBeta per N]},
    "modeled_s": {impl: [N][size]}, "modeled_ratio": [N][size], "reliable"}``
    (``fit`` holds None and the modeled times NaN when there is a single size: a fit needs
    two). ``reliable`` is True when every run's ``load`` is known and at most
    :data:`LOAD_LIMIT` cores. ``progress(done, total)`` is called after each world size.
    """
    backend = check_choice("backend", backend, ("gloo", "nccl"))
    world_sizes = check_ints("world_sizes", world_sizes, lo=2)
    sizes = check_ints("sizes", sizes, lo=4)
    small = [n for n in sizes if n // 4 < max(world_sizes)]
    if small:
        raise ValueError(f"sizes {small}: every size must hold at least one float32 per rank "
                         f"(>= {4 * max(world_sizes)} bytes for {max(world_sizes)} ranks)")
    repeat, warmup = check_int("repeat", repeat, lo=1), check_int("warmup", warmup, lo=0)
    timeout = float(timeout)
    impls = ("all_reduce", "ring_all_reduce")
    out: dict = {"sizes": [n // 4 * 4 for n in sizes], "world_sizes": world_sizes,
                 "backend": backend, "repeat": repeat,
                 "device": f"{backend} ranks on {_where(backend)}", "torch_threads": [],
                 "os_threads": [], "load": [], "max_diff": [], "max_abs": [],
                 "median_s": {k: [] for k in impls}, "q1_s": {k: [] for k in impls},
                 "q3_s": {k: [] for k in impls}, "times_s": {k: [] for k in impls},
                 "ratio": [], "ratio_q1": [], "ratio_q3": [], "fit": {k: [] for k in impls},
                 "modeled_s": {k: [] for k in impls}, "modeled_ratio": []}
    for done, n_ranks in enumerate(world_sizes):
        per_rank, load = other_load(lambda n=n_ranks: run(
            collectives.ring_vs_gloo_times, n, backend=backend, timeout=timeout,
            args=(tuple(out["sizes"]), repeat, warmup, seed)))
        out["load"].append(load)
        out["torch_threads"].append(max(r["torch_threads"] for r in per_rank))
        out["os_threads"].append(max(r["os_threads"] for r in per_rank))
        out["max_diff"].append([max(r["max_diff"][n] for r in per_rank) for n in out["sizes"]])
        out["max_abs"].append([max(r["max_abs"][n] for r in per_rank) for n in out["sizes"]])
        slowest = {k: [[max(ts) for ts in zip(*(r[k][n] for r in per_rank), strict=True)]
                       for n in out["sizes"]] for k in impls}
        for k in impls:
            out["times_s"][k].append(slowest[k])
            qs = [_quartiles(ts) for ts in slowest[k]]
            for i, key in enumerate(("q1_s", "median_s", "q3_s")):
                out[key][k].append([q[i] for q in qs])
            fit = fit_alpha_beta(out["sizes"], out["median_s"][k][-1], kind="all_reduce",
                                 world_size=n_ranks) if len(sizes) > 1 else None
            out["fit"][k].append(fit)
            out["modeled_s"][k].append([collective_time("all_reduce", n, n_ranks, fit)
                                        if fit else float("nan") for n in out["sizes"]])
        qs = [_quartiles([a / b for a, b in zip(g, r, strict=True)])
              for g, r in zip(slowest["all_reduce"], slowest["ring_all_reduce"], strict=True)]
        out["ratio_q1"].append([q[0] for q in qs])
        out["ratio"].append([q[1] for q in qs])
        out["ratio_q3"].append([q[2] for q in qs])
        out["modeled_ratio"].append([a / b for a, b in zip(
            out["modeled_s"]["all_reduce"][-1], out["modeled_s"]["ring_all_reduce"][-1],
            strict=True)])
        if progress is not None:
            progress(done + 1, len(world_sizes))
    out["reliable"] = all(x is not None and x <= LOAD_LIMIT for x in out["load"])
    return out


def _trust(load: float | None, spreads: Sequence[float] = ()) -> str:
    """What a row's timings can be trusted for: the CPU other programs used while they ran
    (:func:`other_load`; the ranks' own work is not counted) and, apart from it, whether the
    repeats' spread (interquartile range over median) exceeded :data:`SPREAD_LIMIT`."""
    wide = max(spreads, default=0.0)
    if load is None:
        text = "load of other programs unknown"
    elif load > LOAD_LIMIT:
        text = f"UNRELIABLE: other programs used {load:.1f} cores meanwhile"
    else:
        text = f"other programs used {load:.2f} cores (quiet)"
    if wide > SPREAD_LIMIT:
        text += f"; spread up to {wide:.0%}" + (
            " with the cores otherwise quiet: the ranks' own jitter" if load is not None
            and load <= LOAD_LIMIT else "")
    return text


# Sizes (bytes) of the ring-vs-gloo rows: latency-bound, middle, bandwidth-bound.
_ROW_SIZES = (1 << 16, 1 << 20, 1 << 26)


def bench(device: torch.device, quick: bool) -> list:
    """Rows for ``python -m parlearn.bench dist``, all on 2 real ranks (NCCL when ``device``
    is CUDA and there are 2 GPUs, else gloo on the CPU, one intra-op thread per rank).

    Ring all-reduce from send/recv against ``torch.distributed.all_reduce``
    (:func:`ring_vs_gloo`: interleaved, median of per-repeat ratios with IQR) at a
    latency-bound 64 KiB and a bandwidth-bound 64 MiB (4 MiB with ``quick``), each beside
    the ratio the alpha-beta ring formula gives with each implementation's own fit on the
    same run (three sizes). Then measured all-reduce time against the alpha-beta model
    fitted on a separate sweep, at 3 sizes between the fitted ones (ratio
    measured/modeled). Every row says how much CPU other programs used meanwhile."""
    backend = "nccl" if device.type == "cuda" and default_backend(2) == "nccl" else "gloo"
    repeat = 5 if quick else 21
    sizes = _ROW_SIZES[:2] + ((1 << 22,) if quick else _ROW_SIZES[2:])
    st = ring_vs_gloo(sizes, (2,), repeat, backend=backend)
    where, why = f"2 {st['device']}", {
        0: "latency-bound: the ring pays 2(N-1) Python-level send/recv steps, gloo one "
           "C++ call on its worker thread; both wait on the scheduler, so under load the "
           "per-repeat ratio swings widely",
        len(sizes) - 1: "bandwidth-bound: both run a ring (gloo's in C++, 1 MiB segments, "
                        "two in flight), so near parity; ours lost at 64 MiB (0.62-0.76) "
                        "while it allocated a fresh 32 MiB receive buffer per call, whose "
                        "page faults cost tens of ms; it now keeps one (lesson 10, 6)"}
    rows = []
    for j in (0, len(sizes) - 1):
        n = st["sizes"][j]
        g, r = st["median_s"]["all_reduce"][0][j], st["median_s"]["ring_all_reduce"][0][j]
        spreads = [(st["q3_s"][k][0][j] - st["q1_s"][k][0][j]) / st["median_s"][k][0][j]
                   for k in ("all_reduce", "ring_all_reduce")]
        size = f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
        rows.append(Row(
            "dist", f"all_reduce {size}", "ring from send/recv (parlearn)", st["ratio"][0][j],
            where,
            detail=f"median of {repeat} interleaved per-repeat ratios, IQR "
                   f"{st['ratio_q1'][0][j]:.2f}-{st['ratio_q3'][0][j]:.2f}; torch "
                   f"{g * 1e3:.2f} ms, ring {r * 1e3:.2f} ms (medians); modeled "
                   f"{st['modeled_ratio'][0][j]:.2f}x from 2(N-1)a + 2(N-1)/N nb fitted on "
                   f"this run per implementation (torch {st['fit']['all_reduce'][0]}; ring "
                   f"{st['fit']['ring_all_reduce'][0]}); {st['torch_threads'][0]} intra-op "
                   f"thread, {st['os_threads'][0]} OS threads per rank; {why[j]}; "
                   f"{_trust(st['load'][0], spreads)}"))
    fit_sizes = DEFAULT_SIZES[::4] if quick else DEFAULT_SIZES[::2]
    sw, load_fit = other_load(lambda: sweep_collective(("all_reduce",), fit_sizes, 2,
                                                       repeat=repeat, backend=backend))
    model = fit_alpha_beta(sw["sizes"], sw["median_s"]["all_reduce"], kind="all_reduce",
                           world_size=2)
    check = [3 * 1024 // 4 * 4, 96 * 1024, 3 * 1024 * 1024]
    at, load_at = other_load(lambda: sweep_collective(("all_reduce",), check, 2,
                                                      repeat=repeat, backend=backend))
    load = None if load_fit is None or load_at is None else max(load_fit, load_at)
    for j, (n, t) in enumerate(zip(at["sizes"], at["median_s"]["all_reduce"], strict=True)):
        modeled = collective_time("all_reduce", n, 2, model)
        rows.append(Row("dist", f"measured all_reduce {n / 1024:.0f} KiB",
                        "alpha-beta model (fitted here)", t / modeled, at["device"],
                        detail=f"ratio = measured/modeled; {model}; measured "
                               f"{t * 1e6:.0f} us, modeled {modeled * 1e6:.0f} us; "
                               f"{_trust(load, [at['spread']['all_reduce'][j]])}"))
    return rows
