"""Diagrams of who holds what in lesson 17: the ring's K/V blocks step by step, Ulysses'
sequence <-> heads all-to-all, and the zig-zag layout of a causal sequence.

Each function draws on a matplotlib axis and returns the table it drew (what each rank
holds), so a test can check the picture against the schedule the code runs: the ring's
step ``t`` on rank ``r`` holds the block that started on rank ``(r - t) mod N``
(:mod:`.ring`); zig-zag gives rank ``r`` chunks ``r`` and ``2N - 1 - r``
(:func:`.blocks.shard_chunks`).
"""

from __future__ import annotations

import numpy as np

from parlearn.core.checks import check_int
from parlearn.multi_device.context_parallel.blocks import LAYOUTS, shard_chunks

__all__ = ["draw_ring", "draw_ulysses", "draw_zigzag"]


def _color(rank: int) -> str:
    return f"C{rank % 10}"


def _cell(ax, x, y, text, color, alpha=0.85):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), 0.9, 0.8, color=color, alpha=alpha))
    ax.text(x + 0.45, y + 0.4, text, ha="center", va="center", fontsize=8, color="white")


def draw_ring(ax, world_size: int = 4) -> list[list[int]]:
    """Ring attention's forward, one column per step and one row per rank: the cell says
    whose K/V block the rank computes on at that step (coloured by the rank it started
    on), and an arrow shows each block moving on to the next rank. Returns
    ``held[rank][step]``, the origin of the block in hand."""
    n = check_int("world_size", world_size, lo=2)
    held = [[(r - t) % n for t in range(n)] for r in range(n)]
    gap = 1.5   # column pitch, leaving room for the arrows between steps
    for r in range(n):
        for t in range(n):
            _cell(ax, gap * t, r, f"K/V {held[r][t]}", _color(held[r][t]))
            if t < n - 1:
                # the block in hand goes to rank r+1; the last rank's wraps round to rank 0
                end = (gap * (t + 1), r + 1.4) if r < n - 1 else (gap * t + 1.2, n + 0.2)
                ax.annotate("", xy=end, xytext=(gap * t + 0.9, r + 0.4),
                            arrowprops=dict(arrowstyle="->", color="gray", lw=0.9))
                if r == n - 1:
                    ax.text(end[0], end[1] + 0.05, "to rank 0", fontsize=7, color="gray",
                            va="top")
    ax.set(xlim=(-0.2, gap * n), ylim=(n + 0.7, -0.2), xticks=[gap * t + 0.45 for t in
                                                               range(n)],
           xticklabels=[f"step {t}" for t in range(n)], yticks=[r + 0.4 for r in range(n)],
           yticklabels=[f"rank {r}\n(queries {r})" for r in range(n)])
    ax.set_title(f"ring: K/V blocks pass to the next rank, {n - 1} hops\n"
                 "(backward: again, carrying dK, dV, + 1 hop home)", fontsize=9)
    ax.tick_params(length=0, labelsize=8)
    return held


def draw_ulysses(ax, world_size: int = 4, heads: int | None = None) -> dict:
    """Ulysses' all-to-all: left, each rank (colour) holds its ``S/N`` tokens of every head;
    right, after the all-to-all, every token of ``H/N`` heads. Returns ``{"before":
    owner[chunk][head], "after": owner[chunk][head]}``."""
    n = check_int("world_size", world_size, lo=2)
    h = n if heads is None else check_int("heads", heads, lo=1)
    if h % n:
        raise ValueError(f"Ulysses needs world_size={n} to divide heads={h}")
    before = [[c for _ in range(h)] for c in range(n)]
    after = [[hd // (h // n) for hd in range(h)] for _ in range(n)]
    for x0, table in ((0, before), (h + 2, after)):
        for c in range(n):
            for hd in range(h):
                _cell(ax, x0 + hd, c, "", _color(table[c][hd]))
    ax.annotate("", xy=(h + 1.9, n / 2), xytext=(h + 0.05, n / 2),
                arrowprops=dict(arrowstyle="->", lw=1.5))
    ax.text(h + 1, n / 2 - 0.15, "all-to-all", ha="center", va="bottom", fontsize=8,
            rotation=90)
    ax.text(h / 2, -0.3, "before: rank r = tokens chunk r,\nall heads", ha="center",
            va="bottom", fontsize=8)
    ax.text(h + 2 + h / 2, -0.3, f"after: rank r = all tokens,\nheads of group r ({h // n} "
            "each)", ha="center", va="bottom", fontsize=8)
    ax.set(xlim=(-0.2, 2 * h + 2.2), ylim=(n, -1.6), xticks=[], yticks=[c + 0.4 for c in
                                                                        range(n)],
           yticklabels=[f"tokens {c}" for c in range(n)], xlabel="heads")
    ax.set_title("Ulysses: sequence shards <-> head shards\n(colour = rank holding it; "
                 "a second all-to-all brings the output back)", fontsize=9)
    ax.tick_params(length=0, labelsize=8)
    return {"before": before, "after": after}


def draw_zigzag(ax, world_size: int = 4) -> dict:
    """The causal score matrix cut into ``2N x 2N`` chunk tiles (query chunk down, key
    chunk across; only the lower triangle is computed), each tile coloured by the rank
    that owns its query chunk, for the contiguous and the zig-zag layout side by side, with
    each rank's tile count. Returns ``{layout: owner of each of the 2N chunks}``."""
    n = check_int("world_size", world_size, lo=2)
    c = 2 * n
    owners: dict = {}
    for j, layout in enumerate(LAYOUTS):
        owner = [0] * c
        for r in range(n):
            for a, b in shard_chunks(c, n, r, layout):   # 2N tokens: one token per chunk
                for i in range(a, b):
                    owner[i] = r
        owners[layout] = owner
        x0 = j * (c + 2)
        tiles = np.zeros(n, dtype=int)
        for qi in range(c):
            for ki in range(qi + 1):
                _cell(ax, x0 + ki, qi, "", _color(owner[qi]), alpha=0.5 if ki == qi else 0.85)
                tiles[owner[qi]] += 1
            ax.text(x0 - 0.2, qi + 0.4, str(owner[qi]), ha="right", va="center", fontsize=7,
                    color=_color(owner[qi]))
        counts = ", ".join(str(t) for t in tiles)
        ax.text(x0 + c / 2, c + 0.3, f"{layout}\ntiles per rank: {counts}", ha="center",
                va="top", fontsize=8)
    ax.set(xlim=(-1, 2 * c + 2.2), ylim=(c + 2.2, -0.4), xticks=[], yticks=[])
    ax.set_title(f"causal tiles, N = {n}: zig-zag gives rank r chunks r and {c - 1}-r\n"
                 "(number left of a row = rank owning those queries; light = diagonal)",
                 fontsize=9)
    ax.set_axis_off()
    return owners
