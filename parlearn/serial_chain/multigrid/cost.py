"""MGRIT's cost model (depth and work against the serial sweep) and the bench rows.

:func:`cost_model` counts exactly the batched calls :func:`~parlearn.serial_chain.multigrid.
solver.mgrit` makes (modeled: every step evaluation one step time); :func:`bench` measures
MGRIT against :class:`~parlearn.serial_chain.multigrid.layer_parallel.SerialResNet` and
puts each ratio next to that modeled limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from parlearn.core.bench import Row
from parlearn.core.checks import check_bool, check_choice, check_int
from parlearn.core.timing import compare
from parlearn.serial_chain.multigrid.layer_parallel import (
    LayerParallelResNet,
    SerialResNet,
    mgrit_forward,
)
from parlearn.serial_chain.multigrid.solver import RELAX, _check_grid
from parlearn.serial_chain.multigrid.stack import random_stack

__all__ = ["cost_model", "bench"]


# --- cost model ----------------------------------------------------------------------


def cost_model(N: int, cfactor: int, levels: int, iters: int, *, relax: str = "FCF",
               devices: int | None = None, record: bool = False,
               bwd_iters: int | None = None) -> dict:
    """Sequential batched calls (depth) and step evaluations (work) of serial vs MGRIT
    (modeled: every step evaluation costs the same, a batched call of k steps costs
    ``ceil(k/P)`` step times on ``devices=P``, one with ``devices=None``).

    It counts exactly the calls :func:`mgrit` makes to its step function. One V-cycle
    at level l with ``n`` steps and ``m = cfactor``: each F-relaxation is ``m-1`` calls
    of ``n/m`` steps (FCF: F, one C call of ``n/m``, F); the C-point residual is one
    call of ``n/m``; the FAS right-hand side one coarse call of ``n/m``; then the cycle
    at level l+1 on ``n/m`` steps; then an F-relaxation. The coarsest level is solved
    serially (``n`` calls of one step); ``levels=1`` is that serial solve on N steps.
    ``record=True`` adds the full residual (one call of N) before the first and after
    every iteration, as :func:`mgrit` evaluates it with ``record=True`` or a ``tol``
    (``iters`` is then the number of iterations the run took). With ``devices=1``,
    depth equals work.

    ``bwd_iters`` adds a backward pass: the adjoint solve (the same cycles, ``bwd_iters``
    iterations) plus one parameter-gradient call of N steps, against a serial backward
    of N steps (serial depth and work 2N); ``speedup`` is then that of forward+backward.

    Layer-wise model parallelism on P devices still runs the N layers in order: depth N
    for one batch (it only splits memory), which is the baseline Kirby et al. compare to.
    """
    N = check_int("N", N, lo=1)
    cfactor, levels = _check_grid(N, cfactor, levels)
    iters = check_int("iters", iters, lo=1)
    check_choice("relax", relax, RELAX)
    if devices is not None:
        devices = check_int("devices", devices, lo=1)
    check_bool("record", record)
    if bwd_iters is not None:
        bwd_iters = check_int("bwd_iters", bwd_iters, lo=1)
    m, P = cfactor, devices

    def t(k):  # time of one batched call of k steps
        return 1 if P is None else math.ceil(k / P)

    def cycle(n, level):  # (depth, work) of one cycle at `level` on n steps
        if level == levels - 1:
            return n * t(1), n
        k = n // m
        calls = [k] * (m - 1)  # F-relaxation
        if relax == "FCF":
            calls += [k] + [k] * (m - 1)  # C, F
        calls += [k, k]  # C-point residual; coarse operator in the FAS right-hand side
        calls += [k] * (m - 1)  # the final F-relaxation
        d, w = cycle(k, level + 1)
        return sum(t(c) for c in calls) + d, sum(calls) + w

    d, w = cycle(N, 0)
    res_d, res_w = (t(N), N) if record else (0, 0)

    def solve(its):
        return (its * (d + res_d) + res_d, its * (w + res_w) + res_w)

    depth, work = solve(iters)
    serial = N
    if bwd_iters is not None:
        bd, bw = solve(bwd_iters)
        depth, work, serial = depth + bd + t(N), work + bw + N, 2 * N
    return {"serial_depth": serial, "serial_work": serial, "mgrit_depth": depth,
            "mgrit_work": work, "model_parallel_depth": serial, "speedup": serial / depth}


# --- bench ------------------------------------------------------------------------------


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _fwd_bwd(net: nn.Module, x0: torch.Tensor) -> None:
    net.zero_grad(set_to_none=True)  # the bench's own networks only
    net(x0).square().sum().backward()


def _no_grad(fn: Callable, *args) -> Callable[[], Any]:
    def run():
        with torch.no_grad():
            return fn(*args)
    return run


def _ratio_row(name: str, baseline: str, variant: str, cmp, limit: float, device, extra: str,
               target: str = "", met: bool | None = None,
               formula: str = "N / MGRIT depth") -> Row:
    ratio = cmp.speedup("mgrit")
    lo, hi = cmp.speedup_range("mgrit")
    detail = (f"IQR {lo:.2f}-{hi:.2f}, {cmp.threads} thread(s); modeled limit {limit:.1f}x "
              f"({formula}, every batched call one step time); {extra}")
    if ratio > limit:
        detail += ("; MEASURED ABOVE THE MODELED LIMIT: a bug to explain (baseline or "
                   "model), not a result")
    if not cmp.reliable:
        detail += "; WARNING: another program is using the cores; this figure is not reliable"
    return Row(name, baseline, variant, ratio, str(device), target, met, detail)


def bench(device: torch.device, quick: bool) -> list[Row]:
    """MGRIT forward and forward+backward vs :class:`SerialResNet` (per-layer parameters,
    autograd) with the same weights, each next to its modeled limit. On CPU one intra-op
    thread (see :data:`parlearn.device.THREAD_POLICY`)."""
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, got {type(device).__name__}")
    check_bool("quick", quick)
    rows = []
    sizes = (64, 256) if quick else (256, 1024)
    width, batch = 32, 4
    target = 1.5 if device.type == "cpu" else 3.0
    threads = 1 if device.type == "cpu" else None
    g = torch.Generator().manual_seed(0)
    for N in sizes:
        stack = random_stack(N, width, dtype=torch.float32, seed=0).to(device)
        serial = SerialResNet(stack)
        x0 = torch.randn(batch, width, generator=g).to(device)
        with torch.no_grad():
            ref = serial(x0)
        best = None
        for m, levels, iters in ((8, 2, 2), (16, 2, 2), (4, 3, 2), (8, 3, 2), (16, 3, 1)):
            if N % m ** (levels - 1):
                continue
            res = mgrit_forward(stack, x0, cfactor=m, levels=levels, iters=iters, record=False)
            err = _rel_err(res.output, ref)
            if err < 1e-4:
                cost = cost_model(N, m, levels, iters)["mgrit_depth"]
                if best is None or cost < best[0]:
                    best = (cost, m, levels, iters, err)
        name = f"multigrid N={N} w={width} B={batch}"
        if best is None:
            rows.append(Row(name, "serial forward", "MGRIT forward", 0.0, str(device), "",
                            False, "no setting reached 1e-4"))
            continue
        _, m, levels, iters, err = best
        repeat = 3 if quick else 7
        cmp = compare({"serial": _no_grad(serial, x0),
                       "mgrit": _no_grad(partial(mgrit_forward, stack, x0, cfactor=m,
                                                 levels=levels, iters=iters, record=False))},
                      warmup=1, repeat=repeat, device=device, threads=threads)
        has_target = N >= 1024  # the target is stated at N = 1024
        ratio = cmp.speedup("mgrit")
        rows.append(_ratio_row(name, "serial ResNet forward (per-layer weights)",
                               f"MGRIT forward m={m} L={levels} it={iters}", cmp,
                               cost_model(N, m, levels, iters)["speedup"], device,
                               f"rel. error {err:.1e}",
                               f">= {target}x" if has_target else "",
                               ratio >= target if has_target else None))
        lp = LayerParallelResNet(stack, cfactor=m, levels=levels, fwd_iters=iters,
                                 bwd_iters=iters, warm_start=False, record=False)
        cmp2 = compare({"serial": partial(_fwd_bwd, serial, x0),
                        "mgrit": partial(_fwd_bwd, lp, x0)}, warmup=1,
                       repeat=3 if quick else 5, device=device, threads=threads)
        rows.append(_ratio_row(name, "serial ResNet fwd+bwd (autograd)",
                               f"MGRIT fwd+bwd m={m} L={levels} it={iters}", cmp2,
                               cost_model(N, m, levels, iters, bwd_iters=iters)["speedup"],
                               device, "same weights, gradients inexact at these iterations",
                               formula="2N / (forward + adjoint + gradient depth)"))
    return rows
