"""A language with exactly known dependencies, and a tiny masked-diffusion LM for it.

The *paired-phrase* language: a sequence is ``S`` two-token slots. Slot ``s`` has
its own alphabet ``A_s`` of ``m`` tokens, used by both halves; the valid bigrams are
``(x, sigma(x))`` for a fixed permutation ``sigma`` of ``A_s`` with no fixed point.
Each half alone is uniform over ``A_s``, but the pair is determined by either half,
so committing both halves independently from their marginals is valid with
probability only ``1/m``. Slots are independent of each other.

The *shared-alphabet control* (``shared=True``) uses one alphabet for every slot:
the structure is the same, but now every masked position has the same marginal, so
a coupling built from the overlap of marginals cannot tell partners from strangers.

:class:`PairedPhrase` gives samples, exact validity checks and the exact denoiser
(the true conditional of every masked position given the rest). :class:`TinyMDLM`
is a 2-layer bidirectional transformer trained with the MDLM/LLaDA loss by
:func:`train_mdlm`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn
from tqdm.auto import tqdm

__all__ = ["PairedPhrase", "TinyMDLM", "train_mdlm", "conditional_distance"]


@dataclass(frozen=True)
class PairedPhrase:
    """The paired-phrase language: ``slots`` slots of two tokens, ``m`` valid bigrams each."""

    slots: int = 8
    m: int = 4
    shared: bool = False

    def __post_init__(self):
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.m < 2:
            raise ValueError(f"m must be >= 2 (a permutation without fixed points), got {self.m}")

    @property
    def length(self) -> int:
        return 2 * self.slots

    @property
    def vocab(self) -> int:
        """Number of real tokens; the mask id is ``vocab`` (outside the vocabulary)."""
        return self.m if self.shared else self.m * self.slots

    @property
    def mask_id(self) -> int:
        return self.vocab

    def _offset(self) -> torch.Tensor:
        base = torch.zeros(self.slots, dtype=torch.int64) if self.shared else \
            torch.arange(self.slots) * self.m
        return base

    def slot_of(self) -> torch.Tensor:
        """Slot index of every position, shape ``(length,)``."""
        return torch.arange(self.length) // 2

    def sample(self, n: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """``n`` valid sequences, shape ``(n, length)``, uniform over the language."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        left = torch.randint(0, self.m, (n, self.slots), generator=generator)
        right = (left + 1) % self.m  # sigma(x) = x + 1 mod m: no fixed point
        off = self._offset()
        return torch.stack([left + off, right + off], dim=2).reshape(n, self.length)

    def slot_valid(self, tokens: torch.Tensor) -> torch.Tensor:
        """Boolean ``(n, slots)``: is each slot a valid bigram of its own alphabet?"""
        if tokens.ndim != 2 or tokens.shape[1] != self.length:
            raise ValueError(f"tokens must have shape (n, {self.length}), got "
                             f"{tuple(tokens.shape)}")
        pairs = tokens.reshape(-1, self.slots, 2) - self._offset()[None, :, None]
        in_alpha = ((pairs >= 0) & (pairs < self.m)).all(-1)
        return in_alpha & (pairs[..., 1] == (pairs[..., 0] + 1) % self.m)

    def valid(self, tokens: torch.Tensor) -> torch.Tensor:
        """Boolean ``(n,)``: is every slot valid?"""
        return self.slot_valid(tokens).all(-1)

    def denoiser(self, tokens: torch.Tensor) -> torch.Tensor:
        """Exact conditionals ``p(x_i | unmasked tokens)``, shape ``(n, length, vocab)``.

        A masked half whose partner is known is determined; one whose partner is masked
        is uniform over the slot's alphabet. Unmasked positions get a one-hot of their
        own token (decoders ignore them).
        """
        n = tokens.shape[0]
        if tokens.ndim != 2 or tokens.shape[1] != self.length:
            raise ValueError(f"tokens must have shape (n, {self.length}), got "
                             f"{tuple(tokens.shape)}")
        off = self._offset().repeat_interleave(2).to(tokens.device)  # (length,)
        probs = torch.zeros(n, self.length, self.vocab, device=tokens.device)
        masked = tokens == self.mask_id
        partner = tokens.reshape(n, self.slots, 2).flip(-1).reshape(n, self.length)
        partner_known = partner != self.mask_id
        local = (partner - off).clamp(0, self.m - 1)
        is_left = (torch.arange(self.length, device=tokens.device) % 2 == 0)
        # left = sigma^-1(right) = right - 1; right = sigma(left) = left + 1
        implied = torch.where(is_left, (local - 1) % self.m, (local + 1) % self.m) + off
        uniform_cols = off[None, :, None] + torch.arange(self.m, device=tokens.device)
        uni = torch.zeros_like(probs).scatter_(
            2, uniform_cols.expand(n, -1, -1), 1.0 / self.m)
        det = torch.zeros_like(probs).scatter_(2, implied.unsqueeze(-1), 1.0)
        own = torch.zeros_like(probs).scatter_(
            2, tokens.clamp(max=self.vocab - 1).unsqueeze(-1), 1.0)
        probs = torch.where((masked & partner_known)[..., None], det, uni)
        return torch.where(masked[..., None], probs, own)

    def fixed_k_validity(self, k: int) -> float:
        """Exact probability that ``fixed_k`` decoding with the exact denoiser is valid.

        With ties broken uniformly at random, a pass first commits half-open slots'
        second halves (confidence 1, always valid), then spends the rest of its ``k``
        on a uniform choice of positions among the untouched slots; a slot hit twice
        is valid with probability ``1/m``. A recursion over (untouched, half-open)
        slot counts sums this exactly. ``k >= length`` is one-shot: ``m**-slots``.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")

        @cache
        def valid(untouched: int, half: int) -> float:
            if untouched == 0 and half == 0:
                return 1.0
            if k <= half:
                return valid(untouched, half - k)
            j = min(k - half, 2 * untouched)
            total = 0.0
            for both in range(max(0, j - untouched), j // 2 + 1):
                single = j - 2 * both
                ways = math.comb(untouched, both) * math.comb(untouched - both, single) * 2**single
                prob = ways / math.comb(2 * untouched, j)
                total += prob * self.m ** (-both) * valid(untouched - both - single, single)
            return total

        return valid(self.slots, 0)

    def oracle_coupling(self, probs: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """A coupling that knows the structure: 1 between the two halves of a slot, else 0."""
        slot = self.slot_of().to(probs.device)
        same = (slot[:, None] == slot[None, :]).to(probs.dtype)
        same.fill_diagonal_(0)
        return same.expand(probs.shape[0], -1, -1)


class TinyMDLM(nn.Module):
    """A tiny bidirectional transformer: tokens ``(B, L)`` -> logits ``(B, L, vocab)``."""

    def __init__(self, vocab: int, length: int, *, width: int = 64, layers: int = 2,
                 heads: int = 4):
        super().__init__()
        self.vocab, self.length = vocab, length
        self.embed = nn.Embedding(vocab + 1, width)  # + the mask token
        self.pos = nn.Parameter(torch.randn(length, width) * 0.02)
        block = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.encoder(h)))


def train_mdlm(lang: PairedPhrase, *, steps: int = 1500, batch: int = 128, lr: float = 3e-3,
               width: int = 64, seed: int = 0, device="cpu", progress: bool = True) -> TinyMDLM:
    """Train a :class:`TinyMDLM` on freshly sampled sequences with the MDLM loss.

    Each step: sample sequences, draw a mask rate ``t ~ U(0, 1)`` per sequence, mask
    each position with probability ``t``, and minimise the cross-entropy on masked
    positions weighted by ``1/t`` (the continuous-time MDLM / LLaDA bound).
    """
    if steps < 1 or batch < 1:
        raise ValueError(f"steps and batch must be >= 1, got {steps}, {batch}")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = TinyMDLM(lang.vocab, lang.length, width=width).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    bar = tqdm(range(steps), desc="training tiny MDLM", disable=not progress, leave=False)
    for _ in bar:
        x = lang.sample(batch, generator=g)
        t = torch.rand(batch, 1, generator=g).clamp_min(1e-3)
        mask = torch.rand(batch, lang.length, generator=g) < t
        noisy = torch.where(mask, torch.full_like(x, lang.mask_id), x).to(device)
        logits = model(noisy)
        ce = nn.functional.cross_entropy(logits.transpose(1, 2), x.to(device), reduction="none")
        loss = (ce * mask.to(device) / t.to(device)).sum() / (batch * lang.length)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    return model.eval()


@torch.no_grad()
def conditional_distance(model: nn.Module, lang: PairedPhrase, *, n: int = 512,
                         seed: int = 1) -> float:
    """Mean total-variation distance between the model's and the exact conditionals,
    over masked positions of ``n`` sequences masked at rates ``t ~ U(0, 1)``."""
    g = torch.Generator().manual_seed(seed)
    x = lang.sample(n, generator=g)
    mask = torch.rand(n, lang.length, generator=g) < torch.rand(n, 1, generator=g)
    noisy = torch.where(mask, torch.full_like(x, lang.mask_id), x)
    dev = next(model.parameters()).device
    p_model = torch.softmax(model(noisy.to(dev)).float(), -1).cpu()
    p_true = lang.denoiser(noisy)
    tv = 0.5 * (p_model - p_true).abs().sum(-1)
    return tv[mask].mean().item() if mask.any() else math.nan
