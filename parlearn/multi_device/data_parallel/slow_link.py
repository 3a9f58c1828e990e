"""An EMULATED slow link: a delay per message and per byte added to every collective.

Between two processes on one machine gloo moves bytes at memory speed, so the bandwidth
below which 8-bit gradients pay (:func:`parlearn.data_parallel.compression.crossover_bandwidth`)
cannot be reached for real. :func:`emulated_link` makes it reachable: inside the block,
each collective of :data:`EMULATED_KINDS` that this rank issues runs for real and then
sleeps the alpha-beta time of the same collective on the emulated link,
``collective_time(kind, payload, N, AlphaBeta(alpha, 1 / bandwidth))`` (ring): the same
charge for the fp32 all-reduce and for the 8-bit path's all-to-alls and all-gathers,
applied where the bytes are sent. The time measured is therefore *emulated*: real
compute, real coding and real local communication, plus a modeled wire. Every rank
charges the same delay for the same call, so the ranks stay in step.

:func:`emulated_bandwidths` picks the emulated bandwidths on both sides of the modeled
crossover for the bench row and lesson 11.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch.distributed as tdist

from parlearn.core.checks import check_callable, check_float, check_int
from parlearn.distributed import AlphaBeta, collective_time, ring_bytes
from parlearn.distributed.traffic import replace_collective

__all__ = ["EMULATED_KINDS", "Charge", "EmulatedLink", "emulated_link", "emulated_bandwidths",
           "plot_check"]

# collective -> (positional index, keyword) of its payload, counted as the ledger counts it
# (parlearn.distributed.ledger): the tensor for all_reduce and broadcast, the input of all_to_all
# and reduce_scatter, the gathered output of all_gather.
_PAYLOAD = {"all_reduce": (0, "tensor"), "broadcast": (0, "tensor"),
            "all_to_all_single": (1, "input"), "all_gather_single": (0, "output"),
            "reduce_scatter_single": (1, "input")}
EMULATED_KINDS = tuple(_PAYLOAD)


@dataclass(frozen=True)
class Charge:
    """What the emulated link charged one collective: its ``payload`` bytes (as the ledger
    counts them), the ring ``wire_bytes`` each rank sends, the ``messages`` on the ring's
    critical path, and the ``seconds`` slept: ``messages * alpha + wire_bytes / bandwidth``."""

    kind: str
    payload: int
    wire_bytes: float
    messages: float
    seconds: float


class EmulatedLink:
    """An emulated link of ``alpha`` seconds per message and ``bandwidth`` bytes/s; its
    ``charges`` list every collective charged (on this rank) since the block began."""

    def __init__(self, alpha: float, bandwidth: float, *,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.alpha = check_float("alpha", alpha, lo=0)
        self.bandwidth = check_float("bandwidth", bandwidth, lo=0, lo_open=True)
        self.sleep = check_callable("sleep", sleep)
        self.charges: list[Charge] = []

    @property
    def model(self) -> AlphaBeta:
        """The emulated link as an alpha-beta model (``beta = 1 / bandwidth``)."""
        return AlphaBeta(self.alpha, 0.0 if math.isinf(self.bandwidth) else 1 / self.bandwidth)

    def charge(self, kind: str, payload: int, world_size: int) -> Charge:
        """Record and return the charge of one collective (does not sleep)."""
        if world_size < 2:      # one rank sends nothing
            c = Charge(kind, payload, 0.0, 0.0, 0.0)
        else:
            c = Charge(kind, payload, ring_bytes(kind, payload, world_size),
                       collective_time(kind, payload, world_size, AlphaBeta(1.0, 0.0)),
                       collective_time(kind, payload, world_size, self.model))
        self.charges.append(c)
        return c

    def wire_bytes(self) -> float:
        """Ring wire bytes charged so far (this rank)."""
        return sum(c.wire_bytes for c in self.charges)

    def seconds(self) -> float:
        """Seconds charged (slept) so far (this rank)."""
        return sum(c.seconds for c in self.charges)

    def __str__(self) -> str:
        return (f"emulated link: {self.alpha * 1e6:.0f} us per message, "
                f"{self.bandwidth / 1e6:.3g} MB/s")


def _payload(kind: str, args: tuple, kwargs: dict) -> int:
    pos, key = _PAYLOAD[kind]
    t = args[pos] if len(args) > pos else kwargs[key]
    return t.numel() * t.element_size()


def _slowed(kind: str, original: Callable, link: EmulatedLink) -> Callable:
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        if out is not None:
            # async_op=True: the wire time is added after completion, so an emulated
            # transfer never overlaps compute (BucketedDP's overlap is lost on this link).
            out.wait()
        group = kwargs.get("group")
        c = link.charge(kind, _payload(kind, args, kwargs), tdist.get_world_size(group))
        if c.seconds > 0:
            link.sleep(c.seconds)
        return out
    return wrapper


_active: list[EmulatedLink] = []


def emulated_link(alpha: float, bandwidth: float, *, sleep: Callable[[float], None] = time.sleep
                  ) -> contextlib.AbstractContextManager[EmulatedLink]:
    """Inside the block, every collective of :data:`EMULATED_KINDS` issued through
    ``torch.distributed``'s Python API runs, is waited for if async, and is then followed
    by ``sleep(collective_time(kind, payload, N, AlphaBeta(alpha, 1 / bandwidth)))``, which
    is recorded in the yielded :class:`EmulatedLink` (``N`` is the size of the ``group``
    passed by keyword, else the world). Other collectives pass uncharged, and so do those
    torch issues from C++ (DDP's own buckets). Links do not nest. A
    :func:`parlearn.distributed.ledger` may be opened inside the block (its records then time
    the emulated delay too) or around it (they time the real collective only). ``sleep``
    is for tests. The arguments are checked by the call, before any block is entered."""
    return _emulated(EmulatedLink(alpha, bandwidth, sleep=sleep))


@contextlib.contextmanager
def _emulated(link: EmulatedLink) -> Iterator[EmulatedLink]:
    if _active:
        raise RuntimeError("an emulated link is already active on this process")
    if not tdist.is_initialized():
        raise RuntimeError("emulated_link needs an initialised process group "
                           "(run the worker with parlearn.distributed.run)")
    saved = []
    for kind in EMULATED_KINDS:
        original = getattr(tdist, kind)
        saved.append((kind, original, _slowed(kind, original, link)))
        replace_collective(kind, original, saved[-1][2])
    _active.append(link)
    try:
        yield link
    finally:
        _active.remove(link)
        for kind, original, wrapped in saved:
            replace_collective(kind, wrapped, original)


def emulated_bandwidths(numel: int, world_size: int, real: AlphaBeta, *, alpha: float,
                        quantize_s: float, dequantize_s: float, factor: float = 4.0
                        ) -> tuple[float, float, float]:
    """``(crossover, below, above)`` emulated bandwidths (bytes/s) for a gradient of
    ``numel`` float32 entries on ``world_size`` ranks whose real link is ``real``, with
    an emulated link of ``alpha`` seconds per message added to it.

    Delays add and the model is linear in alpha and beta, so the link the ranks see is
    ``AlphaBeta(real.alpha + alpha, real.beta + 1 / bw)``; 8-bit pays below the total
    bandwidth ``B*`` of :func:`crossover_bandwidth`, i.e. below the emulated
    ``crossover = 1 / (1 / B* - real.beta)``. ``below`` and ``above`` are ``crossover /
    factor`` and ``crossover * factor``. ``crossover`` is ``inf`` when 8-bit pays on the
    real link already (no emulated bandwidth is above it; then ``above`` is ``inf``),
    and 0 when it pays at no bandwidth (then ``below`` is 0)."""
    from parlearn.multi_device.data_parallel.compression import crossover_bandwidth

    numel = check_int("numel", numel, lo=1)
    world_size = check_int("world_size", world_size, lo=2)
    if not isinstance(real, AlphaBeta):
        raise TypeError(f"real must be an AlphaBeta, got {type(real).__name__}")
    alpha = check_float("alpha", alpha, lo=0)
    factor = check_float("factor", factor, lo=1, lo_open=True)
    total = crossover_bandwidth(numel, world_size, real.alpha + alpha,
                                quantize_s=quantize_s, dequantize_s=dequantize_s)
    if total <= 0:
        return 0.0, 0.0, 0.0
    beta_e = (0.0 if math.isinf(total) else 1 / total) - real.beta
    cross = math.inf if beta_e <= 0 else 1 / beta_e
    return cross, cross / factor, cross * factor



_SIDE_KEYS = ("bandwidth", "measured", "q1", "q3", "modeled", "steps", "charged")


def _check_result(check: dict) -> None:
    """``check`` has the fields of a :func:`slow_link_check` result that are drawn."""
    if not isinstance(check, dict):
        raise TypeError(f"check must be a slow_link_check result (a dict), got "
                        f"{type(check).__name__}")
    missing = [k for k in ("coding", "crossover", "numel", "alpha", "below", "above")
               if k not in check]
    missing += [f"{side}.{k}" for side in ("below", "above")
                if isinstance(check.get(side), dict) and "skipped" not in check[side]
                for k in _SIDE_KEYS if k not in check[side]]
    bad_sides = [side for side in ("below", "above")
                 if side in check and not isinstance(check[side], dict)]
    if missing or bad_sides:
        raise ValueError(f"check must be a slow_link_check result; missing {missing}, not a "
                         f"dict: {bad_sides}")
    coding = check["coding"]
    if not isinstance(coding, tuple | list) or len(coding) != 2:
        raise ValueError(f"check['coding'] must be a pair (quantize_s, dequantize_s), got "
                         f"{coding!r}")
    for i, c in enumerate(coding):
        check_float(f"check['coding'][{i}]", c, lo=0)
    check_float("check['crossover']", check["crossover"], lo=0, finite=False)
    check_int("check['numel']", check["numel"], lo=1)
    check_float("check['alpha']", check["alpha"], lo=0)


def plot_check(ax, check: dict, real: AlphaBeta) -> list[str]:
    """Draw a :func:`parlearn.data_parallel.workers.slow_link_check` result on ``ax``: the
    modeled fp32 / 8-bit step ratio over emulated bandwidths from 1/30 to 30 times the
    crossover (total link ``real`` + the emulated one, compute the median of the sides'
    measured compute, the check's coding), the modeled crossover as a dashed vertical
    line, and each measured side's median ratio with its IQR. Returns one line of text
    per side (measured vs modeled, bytes charged)."""
    import numpy as np

    from parlearn.core.viz import modeled_label, plot_measured, plot_modeled
    from parlearn.multi_device.data_parallel.compression import modeled_step_ratio

    _check_result(check)
    if not isinstance(real, AlphaBeta):
        raise TypeError(f"real must be an AlphaBeta, got {type(real).__name__}")
    q, d = check["coding"]
    done = [check[s] for s in ("below", "above") if "skipped" not in check[s]]
    lines = [f"{s}: not measured, {check[s]['skipped']}" for s in ("below", "above")
             if "skipped" in check[s]]
    cross = check["crossover"]
    if not done or not 0 < cross < math.inf:
        return lines
    compute = float(np.median([o["steps"]["local"]["median"] for o in done]))
    bws = np.logspace(math.log10(cross / 30), math.log10(cross * 30), 61)
    ratio = [modeled_step_ratio(check["numel"], 2,
                                AlphaBeta(real.alpha + check["alpha"], real.beta + 1 / b),
                                compute_s=compute, quantize_s=q, dequantize_s=d) for b in bws]
    plot_modeled(ax, bws / 1e6, ratio, name="fp32 / 8-bit step",
                 formula="alpha-beta + coding, real + emulated link")
    ax.axvline(cross / 1e6, color="k", ls="--", lw=1,
               label=modeled_label(f"crossover {cross / 1e6:.3g} MB/s", "alpha-beta"))
    for side in ("below", "above"):
        o = check[side]
        if "skipped" in o:
            continue
        plot_measured(ax, [o["bandwidth"] / 1e6], [o["measured"]], name=f"{side} crossover",
                      device="cpu, 2 gloo ranks x 1 thread, EMULATED link", ls="none",
                      yerr=[[o["measured"] - o["q1"]], [o["q3"] - o["measured"]]])
        lines.append(f"emulated {o['bandwidth'] / 1e6:.3g} MB/s ({side}): fp32 / 8-bit step "
                     f"measured {o['measured']:.2f}x (IQR {o['q1']:.2f}-{o['q3']:.2f}), "
                     f"modeled {o['modeled']:.2f}x; charged per step: fp32 "
                     f"{o['charged']['bucketed'][0]:.0f} B, 8-bit "
                     f"{o['charged']['compressed'][0]:.0f} B")
    ax.axhline(1, color="gray", lw=0.6)
    ax.set(xscale="log", yscale="log", xlabel="emulated link bandwidth (MB/s)",
           ylabel="fp32 step / 8-bit step",
           title=f"{check['numel']} params, 2 ranks; quantize {q * 1e9:.1f}, dequantize "
                 f"{d * 1e9:.1f} ns/element (measured on the ranks)")
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))       # ticks 0.5, 1, 2, not 5x10^-1
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    return lines


def _slow_link_rows(slow: dict, real) -> list:
    """The bench rows of a :func:`parlearn.data_parallel.workers.slow_link_check` result, one per
    side (for ``workers.bench``)."""
    from parlearn.core.bench import Row

    q, d = slow["coding"]
    rows = []
    for side in ("below", "above"):
        o = slow[side]
        where = f"{slow['factor']:g}x {side} the modeled crossover"
        if "skipped" in o:
            rows.append(Row("data_parallel", f"fp32 DP step, EMULATED link {where}",
                            "8-bit DP step, same link", math.nan, "cpu, 2 gloo ranks",
                            detail=f"not measured: {o['skipped']} (modeled)"))
            continue
        s = o["steps"]
        rows.append(Row(
            "data_parallel",
            f"fp32 DP step (one bucket), EMULATED link {o['bandwidth'] / 1e6:.3g} MB/s ({where})",
            "8-bit dynamic-tree DP step, same emulated link", o["measured"],
            "cpu, 2 gloo ranks x 1 thread, emulated link",
            target=f"modeled {o['modeled']:.2f}x", met=(o["measured"] > 1) == (o["modeled"] > 1),
            detail=(f"EMULATED: each collective sleeps its alpha-beta time on a link of "
                    f"{slow['alpha'] * 1e6:.0f} us per message and {o['bandwidth'] / 1e6:.3g} "
                    f"MB/s after running for real (this machine's fitted link: {real}). "
                    f"Modeled crossover: 8 bits pay below an emulated "
                    f"{slow['crossover'] / 1e6:.3g} MB/s ({slow['numel']} params, coding "
                    f"measured on the ranks: quantize {q * 1e9:.1f} ns, dequantize "
                    f"{d * 1e9:.1f} ns per element). Measured ratio {o['measured']:.2f}x "
                    f"(IQR {o['q1']:.2f}-{o['q3']:.2f} over "
                    f"{slow['steps'] - 1} interleaved steps): fp32 "
                    f"{s['bucketed']['median'] * 1e3:.1f} ms, 8-bit "
                    f"{s['compressed']['median'] * 1e3:.1f} ms, compute alone "
                    f"{s['local']['median'] * 1e3:.1f} ms. Charged per step: fp32 "
                    f"{o['charged']['bucketed'][0]:.0f} wire bytes "
                    f"{o['charged']['bucketed'][1] * 1e3:.1f} ms, 8-bit "
                    f"{o['charged']['compressed'][0]:.0f} bytes "
                    f"{o['charged']['compressed'][1] * 1e3:.1f} ms. met = measured and "
                    f"modeled on the same side of 1.")))
    return rows
