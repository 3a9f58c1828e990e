"""The planner's explorer (lesson 19): the fastest plan of each of the best meshes for a
Llama model on a cluster of H100 nodes, modeled, beside a real run's measured MFU.

:func:`best_meshes` ranks every plan with :func:`parlearn.mesh.planner.rank_plans` on
``h100-8x-nvlink`` nodes joined by ``h100-ib`` links (presets of :mod:`parlearn.card`,
their bandwidth between nodes set by ``inter_gbs``) and keeps the fastest plan of each mesh
``(dp, tp, pp, cp)`` that fits. :func:`plot_best` draws their modeled step time, MFU and
memory; the MFU panel carries the measured MFU of :data:`planner.MEASURED_MFU`'s first
anchor (Llama 3 405B on H100s) in the same units, and the time panel the step time this
workload would take at that MFU, ``3 F / (MFU x peak x GPUs)``. :func:`explorer` wires
both to sliders.
"""

from __future__ import annotations

from parlearn.core.checks import check_choice, check_float, check_int
from parlearn.distributed import card as cards
from parlearn.multi_device.memory.calculator import PRESETS
from parlearn.multi_device.mesh.planner import (
    MEASURED_MFU,
    Cluster,
    LlamaWorkload,
    rank_plans,
)

__all__ = ["best_meshes", "plot_best", "explorer"]

TIME_PARTS = ("compute", "bubble", "tp", "cp", "pp", "dp")
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "logits")
MEASURED = "goldenrod"  # the measured anchor's band, on the time and the MFU axes


def best_meshes(model: str = "llama3-8b", gpus: int = 8, seq: int = 4096,
                inter_gbs: float = 50.0, efficiency: float | None = None,
                top: int = 6) -> dict:
    """The fastest plan of each of the ``top`` fastest meshes that fit (modeled), for a
    global batch of ``max(gpus // 2, 64)`` sequences of ``seq`` tokens; ``efficiency`` as
    :class:`parlearn.mesh.planner.Cluster` takes it (None: 0.6 of the datasheet peak).
    Returns ``{"ranked", "model", "gpus", "inter_gbs", "batch", "seq", "n_fit", "n", "efficiency",
    "anchor"`` (the measured run), ``"anchor_s"`` (step time at its MFU, low and high)``}``."""
    check_choice("model", model, tuple(PRESETS))
    gpus = check_int("gpus", gpus, lo=1)
    seq = check_int("seq", seq, lo=1)
    inter_gbs = check_float("inter_gbs", inter_gbs, lo=0, lo_open=True)
    top = check_int("top", top, lo=1)
    node, links = cards.preset("h100-8x-nvlink"), cards.preset("h100-ib")
    inter = cards.Card(**{**links.__dict__, "links": {
        k: cards.AlphaBeta(ab.alpha, 1 / (inter_gbs * 1e9)) for k, ab in links.links.items()}})
    cluster = Cluster(node, 8, inter, efficiency=efficiency)
    work = LlamaWorkload(model, batch=max(gpus // 2, 64), seq=seq)
    ranked = rank_plans(work, cluster, gpus, recompute=("none", "selective", "full"))
    best: dict = {}
    for p in ranked:
        if p.fits:
            best.setdefault((p.plan.dp, p.plan.tp, p.plan.pp, p.plan.cp), p)
    anchor = MEASURED_MFU[0]
    peak = node.flops[work.dtype] * gpus
    return {"ranked": list(best.values())[:top], "model": model, "gpus": gpus,
            "inter_gbs": inter_gbs,
            "batch": work.batch, "seq": seq, "n_fit": sum(p.fits for p in ranked),
            "n": len(ranked), "efficiency": cluster.sustained, "anchor": anchor,
            "anchor_s": tuple(3 * work.forward_flops() / (m * peak) for m in anchor["mfu"])}


def _stacked(ax, names, preds, parts, values, scale=1.0):
    left = [0.0] * len(preds)
    for i, part in enumerate(parts):
        vals = [values(p)[part] / scale for p in preds]
        ax.barh(names, vals, left=left, color=f"C{i}", label=part)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    return left


def plot_best(res: dict, axes) -> None:
    """Draw :func:`best_meshes`' result on three axes: step time, MFU, memory per GPU."""
    if not isinstance(res, dict) or "ranked" not in res:
        raise TypeError("res must be the dict best_meshes returns")
    if len(axes) != 3:
        raise ValueError(f"axes must be 3 matplotlib axes, got {len(axes)}")
    ax_t, ax_m, ax_mem = axes
    best = res["ranked"]
    lo, hi = res["anchor"]["mfu"]
    # The title names every input, so the figure says what it shows (and changes with any
    # control, even one that moves no bar, such as the link between nodes on one node).
    ax_t.figure.suptitle(f"{res['model']} on {res['gpus']} GPUs "
                         f"({res.get('inter_gbs', float('nan')):g} GB/s between nodes), batch "
                         f"{res['batch']} x {res['seq']}: modeled at {res['efficiency']:.2f} of "
                         f"the datasheet peak; measured: Llama 3 405B, {lo:.2f}-{hi:.2f} MFU on "
                         "H100s")
    if not best:
        for ax in axes:
            ax.axis("off")
        ax_m.text(0.5, 0.5, f"no plan fits in 80 GB ({res['n']} tried)", ha="center",
                  va="center", transform=ax_m.transAxes)
        return
    names = [str(p.plan).replace(" cp1", "") for p in best]
    totals = _stacked(ax_t, names, best, TIME_PARTS, lambda p: p.time)
    for i, total in enumerate(totals):  # the totals: close plans look alike as bars
        ax_t.text(total, i, f" {total:.3g} s", va="center", fontsize=8)
    t_fast, t_slow = res["anchor_s"][1], res["anchor_s"][0]
    ax_t.axvspan(t_fast, t_slow, color=MEASURED, alpha=0.4, zorder=3,
                 label=f"at measured MFU {lo:.2f}-{hi:.2f}")
    ax_t.set_xlim(0, 1.18 * max(max(totals), t_slow))
    ax_t.invert_yaxis()
    ax_t.set(xlabel="step time, s (modeled; band: 3F / (measured MFU x peak))",
             title=f"{res['n_fit']} of {res['n']} plans fit; the best of {len(best)} meshes")
    ax_t.legend(fontsize="x-small", ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    ax_m.barh(names, [p.mfu for p in best], color="C0",
              label="modeled: 3F / (step time x peak)")
    ax_m.axvspan(lo, hi, color=MEASURED, alpha=0.4, zorder=3,
                 label="measured: Llama 3 405B, H100s (arXiv:2407.21783)")
    ax_m.axvline(res["efficiency"], color="C3", ls="--",
                 label=f"modeled, no communication: {res['efficiency']:.2f}")
    ax_m.invert_yaxis()
    ax_m.set(xlim=(0, 1), xlabel="MFU (of datasheet peak)", yticklabels=[], title="MFU")
    ax_m.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.2))
    _stacked(ax_mem, names, best, MEMORY_PARTS, lambda p: p.memory, scale=2**30)
    ax_mem.axvline(80e9 / 2**30, color="k", ls="--", label="80 GB")
    ax_mem.invert_yaxis()
    ax_mem.set(xlabel="GiB per GPU (modeled)", yticklabels=[], title="memory per GPU")
    ax_mem.legend(fontsize="x-small", ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.2))


def explorer(model: str = "llama3-8b", gpus: int = 8, seq: int = 4096,
             inter_gbs: float = 50.0, efficiency: float = 0.6):
    """A :class:`parlearn.widgets.Dashboard` of :func:`best_meshes` and :func:`plot_best`,
    its sliders starting at the arguments (``efficiency`` from 0.3 to 1)."""
    import ipywidgets as W

    from parlearn.core.widgets import Dashboard

    check_choice("model", model, ("llama3-8b", "llama3-70b"))
    check_choice("gpus", gpus, (8, 64, 256, 1024))
    check_choice("seq", seq, (2048, 4096, 8192))
    check_float("inter_gbs", inter_gbs, lo=5.0, hi=100.0)
    check_float("efficiency", efficiency, lo=0.3, hi=1.0)
    def menu(name, options, value):
        return W.Dropdown(options=options, value=value, description=name)

    return Dashboard(best_meshes, plot_best, ncols=3, figsize=(15, 4.8), controls={
        "model": menu("model", ["llama3-8b", "llama3-70b"], model),
        "gpus": menu("gpus", [8, 64, 256, 1024], gpus),
        "seq": menu("seq", [2048, 4096, 8192], seq),
        "inter_gbs": (5.0, 100.0, 5.0, inter_gbs),
        "efficiency": (0.3, 1.0, 0.05, efficiency)})
