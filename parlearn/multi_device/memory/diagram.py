"""One pre-norm block of the tiny GPT drawn (lesson 16), with the tensors autograd keeps for
backward marked: which ones are kept is read from :func:`activation_terms`, the model
that equals the measured ledger, so the picture changes with ``recompute``."""

from __future__ import annotations

from parlearn.core.checks import check_choice
from parlearn.multi_device.memory.activations import activation_terms
from parlearn.multi_device.transformer.model import RECOMPUTE, GPTConfig

__all__ = ["BLOCK_TENSORS", "draw_block"]

# (key, label on the diagram, the activation term it is, elements per layer, column, row)
BLOCK_TENSORS = (
    ("x", "x\n(block input)", "block input x", "b s h", 0, 0),
    ("ln1", "LN1 output", "ln1 output", "b s h", 1, 0),
    ("st1", "LN1 mean, 1/std", "ln1 mean, 1/std", "2 b s", 1, 1),
    ("qk", "q, k\n(after RoPE)", "q, k after RoPE", "2 b s h", 2, 0),
    ("v", "v", "v", "b s h", 2, 1),
    ("p", "p = softmax\n(q k^T / sqrt d)", "softmax output", "a b s^2", 3, 0),
    ("att", "attention\noutput (p v)", "attention output", "b s h", 4, 0),
    ("x2", "x + attn", "x after attention", "b s h", 0, 2),
    ("ln2", "LN2 output", "ln2 output", "b s h", 1, 2),
    ("st2", "LN2 mean, 1/std", "ln2 mean, 1/std", "2 b s", 1, 3),
    ("gelu", "GELU input\nand output", "GELU input and output", "2 b s 4h", 2, 2),
    ("x3", "x + mlp\n(next block)", None, "b s h", 3, 2),
)
# (from, to, operation on the arrow)
_EDGES = (("x", "ln1", "LN1"), ("x", "st1", ""), ("ln1", "qk", "Wq, Wk,\nRoPE"),
          ("ln1", "v", "Wv"), ("qk", "p", "scores,\nmask"), ("p", "att", "p v"),
          ("v", "att", ""), ("att", "x2", "Wo, + x"), ("x2", "ln2", "LN2"), ("x2", "st2", ""),
          ("ln2", "gelu", "W1, GELU"), ("gelu", "x3", "W2, + x"))


def _kept(recompute: str) -> set[str]:
    """Base names of the per-layer terms kept under ``recompute``."""
    names = set()
    for name, _ in activation_terms(GPTConfig(), 1, 1, recompute=recompute):
        if " x " in name and name.endswith("layers"):
            names.add(name.rsplit(" x ", 1)[0].split(" (")[0])
    return names


def draw_block(ax, recompute: str = "none") -> list[str]:
    """Draw one pre-norm block (attention row, then MLP row), each tensor a box with its
    elements per layer; filled orange where autograd keeps it for backward under
    ``recompute`` (``"none"``, ``"selective"``, ``"full"``), grey where it is freed (and,
    when recomputation drops it, rebuilt in backward). Returns the names of the kept
    terms, as :func:`activation_terms` spells them."""
    from matplotlib.patches import FancyBboxPatch

    check_choice("recompute", recompute, RECOMPUTE)
    kept = _kept(recompute)
    w, hgt = 1.3, 0.8
    where = {}
    out = []
    for key, label, term, size, col, row in BLOCK_TENSORS:
        x, y = 2.4 * col, -1.2 * row - (0.4 if row >= 2 else 0.0)
        where[key] = (x, y)
        on = term in kept
        if on:
            out.append(term)
        ax.add_patch(FancyBboxPatch((x, y), w, hgt, boxstyle="round,pad=0.04",
                                    fc="C1" if on else "0.88", ec="C1" if on else "0.6",
                                    lw=1.5 if on else 0.8))
        ax.text(x + w / 2, y + hgt / 2 + 0.1, label, ha="center", va="center", fontsize=7.5)
        ax.text(x + w / 2, y + 0.06, size, ha="center", va="bottom", fontsize=6.5,
                style="italic")
    for a, b, op in _EDGES:
        (xa, ya), (xb, yb) = where[a], where[b]
        if ya == yb:      # along a row: right edge to left edge
            start, end, rad = (xa + w, ya + hgt / 2), (xb, yb + hgt / 2), 0.0
        elif xa < xb:     # down and right (a sub-row: v, or the statistics)
            start, end, rad = (xa + w, ya + hgt / 2), (xb, yb + hgt / 2), 0.0
        elif xa == xb:    # straight down
            start, end, rad = (xa + w / 2, ya), (xb + w / 2, yb + hgt), 0.0
        else:             # the wrap from the attention row to the MLP row
            start, end, rad = (xa + w / 2, ya), (xb + w / 2, yb + hgt), -0.1
        ax.annotate("", xy=end, xytext=start, arrowprops=dict(
            arrowstyle="->", lw=0.9, color="0.3", connectionstyle=f"arc3,rad={rad}"))
        if op and rad:     # the wrap's label sits by its end, clear of the boxes above
            ax.text(end[0] + 0.2, end[1] + 0.15, op, ha="left", va="bottom", fontsize=6.5,
                    color="0.25")
        elif op:
            ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.05, op,
                    ha="center", va="bottom", fontsize=6.5, color="0.25")
    ax.set(xlim=(-0.2, 2.4 * 4 + w + 0.2), ylim=(-4.4, 1.0))
    ax.set_axis_off()
    ax.set_title(f"one pre-norm block, recompute={recompute!r}\norange: kept for backward "
                 "(activation_terms, equal to the measured ledger)", fontsize=9)
    return out
