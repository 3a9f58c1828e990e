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

:class:`GroupLanguage` generalises the paired phrase into a family
(:func:`language_family`): groups of 2-4 positions, alphabets shared across groups or
not, group members adjacent or spread across the sequence, and different confidence
levels (alphabet size and a peaked marginal). Within a group every member uses the
group's alphabet, so two positions conflict exactly when their marginals overlap:
the family is built for the overlap coupling of :mod:`parlearn.decoding` (and its
shared-alphabet members show where that coupling goes blind).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn
from tqdm.auto import tqdm

from parlearn.core.checks import (
    check_bool,
    check_callable,
    check_choice,
    check_float,
    check_int,
    check_module,
    check_seed,
    check_tensor,
)

__all__ = ["PairedPhrase", "GroupLanguage", "language_family", "TinyMDLM", "train_mdlm",
           "mdlm_corrupt", "mdlm_loss", "conditional_distance"]


def _generator(seed: int | torch.Generator) -> torch.Generator:
    return seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)


def _check_tokens(lang, tokens: torch.Tensor) -> torch.Tensor:
    check_tensor("tokens", tokens, ndim=2, floating=False)
    if tokens.shape[1] != lang.length:
        raise ValueError(f"tokens must have shape (n, {lang.length}), got {tuple(tokens.shape)}")
    if bool(((tokens < 0) | (tokens > lang.mask_id)).any()):
        raise ValueError(f"tokens must lie in [0, {lang.mask_id}] (mask id {lang.mask_id})")
    return tokens


@dataclass(frozen=True)
class PairedPhrase:
    """The paired-phrase language: ``slots`` slots of two tokens, ``m`` valid bigrams each."""

    slots: int = 8
    m: int = 4
    shared: bool = False

    def __post_init__(self):
        check_int("slots", self.slots, lo=1)
        check_int("m", self.m, lo=2)  # m >= 2: a permutation without fixed points
        check_bool("shared", self.shared)

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
        check_int("n", n, lo=1)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        left = torch.randint(0, self.m, (n, self.slots), generator=generator)
        right = (left + 1) % self.m  # sigma(x) = x + 1 mod m: no fixed point
        off = self._offset()
        return torch.stack([left + off, right + off], dim=2).reshape(n, self.length)

    def slot_valid(self, tokens: torch.Tensor) -> torch.Tensor:
        """Boolean ``(n, slots)``: is each slot a valid bigram of its own alphabet?"""
        _check_tokens(self, tokens)
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
        _check_tokens(self, tokens)
        n = tokens.shape[0]
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
        check_int("k", k, lo=1)

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


@dataclass(frozen=True)
class GroupLanguage:
    """Groups of ``size`` positions whose tokens are ``(x, x+1, ..., x+size-1) mod m``.

    ``x`` is drawn per group from ``p(0) = peak`` and ``(1 - peak) / (m - 1)`` for the
    other values (``peak=None``: uniform), so a member alone has confidence
    ``max(peak, 1/m)``, and any one member determines its whole group. Groups are
    independent. ``shared=False`` gives each group its own ``m`` tokens; ``shared=True``
    one alphabet for all. ``layout="near"`` puts a group's members side by side;
    ``"far"`` spreads them ``groups`` positions apart (member ``k`` of group ``g`` sits
    at ``g + k * groups``).
    """

    groups: int = 6
    size: int = 2
    m: int = 4
    shared: bool = False
    layout: str = "near"
    peak: float | None = None

    def __post_init__(self):
        check_int("groups", self.groups, lo=1)
        check_int("size", self.size, lo=2)
        check_int("m", self.m, lo=2)
        check_bool("shared", self.shared)
        check_choice("layout", self.layout, ("near", "far"))
        if self.peak is not None:
            check_float("peak", self.peak, lo=1.0 / self.m, hi=1.0, hi_open=True)

    @property
    def length(self) -> int:
        return self.groups * self.size

    @property
    def vocab(self) -> int:
        """Number of real tokens; the mask id is ``vocab`` (outside the vocabulary)."""
        return self.m if self.shared else self.m * self.groups

    @property
    def mask_id(self) -> int:
        return self.vocab

    @property
    def name(self) -> str:
        conf = "uniform" if self.peak is None else f"peak {self.peak:g}"
        return (f"g={self.size} m={self.m} {'shared' if self.shared else 'own'} "
                f"{self.layout} {conf}")

    def _prior(self) -> torch.Tensor:
        if self.peak is None:
            return torch.full((self.m,), 1.0 / self.m)
        return torch.cat([torch.tensor([self.peak]),
                          torch.full((self.m - 1,), (1 - self.peak) / (self.m - 1))])

    def positions(self) -> torch.Tensor:
        """``(groups, size)``: the sequence position of every member."""
        g = torch.arange(self.groups)[:, None]
        k = torch.arange(self.size)[None, :]
        return g * self.size + k if self.layout == "near" else g + k * self.groups

    def _offset(self) -> torch.Tensor:
        return torch.zeros(self.groups, dtype=torch.int64) if self.shared else \
            torch.arange(self.groups) * self.m

    def _grouped(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(n, groups, size)`` local values (token minus the group's offset)."""
        return tokens[:, self.positions()] - self._offset().to(tokens.device)[None, :, None]

    def sample(self, n: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """``n`` sequences drawn from the language, shape ``(n, length)``."""
        check_int("n", n, lo=1)
        x = torch.multinomial(self._prior(), n * self.groups, replacement=True,
                              generator=generator).reshape(n, self.groups, 1)
        local = (x + torch.arange(self.size)) % self.m + self._offset()[None, :, None]
        out = torch.empty(n, self.length, dtype=torch.int64)
        out[:, self.positions().reshape(-1)] = local.reshape(n, -1)
        return out

    def valid(self, tokens: torch.Tensor) -> torch.Tensor:
        """Boolean ``(n,)``: is every group a valid tuple of its own alphabet?"""
        _check_tokens(self, tokens)
        local = self._grouped(tokens)
        in_alpha = ((local >= 0) & (local < self.m)).all(-1)
        step = (local - local[..., :1] - torch.arange(self.size)) % self.m == 0
        return (in_alpha & step.all(-1)).all(-1)

    def denoiser(self, tokens: torch.Tensor) -> torch.Tensor:
        """Exact conditionals ``p(x_i | unmasked tokens)``, shape ``(n, length, vocab)``.

        A masked member of a group with a known member is determined by the first
        known member (the only consistent value when the known ones agree); one
        whose group is all masked gets the prior shifted to its place. Unmasked
        positions get a one-hot of their own token.
        """
        _check_tokens(self, tokens)
        n, dev = tokens.shape[0], tokens.device
        pos = self.positions().to(dev)
        local = self._grouped(tokens)
        known = tokens[:, pos] != self.mask_id  # (n, groups, size)
        first = known.int().argmax(-1, keepdim=True)  # first known member
        x = (local.gather(-1, first) - first) % self.m  # implied group value
        k = torch.arange(self.size, device=dev)
        det = torch.nn.functional.one_hot((x + k) % self.m, self.m).to(torch.float32)
        # the prior shifted: member k takes value v with probability prior[(v - k) mod m]
        v = torch.arange(self.m, device=dev)
        shifted = self._prior().to(dev)[(v[None, :] - k[:, None]) % self.m]  # (size, m)
        local_p = torch.where(known.any(-1)[..., None, None], det, shifted.expand_as(det))
        probs = torch.zeros(n, self.length, self.vocab, device=dev)
        cols = self._offset().to(dev)[:, None, None] + v  # (groups, 1, m)
        grouped = torch.zeros(n, self.groups, self.size, self.vocab, device=dev)
        grouped.scatter_(-1, cols.expand(n, -1, self.size, -1).contiguous(), local_p)
        probs[:, pos.reshape(-1)] = grouped.reshape(n, self.length, self.vocab)
        masked = tokens == self.mask_id
        own = torch.nn.functional.one_hot(tokens.clamp(max=self.vocab - 1), self.vocab)
        return torch.where(masked[..., None], probs, own.to(probs.dtype))


def language_family() -> list[GroupLanguage]:
    """Twelve languages with known dependencies, for :func:`parlearn.decoding.family_table`.

    Group sizes 2-4; own or shared alphabets; members near or far; confidence from
    1/8 to 0.9 (``m`` and ``peak``). Every one has 12-16 positions.
    """
    return [
        GroupLanguage(groups=8, size=2, m=4),
        GroupLanguage(groups=8, size=2, m=3),
        GroupLanguage(groups=8, size=2, m=2, layout="far"),
        GroupLanguage(groups=8, size=2, m=8, layout="far"),
        GroupLanguage(groups=8, size=2, m=4, peak=0.6),
        GroupLanguage(groups=8, size=2, m=4, peak=0.9, layout="far"),
        GroupLanguage(groups=5, size=3, m=3),
        GroupLanguage(groups=5, size=3, m=4, layout="far", peak=0.7),
        GroupLanguage(groups=4, size=4, m=4),
        GroupLanguage(groups=4, size=4, m=2, layout="far"),
        GroupLanguage(groups=8, size=2, m=4, shared=True),
        GroupLanguage(groups=4, size=3, m=3, shared=True, layout="far"),
    ]


class TinyMDLM(nn.Module):
    """A tiny bidirectional transformer: tokens ``(B, L)`` -> logits ``(B, L, vocab)``.

    Parameters are initialised from ``seed`` (an int or a ``torch.Generator``), never
    from torch's global RNG: matrices Xavier-uniform, the token embedding N(0, 1),
    positions N(0, 0.02^2), norms one, biases zero.
    """

    def __init__(self, vocab: int, length: int, *, width: int = 64, layers: int = 2,
                 heads: int = 4, seed: int | torch.Generator = 0):
        check_int("vocab", vocab, lo=1)
        check_int("length", length, lo=1)
        check_int("width", width, lo=1)
        check_int("layers", layers, lo=1)
        check_int("heads", heads, lo=1)
        check_seed("seed", seed)
        if width % heads:
            raise ValueError(f"width ({width}) must be a multiple of heads ({heads})")
        super().__init__()
        self.vocab, self.length = vocab, length
        with torch.device("meta"):  # built without touching the global RNG
            self.embed = nn.Embedding(vocab + 1, width)  # + the mask token
            self.pos = nn.Parameter(torch.empty(length, width))
            block = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0,
                                               batch_first=True, norm_first=True)
            self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab)
        self.to_empty(device="cpu")
        g = _generator(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name == "embed.weight":
                    p.normal_(0.0, 1.0, generator=g)
                elif name == "pos":
                    p.normal_(0.0, 0.02, generator=g)
                elif p.ndim >= 2:
                    nn.init.xavier_uniform_(p, generator=g)
                elif "norm" in name and name.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.encoder(h)))


def mdlm_corrupt(x: torch.Tensor, mask_id: int, generator: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MDLM forward process: ``(noisy, mask, t)``, one rate ``t ~ U(0, 1)`` per sequence
    (clamped to ``>= 1e-3``), each position masked with probability ``t``."""
    check_tensor("x", x, ndim=2, floating=False)
    check_int("mask_id", mask_id, lo=0)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    t = torch.rand(x.shape[0], 1, generator=generator).clamp_min(1e-3)
    mask = torch.rand(x.shape, generator=generator) < t
    return torch.where(mask, torch.full_like(x, mask_id), x), mask, t


def mdlm_loss(logits: torch.Tensor, x: torch.Tensor, mask: torch.Tensor,
              t: torch.Tensor) -> torch.Tensor:
    """The continuous-time MDLM / LLaDA bound: cross-entropy on masked positions
    weighted by ``1/t``, summed and divided by the number of positions ``B * L``.
    ``logits`` (B, L, V), ``x`` (B, L) tokens in [0, V), ``mask`` (B, L) bool, ``t`` (B, 1)
    rates in (0, 1] (as :func:`mdlm_corrupt` returns them)."""
    check_tensor("logits", logits, ndim=3, floating=True)
    b, length, v = logits.shape
    check_tensor("x", x, shape=(b, length), floating=False)
    if x.numel() and (int(x.min()) < 0 or int(x.max()) >= v):
        raise ValueError(f"x must hold tokens in [0, {v - 1}] (logits' last size), got values "
                         f"from {int(x.min())} to {int(x.max())}")
    check_tensor("mask", mask, shape=(b, length), dtype=torch.bool)
    check_tensor("t", t, shape=(b, 1), floating=True, finite=True)
    if bool((t <= 0).any()) or bool((t > 1).any()):
        raise ValueError("t must hold rates in (0, 1]")
    ce = nn.functional.cross_entropy(logits.transpose(1, 2), x, reduction="none")
    return (ce * mask / t).sum() / x.numel()


def train_mdlm(lang, *, steps: int = 1500, batch: int = 128, lr: float = 3e-3,
               width: int = 64, seed: int | torch.Generator = 0, device="cpu",
               progress: bool | Callable[[float, str], None] = True) -> TinyMDLM:
    """Train a :class:`TinyMDLM` on freshly sampled sequences with the MDLM loss.

    Each step: sample sequences, corrupt them with :func:`mdlm_corrupt`, minimise
    :func:`mdlm_loss` with AdamW on a one-cycle schedule. All randomness comes from
    ``seed`` (never torch's global RNG). ``progress``: a tqdm bar (True), none
    (False), or a callback ``progress(fraction, text)`` called every 50 steps.
    """
    check_int("steps", steps, lo=1)
    check_int("batch", batch, lo=1)
    check_float("lr", lr, lo=0, lo_open=True)
    check_int("width", width, lo=4)
    check_seed("seed", seed)
    if not isinstance(lang, (PairedPhrase, GroupLanguage)):
        raise TypeError(f"lang must be a PairedPhrase or GroupLanguage, got {type(lang).__name__}")
    if not isinstance(progress, bool):
        check_callable("progress", progress)
    g = _generator(seed)
    model = TinyMDLM(lang.vocab, lang.length, width=width, seed=g).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    bar = tqdm(range(steps), desc="training tiny MDLM", disable=progress is not True,
               leave=False)
    for step in bar:
        x = lang.sample(batch, generator=g)
        noisy, mask, t = mdlm_corrupt(x, lang.mask_id, g)
        loss = mdlm_loss(model(noisy.to(device)), x.to(device), mask.to(device), t.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if callable(progress) and (step % 50 == 0 or step == steps - 1):
            progress((step + 1) / steps, f"step {step + 1}/{steps}, loss {loss.item():.3f}")
        elif progress is True:
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    return model.eval()


@torch.no_grad()
def conditional_distance(model: nn.Module, lang, *, n: int = 512, seed: int = 1) -> float:
    """Mean total-variation distance between the model's and the exact conditionals,
    over masked positions of ``n`` sequences masked at rates ``t ~ U(0, 1)``."""
    check_module("model", model)
    if not isinstance(lang, (PairedPhrase, GroupLanguage)):
        raise TypeError(f"lang must be a PairedPhrase or GroupLanguage, got {type(lang).__name__}")
    check_int("n", n, lo=1)
    check_int("seed", seed, lo=0)
    g = torch.Generator().manual_seed(seed)
    x = lang.sample(n, generator=g)
    mask = torch.rand(n, lang.length, generator=g) < torch.rand(n, 1, generator=g)
    noisy = torch.where(mask, torch.full_like(x, lang.mask_id), x)
    dev = next(model.parameters()).device
    p_model = torch.softmax(model(noisy.to(dev)).float(), -1).cpu()
    p_true = lang.denoiser(noisy)
    tv = 0.5 * (p_model - p_true).abs().sum(-1)
    return tv[mask].mean().item() if mask.any() else math.nan
