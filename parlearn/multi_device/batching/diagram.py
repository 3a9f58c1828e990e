"""The two-half probe drawn (lesson 15): ``W`` ranks, two sub-groups all-reducing
separately, the partner swap, and every rank left holding both halves' means."""

from __future__ import annotations

from parlearn.multi_device.batching.halves import _layout

__all__ = ["draw_probe"]


def draw_probe(ax, world_size: int = 4) -> dict:
    """Draw the probe on ``world_size`` ranks (even, at least 2): ranks in a row, coloured by
    half; a bracket under each half for its own all-reduce (giving ``a`` or ``b``); an arc
    above for each partner swap; what every rank then holds. Returns ``{"a": ranks of half
    a, "b": ranks of half b, "swaps": [(rank, partner), ...]}``, the plan the ranks run."""
    from matplotlib.patches import FancyBboxPatch

    ranks_a, ranks_b, partner = _layout(world_size)
    w, pitch = 1.0, 1.4
    x = [pitch * r for r in range(world_size)]
    for r in range(world_size):
        color, half = ("C0", "a") if r in ranks_a else ("C1", "b")
        ax.add_patch(FancyBboxPatch((x[r], 0), w, 0.8, boxstyle="round,pad=0.05", fc=color,
                                    alpha=0.85, ec="none"))
        ax.text(x[r] + w / 2, 0.4, f"rank {r}\nhalf {half}", ha="center", va="center",
                color="white", fontsize=8)
        ax.text(x[r] + w / 2, -1.55, "a, b\ncos(a, b)\nstep (a+b)/2", ha="center", va="top",
                fontsize=7)
    for ranks, name, color in ((ranks_a, "a", "C0"), (ranks_b, "b", "C1")):
        lo, hi = x[ranks[0]], x[ranks[-1]] + w
        ax.plot([lo, lo, hi, hi], [-0.15, -0.35, -0.35, -0.15], color=color, lw=1.5)
        ax.text((lo + hi) / 2, -0.45, f"all-reduce on group {name}\n-> mean of half {name} "
                f"= {name}", ha="center", va="top", fontsize=7.5, color=color)
    swaps = [(r, partner[r]) for r in ranks_a]
    for r, p in swaps:
        ax.annotate("", xy=(x[p] + w / 2, 0.85), xytext=(x[r] + w / 2, 0.85),
                    arrowprops=dict(arrowstyle="<->", color="gray", lw=1.2,
                                    connectionstyle="arc3,rad=-0.35"))
    ax.text((x[0] + x[-1] + w) / 2, 2.1, "partner swap: rank r <-> rank r + W/2 (one "
            "batch_isend_irecv)", ha="center", va="bottom", fontsize=8, color="gray")
    ax.text(-0.3, -1.3, "then every rank holds:", fontsize=7.5, va="bottom", style="italic")
    ax.set(xlim=(-0.3, x[-1] + w + 0.3), ylim=(-2.5, 2.5))
    ax.set_axis_off()
    ax.set_title(f"the two-half probe on W = {world_size} ranks", fontsize=10)
    return {"a": ranks_a, "b": ranks_b, "swaps": swaps}
