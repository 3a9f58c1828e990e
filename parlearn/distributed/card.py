"""A hardware card: the handful of numbers every cost model in the course needs.

    from parlearn import card
    mine = card.calibrate(path="my_card.json")     # measured here, saved as JSON
    print(card.describe(mine))                     # beside published anchors
    h100 = card.preset("h100-8x-nvlink")           # modeled, every number sourced
    h100.comm_time("all_reduce", 2**30, 8), h100.compute_time(1e15, "bfloat16")

A :class:`Card` holds alpha and beta per collective and world size (the alpha-beta model of
:mod:`parlearn.distributed.cost`), sustained matmul FLOP/s per dtype, memory bandwidth and
memory per device. :func:`calibrate` measures them on this machine (real ranks through
:func:`parlearn.dist.sweep_collective`, fitted by :func:`parlearn.dist.fit_alpha_beta`);
:func:`preset` returns modeled cards of real clusters, built from datasheets and
published nccl-tests figures (:func:`anchors`), with the assumed alphas said to be
assumptions. A cost model reads a card instead of constants, so the same planner runs on
the learner's laptop figures and on an 8x H100 node's.

Bandwidth conventions (nccl-tests, ``doc/PERFORMANCE.md``): *algbw* is payload / time;
*busbw* rescales it by what a ring moves per rank, ``2(N-1)/N`` for all_reduce and
``(N-1)/N`` for all_gather, reduce_scatter and all_to_all, so busbw can be compared with a
link's speed in ONE direction whatever ``N`` is. For the ring formulas of
:mod:`parlearn.distributed.cost` a large message has busbw = ``1/beta``. Vendor link figures are
often bidirectional: NVLink 4's "900 GB/s" is 450 GB/s each way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from parlearn.core.checks import check_bool, check_choice, check_float, check_int
from parlearn.core.device import pick_device
from parlearn.core.device import threads as _threads
from parlearn.core.settings import is_fast
from parlearn.core.timing import SPREAD_LIMIT, Timing, measure
from parlearn.distributed.cost import _CANON, KINDS, AlphaBeta, collective_time, fit_alpha_beta
from parlearn.distributed.launch import default_backend
from parlearn.distributed.measure import DEFAULT_SIZES, sweep_collective

__all__ = ["Card", "LINK_KINDS", "DTYPES", "PRESETS", "calibrate", "fit_card", "preset",
           "anchors", "describe", "bus_factor"]

LINK_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
DTYPES = ("float64", "float32", "bfloat16", "float16")
_FORMAT = "parlearn.card/1"
# What sweep_collective calls each link kind.
_TIMED = {"all_reduce": "all_reduce", "all_gather": "all_gather",
          "reduce_scatter": "reduce_scatter", "all_to_all": "all_to_all", "p2p": "send"}


def bus_factor(kind: str, world_size: int) -> float:
    """busbw / algbw in nccl-tests' convention: ``2(N-1)/N`` for all_reduce, ``(N-1)/N``
    for all_gather, reduce_scatter and all_to_all, 1 for p2p (send/recv)."""
    check_choice("kind", kind, LINK_KINDS)
    n = check_int("world_size", world_size, lo=1)
    if kind == "p2p":
        return 1.0
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n


def _split_key(key: str) -> tuple[str, int]:
    kind, sep, n = key.partition("@")
    if not sep or kind not in LINK_KINDS or not n.isdigit() or int(n) < 1:
        raise ValueError(f"links: key {key!r} must be 'kind@world_size' with kind one of "
                         f"{list(LINK_KINDS)} and world_size >= 1")
    return kind, int(n)


@dataclass(frozen=True)
class Card:
    """What one machine (or a modeled cluster) can do, per device.

    ``links`` maps ``f"{kind}@{world_size}"`` to an :class:`AlphaBeta`; ``flops`` a dtype
    name to sustained matmul FLOP/s; ``mem_bw`` is bytes/s of a large copy (read +
    written); ``memory`` bytes per device (0 when unknown); ``measured`` says whether the
    figures were measured (:func:`calibrate`) or modeled (:func:`preset`).
    """

    name: str
    measured: bool
    links: dict[str, AlphaBeta]
    flops: dict[str, float]
    mem_bw: float
    memory: float
    devices: int
    notes: str = field(default="")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name must be a non-empty str, got {self.name!r}")
        check_bool("measured", self.measured)
        if not isinstance(self.links, dict):
            raise TypeError(f"links must be a dict, got {type(self.links).__name__}")
        for key, ab in self.links.items():
            _split_key(key)
            if not isinstance(ab, AlphaBeta):
                raise TypeError(f"links[{key!r}] must be an AlphaBeta, got {type(ab).__name__}")
        if not isinstance(self.flops, dict):
            raise TypeError(f"flops must be a dict, got {type(self.flops).__name__}")
        for dtype, rate in self.flops.items():
            check_choice("flops dtype", dtype, DTYPES)
            check_float(f"flops[{dtype!r}]", rate, lo=0, lo_open=True)
        check_float("mem_bw", self.mem_bw, lo=0, lo_open=True)
        check_float("memory", self.memory, lo=0)
        check_int("devices", self.devices, lo=1)
        if not isinstance(self.notes, str):
            raise TypeError(f"notes must be a str, got {type(self.notes).__name__}")

    def link(self, kind: str, world_size: int) -> AlphaBeta:
        """The alpha-beta fit for ``kind`` (a link kind or any torch name of
        :data:`parlearn.distributed.cost.KINDS`: "send" is p2p) on ``world_size`` ranks.

        The exact ``kind@world_size`` when the card has it; else that kind at the nearest
        world size it has (by ``|N - world_size|``, ties to the larger N: a fit is a line
        through one ring's points, so a far N is an extrapolation); else the all_reduce fit
        by the same rule (broadcast and reduce always take this path); else ValueError.
        """
        check_choice("kind", kind, KINDS)
        world_size = check_int("world_size", world_size, lo=1)
        canon = _CANON[kind]
        for want in (canon, "all_reduce"):
            have = [n for k, n in map(_split_key, self.links) if k == want]
            if have:
                best = min(have, key=lambda n: (abs(n - world_size), -n))
                return self.links[f"{want}@{best}"]
        raise ValueError(f"kind={kind!r}: the card {self.name!r} has no fit for {canon} nor "
                         f"all_reduce (it has {sorted(self.links) or 'no links'})")

    def comm_time(self, kind: str, nbytes: float, world_size: int) -> float:
        """Seconds of one ``kind`` of ``nbytes`` payload on ``world_size`` ranks:
        :func:`parlearn.distributed.collective_time` with :meth:`link`'s fit; 0.0 on one rank."""
        check_choice("kind", kind, KINDS)
        check_float("nbytes", nbytes, lo=0)
        if check_int("world_size", world_size, lo=1) == 1:
            return 0.0
        return collective_time(kind, nbytes, world_size, self.link(kind, world_size))

    def compute_time(self, flops: float, dtype: str = "float32") -> float:
        """Seconds for ``flops`` floating-point operations at this card's sustained matmul
        rate in ``dtype`` on one device."""
        flops = check_float("flops", flops, lo=0)
        if dtype not in self.flops:
            raise ValueError(f"dtype must be one of {sorted(self.flops)} on card "
                             f"{self.name!r}, got {dtype!r}")
        return flops / self.flops[dtype]

    def to_json(self) -> str:
        """The card as JSON text (floats written exactly: :meth:`from_json` gives it back)."""
        d = dataclasses.asdict(self)
        d["links"] = {k: {"alpha": ab.alpha, "beta": ab.beta} for k, ab in self.links.items()}
        return json.dumps({"format": _FORMAT, **d}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Card:
        """The card :meth:`to_json` wrote."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        d = json.loads(text)
        if not isinstance(d, dict) or d.pop("format", None) != _FORMAT:
            raise ValueError(f"text is not a hardware card (no \"format\": {_FORMAT!r})")
        d["links"] = {k: AlphaBeta(v["alpha"], v["beta"]) for k, v in d["links"].items()}
        return cls(**d)

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_json` to ``path``; returns the path."""
        p = Path(path)
        p.write_text(self.to_json() + "\n")
        return p

    @classmethod
    def load(cls, path: str | os.PathLike) -> Card:
        """The card saved at ``path``."""
        return cls.from_json(Path(path).read_text())


def fit_card(links: Mapping[tuple[str, int], tuple[Sequence[float], Sequence[float]]],
             matmuls: Mapping[str, tuple[int, float]], copy: tuple[float, float], *,
             name: str, memory: float, devices: int = 1, notes: str = "",
             measured: bool = True) -> Card:
    """A card from timings, no measuring (what :func:`calibrate` does after timing).

    ``links[(kind, world_size)] = (payload sizes in bytes, seconds)``, fitted with
    :func:`fit_alpha_beta` to the ring formula of ``kind``; ``matmuls[dtype] = (n, seconds)``
    of one ``n x n @ n x n`` (``2 n^3`` FLOPs); ``copy = (bytes, seconds)`` of one copy,
    which reads and writes those bytes (``2 * bytes`` of traffic).
    """
    fitted = {}
    for key, value in links.items():
        if not (isinstance(key, tuple) and len(key) == 2):
            raise TypeError(f"links keys must be (kind, world_size), got {key!r}")
        kind = check_choice("links kind", key[0], LINK_KINDS)
        n = check_int("links world_size", key[1], lo=2)
        sizes, times = value
        fitted[f"{kind}@{n}"] = fit_alpha_beta(sizes, times, kind=kind, world_size=n)
    rates = {}
    for dtype, (n, seconds) in matmuls.items():
        check_choice("matmuls dtype", dtype, DTYPES)
        n = check_int(f"matmuls[{dtype!r}] n", n, lo=1)
        rates[dtype] = 2.0 * n**3 / check_float(f"matmuls[{dtype!r}] seconds", seconds,
                                                lo=0, lo_open=True)
    nbytes, seconds = copy
    nbytes = check_float("copy bytes", nbytes, lo=0, lo_open=True)
    mem_bw = 2.0 * nbytes / check_float("copy seconds", seconds, lo=0, lo_open=True)
    return Card(name, measured, fitted, rates, mem_bw, float(memory), devices, notes)


def _host_memory() -> float:
    """Bytes of RAM from ``os.sysconf`` (Linux and most Unixes); 0.0 where it is missing."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return 0.0


def _round_sizes(sizes: Sequence[int], world_size: int) -> list[int]:
    """Each size rounded to whole float32 chunks per rank (what all_gather and friends
    need), at least one element per rank, duplicates dropped."""
    unit = 4 * world_size
    return sorted({max(unit, round(n / unit) * unit) for n in sizes})


def _matmul(dtype: torch.dtype, dev: torch.device, target_s: float, n_max: int,
            repeat: int) -> tuple[int, Timing]:
    """(n, Timing) of ``a @ a`` at the smallest power-of-two n from 128 whose one call
    takes ``target_s`` (capped at ``n_max``): big enough to run at the sustained rate,
    small enough to stay a few hundred ms on a laptop CPU."""
    n = 128
    while True:
        a = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(dev, dtype)
        t = measure(lambda a=a: a @ a, warmup=1, repeat=1, device=dev)
        if t.median >= target_s or n >= n_max:
            break
        n *= 2
    return n, measure(lambda: a @ a, warmup=1, repeat=repeat, device=dev)


def calibrate(world_sizes: Sequence[int] = (2,), kinds: Sequence[str] = LINK_KINDS,
              sizes: Sequence[int] | None = None,
              dtypes: Sequence[str] = ("float32", "float64"), *, repeat: int = 5,
              threads: int | None = None, path: str | os.PathLike | None = None,
              progress: bool = True, device: str | torch.device | None = None) -> Card:
    """Measure this machine's card.

    Collectives: for each of ``world_sizes``, one launch of real ranks
    (:func:`sweep_collective`: gloo on CPU, NCCL with a GPU per rank) times ``kinds``
    interleaved at payload ``sizes`` (bytes, rounded to whole float32 chunks per rank;
    default 64 B to 4 MiB), median of the slowest rank; each kind is fitted with
    :func:`fit_alpha_beta`. Compute: an ``n x n`` matmul per dtype on ``device`` (default
    :func:`pick_device`), n grown until a call is long enough to be sustained. Memory
    bandwidth: one large copy (bytes read + written). ``threads`` pins torch's intra-op
    threads for the compute part and restores the caller's count; the ranks use 1 each.
    In FAST mode (``PARLEARN_FAST=1``) sizes, matmul and copy shrink and ``repeat`` is at
    most 3, so it takes a few seconds. ``path``: also save the card there as JSON.
    """
    world_sizes = [check_int("world_sizes", n, lo=2) for n in world_sizes]
    if not world_sizes:
        raise ValueError("world_sizes must name at least one world size >= 2")
    kinds = list(dict.fromkeys(check_choice("kinds", k, LINK_KINDS) for k in kinds))
    if not kinds:
        raise ValueError(f"kinds must name at least one of {list(LINK_KINDS)}")
    dtypes = [check_choice("dtypes", d, DTYPES) for d in dtypes]
    repeat = check_int("repeat", repeat, lo=1)
    if threads is not None:
        threads = check_int("threads", threads, lo=1)
    check_bool("progress", progress)
    fast = is_fast()
    if sizes is None:
        sizes = (256, 4096, 65536, 1 << 20) if fast else DEFAULT_SIZES[::4]
    sizes = [check_int("sizes", n, lo=4) for n in sizes]
    rounded = {n: _round_sizes(sizes, n) for n in world_sizes}
    if any(len(r) < 2 for r in rounded.values()):  # checked before any rank starts
        raise ValueError(f"sizes must hold at least 2 sizes that differ after rounding to "
                         f"whole float32 chunks per rank, to fit alpha and beta; got {sizes}")
    repeat = min(repeat, 3) if fast else repeat
    dev = pick_device(device)

    bar = tqdm(total=len(world_sizes) + len(dtypes) + 1, desc="calibrating", disable=not progress)
    link_times, backends, worst = {}, set(), 0.0
    with bar:
        for n in world_sizes:
            bar.set_postfix_str(f"collectives on {n} ranks")
            sw = sweep_collective([_TIMED[k] for k in kinds], rounded[n], n,
                                  repeat=repeat, timeout=60)
            backends.add(default_backend(n))
            worst = max([worst, *(s for v in sw["spread"].values() for s in v)])
            for k in kinds:
                link_times[(k, n)] = (sw["sizes"], sw["median_s"][_TIMED[k]])
            bar.update()
        pin = _threads(threads) if threads is not None else contextlib.nullcontext()
        matmuls, compute_notes = {}, []
        with pin:
            n_threads = torch.get_num_threads()
            for d in dtypes:
                bar.set_postfix_str(f"matmul {d}")
                n_max = (8192 if dev.type == "cuda" else 2048) // (4 if fast else 1)
                n_mm, t = _matmul(getattr(torch, d), dev, 0.01 if fast else 0.05, n_max, repeat)
                matmuls[d] = (n_mm, t.median)
                compute_notes.append(f"{d} n={n_mm} spread {t.spread:.0%}")
                bar.update()
            bar.set_postfix_str("memory bandwidth")
            # Far larger than any CPU cache, so the copy streams from memory.
            nbytes = (1 << 30 if dev.type == "cuda" else 1 << 26) >> (3 if fast else 0)
            src = torch.ones(nbytes // 4, device=dev)
            dst = torch.empty_like(src)
            copy = measure(lambda: dst.copy_(src), warmup=1, repeat=repeat, device=dev)
            bar.update()

    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        where, memory, devices = f"{props.name}", float(props.total_memory), \
            torch.cuda.device_count()
    else:
        where, memory, devices = f"{os.cpu_count()} CPU cores", _host_memory(), 1
    trust = "" if worst <= SPREAD_LIMIT and copy.reliable else \
        " UNRELIABLE: spreads above the limit (usually another program using the cores)."
    notes = (f"measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on "
             f"{platform.node() or 'this machine'} ({platform.processor() or platform.machine()}"
             f"), torch {torch.__version__}"
             f"{' in FAST mode (small sizes, few repeats)' if fast else ''}. Collectives: "
             f"{'/'.join(sorted(backends))} ranks "
             f"(1 thread each), {len(sizes)} sizes {min(sizes)}-{max(sizes)} B, {repeat} "
             f"repeats, median of the slowest rank, worst spread {worst:.0%}; fitted to the "
             f"ring formulas. Compute on {dev} with {n_threads} thread(s): "
             f"{', '.join(compute_notes)}. Copy of {nbytes >> 20} MiB: spread "
             f"{copy.spread:.0%}. Memory: "
             f"{'torch.cuda' if dev.type == 'cuda' else 'os.sysconf'}." + trust)
    card = fit_card(link_times, matmuls, (nbytes, copy.median), memory=memory,
                    devices=devices, notes=notes,
                    name=f"this machine ({where}, {'/'.join(sorted(backends))})")
    if path is not None:
        card.save(path)
    return card


# ---- published figures and the modeled cards built from them ---------------------------

_H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM5 column)"
_NCCL212 = ("NVIDIA/nccl-tests issue #212, S. Jeaugey (NVIDIA), 2024-05-06: "
            "github.com/NVIDIA/nccl-tests/issues/212")
_ANCHORS = (
    {"what": "H100 SXM dense bf16/fp16 tensor-core matmul", "value": 989e12,
     "unit": "FLOP/s", "convention": "peak, dense (1979 is with 2:4 sparsity)", "source": _H100},
    {"what": "H100 SXM fp32 matmul without TF32 (CUDA cores, not tensor cores)",
     "value": 67e12, "unit": "FLOP/s", "convention": "peak", "source": _H100},
    {"what": "H100 SXM fp64 tensor-core matmul", "value": 67e12, "unit": "FLOP/s",
     "convention": "peak (fp64 on CUDA cores: 34)", "source": _H100},
    {"what": "H100 SXM HBM3 bandwidth (80 GB)", "value": 3.35e12, "unit": "B/s",
     "convention": "peak", "source": _H100},
    {"what": "NVLink 4 per H100 (18 links)", "value": 900e9, "unit": "B/s",
     "convention": "bidirectional total = 450 GB/s each direction", "source": _H100},
    {"what": "8x H100 NVLink: effective bandwidth of ring / non-all-reduce collectives",
     "value": 370e9, "unit": "B/s", "convention": "busbw (450 GB/s line rate less ~20% "
     "protocol overhead)", "source": _NCCL212},
    {"what": "8x H100 NVLS (NVLink SHARP) all_reduce, large messages", "value": 480e9,
     "unit": "B/s", "convention": "busbw (algbw ~275 GB/s); with NVLS busbw is not wire "
     "bandwidth", "source": _NCCL212},
    {"what": "InfiniBand NDR port (one ConnectX-7 per GPU in DGX H100)", "value": 50e9,
     "unit": "B/s", "convention": "400 Gb/s line rate, each direction",
     "source": "NVIDIA DGX H100 user guide / ConnectX-7 datasheet (400 Gb/s NDR)"},
    {"what": "gloo all_reduce, 2 ranks on this project's 2-core dev machine, 16 MB",
     "value": 1.2e9, "unit": "B/s", "convention": "algbw (= busbw at N=2), range 0.7-1.8",
     "source": "measured by the parlearn developers on a 2-core VM (shared cores)"},
)


def anchors() -> list[dict]:
    """Published figures to read a card against: each a dict with ``what``, ``value``,
    ``unit``, ``convention`` (peak or sustained, algbw or busbw, uni- or bidirectional)
    and ``source``."""
    return [dict(a) for a in _ANCHORS]


def _h100_8x_nvlink() -> Card:
    """One HGX/DGX H100 node: 8 H100 SXM5 on NVSwitch (NVLink 4).

    Compute, HBM: the datasheet's peaks (989 TFLOP/s bf16/fp16 dense on tensor cores;
    67 TFLOP/s fp32 on CUDA cores, without TF32, torch's matmul default; 67 TFLOP/s fp64
    on tensor cores; 3.35 TB/s; 80 GB), not
    sustained rates: a measured matmul reaches less. Links: beta = 1/busbw from nccl-tests
    #212 (all_reduce 480 GB/s with NVLS; the other collectives and p2p 370 GB/s, NCCL's
    effective NVLink rate). Alphas are ASSUMPTIONS, not measurements: 1 us per ring step
    (so a tiny all_reduce on 8 GPUs costs 14 us) and 5 us for a p2p message.
    """
    links = {f"{k}@8": AlphaBeta(1e-6, 1 / (480e9 if k == "all_reduce" else 370e9))
             for k in LINK_KINDS if k != "p2p"}
    links["p2p@8"] = AlphaBeta(5e-6, 1 / 370e9)
    return Card("8x H100 SXM, NVLink 4 / NVSwitch (modeled: datasheet + nccl-tests #212)",
                False, links, {"float64": 67e12, "float32": 67e12, "bfloat16": 989e12,
                               "float16": 989e12},
                3.35e12, 80e9, 8, notes=_doc_notes(_h100_8x_nvlink))


def _h100_ib() -> Card:
    """Two or more H100 nodes on InfiniBand NDR, 400 Gb/s per GPU, modeled as a flat ring
    that crosses the network (16 GPUs = 2 nodes of 8).

    Compute, HBM: the H100 SXM datasheet's peaks, as in ``h100-8x-nvlink`` (989 TFLOP/s
    bf16/fp16 dense, 67 TFLOP/s fp32 (CUDA cores) and fp64 (tensor cores), 3.35 TB/s,
    80 GB), not sustained. Links:
    beta = 1/50 GB/s, the 400 Gb/s line rate in each direction: an UPPER bound (NCCL
    loses protocol overhead, ~20% on NVLink per nccl-tests #212), and hierarchical or
    SHARP algorithms, which this flat ring ignores, beat it. Alphas are ASSUMPTIONS: 5 us
    per ring step, 10 us per p2p message.
    """
    links = {f"{k}@16": AlphaBeta(5e-6, 1 / 50e9) for k in LINK_KINDS if k != "p2p"}
    links["p2p@16"] = AlphaBeta(10e-6, 1 / 50e9)
    return Card("H100 nodes on InfiniBand NDR 400 Gb/s per GPU (modeled: line rate)",
                False, links, {"float64": 67e12, "float32": 67e12, "bfloat16": 989e12,
                               "float16": 989e12},
                3.35e12, 80e9, 16, notes=_doc_notes(_h100_ib))


def _doc_notes(fn) -> str:
    """A preset's notes: its docstring after the first paragraph, on one line (the
    sources live once, in the docstring a reader of the code sees)."""
    return " ".join(fn.__doc__.split("\n\n", 1)[1].split())


_PRESETS = {"h100-8x-nvlink": _h100_8x_nvlink, "h100-ib": _h100_ib}
PRESETS = tuple(_PRESETS)


def preset(name: str) -> Card:
    """A modeled card (``measured=False``): one of :data:`PRESETS`. Sources and which
    numbers are assumptions are in each card's ``notes``."""
    return _PRESETS[check_choice("name", name, PRESETS)]()


def describe(card: Card, nbytes: float = 2**24, *, show_anchors: bool = True) -> str:
    """A readable table of ``card``: per link alpha, ``1/beta``, and the algbw and busbw
    the fitted model gives at ``nbytes`` of payload (default 16 MiB); FLOP/s per dtype;
    memory bandwidth; the conventions; the published anchors beside it."""
    if not isinstance(card, Card):
        raise TypeError(f"card must be a Card, got {type(card).__name__}")
    nbytes = check_float("nbytes", nbytes, lo=0, lo_open=True)
    kind_order = {k: i for i, k in enumerate(LINK_KINDS)}
    how = "MEASURED" if card.measured else "MODELED (not measured)"
    lines = [f"{card.name}: {how}, {card.devices} device(s)",
             f"  memory {card.memory / 1e9:.1f} GB per device, memory bandwidth "
             f"{card.mem_bw / 1e9:.1f} GB/s "
             + ("(a large copy, read + write)" if card.measured else "(datasheet)"),
             "  matmul" + (" (sustained): " if card.measured else " (datasheet peak): ")
             + ", ".join(f"{d} {r / 1e12:.3g} TFLOP/s"
                                      for d, r in card.flops.items()),
             f"  collectives at {nbytes / 2**20:.4g} MiB payload (time from the fitted "
             f"alpha-beta model):",
             f"  {'kind':<15}{'N':>4}{'alpha us':>10}{'1/beta GB/s':>13}{'time ms':>10}"
             f"{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for key in sorted(card.links, key=lambda k: (kind_order[_split_key(k)[0]],
                                                  _split_key(k)[1])):
        kind, n = _split_key(key)
        ab, t = card.links[key], card.comm_time(kind, nbytes, n)
        algbw = nbytes / t if t > 0 else math.inf
        lines.append(f"  {kind:<15}{n:>4}{ab.alpha * 1e6:>10.2f}{ab.bandwidth / 1e9:>13.2f}"
                     f"{t * 1e3:>10.3f}{algbw / 1e9:>12.2f}"
                     f"{algbw * bus_factor(kind, n) / 1e9:>12.2f}")
    lines += ["  algbw = payload / time. busbw = algbw * 2(N-1)/N for all_reduce, * (N-1)/N "
              "for all_gather,",
              "  reduce_scatter and all_to_all, * 1 for p2p (nccl-tests' convention): "
              "comparable with ONE",
              "  direction of a link whatever N. NVLink's quoted 900 GB/s is bidirectional "
              "(450 GB/s each way).",
              f"  notes: {card.notes}" if card.notes else "  notes: none"]
    if show_anchors:
        lines.append("  published anchors (read the convention before comparing):")
        for a in _ANCHORS:
            scale, unit = (1e12, "TFLOP/s") if a["unit"] == "FLOP/s" else (1e9, "GB/s")
            lines.append(f"    {a['value'] / scale:8.4g} {unit:<8}{a['what']} "
                         f"[{a['convention']}] ({a['source']})")
    return "\n".join(lines)
