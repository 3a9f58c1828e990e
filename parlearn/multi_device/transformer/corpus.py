"""A character-level corpus every Python already has: the text of ``pydoc_data.topics``.

CPython ships the help text of the language reference in ``pydoc_data.topics`` (about 465k
characters and 103 distinct symbols in Python 3.11; other versions differ a little). No
download, no licence question, and enough structure (English prose, code, tables) that a
tiny model's validation loss falls for a while before it memorises.

The text is the topics joined in sorted key order; the first ``1 - val_fraction`` of it is
the training split and the rest the validation split, so the split is the same on every
machine with the same Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parlearn.core.checks import check_float, check_int, check_tensor

__all__ = ["CharCorpus", "pydoc_corpus", "get_batch"]


@dataclass(frozen=True)
class CharCorpus:
    """Token ids of a text split in two, and the vocabulary that maps them back."""

    chars: str
    train: torch.Tensor  # int64 token ids
    val: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.chars, str) or not self.chars or len(set(self.chars)) != len(
                self.chars):
            raise ValueError(f"chars must be a non-empty str of distinct symbols, got "
                             f"{self.chars!r:.40}")
        for name in ("train", "val"):
            ids = check_tensor(name, getattr(self, name), ndim=1, floating=False)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= len(self.chars)):
                raise ValueError(f"{name} must hold ids in [0, {len(self.chars)}), got "
                                 f"[{int(ids.min())}, {int(ids.max())}]")

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        index = {c: i for i, c in enumerate(self.chars)}
        unknown = sorted({c for c in text if c not in index})
        if unknown:
            raise ValueError(f"text has characters outside the vocabulary: {unknown[:5]}")
        return torch.tensor([index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


_CACHE: dict[float, CharCorpus] = {}


def pydoc_corpus(val_fraction: float = 0.1) -> CharCorpus:
    """The ``pydoc_data.topics`` text as a :class:`CharCorpus` (cached per split)."""
    val_fraction = check_float("val_fraction", val_fraction, lo=0.0, hi=1.0,
                               lo_open=True, hi_open=True)
    if val_fraction not in _CACHE:
        from pydoc_data import topics

        text = "".join(topics.topics[k] for k in sorted(topics.topics))
        chars = "".join(sorted(set(text)))
        ids = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32)
        lookup = torch.zeros(max(map(ord, chars)) + 1, dtype=torch.long)
        lookup[torch.tensor([ord(c) for c in chars])] = torch.arange(len(chars))
        ids = lookup[ids.long()]
        cut = int(len(ids) * (1 - val_fraction))
        _CACHE[val_fraction] = CharCorpus(chars, ids[:cut].clone(), ids[cut:].clone())
    return _CACHE[val_fraction]


def get_batch(ids: torch.Tensor, batch: int, seq: int, generator: torch.Generator
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``seq`` tokens and the same windows shifted by one, as
    two contiguous tensors of their own (so a memory ledger sees each once)."""
    check_tensor("ids", ids, ndim=1, floating=False)
    batch, seq = check_int("batch", batch, lo=1), check_int("seq", seq, lo=1)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if ids.ndim != 1 or len(ids) <= seq:
        raise ValueError(f"ids must be 1-D and longer than seq={seq}, got shape "
                         f"{tuple(ids.shape)}")
    start = torch.randint(0, len(ids) - seq, (batch,), generator=generator)
    window = start[:, None] + torch.arange(seq + 1)
    chunk = ids[window]
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
