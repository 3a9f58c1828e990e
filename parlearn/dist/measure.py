"""Measure collectives on real ranks and fit the alpha-beta model to them.

    from parlearn.dist import measure_alpha_beta
    measure_alpha_beta(world_size=2)      # AlphaBeta(alpha=..., beta=...) of this machine

:func:`sweep_collective` times collectives (median and quartiles of the slowest rank, over
interleaved repeats) at a sweep of payload sizes; :func:`measure_alpha_beta` fits
:func:`parlearn.dist.cost.fit_alpha_beta` to such a sweep. :func:`bench` is the ``dist``
group of ``python -m parlearn.bench``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from parlearn.core.bench import Row
from parlearn.core.checks import check_choice, check_int
from parlearn.core.timing import SPREAD_LIMIT, Timing
from parlearn.dist import collectives
from parlearn.dist.cost import AlphaBeta, collective_time, fit_alpha_beta
from parlearn.dist.launch import default_backend, run

__all__ = ["DEFAULT_SIZES", "sweep_collective", "measure_alpha_beta", "bench"]


# Payload sizes (bytes) of the default sweep: 64 B to 4 MiB, four per decade or so.
DEFAULT_SIZES = tuple(int(2 ** (k / 2)) // 4 * 4 for k in range(12, 45))


def _label(backend: str, world_size: int) -> str:
    where = "GPUs" if backend == "nccl" else f"CPU, {os.cpu_count()} cores"
    return f"{world_size} {backend} ranks on {where}"


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
    kinds = [check_choice("kinds", k, collectives.TIMED_KINDS) for k in kinds]
    sizes = [check_int("sizes", n, lo=4) for n in sizes]
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


def _trust(reliable: bool) -> str:
    return "spread ok" if reliable else "UNRELIABLE: another program is using the cores"


def bench(device: torch.device, quick: bool) -> list:
    """Rows for ``python -m parlearn.bench dist``, all on 2 real ranks (NCCL when ``device``
    is CUDA and there are 2 GPUs, else gloo on the CPU): the ring all-reduce written from
    send/recv against ``torch.distributed.all_reduce`` (4 MiB, interleaved), and measured
    all-reduce time against the alpha-beta model fitted on a separate sweep, at 3 sizes
    between the fitted ones (ratio measured/modeled)."""
    backend = "nccl" if device.type == "cuda" and default_backend(2) == "nccl" else "gloo"
    repeat = 3 if quick else 9
    big = 1 << 20 if quick else 1 << 22
    cmp = sweep_collective(("all_reduce", "ring_all_reduce"), [big], 2, repeat=repeat,
                           backend=backend)
    t_torch, t_ring = cmp["median_s"]["all_reduce"][0], cmp["median_s"]["ring_all_reduce"][0]
    rows = [Row("dist", f"all_reduce {big >> 20} MiB", "ring from send/recv (parlearn)",
                t_torch / t_ring, cmp["device"],
                detail=f"torch {t_torch * 1e3:.2f} ms, ring {t_ring * 1e3:.2f} ms; "
                       f"{_trust(cmp['reliable'])}")]
    fit_sizes = DEFAULT_SIZES[::4] if quick else DEFAULT_SIZES[::2]
    sw = sweep_collective(("all_reduce",), fit_sizes, 2, repeat=repeat, backend=backend)
    model = fit_alpha_beta(sw["sizes"], sw["median_s"]["all_reduce"], kind="all_reduce",
                           world_size=2)
    check = [3 * 1024 // 4 * 4, 96 * 1024, 3 * 1024 * 1024]
    at = sweep_collective(("all_reduce",), check, 2, repeat=repeat, backend=backend)
    for n, t in zip(at["sizes"], at["median_s"]["all_reduce"], strict=True):
        modeled = collective_time("all_reduce", n, 2, model)
        rows.append(Row("dist", f"measured all_reduce {n / 1024:.0f} KiB",
                        "alpha-beta model (fitted here)", t / modeled, at["device"],
                        detail=f"ratio = measured/modeled; {model}; measured "
                               f"{t * 1e6:.0f} us, modeled {modeled * 1e6:.0f} us; "
                               f"{_trust(sw['reliable'] and at['reliable'])}"))
    return rows
