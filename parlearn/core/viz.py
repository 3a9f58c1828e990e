"""Shared matplotlib figures, with the measured/modeled labelling built in.

A measured curve always names its device; a modeled curve always names its
formula and is drawn dashed. Lessons never label a curve by hand.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

from parlearn.core.checks import check_bool, check_str

__all__ = [
    "measured_label",
    "modeled_label",
    "plot_measured",
    "plot_measured_sweep",
    "plot_modeled",
    "mark_reliability",
    "log_ticks",
    "timeline",
    "convergence",
    "dag",
]


# Colour of each task kind in timelines; the common ones are fixed up front.
_TASK_COLORS = {"chain": "C0", "wgrad": "C1", "transfer": "C2", "boundary": "C3"}


def measured_label(name: str, device: str) -> str:
    """``'name (measured on device)'``."""
    check_str("name", name)
    check_str("device", device)
    return f"{name} (measured on {device})"


def modeled_label(name: str, formula: str) -> str:
    """``'name (modeled: formula)'``."""
    check_str("name", name)
    check_str("formula", formula)
    return f"{name} (modeled: {formula})"


def plot_measured(ax, x, y, *, name: str, device: str, yerr=None, **kw):
    """Solid line with markers (and error bars from min/max when given)."""
    kw.setdefault("marker", "o")
    label = measured_label(name, device)
    if yerr is not None:
        return ax.errorbar(x, y, yerr=yerr, label=label, capsize=3, **kw)
    return ax.plot(x, y, label=label, **kw)


def plot_measured_sweep(ax, sweep: dict, name: str, *, key: str = "speedup", **kw):
    """One candidate of a :func:`parlearn.timing.sweep` result: medians with IQR error bars.

    ``key`` is ``"speedup"`` (error bars from the per-repeat ratio IQR) or ``"median_s"``
    (error bars from the spread). The label names the device and thread count, and the
    axes get the unreliable-measurement warning when the sweep's spread was too wide.
    """
    need = {"values", "device", "threads", "reliable", "median_s", "spread", "speedup",
            "speedup_lo", "speedup_hi"}
    if not isinstance(sweep, dict) or not need <= set(sweep):
        raise TypeError(f"sweep must be a dict from parlearn.timing.sweep (keys {sorted(need)})")
    if name not in sweep["median_s"]:
        raise ValueError(f"name must be one of the sweep's candidates {list(sweep['median_s'])},"
                         f" got {name!r}")
    x = np.asarray(sweep["values"], dtype=float)
    if key == "speedup":
        y = np.asarray(sweep["speedup"][name])
        lo, hi = np.asarray(sweep["speedup_lo"][name]), np.asarray(sweep["speedup_hi"][name])
    elif key == "median_s":
        y = np.asarray(sweep["median_s"][name])
        half = np.asarray(sweep["spread"][name]) * y / 2
        lo, hi = y - half, y + half
    else:
        raise ValueError(f"key must be 'speedup' or 'median_s', got {key!r}")
    yerr = np.vstack([np.clip(y - lo, 0, None), np.clip(hi - y, 0, None)])
    device = f"{sweep['device']}, {sweep['threads']} thread(s)"
    out = plot_measured(ax, x, y, name=name, device=device, yerr=yerr, **kw)
    mark_reliability(ax, sweep["reliable"])
    return out


_WARNING_GID = "parlearn-unreliable"


def mark_reliability(ax, reliable: bool) -> None:
    """Write the 'not reliable' warning above ``ax`` when a measurement's spread was too wide.

    The warning sits just above the axes and their titles (read at draw time, so titles set
    after this call, the usual order, stay under it), never over the data, and out of the
    way of legends placed under or beside the axes; ``tight_layout`` and the notebook's
    tight bounding box make room for it. Once per axes, however many curves call it.
    """
    from parlearn.core.timing import UNRELIABLE

    if check_bool("reliable", reliable) or any(t.get_gid() == _WARNING_GID for t in ax.texts):
        return
    ax.annotate("WARNING: " + UNRELIABLE.replace(" (", "\n(").replace("; ", ";\n"), xy=(0.5, 1.0),
                xycoords=_axes_and_titles(ax), xytext=(0, 3), textcoords="offset points",
                ha="center", va="bottom", color="red", fontsize=9, gid=_WARNING_GID,
                annotation_clip=False)


def _refuse(name: str, value, what: str):
    raise TypeError(f"{name} must be {what}, got {value!r}")


def _axes_and_titles(ax):
    """A callable matplotlib accepts as ``xycoords``: the box around ``ax`` and its non-empty
    titles (centre, left, right), in display units, computed at draw time."""
    from matplotlib.transforms import Bbox

    def box(renderer):
        boxes = [ax.get_window_extent(renderer)]
        # Only titles that show: a hidden one reports the unit box at the figure's corner,
        # and matplotlib may park an empty one far above (it lines the titles up with a
        # hidden one it moved); its own tight box leaves empty boxes out too.
        for name in ("title", "_left_title", "_right_title"):
            title = getattr(ax, name, None)
            if title is not None and title.get_visible() and title.get_text():
                boxes.append(title.get_window_extent(renderer))
        return Bbox.union(boxes)

    return box


def log_ticks(ax, axis: str = "y") -> None:
    """Readable tick labels on a log-scaled ``axis`` (``"x"``, ``"y"`` or ``"both"``) of
    ``ax``, whatever range its data span.

    Matplotlib labels only powers of ten once minor ticks are off, so an axis spanning less
    than a decade shows one label ("10^0") or none. Here ticks sit at 1, 2 and 5 times each
    power of ten while the axis spans at most three decades (at 1, 2, ..., 9 times under
    one decade), labelled as plain numbers ("0.5", "2", "20"); wider axes keep the powers
    of ten, which then give several labels. Call it after plotting and setting the scale:
    it reads the limits.
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    if axis not in ("x", "y", "both"):
        raise ValueError(f"axis must be 'x', 'y' or 'both', got {axis!r}")
    for name in ("x", "y") if axis == "both" else (axis,):
        if getattr(ax, f"get_{name}scale")() != "log":
            raise ValueError(f"ax's {name} axis is not log-scaled")
        lo, hi = sorted(getattr(ax, f"get_{name}lim")())
        decades = np.log10(hi / lo)
        if decades > 3:
            continue
        subs = tuple(range(1, 10)) if decades < 1 else (1.0, 2.0, 5.0)
        target = ax.xaxis if name == "x" else ax.yaxis
        target.set_major_locator(LogLocator(base=10, subs=subs))
        target.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        target.set_minor_formatter(NullFormatter())


def plot_modeled(ax, x, y, *, name: str, formula: str, **kw):
    """Dashed line, no markers: a model, not a measurement."""
    kw.setdefault("linestyle", "--")
    return ax.plot(x, y, label=modeled_label(name, formula), **kw)


def timeline(ax, events: Sequence[tuple[str, str, float, float]], *, title: str = "") -> None:
    """Gantt chart. ``events`` are ``(lane, label, start_s, end_s)``; one row per lane.

    Bars are coloured by the label's first word (e.g. ``'chain'``, ``'wgrad'``), with
    one colour per word for the whole session, so side-by-side timelines agree.
    """
    events = list(events) if isinstance(events, Sequence) and not isinstance(events, str) \
        else _refuse("events", events, "a sequence of (lane, label, start_s, end_s)")
    for i, e in enumerate(events):
        ok = (isinstance(e, tuple | list) and len(e) == 4 and isinstance(e[1], str)
              and e[1].split() and all(isinstance(t, numbers.Real) and not isinstance(t, bool)
                                       and np.isfinite(t) for t in e[2:]) and e[3] >= e[2])
        if not ok:
            raise ValueError(f"events[{i}] must be (lane, label, start_s, end_s) with a "
                             f"non-empty label and finite start_s <= end_s, got {e!r}")
    check_str("title", title)
    lanes = list(dict.fromkeys(e[0] for e in events))
    kinds = list(dict.fromkeys(e[1].split()[0] for e in events))
    for k in kinds:
        _TASK_COLORS.setdefault(k, f"C{len(_TASK_COLORS) % 10}")
    colors = {k: _TASK_COLORS[k] for k in kinds}
    t0 = min((e[2] for e in events), default=0.0)
    for lane, label, start, end in events:
        row = lanes.index(lane)
        ax.barh(row, (end - start) * 1e3, left=(start - t0) * 1e3, height=0.6,
                color=colors[label.split()[0]], edgecolor="black", linewidth=0.4)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    for k, c in colors.items():
        ax.barh(0, 0, color=c, label=k)
    ax.legend(loc="lower right", fontsize="small")
    if title:
        ax.set_title(title)


def dag(ax, graph: dict, *, title: str = "") -> None:
    """Draw a computation graph as :func:`parlearn.basics.sum_graph` returns it: inputs as
    grey squares (data, not work), operations as blue circles marked "+", edges in grey."""
    keys = {"leaves", "ops", "edges", "pos"}
    if not isinstance(graph, dict) or not keys <= set(graph):
        _refuse("graph", graph, f"a dict with keys {sorted(keys)} (basics.sum_graph)")
    pos = graph["pos"]
    missing = [v for v in [*graph["leaves"], *graph["ops"]] if v not in pos]
    if missing:
        raise ValueError(f"graph['pos'] must place every node; missing {missing}")
    check_str("title", title)
    for a, b in graph["edges"]:
        ax.plot(*zip(pos[a], pos[b], strict=True), color="gray", zorder=1)
    ax.scatter(*zip(*(pos[v] for v in graph["leaves"]), strict=True), s=110, marker="s",
               color="C7", zorder=2, label=f"input ({len(graph['leaves'])}, not work)")
    ax.scatter(*zip(*(pos[v] for v in graph["ops"]), strict=True), s=170, color="C0",
               zorder=2, label=f"+ operation ({len(graph['ops'])})")
    for v in graph["ops"]:
        ax.text(*pos[v], "+", ha="center", va="center", color="white", zorder=3)
    ax.set_ylim(-0.8, max(y for _, y in pos.values()) + 0.8)
    ax.axis("off")
    ax.legend(loc="upper left", fontsize="small", frameon=False)
    if title:
        ax.set_title(title)


def convergence(ax, histories: dict[str, Sequence[float]], *, ylabel: str = "residual") -> None:
    """Semilog-y plot of one or more residual histories against iteration.

    Exact zeros are drawn at 1e-18 times the largest value (round-off level), not at
    the smallest float, so the axis stays readable.
    """
    if not isinstance(histories, dict) or not histories:
        raise TypeError(f"histories must be a non-empty dict of name -> residuals, got "
                        f"{histories!r}")
    check_str("ylabel", ylabel)
    for name, hist in histories.items():
        h = np.asarray(hist)
        if h.ndim != 1 or h.dtype == bool or not np.issubdtype(h.dtype, np.number) \
                or np.any(np.asarray(h, dtype=float) < 0):
            raise ValueError(f"histories[{name!r}] must be a 1-D sequence of residuals >= 0 "
                             f"(NaN allowed: a diverged run), got {hist!r}")
        h = h.astype(float)
        floor = max(h.max(initial=0.0) * 1e-18, np.finfo(float).tiny)
        ax.semilogy(np.arange(len(h)), np.maximum(h, floor), marker="o", label=name)
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize="small")
