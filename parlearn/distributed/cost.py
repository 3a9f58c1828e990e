"""The alpha-beta cost model of collectives: closed forms, wire bytes, and the fit.

A message of ``n`` bytes between two ranks takes ``alpha + n * beta`` seconds: ``alpha``
is the latency paid per message (software, synchronisation, the wire's first byte) and
``beta`` the seconds per byte (1 / bandwidth). A collective is a schedule of such
messages; counting the steps on the critical path and the bytes each rank sends per step
gives its time (Thakur, Rabenseifner & Gropp 2005; Chan et al. 2007). With ``N`` ranks
and ``n`` the payload in bytes as :func:`parlearn.distributed.ledger` counts it:

=================  ===============================  =========================================
collective         ring                             tree
=================  ===============================  =========================================
send / recv        a + n b                          a + n b
all_reduce         2(N-1) a + 2(N-1)/N n b          2 ceil(log2 N) (a + n b)  (reduce + bcast)
reduce_scatter     (N-1) a + (N-1)/N n b            ceil(log2 N) a + (N-1)/N n b  (halving)
all_gather         (N-1) a + (N-1)/N n b            ceil(log2 N) a + (N-1)/N n b  (doubling)
broadcast, reduce  (N-1) a + n b  (pipelined)       ceil(log2 N) (a + n b)  (binomial)
all_to_all         (N-1) (a + n/N b)  (pairwise)    ceil(log2 N) (a + n/2 b)  (Bruck)
=================  ===============================  =========================================

(``n`` is the input for reduce_scatter and all_to_all, the gathered output for all_gather.)

The "tree" column is the textbook binomial tree, which moves the whole tensor at every level
and is *not* pipelined. NCCL's trees are not that: it runs two binary trees at once (a
"double binary tree", each carrying half the data, every rank an inner node of at most one),
and cuts the tensor into chunks that stream up and down them (Sanders, Speck & Traeff 2009;
NVIDIA's NCCL 2.4 announcement, 2019). Algorithm ``"double_tree"`` is that tree in its
large-message limit: ``2 ceil(log2 N) a + 2 n b`` for all_reduce (reduce then broadcast:
latency of a tree, bytes of a ring) and ``ceil(log2 N) a + n b`` for broadcast and reduce;
it ignores the pipeline's fill (a few chunks' time), so it is a lower bound for small
messages. NCCL uses trees only for those collectives; the others refuse it.
The ring all-reduce is a ring reduce-scatter followed by a ring all-gather, so its two
terms are twice theirs. The pipelined ring broadcast is its large-message limit (chunks
small against ``n``, so the ``N-1`` hops overlap). The model ignores contention, the
reduction arithmetic and the topology: it is a line through measured points, not physics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from parlearn.core.checks import check_choice, check_float, check_int

__all__ = ["AlphaBeta", "KINDS", "ALGORITHMS", "collective_time", "ring_bytes",
           "fit_alpha_beta", "hierarchical_all_reduce_time"]

ALGORITHMS = ("ring", "tree", "double_tree")
# Each torch function name maps to the collective it performs.
_CANON = {
    "send": "p2p", "recv": "p2p", "isend": "p2p", "irecv": "p2p", "p2p": "p2p",
    "all_reduce": "all_reduce",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "broadcast": "broadcast", "reduce": "broadcast",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
}
KINDS = tuple(_CANON)


@dataclass(frozen=True)
class AlphaBeta:
    """``alpha`` seconds per message, ``beta`` seconds per byte (``1/beta`` is bytes/s)."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        check_float("alpha", self.alpha, lo=0)
        check_float("beta", self.beta, lo=0)

    @property
    def bandwidth(self) -> float:
        """Bytes per second, ``1 / beta`` (infinite when ``beta`` is 0)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def __str__(self) -> str:
        return f"alpha = {self.alpha * 1e6:.1f} us, 1/beta = {self.bandwidth / 1e9:.2f} GB/s"


def _check(kind: str, nbytes: float, world_size: int, algorithm: str,
           bytes_name: str = "nbytes") -> tuple[str, float, int]:
    check_choice("kind", kind, KINDS)
    nbytes = check_float(bytes_name, nbytes, lo=0)
    world_size = check_int("world_size", world_size, lo=1)
    check_choice("algorithm", algorithm, ALGORITHMS)
    if algorithm == "double_tree" and _CANON[kind] not in ("all_reduce", "broadcast", "p2p"):
        raise ValueError(f"algorithm 'double_tree' is modeled for all_reduce, broadcast and "
                         f"reduce only, got kind {kind!r}")
    if _CANON[kind] == "p2p" and world_size < 2:
        raise ValueError(f"{kind} needs world_size >= 2, got {world_size}")
    return _CANON[kind], nbytes, world_size


def _terms(kind: str, n: float, N: int, algorithm: str) -> tuple[float, float]:
    """(messages on the critical path, bytes on it): time = first * alpha + second * beta."""
    log = math.ceil(math.log2(N)) if N > 1 else 0
    if kind == "p2p":
        return 1, n
    if algorithm == "ring":
        return {
            "all_reduce": (2 * (N - 1), 2 * (N - 1) / N * n),
            "reduce_scatter": (N - 1, (N - 1) / N * n),
            "all_gather": (N - 1, (N - 1) / N * n),
            "broadcast": (N - 1, n if N > 1 else 0.0),
            "all_to_all": (N - 1, (N - 1) / N * n),
        }[kind]
    if algorithm == "double_tree":   # pipelined: latency of a tree, bytes of a ring
        return {"all_reduce": (2 * log, 2 * n if N > 1 else 0.0),
                "broadcast": (log, n if N > 1 else 0.0)}[kind]
    return {
        "all_reduce": (2 * log, 2 * log * n),
        "reduce_scatter": (log, (N - 1) / N * n),
        "all_gather": (log, (N - 1) / N * n),
        "broadcast": (log, log * n),
        "all_to_all": (log, log * n / 2),
    }[kind]


def collective_time(kind: str, nbytes: float, world_size: int,
                    model: AlphaBeta | Mapping[str, AlphaBeta],
                    algorithm: str = "ring") -> float:
    """Modeled seconds of one collective (table in the module docstring): ``kind`` a torch
    function name ("all_reduce", "reduce_scatter_tensor", "send", ...), ``nbytes`` its
    payload as the ledger counts it, on ``world_size`` ranks. ``algorithm``: "ring", "tree"
    (binomial, not pipelined) or "double_tree" (NCCL's pipelined trees; all_reduce,
    broadcast and reduce only).

    ``model`` is one :class:`AlphaBeta` for every collective, or a mapping from collective
    names (torch's or the table's) to the link fitted for that collective: a real engine
    implements each collective its own way, so one fit need not price them all (over a
    dozen sweeps on our 2-core machine, gloo's CPU all_gather fitted 0.45-1.1 times the
    bandwidth of its all_reduce, typically 0.7). Two keys
    naming the same collective must hold the same link."""
    kind, n, N = _check(kind, nbytes, world_size, algorithm)
    link = _link_for(kind, model)
    steps, wire = _terms(kind, n, N, algorithm)
    return steps * link.alpha + wire * link.beta


def hierarchical_all_reduce_time(nbytes: float, gpus_per_node: int, nodes: int,
                                 intra: AlphaBeta, inter: AlphaBeta) -> dict:
    """Modeled seconds of a two-level all-reduce of ``nbytes`` over ``nodes`` servers of
    ``gpus_per_node`` GPUs (Jia et al. 2018, arXiv:1807.11205; Horovod's hierarchical
    all-reduce): (1) a ring reduce-scatter inside each node over ``intra``, leaving each GPU
    ``nbytes / G`` summed over its node; (2) ``G`` independent ring all-reduces of those
    ``nbytes / G`` bytes across the ``nodes`` servers, one per local GPU index, each over
    its own ``inter`` link (a NIC per GPU); (3) a ring all-gather inside each node. The
    phases run one after the other (no pipelining between them)::

        T = 2 [(G-1) a_in + (G-1)/G n b_in] + 2 (M-1) a_out + 2 (M-1)/M (n/G) b_out

    Returns ``{"reduce_scatter", "all_reduce", "all_gather", "total"}`` in seconds."""
    n = check_float("nbytes", nbytes, lo=0)
    g = check_int("gpus_per_node", gpus_per_node, lo=1)
    m = check_int("nodes", nodes, lo=1)
    for name, link in (("intra", intra), ("inter", inter)):
        if not isinstance(link, AlphaBeta):
            raise TypeError(f"{name} must be an AlphaBeta, got {link!r}")
    rs = collective_time("reduce_scatter", n, g, intra)
    ar = collective_time("all_reduce", n / g, m, inter)
    ag = collective_time("all_gather", n, g, intra)
    return {"reduce_scatter": rs, "all_reduce": ar, "all_gather": ag, "total": rs + ar + ag}


def _link_for(canon: str, model: AlphaBeta | Mapping[str, AlphaBeta]) -> AlphaBeta:
    """The link that prices collective ``canon``: ``model`` itself, or its entry."""
    if isinstance(model, AlphaBeta):
        return model
    if not isinstance(model, Mapping):
        raise TypeError("model must be an AlphaBeta or a mapping of collective names to "
                        f"AlphaBeta, got {type(model).__name__}")
    found = {}
    for key, link in model.items():
        check_choice("model's keys", key, KINDS)
        if not isinstance(link, AlphaBeta):
            raise TypeError(f"model[{key!r}] must be an AlphaBeta, got {type(link).__name__}")
        if _CANON[key] == canon:
            found[key] = link
    if not found:
        raise ValueError(f"model has no link for {canon!r} (its keys: {sorted(model)})")
    if len(set(found.values())) > 1:
        raise ValueError(f"model's keys {sorted(found)} name the same collective with "
                         "different links")
    return next(iter(found.values()))


def ring_bytes(kind: str, payload_bytes: float, world_size: int) -> float:
    """Bytes each rank sends under the ring schedule: all_reduce ``2(N-1)/N n``;
    reduce_scatter, all_gather and all_to_all ``(N-1)/N n``; send and broadcast ``n``."""
    kind, n, N = _check(kind, payload_bytes, world_size, "ring", "payload_bytes")
    return _terms(kind, n, N, "ring")[1]


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float], *, kind: str = "send",
                   world_size: int = 2, algorithm: str = "ring") -> AlphaBeta:
    """Alpha and beta from measured ``times`` (seconds) of one collective at payload
    ``sizes`` (bytes), by least squares on the model ``t = s(N) alpha + w(n, N) beta``
    of :func:`collective_time` (``kind="send"``: ``t = alpha + n beta``).

    Residuals are relative (each equation divided by its time), so small messages, which
    decide alpha, weigh as much as large ones, which decide beta. Both are constrained to
    be >= 0: if the unconstrained solution has a negative one, it is refitted as 0.
    """
    if len(sizes) != len(times):
        raise ValueError(f"sizes and times must have the same length, "
                         f"got {len(sizes)} and {len(times)}")
    if len(sizes) < 2:
        raise ValueError(f"need at least 2 measurements, got {len(sizes)}")
    ts = [check_float("times", t, lo=0, lo_open=True) for t in times]
    rows = []
    for n in sizes:
        canon, n, N = _check(kind, n, world_size, algorithm, "sizes")
        rows.append(_terms(canon, n, N, algorithm))
    # Weighted normal equations of the 2x2 problem, by hand (no numpy needed).
    w = [(s / t, b / t, 1.0) for (s, b), t in zip(rows, ts, strict=True)]
    aa, ab, bb = (sum(x * x for x, _, _ in w), sum(x * y for x, y, _ in w),
                  sum(y * y for _, y, _ in w))
    ya, yb = sum(x for x, _, _ in w), sum(y for _, y, _ in w)
    det = aa * bb - ab * ab
    if det > 1e-12 * aa * bb:
        alpha, beta = (ya * bb - yb * ab) / det, (yb * aa - ya * ab) / det
        if alpha >= 0 and beta >= 0:
            return AlphaBeta(alpha, beta)
    # One of them is pinned to 0: the best fit of the other alone, or the better of the two.
    only_alpha = AlphaBeta(max(ya / aa, 0.0), 0.0) if aa > 0 else AlphaBeta(0.0, 0.0)
    only_beta = AlphaBeta(0.0, max(yb / bb, 0.0)) if bb > 0 else AlphaBeta(0.0, 0.0)

    def err(m: AlphaBeta) -> float:
        return sum((x * m.alpha + y * m.beta - 1.0) ** 2 for x, y, _ in w)
    return min((only_alpha, only_beta), key=err)
