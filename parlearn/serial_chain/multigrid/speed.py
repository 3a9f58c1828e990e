"""Lesson 21's speed dashboard: MGRIT against the serial ResNet, measured beside three models.

:func:`speed_sweep` builds one random stack per depth ``N``, checks the layer-parallel output
against the serial one, calibrates MGRIT's calls (:func:`~.cost.calibrate`) and times the
forward and the forward + backward of both, interleaved. :func:`plot_speed` (a
``Dashboard``'s ``plot(result, ax)``) draws the measured speedups beside the modeled limits
``N / depth`` (forward) and ``2N / (fwd+bwd depth)``, and the calibrated limit (serial time
over the sum of the calibrated call times).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from parlearn.core.checks import check_device, check_int
from parlearn.core.device import pick_device
from parlearn.core.timing import compare, sweep
from parlearn.serial_chain.multigrid.cost import calibrate, cost_model
from parlearn.serial_chain.multigrid.layer_parallel import LayerParallelResNet, SerialResNet
from parlearn.serial_chain.multigrid.solver import _check_grid
from parlearn.serial_chain.multigrid.stack import random_stack

__all__ = ["speed_sweep", "plot_speed", "read_above", "cal_reading"]

ABOVE_CAL = 1.25   # a forward this many times its calibrated limit is flagged
BELOW_CAL = 0.8    # below this fraction of it, the solver's own work between calls shows
_KEYS = ("Ns", "fwd", "fb", "model_f", "model_fb", "model_cal", "err", "above", "cal_over_limit",
         "over_cal", "setting")


def _no_grad(f: Callable, x: torch.Tensor) -> Callable[[], None]:
    def run():
        with torch.no_grad():
            f(x)
    return run


def _fwd_bwd(net: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run():
        net.zero_grad(set_to_none=True)
        net(x).square().sum().backward()
    return run


def speed_sweep(width: int, batch: int, cfactor: int, levels: int, iters: int, *,
                depths: Sequence[int] = (64, 128, 256, 512, 1024), repeat: int = 5,
                device: torch.device | str | None = None, threads: int | None = 1,
                progress: Callable | None = None) -> dict:
    """Time the serial ResNet (``SerialResNet``) and MGRIT (``LayerParallelResNet`` with
    ``iters`` forward and backward iterations, no warm start) on ``random_stack(N, width)``
    float32 and a batch of ``batch``, for each ``N`` in ``depths``: forward (no grad) and
    forward + backward, interleaved (:func:`~parlearn.core.timing.sweep`, ``repeat`` repeats,
    ``threads`` intra-op threads; None leaves torch's count). ``progress(fraction, text)``
    is told where it is.

    Returns a dict: ``fwd`` and ``fb`` (the sweeps), ``model_f``/``model_fb`` (the modeled
    limits ``N / depth``), ``model_cal`` (the serial ResNet's median over the sum of MGRIT's
    calls, each calibrated (:func:`~.cost.calibrate`), the serial ResNet timed right after them:
    ``cal_serial_s``), ``err`` (MGRIT's relative output error), ``above`` (measured speedups
    above their modeled limit: a bug to explain), ``cal_over_limit``
    (``(N, calibrated, modeled)``, where the calibrated limit exceeds ``ABOVE_CAL`` x
    ``N / depth``: the calls added up to less than ``depth`` serial layers, which no batched
    call can do, so the load changed between the two timings), ``over_cal``
    (``(N, measured, calibrated)`` where the forward measured more than ``ABOVE_CAL`` x its
    calibrated limit: the calls ran slower while calibrated than inside the forward, so that
    limit is not a result there), and ``Ns``, ``width``, ``batch``, ``cfactor``, ``setting``."""
    width, batch = check_int("width", width, lo=1), check_int("batch", batch, lo=1)
    iters, repeat = check_int("iters", iters, lo=1), check_int("repeat", repeat, lo=1)
    if isinstance(depths, str) or not isinstance(depths, Sequence) or not depths:
        raise TypeError(f"depths must be a non-empty sequence of layer counts, got {depths!r}")
    depths = [check_int("depths", n, lo=1) for n in depths]
    for n in depths:   # every depth's grid is checked before the first is built
        try:
            cfactor, levels = _check_grid(n, cfactor, levels)
        except ValueError as err:
            if "cfactor" in str(err) and "divisible" not in str(err):
                raise
            raise ValueError(f"depths: {err}") from None
    if threads is not None:
        threads = check_int("threads", threads, lo=1)
    dev = pick_device() if device is None else check_device("device", device)
    tell = progress if progress is not None else (lambda *_: None)
    if not callable(tell):
        raise TypeError(f"progress must be a callable or None, got {progress!r}")
    nets, err, cals, serial_cal = {}, [], {}, {}
    steps = len(depths) + 1
    for k, n in enumerate(depths):
        tell(k / steps, f"building N = {n}")
        st = random_stack(n, width, dtype=torch.float32, seed=0).to(dev)
        x = torch.randn(batch, width, generator=torch.Generator().manual_seed(0)).to(dev)
        lp = LayerParallelResNet(st, cfactor=cfactor, levels=levels, fwd_iters=iters,
                                 bwd_iters=iters, warm_start=False, record=False)
        nets[n] = (SerialResNet(st), lp, x)
        cals[n] = calibrate(st, x, cfactor=cfactor, levels=levels, repeat=repeat,
                            threads=threads)
        # the serial ResNet timed right after its calls: a calibrated limit from timings far
        # apart reads the machine's load between them. (Not interleaved with the calls: the
        # serial run between them leaves them cold, 1.5-1.8x slower on this CPU.)
        serial_cal[n] = compare({"serial": _no_grad(nets[n][0], x)}, warmup=1, repeat=repeat,
                                device=dev, threads=threads).timings["serial"].median
        with torch.no_grad():
            ref = nets[n][0](x)
            err.append(((lp(x) - ref).norm() / ref.norm()).item())
    tell(len(depths) / steps, "measuring forward")
    fwd = sweep(depths, lambda n: {"serial": _no_grad(nets[n][0], nets[n][2]),
                                   "MGRIT": _no_grad(nets[n][1], nets[n][2])},
                repeat=repeat, device=dev, threads=threads)
    tell((len(depths) + 0.5) / steps, "measuring forward + backward")
    fb = sweep(depths, lambda n: {"serial": _fwd_bwd(nets[n][0], nets[n][2]),
                                  "MGRIT": _fwd_bwd(nets[n][1], nets[n][2])},
               repeat=repeat, device=dev, threads=threads)
    model_f = [cost_model(n, cfactor, levels, iters)["speedup"] for n in depths]
    model_fb = [cost_model(n, cfactor, levels, iters, bwd_iters=iters)["speedup"]
                for n in depths]
    model_cal = [serial_cal[n] / cost_model(n, cfactor, levels, iters,
                                            call_time=cals[n].__getitem__)["mgrit_seconds"]
                 for n in depths]
    above = [(what, n, s, lim)
             for what, sw, mod in (("forward", fwd, model_f), ("fwd+bwd", fb, model_fb))
             for n, s, lim in zip(depths, sw["speedup"]["MGRIT"], mod, strict=True) if s > lim]
    # within ABOVE_CAL of N / depth is the serial ResNet's per-layer module call costing a
    # little more than the solver's own step (seen at N = 64 on a quiet CPU), not the load
    cal_over_limit = [(n, c, lim) for n, c, lim in zip(depths, model_cal, model_f, strict=True)
                      if c > ABOVE_CAL * lim]
    over_cal = [(n, s, c) for n, s, c in zip(depths, fwd["speedup"]["MGRIT"], model_cal,
                                              strict=True) if s > ABOVE_CAL * c]
    return {"Ns": depths, "fwd": fwd, "fb": fb, "model_f": model_f, "model_fb": model_fb,
            "err": err, "model_cal": model_cal, "cal_serial_s": [serial_cal[n] for n in depths],
            "width": width, "batch": batch,
            "cfactor": cfactor, "above": above, "cal_over_limit": cal_over_limit,
            "over_cal": over_cal,
            "setting": f"w={width}, B={batch}, m={cfactor}, {levels} levels, {iters} it"}


def _over_cal_note(result: dict) -> str:
    """What :func:`plot_speed` writes when a forward lies above its calibrated limit."""
    where = ", ".join(f"N={n}: {s:.2g}x > {c:.2g}x" for n, s, c in result["over_cal"])
    return (f"MEASURED ABOVE THE CALIBRATED LIMIT ({where}): the calls ran slower while "
            f"calibrated than inside the forward;\nthe calibrated line is not a result there")


def read_above(result: dict) -> list[dict]:
    """Each entry of :func:`speed_sweep`'s ``result["above"]`` (a median speedup above its
    modeled limit), read: a dict with ``what`` ("forward" or "fwd+bwd"), ``N``, ``measured``,
    ``limit``, ``lo`` and ``hi`` (the repeats' IQR) and ``steady``. ``steady`` is True only when
    the sweep's repeats were steady and even the lower IQR end is above the limit: then the
    baseline or the model is wrong, a bug to explain. Otherwise the repeats spread too much
    for the median to be read."""
    _check_result(result)
    out = []
    for what, n, s, lim in result["above"]:
        sw = result["fwd"] if what == "forward" else result["fb"]
        i = result["Ns"].index(n)
        lo, hi = sw["speedup_lo"]["MGRIT"][i], sw["speedup_hi"]["MGRIT"][i]
        out.append({"what": what, "N": n, "measured": s, "limit": lim, "lo": lo, "hi": hi,
                    "steady": bool(sw["reliable"]) and lo > lim})
    return out


def cal_reading(result: dict, n: int) -> str:
    """How the forward at depth ``n`` of :func:`speed_sweep`'s ``result`` stands to its
    calibrated limit: ``"cal_over_limit"`` (the calibrated limit exceeds ``ABOVE_CAL`` x
    ``N / depth``: the load changed between the calls' timing and the serial run's, so it is
    not a result), ``"over_cal"`` (measured above ``ABOVE_CAL`` x the calibrated limit: the
    calls ran slower while calibrated than inside the forward), ``"under_cal"`` (below
    ``BELOW_CAL`` x it: the solver's own work between calls) or ``"near"``."""
    _check_result(result)
    if isinstance(n, bool) or n not in result["Ns"]:
        raise ValueError(f"n must be one of the swept depths {result['Ns']}, got {n!r}")
    if any(m == n for m, _c, _lim in result["cal_over_limit"]):
        return "cal_over_limit"
    if any(m == n for m, _s, _c in result["over_cal"]):
        return "over_cal"
    i = result["Ns"].index(n)
    if result["fwd"]["speedup"]["MGRIT"][i] < BELOW_CAL * result["model_cal"][i]:
        return "under_cal"
    return "near"


def _check_result(result) -> None:
    if not isinstance(result, dict) or set(_KEYS) - set(result):
        raise ValueError(f"result must be the dict multigrid.speed_sweep returns (keys "
                         f"{_KEYS}), got {result!r:.80}")


def _above_note(result: dict) -> str:
    """What :func:`plot_speed` writes when a median lies above its modeled limit (see
    :func:`read_above`)."""
    read = read_above(result)
    spread = [f"{a['what']} N={a['N']}" for a in read if not a["steady"]]
    if len(spread) == len(read):
        return ("MEASURED ABOVE THE MODELED LIMIT (" + ", ".join(spread)
                + "): repeats too spread to read, not a result")
    return "MEASURED ABOVE THE MODELED LIMIT with steady repeats: a bug to explain"


def _cal_note(result: dict) -> str:
    """What :func:`plot_speed` writes when the calibrated limit lies more than ``ABOVE_CAL``
    x above ``N / depth``."""
    where = ", ".join(f"N={n}: {c:.2g}x > {lim:.2g}x" for n, c, lim in result["cal_over_limit"])
    return (f"CALIBRATED LIMIT ABOVE THE MODELED ONE ({where}): the calls added up to less "
            f"than depth serial layers;\nthe load changed between the calls' timing and the "
            f"serial run's: not a result")


def plot_speed(result: dict, ax) -> None:
    """Draw :func:`speed_sweep`'s ``result``: measured forward and fwd+bwd speedups (IQR
    bars) beside the modeled and calibrated limits, on log axes, with the spread warning
    and a flag when a measurement exceeds its modeled limit."""
    from matplotlib.transforms import offset_copy

    from parlearn.core.viz import log_ticks, mark_reliability, plot_measured, plot_modeled

    _check_result(result)
    for sw, name, color in ((result["fwd"], "MGRIT forward / serial ResNet (IQR bars)", "C0"),
                            (result["fb"], "MGRIT fwd+bwd / serial ResNet with autograd", "C1")):
        y = np.asarray(sw["speedup"]["MGRIT"])
        lo, hi = np.asarray(sw["speedup_lo"]["MGRIT"]), np.asarray(sw["speedup_hi"]["MGRIT"])
        plot_measured(ax, sw["values"], y, name=name,
                      device=f"{sw['device']}, {sw['threads']} thread(s)",
                      yerr=np.clip(np.vstack([y - lo, hi - y]), 0, None), color=color)
    ns = result["Ns"]
    if np.allclose(result["model_f"], result["model_fb"], rtol=0.01):   # one line, not two
        plot_modeled(ax, ns, result["model_f"], name="forward and fwd+bwd limits (equal here)",
                     formula="N / MGRIT depth = 2N / (fwd+bwd depth)", color="C0")
    else:
        plot_modeled(ax, ns, result["model_f"], name="forward limit", formula="N / MGRIT depth",
                     color="C0")
        plot_modeled(ax, ns, result["model_fb"], name="fwd+bwd limit",
                     formula="2N / (fwd+bwd depth)", color="C1", linestyle=":", marker="x", ms=7)
    flagged = {n for n in ns if cal_reading(result, n) in ("cal_over_limit", "over_cal")}
    cal = [np.nan if n in flagged else c for n, c in zip(ns, result["model_cal"], strict=True)]
    plot_modeled(ax, ns, cal, name="forward limit, calibrated (flagged N left out)",
                 formula="serial time / sum of measured call times", color="C2",
                 linestyle="--", marker="d", ms=5)   # a lone unflagged N still shows
    ax.axhline(1, color="gray", lw=0.8, label="break-even")
    mark_reliability(ax, result["fwd"]["reliable"] and result["fb"]["reliable"])
    notes = ([_above_note(result)] if result["above"] else []) + (
        [_cal_note(result)] if result.get("cal_over_limit") else []) + (
        [_over_cal_note(result)] if result.get("over_cal") else [])
    ax.set(xscale="log", yscale="log", xlabel="layers N", ylabel="speedup over the serial ResNet",
           title=result["setting"])
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.minorticks_off()
    log_ticks(ax, "y")   # a speedup axis often spans under a decade: label 0.5, 1, 2...
    under = offset_copy(ax.transAxes, fig=ax.figure, y=-30, units="points")   # below the x label
    leg = ax.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, 0.0),
                    bbox_transform=under, ncol=2)
    if notes:   # under the legend, never over the data
        ax.annotate("\n".join(notes), xy=(0.5, 0.0), xycoords=leg, xytext=(0, -4),
                    textcoords="offset points", ha="center", va="top", color="red", fontsize=8,
                    annotation_clip=False)
