"""Lesson 11's explorer and its modeled cluster timeline, kept here so the notebook's cells
stay short.

- :func:`explorer_step` measures a data-parallel MLP step on real gloo ranks (bucketed or
  8-bit compressed) beside the compute alone, and prices it with the alpha-beta model
  fitted on this machine; :func:`plot_explorer` draws that result on three axes.
- :func:`cluster_timeline` draws the *modeled* step of a large model on many ranks (naive
  against bucketed), with a zoom on the end of backward where the last buckets are exposed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from parlearn.core.checks import check_bool, check_float, check_int

__all__ = ["explorer_step", "plot_explorer", "cluster_timeline"]


def explorer_step(ranks: int, hidden: int, bucket_kb: int, compression_on: bool, *,
                  links: Mapping, quantize_s: float, dequantize_s: float, steps: int = 8,
                  progress=None) -> dict:
    """Measure steps of the MLP ``[64, hidden, hidden, hidden, 10]`` (batch 32 per rank) on
    ``ranks`` gloo ranks with ``BucketedDP`` (buckets of ``bucket_kb`` KiB) or, with
    ``compression_on``, the 8-bit ``CompressedDP``, next to the same steps without
    communication ("local"); ``steps`` timed steps (``workers.worker_step_time``).

    Modeled beside it: ``dp_step_model`` with ``links["all_reduce"]`` (bucketed) or the
    compute plus ``compressed_all_reduce_time`` with ``links`` and the coding times
    ``quantize_s`` / ``dequantize_s`` per element (8-bit). ``links`` maps collective names
    to fitted :class:`parlearn.distributed.AlphaBeta` (``dist.measure_links``). ``progress``,
    if given, is called as ``progress(fraction, text)``."""
    import parlearn.distributed as dist
    from parlearn.core.models import mlp_param_bytes
    from parlearn.multi_device.data_parallel import compression, workers
    from parlearn.multi_device.data_parallel.step_model import dp_step_model

    ranks = check_int("ranks", ranks, lo=2, hi=8)
    hidden = check_int("hidden", hidden, lo=1)
    bucket_kb = check_int("bucket_kb", bucket_kb, lo=1)
    compression_on = check_bool("compression_on", compression_on)
    if not isinstance(links, Mapping) or not isinstance(links.get("all_reduce"), dist.AlphaBeta):
        raise TypeError(f"links must map 'all_reduce' (and the 8-bit path's collectives) to "
                        f"an AlphaBeta, as dist.measure_links returns, got {links!r}")
    q = check_float("quantize_s", quantize_s, lo=0)
    d = check_float("dequantize_s", dequantize_s, lo=0)
    steps = check_int("steps", steps, lo=1)
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be callable or None, got {progress!r}")
    ab = links["all_reduce"]
    w = [64, hidden, hidden, hidden, 10]
    kind = "compressed" if compression_on else "bucketed"
    if progress is not None:
        progress(0.1, f"{ranks} ranks, {kind}")
    out = dist.run(workers.worker_step_time, ranks,
                   args=(("local", kind), w, 32, steps, bucket_kb * 1024), timeout=120)
    s = workers.summarize_steps(out)
    sizes = mlp_param_bytes(w)
    comp = s["local"]["median"]
    numel = sum(sizes) // 4
    if compression_on:
        modeled = comp + compression.compressed_all_reduce_time(
            numel, ranks, links, quantize_s=q, dequantize_s=d)
        wire_model = 2 * (ranks - 1) / ranks * numel + 2 * (ranks - 1) * 4
    else:
        modeled = dp_step_model(sizes, ranks, ab, compute_seconds=comp,
                                bucket_bytes=bucket_kb * 1024).step
        wire_model = 2 * (ranks - 1) / ranks * sum(sizes)
    wire = sum(dist.ring_bytes(k, b, ranks) for k, b in s[kind]["bytes"].items())
    return {"kind": kind, "s": s[kind], "local": s["local"], "modeled": modeled,
            "wire": wire, "wire_model": wire_model, "ranks": ranks, "numel": numel,
            "link": ab, "quantize_s": q, "dequantize_s": d}


def plot_explorer(r: dict, axes) -> None:
    """Draw :func:`explorer_step`'s result on three axes: the step measured (median, IQR) next
    to the model and the compute alone; the wire bytes per rank counted by the ledger next
    to the formula; the modeled fp32 / 8-bit step ratio over link bandwidths, with the
    crossover and this machine's fitted link marked."""
    from parlearn.core import viz
    from parlearn.distributed import AlphaBeta
    from parlearn.multi_device.data_parallel import compression

    need = {"kind", "s", "local", "modeled", "wire", "wire_model", "ranks", "numel", "link",
            "quantize_s", "dequantize_s"}
    if not isinstance(r, dict) or not need <= set(r):
        raise TypeError(f"r must be explorer_step's result (keys {sorted(need)}), got {r!r}")
    if len(axes) != 3:
        raise ValueError(f"axes must hold 3 axes, got {len(axes)}")
    s, ab, q, d = r["s"], r["link"], r["quantize_s"], r["dequantize_s"]
    axes[0].bar([0], [s["median"] * 1e3], yerr=[[(s["median"] - s["q1"]) * 1e3],
                                                [(s["q3"] - s["median"]) * 1e3]],
                label=viz.measured_label(r["kind"] + " step", f"cpu, {r['ranks']} gloo ranks"))
    axes[0].bar([1], [r["modeled"] * 1e3], hatch="//", fill=False,
                label=viz.modeled_label(r["kind"] + " step", "alpha-beta fitted here"
                                        + (" + coding" if r["kind"] == "compressed" else "")))
    axes[0].bar([2], [r["local"]["median"] * 1e3],
                label=viz.measured_label("compute alone", "cpu"))
    exposed, modeled_comm = s["median"] - r["local"]["median"], r["modeled"] - r["local"]["median"]
    axes[0].set(xticks=[], ylabel="ms per step",
                title=f"communication beyond compute: measured {exposed * 1e3:.1f} ms, "
                      f"modeled {modeled_comm * 1e3:.1f} ms"
                      + (f"\n{exposed / modeled_comm:.1f}x: collectives wait for the later "
                         "rank, and share the cores" if modeled_comm > 0
                         and exposed > 1.5 * modeled_comm else ""))
    axes[0].title.set_fontsize("small")
    axes[1].bar([0], [r["wire"] / 1e3], label=viz.measured_label("wire bytes", "ledger"))
    axes[1].bar([1], [r["wire_model"] / 1e3], hatch="//", fill=False,
                label=viz.modeled_label("wire bytes", "2(N-1)/N n (+ scales)"))
    axes[1].set(xticks=[], ylabel="kB per rank per step")
    bws = np.logspace(6, 11, 61)
    ratio = [compression.modeled_step_ratio(r["numel"], r["ranks"], AlphaBeta(ab.alpha, 1 / b),
                                            compute_s=r["local"]["median"], quantize_s=q,
                                            dequantize_s=d) for b in bws]
    viz.plot_modeled(axes[2], bws / 1e6, ratio, name="fp32 / 8-bit step",
                     formula="alpha-beta + coding measured here")
    cross = compression.crossover_bandwidth(r["numel"], r["ranks"], ab.alpha, quantize_s=q,
                                            dequantize_s=d)
    if np.isfinite(cross):
        axes[2].axvline(cross / 1e6, color="k", ls="--", lw=1,
                        label=viz.modeled_label(f"crossover {cross / 1e6:.3g} MB/s", "alpha-beta"))
    axes[2].axvline(ab.bandwidth / 1e6, color="gray", ls=":", lw=1,
                    label=f"this machine's fitted link, {ab.bandwidth / 1e6:.0f} MB/s")
    axes[2].axhline(1, color="gray", lw=0.6)
    axes[2].set(xscale="log", yscale="log", xlabel="link bandwidth (MB/s)",
                ylabel="fp32 step / 8-bit step")
    _plain_log_ticks(axes[2])
    viz.mark_reliability(axes[0], s["q3"] <= 2 * s["q1"])
    for ax in axes:   # the third panel has an x label to clear
        ax.legend(fontsize="small", loc="upper center",
                  bbox_to_anchor=(0.5, -0.16 if ax is axes[2] else -0.05))


def cluster_timeline(axes, param_bytes: Sequence[int], world_size: int, link, *,
                     compute_seconds: float, bucket_bytes: int = 25 * 2**20,
                     zoom_last: int = 4) -> dict:
    """Draw the modeled step (``dp_step_model``) of gradients ``param_bytes`` on
    ``world_size`` ranks over ``link`` (an AlphaBeta) on two axes. Left, the whole step:
    compute, the naive all-reduce after backward, and the bucketed all-reduces (alternate
    shades, one bar per bucket). Right, a zoom on the end of backward: the last ``zoom_last``
    buckets, each labelled with its number, and the exposed tail after backward. Returns
    ``{"naive": DPStepModel, "bucketed": DPStepModel, "exposed": seconds}``."""
    from parlearn.distributed import AlphaBeta
    from parlearn.multi_device.data_parallel.step_model import dp_step_model

    if len(axes) != 2:
        raise ValueError(f"axes must hold 2 axes, got {len(axes)}")
    if not isinstance(link, AlphaBeta):
        raise TypeError(f"link must be an AlphaBeta, got {link!r}")
    zoom_last = check_int("zoom_last", zoom_last, lo=1)
    m = {k: dp_step_model(param_bytes, world_size, link, compute_seconds=compute_seconds,
                          strategy=k, bucket_bytes=bucket_bytes) for k in ("naive", "bucketed")}
    t_f = compute_seconds / 3          # dp_step_model's default backward fraction 2/3
    exposed = m["bucketed"].step - compute_seconds
    lanes = ["naive compute", "naive comm", "bucketed compute", "bucketed comm"]
    shades = ("C6", "#f0a6d8")
    for ax, zoom in zip(axes, (False, True), strict=True):
        for row in (0, 2):
            ax.barh(row, t_f * 1e3, color="C4", label="forward" if row == 0 else None)
            ax.barh(row, (compute_seconds - t_f) * 1e3, left=t_f * 1e3, color="C5",
                    label="backward" if row == 0 else None)
        ax.barh(1, (m["naive"].step - compute_seconds) * 1e3, left=compute_seconds * 1e3,
                color="C6", label="all-reduce")
        buckets = m["bucketed"].buckets
        for i, (_, start, end) in enumerate(buckets):
            ax.barh(3, (end - start) * 1e3, left=start * 1e3, color=shades[i % 2],
                    label="bucket (alternate shades)" if i == 1 and not zoom else None)
            if zoom and i >= len(buckets) - zoom_last:
                ax.text((start + end) / 2 * 1e3, 3, f"b{i}", ha="center", va="center",
                        fontsize=7)
        ax.axvline(compute_seconds * 1e3, color="k", lw=0.8, ls=":")
        ax.set_yticks(range(4), lanes)
        ax.invert_yaxis()
        ax.set_xlabel("time (ms)")
    first = buckets[max(0, len(buckets) - zoom_last)][1]
    lo = min(first, compute_seconds - 0.02 * compute_seconds)
    hi = max(m["bucketed"].step, compute_seconds) + 0.05 * (compute_seconds - lo)
    axes[1].set_xlim(lo * 1e3, hi * 1e3)
    # the bucketed tail, marked on its own row (a label in the naive row read as naive's)
    axes[1].plot([compute_seconds * 1e3, m["bucketed"].step * 1e3], [3.45, 3.45], color="k",
                 lw=1.5, label="bucketed: exposed after backward")
    axes[0].legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=4)
    axes[0].set_title(f"whole step: naive {m['naive'].step * 1e3:.0f} ms, bucketed "
                      f"{m['bucketed'].step * 1e3:.0f} ms ({len(buckets)} buckets)",
                      fontsize="small")
    axes[1].set_title(f"zoom on the end of backward (dotted): the last {zoom_last} buckets;\n"
                      f"bucketed exposed after backward (black line): {exposed * 1e3:.1f} ms",
                      fontsize="small")
    return {**m, "exposed": exposed}


def _plain_log_ticks(ax) -> None:
    """Ticks 0.5, 1, 2, 5 on a log y-axis instead of 5x10^-1, 10^0, 2x10^0."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
