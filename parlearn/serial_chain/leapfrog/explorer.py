"""Lesson 20's explorer: one setting measured beside the cost model, and its figure.

:func:`explore` times the backward of every schedule (and torch's own autograd) on one deep
MLP, interleaved, converts the cost model's work/span bound to seconds at the measured serial
flop rate, and reads the two timelines with :func:`~parlearn.serial_chain.leapfrog.shortfall`.
:func:`plot_explore` (a ``Dashboard``'s ``plot(result, axes)``) draws the result: measured
against modeled backward times, and the modeled speedup for every worker count with the
measured points at the chosen one.
"""

from __future__ import annotations

import textwrap

import numpy as np
import torch

from parlearn.core.checks import check_device, check_int
from parlearn.core.device import pick_device
from parlearn.core.device import threads as _threads
from parlearn.core.timing import compare
from parlearn.serial_chain.leapfrog.cost import cost_model, deep_mlp
from parlearn.serial_chain.leapfrog.schedules import MODES, backward, timeline
from parlearn.serial_chain.leapfrog.terms import forward
from parlearn.serial_chain.leapfrog.verdict import shortfall

__all__ = ["explore", "plot_explore"]

_SKIP = 20   # a schedule modeled this many times slower than serial is not timed
_KEYS = ("cmp", "device", "threads", "workers", "layers", "modeled", "ks", "model_speedup",
         "limit", "why")


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def explore(layers: int, width: int, batch: int, workers: int, *,
            threads_per_worker: int | None = 1, device: torch.device | str | None = None,
            repeat: int = 5, seed: int = 0) -> dict:
    """Measure one backward of ``leapfrog.deep_mlp(layers, width)`` on a batch of ``batch``
    under every schedule with ``workers`` workers, and torch's autograd, interleaved
    (:func:`~parlearn.core.timing.compare`, ``repeat`` repeats). ``threads_per_worker``: the
    intra-op threads of each worker on a CPU (None: ``n // k`` of the ``n`` threads, the
    serial schedule and autograd all ``n``); ignored on a GPU. A schedule modeled more than
    20x slower than serial is skipped.

    Returns a dict: ``cmp`` (the comparison), ``modeled`` (each schedule's work/span bound,
    ``max(depth, work/k)`` flops, in seconds at the serial schedule's measured flop rate),
    ``ks``/``model_speedup`` (leapfrog's modeled speedup for k = 1..8), ``limit`` (2 - 1/L),
    ``why`` (:func:`shortfall` of the two timelines) and the setting."""
    layers, width = check_int("layers", layers, lo=1), check_int("width", width, lo=1)
    batch, workers = check_int("batch", batch, lo=1), check_int("workers", workers, lo=1)
    if threads_per_worker is not None:
        threads_per_worker = check_int("threads_per_worker", threads_per_worker, lo=1)
    repeat, seed = check_int("repeat", repeat, lo=1), check_int("seed", seed, lo=0)
    dev = pick_device() if device is None else check_device("device", device)
    per = threads_per_worker if dev.type == "cpu" else None
    g = torch.Generator().manual_seed(seed)
    net = deep_mlp(layers, width, seed=g).to(dev)
    x = torch.randn(batch, width, generator=g).to(dev)
    y = torch.randn(batch, width, generator=g).to(dev)
    tape = forward(net, _mse, x, y)
    out = net(x)
    models = {m: cost_model(layers, width, batch, workers, m) for m in MODES}
    cands = {m: (lambda m=m: backward(tape, workers=workers, mode=m, accumulate=False,
                                      threads_per_worker=per))
             for m in MODES if models[m]["lower_bound"] <= _SKIP * models["serial"]["lower_bound"]}

    def autograd():
        if per is None:
            torch.autograd.grad(_mse(out, y), list(net.parameters()), retain_graph=True)
            return
        with _threads(per):
            torch.autograd.grad(_mse(out, y), list(net.parameters()), retain_graph=True)

    cands["autograd"] = autograd
    cmp = compare(cands, repeat=repeat, device=dev)
    evs = {m: timeline(net, _mse, x, y, workers=workers, mode=m, threads_per_worker=per)
           for m in ("serial", "leapfrog")}
    rate = cmp.timings["serial"].median / models["serial"]["lower_bound"]
    ks = np.arange(1, 9)
    return {"cmp": cmp, "device": str(dev), "workers": workers, "layers": layers,
            "threads": "n // k per worker" if per is None else f"{per} per worker",
            "modeled": {m: c["lower_bound"] * rate for m, c in models.items()},
            "ks": ks, "model_speedup": [cost_model(layers, width, batch, int(k),
                                                   "leapfrog")["speedup"] for k in ks],
            "limit": models["leapfrog"]["speedup_limit"],
            "why": shortfall(evs["serial"], evs["leapfrog"], measured=cmp.speedup("leapfrog"),
                             modeled=models["leapfrog"]["speedup"], workers=workers)}


def plot_explore(result: dict, axes) -> None:
    """Draw :func:`explore`'s ``result`` on two axes: measured backward times beside the
    modeled ones (log scale; a measurement below its modeled bar is flagged, since the
    seconds assume the serial flop rate), and leapfrog's modeled speedup against k with
    Amdahl's cap and the measured speedups (over the serial schedule and over autograd),
    with the verdict of the timelines."""
    from parlearn.core.viz import (
        mark_reliability,
        measured_label,
        modeled_label,
        plot_measured,
        plot_modeled,
    )

    if not isinstance(result, dict) or set(_KEYS) - set(result):
        raise ValueError(f"result must be the dict leapfrog.explore returns (keys {_KEYS}), "
                         f"got {result!r:.80}")
    cmp, ax = result["cmp"], axes[0]
    names = ["serial", "leapfrog", "segments", "autograd"]
    xs = np.arange(len(names))
    meas = np.array([cmp.timings[n].median * 1e3 if n in cmp.timings else np.nan for n in names])
    half = np.array([cmp.timings[n].spread / 2 if n in cmp.timings else 0 for n in names]) * meas
    mod = [result["modeled"].get(n, np.nan) * 1e3 for n in names]
    where = f"{result['device']}, threads: {result['threads']}"
    ax.bar(xs - 0.2, np.nan_to_num(meas), 0.4, yerr=np.nan_to_num(half), capsize=3,
           label=measured_label("backward", where))
    ax.bar(xs + 0.2, mod, 0.4, hatch="//", alpha=0.5,
           label=modeled_label("backward", "max(depth, work/k) at serial flop rate"))
    ax.set_xticks(xs, [n if n in cmp.timings else f"{n}\n(skipped)" for n in names])
    ax.set(ylabel="ms", yscale="log",
           title=f"k = {result['workers']}, L = {result['layers']} Linear layers")
    below = [n for n, m_, h, md in zip(names, meas, half, mod, strict=True)
             if np.isfinite(m_) and np.isfinite(md) and m_ + h < md]
    if below:
        ax.set_ylim(top=ax.get_ylim()[1] * 20)  # headroom for the note
        ax.text(0.5, 0.97, f"measured below its modeled bar: {', '.join(below)}\n(the bound "
                "holds in flops; its seconds assume serial's flop rate,\nand bigger kernels run "
                "faster per flop)", transform=ax.transAxes, ha="center", va="top", color="red",
                fontsize=8)
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.22))
    mark_reliability(ax, cmp.reliable)
    ax, k = axes[1], result["workers"]
    plot_modeled(ax, result["ks"], result["model_speedup"], name="leapfrog",
                 formula="work / max(depth, work/k)", marker=".")
    ax.axhline(result["limit"], color="C3", lw=0.8,
               label=modeled_label(f"Amdahl cap {result['limit']:.2f}x", "2 - 1/L"))
    sp, (lo, hi) = cmp.speedup("leapfrog"), cmp.speedup_range("leapfrog")
    plot_measured(ax, [k], [sp], name="leapfrog", device=where,
                  yerr=[[max(sp - lo, 0)], [max(hi - sp, 0)]], color="C1", linestyle="none")
    sa = cmp.speedup("leapfrog", over="autograd")
    la, ha = cmp.speedup_range("leapfrog", over="autograd")
    plot_measured(ax, [k + 0.15], [sa], name="leapfrog vs torch autograd", device=where,
                  yerr=[[max(sa - la, 0)], [max(ha - sa, 0)]], color="C2", linestyle="none",
                  marker="s")
    ax.axhline(1, color="gray", lw=0.6)
    ax.set(xlabel="workers k", ylabel="speedup (other time / leapfrog time)",
           ylim=(0, max(2.4, hi * 1.15, ha * 1.15)), title="leapfrog vs serial (and vs autograd)")
    if sp > result["limit"]:
        ax.text(0.5, 0.93, "measured above the modeled cap: a bug until explained\n"
                "(usually a busy machine slowing the serial run)", transform=ax.transAxes,
                ha="center", va="top", color="red", fontsize=8)
    leg = ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.22))
    ax.annotate(textwrap.fill(result["why"]["verdict"], 70), xy=(0.5, 0.0), xycoords=leg,
                xytext=(0, -4), textcoords="offset points", ha="center", va="top", fontsize=9,
                color="C3" if result["why"]["short"] else "black", annotation_clip=False)
    mark_reliability(ax, cmp.reliable)
