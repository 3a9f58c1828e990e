"""The collectives ledger: what each collective a rank issued sent, and how long it took.

    with dist.ledger() as led:          # inside a worker, on each rank
        torch.distributed.all_reduce(t)
    led.bytes("all_reduce"), led.count(), led.records

Re-exported by :mod:`parlearn.distributed`; see :func:`ledger` for what is counted.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

from parlearn.core.checks import check_callable

__all__ = ["Record", "Ledger", "ledger", "replace_collective"]


@dataclass(frozen=True)
class Record:
    """One collective call on this rank: ``bytes`` is its payload as passed (see
    :func:`ledger`), ``seconds`` its wall time (issue time only for async calls),
    ``ranks`` the size of the group it ran on."""

    kind: str
    bytes: int
    seconds: float
    ranks: int


class Ledger:
    """The records of one ``with ledger():`` block (on one rank)."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def record(self, kind: str, nbytes: int, seconds: float, ranks: int) -> None:
        """Add a record by hand, e.g. from a DDP communication hook that torch calls from C++."""
        self.records.append(Record(kind, int(nbytes), float(seconds), int(ranks)))

    def _watch(self, kind: str, args: tuple, kwargs: dict) -> Callable:
        nbytes = _payload(kind, args, kwargs)
        group = kwargs.get("group")

        def end(seconds: float, error: BaseException | None) -> None:
            ranks = tdist.get_world_size(group) if tdist.is_initialized() else 1
            self.record(kind, nbytes, seconds, ranks)
        return end

    def _of(self, kind: str | None) -> list[Record]:
        return [r for r in self.records if kind is None or r.kind == kind]

    def bytes(self, kind: str | None = None) -> int:
        """Total payload bytes of the records (of one ``kind`` when given)."""
        return sum(r.bytes for r in self._of(kind))

    def count(self, kind: str | None = None) -> int:
        """Number of records (of one ``kind`` when given)."""
        return len(self._of(kind))

    def seconds(self, kind: str | None = None) -> float:
        """Total wall time of the records (of one ``kind`` when given)."""
        return sum(r.seconds for r in self._of(kind))

    def summary(self) -> dict[str, tuple[int, int, float]]:
        """``{kind: (count, bytes, seconds)}`` in order of first appearance."""
        return {k: (self.count(k), self.bytes(k), self.seconds(k))
                for k in dict.fromkeys(r.kind for r in self.records)}


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


# kind -> which positional argument is the payload (see ledger's docstring for the rule).
_PAYLOAD = {
    "all_reduce": 0, "broadcast": 0, "reduce": 0, "send": 0, "recv": 0, "isend": 0,
    "irecv": 0, "gather": 0, "scatter": 0, "all_gather": 0, "all_gather_into_tensor": 0,
    "all_gather_single": 0, "reduce_scatter": 1, "reduce_scatter_tensor": 1,
    "reduce_scatter_single": 1, "all_to_all": 1, "all_to_all_single": 1,
    "all_reduce_coalesced": 0, "barrier": None, "batch_isend_irecv": 0,
    "monitored_barrier": None,
}
_KEYWORD = {"all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor",
            "send": "tensor", "recv": "tensor", "isend": "tensor", "irecv": "tensor",
            "gather": "tensor", "scatter": "tensor", "all_gather": "tensor_list",
            "all_gather_into_tensor": "output_tensor", "all_gather_single": "output",
            "reduce_scatter": "input_list", "reduce_scatter_tensor": "input",
            "reduce_scatter_single": "input", "all_to_all": "input_tensor_list",
            "all_to_all_single": "input", "all_reduce_coalesced": "tensors",
            "batch_isend_irecv": "p2p_op_list"}

# Who watches the collectives now: each watcher is called before a call with
# ``(kind, args, kwargs)`` and returns what to call when it ends, with ``(seconds, error)``
# (``error`` the exception it raised, else None). The ledger and the flight recorder are two.
Watcher = Callable[[str, tuple, dict], Callable[[float, BaseException | None], None]]
_watchers: list[Watcher] = []
_originals: dict[str, Callable] = {}
_inside = threading.local()


def _payload_value(kind: str, args: tuple, kwargs: dict) -> Any:
    pos = _PAYLOAD[kind]
    if pos is None:
        return None
    return args[pos] if len(args) > pos else kwargs.get(_KEYWORD[kind])


def _payload(kind: str, args: tuple, kwargs: dict) -> int:
    value = _payload_value(kind, args, kwargs)
    if kind == "batch_isend_irecv":
        return sum(_nbytes(op.tensor) for op in value or ())
    return _nbytes(value)


def _watched(kind: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if getattr(_inside, "depth", 0):  # a collective called by another is not counted twice
            return original(*args, **kwargs)
        ends = [watch(kind, args, kwargs) for watch in list(_watchers)]
        _inside.depth = 1
        error = None
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        except BaseException as err:
            error = err
            raise
        finally:
            seconds = time.perf_counter() - t0
            _inside.depth = 0
            for end in ends:
                end(seconds, error)
    return wrapper


@contextlib.contextmanager
def _watching(watcher: Watcher) -> Iterator[None]:
    """Call ``watcher(kind, args, kwargs)`` before every collective this process issues
    through ``torch.distributed``'s Python API inside the block, and what it returns with
    ``(seconds, error)`` when the call ends (after an error too). The module attributes are
    wrapped when the first watcher enters and restored when the last one leaves; a
    collective that another one calls is seen once, as the outer call."""
    check_callable("watcher", watcher)
    if not _watchers:
        c10d = tdist.distributed_c10d
        for kind in _PAYLOAD:
            if hasattr(c10d, kind):
                _originals[kind] = getattr(c10d, kind)
                replace_collective(kind, _originals[kind], _watched(kind, _originals[kind]))
    _watchers.append(watcher)
    try:
        yield
    finally:
        _watchers.remove(watcher)
        if not _watchers:
            for kind, original in _originals.items():
                for mod in (tdist, tdist.distributed_c10d):
                    if getattr(getattr(mod, kind, None), "__wrapped__", None) is original:
                        setattr(mod, kind, original)
            _originals.clear()


def replace_collective(kind: str, old: Callable, new: Callable) -> None:
    """Set ``new`` wherever ``torch.distributed`` exposes ``old`` under the name ``kind``:
    the package and ``distributed_c10d`` (code calls either), leaving a module whose
    attribute is something else (another wrapper) alone. Wrapping and restoring are the
    same call with the arguments swapped."""
    if not isinstance(kind, str) or not callable(getattr(tdist, kind, None)):
        raise ValueError(f"kind must name a torch.distributed function, got {kind!r}")
    check_callable("old", old)
    check_callable("new", new)
    for mod in (tdist, tdist.distributed_c10d):
        if getattr(mod, kind, None) is old:
            setattr(mod, kind, new)


@contextlib.contextmanager
def ledger() -> Iterator[Ledger]:
    """Record every collective this process issues through ``torch.distributed``'s Python
    API inside the block (module attributes are wrapped on entry and restored on exit;
    nested ledgers each see every call).

    ``bytes`` is the payload as passed: the tensor for all_reduce, broadcast, reduce,
    send/recv/isend/irecv; the OUTPUT for all_gather(_into_tensor, _single) (the whole
    gathered tensor); the INPUT for reduce_scatter(_tensor, _single) and all_to_all(_single);
    what this rank contributes for gather and receives for scatter; 0 for barrier and
    monitored_barrier. Wire
    traffic under a given algorithm is :func:`ring_bytes`. Calls ``torch`` makes from C++
    (DDP's gradient buckets) and functional collectives (DTensor) are not seen: count
    those with ``torch.distributed.tensor.debug.CommDebugMode`` or :meth:`Ledger.record`.
    Async calls (``async_op=True``, isend, irecv) are timed at issue only.
    """
    led = Ledger()
    with _watching(led._watch):
        yield led
