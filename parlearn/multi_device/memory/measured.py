"""Measure where a training step's memory goes: the tensors autograd saves, and the peak.

:func:`saved_tensors` runs one forward under ``torch.autograd.graph.saved_tensors_hooks``
and records every tensor autograd keeps for backward. A tensor can be saved by several ops
(the input of the q, k and v projections) and a view keeps its whole storage alive, so the
ledger counts each *storage* once, at its full size. Each storage is sorted into

- ``parameter``: a model parameter (it exists whether or not a step runs);
- ``buffer``: a model buffer (causal mask, RoPE tables);
- ``input``: the step's own token ids and targets;
- ``weight copy``: a lower-precision copy of a parameter made by autocast (bf16 weights of
  any rank: a linear's, or its transpose, a conv's 4-D one), recognised by shape, dtype
  and value;
- ``activation``: everything else: what the activation model must account for.

What the ledger counts is every storage that passes through autograd's saved-tensor hooks,
byte for byte. It does NOT count what is held beside them:

- the RNG state ``torch.utils.checkpoint`` stashes per call when ``preserve_rng_state=True``
  (its default): the CPU generator's state (``torch.get_rng_state()``, 5,056 bytes) and,
  once CUDA is initialised, each device's generator state. :class:`parlearn.transformer.GPT`
  draws no random numbers in forward and checkpoints with ``preserve_rng_state=False``, so
  it stashes none and its ledger is everything its forward keeps for backward (tested);
  a user's model that checkpoints with the default holds these bytes on top;
- the autograd graph's own nodes and Python objects (checkpoint's per-tensor metadata);
- the allocator's rounding and caching (see :func:`peak_memory` for the allocator's view).

:func:`peak_memory` measures the allocator's peak of a whole step on CUDA
(``torch.cuda.max_memory_allocated``); there is no such counter on CPU, where it returns
None.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from parlearn.core.checks import check_callable, check_choice, check_int

__all__ = ["Saved", "SavedLedger", "saved_tensors", "peak_memory", "autocast_for"]

AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
KINDS = ("activation", "weight copy", "input", "buffer", "parameter")


@dataclass(frozen=True)
class Saved:
    """One storage autograd kept: its first saver's shape and dtype, and its bytes."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    kind: str
    uses: int  # how many times ops saved (views of) it

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple):
            raise TypeError(f"shape must be a tuple of ints, got {self.shape!r}")
        for d in self.shape:
            check_int("shape", d, lo=0)
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        check_int("nbytes", self.nbytes, lo=0)
        check_choice("kind", self.kind, KINDS)
        check_int("uses", self.uses, lo=1)


@dataclass
class SavedLedger:
    """Every storage saved for backward in one forward, deduplicated."""

    records: list[Saved] = field(default_factory=list)

    def bytes(self, kind: str | None = None) -> int:
        return sum(r.nbytes for r in self.records if kind is None or r.kind == kind)

    def by_kind(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for r in self.records:
            out[r.kind] += r.nbytes
        return out

    def by_shape(self, kind: str = "activation") -> dict[tuple, int]:
        """Bytes of ``kind`` storages grouped by ``(shape, dtype)``: what to compare with a
        term-by-term model."""
        out: dict[tuple, int] = defaultdict(int)
        for r in self.records:
            if r.kind == kind:
                out[(r.shape, r.dtype)] += r.nbytes
        return dict(out)


def autocast_for(device: torch.device | str, dtype: torch.dtype | None):
    """``torch.autocast`` on ``device``'s type at ``dtype``, or a no-op for None."""
    from parlearn.multi_device.transformer.model import check_device

    dev = check_device("device", device)
    if dtype is None:
        return contextlib.nullcontext()
    check_choice("dtype", dtype, AUTOCAST_DTYPES)
    return torch.autocast(dev.type, dtype=dtype)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def saved_tensors(model: nn.Module, *inputs: torch.Tensor, autocast: torch.dtype | None = None,
                  **kwargs) -> tuple[SavedLedger, torch.Tensor]:
    """Run ``model(*inputs, **kwargs)`` once and return the :class:`SavedLedger` of what
    autograd saved, and the loss (the output's second element if it is a tuple, else the
    output), whose ``backward()`` the caller may still run. Tensors given as inputs,
    positional or keyword (``targets=``), count as ``"input"``, not as activations.
    ``autocast``: a dtype such as ``torch.bfloat16`` to run the forward under
    ``torch.autocast``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if autocast is not None:
        check_choice("autocast", autocast, AUTOCAST_DTYPES)
    params = {_ptr(p) for p in model.parameters()}
    buffers = {_ptr(b) for b in model.buffers()}
    tensors = [t for t in (*inputs, *kwargs.values()) if isinstance(t, torch.Tensor)]
    given = {_ptr(t) for t in tensors}
    seen: dict[int, list] = {}
    keep: list[torch.Tensor] = []  # hold every saved tensor so no address is reused

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = _ptr(t)
        if ptr in seen:
            seen[ptr][4] += 1
        else:
            keep.append(t)
            if ptr in params:
                kind = "parameter"
            elif ptr in buffers:
                kind = "buffer"
            elif ptr in given:
                kind = "input"
            elif autocast is not None and t.dtype == autocast and _is_weight_copy(t, model):
                kind = "weight copy"
            else:
                kind = "activation"
            seen[ptr] = [tuple(t.shape), t.dtype, t.untyped_storage().nbytes(), kind, 1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        # A model may have no parameter (a bare activation): then the inputs say the device.
        first = next(model.parameters(), None)
        dev = first.device if first is not None else (tensors[0].device if tensors else "cpu")
        with autocast_for(dev, autocast):
            out = model(*inputs, **kwargs)
    loss = out[1] if isinstance(out, tuple) else out
    ledger = SavedLedger([Saved(*v) for v in seen.values()])
    return ledger, loss


def _is_weight_copy(t: torch.Tensor, model: nn.Module) -> bool:
    """True when ``t`` is a parameter of any rank (a linear's 2-D weight, a conv's 4-D one),
    or a 2-D one's transpose, rounded to ``t``'s dtype."""
    for p in model.parameters():
        for w in (p, p.t()) if p.ndim == 2 else (p,):
            if w.shape == t.shape and torch.equal(w.detach().to(t.dtype), t.detach()):
                return True
    return False


def peak_memory(step, device: torch.device | str) -> int | None:
    """Peak bytes the CUDA allocator held while ``step()`` ran (above what was allocated
    before), or None on a device without an allocator counter (CPU)."""
    from parlearn.multi_device.transformer.model import check_device

    check_callable("step", step)
    dev = check_device("device", device)
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    step()
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) - base
