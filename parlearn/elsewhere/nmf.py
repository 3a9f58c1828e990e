"""Multiplicative-update NMF in torch, and paired dictionaries for spectral conversion.

Lee and Seung's multiplicative updates for ``min ||V - W H||_F^2`` over ``W, H >= 0`` change
every entry of ``H`` (then of ``W``) at once, from three matrix products: the whole update is
data parallel, where coordinate descent (scikit-learn's default solver) walks the components
one by one. :func:`mu_step_loop` is the serial reference: one entry at a time, reading only the
old matrices, which is what makes the parallel update equal to it.

Exemplar-based conversion (the seed: C.-C. Hsu et al., "Dictionary Update for NMF-based Voice
Conversion Using an Encoder-Decoder Network", ISCSLP 2016, arXiv 1610.03988; abstract and
conclusion read): a source and a target dictionary hold *paired* exemplars (the same frame
spoken by both); a source frame is written as ``W_src h`` with ``h >= 0`` and converted as
``W_tgt h``. The seed's dictionary update, an encoder-decoder reformulation of NMF, lets a
small dictionary do a large exemplar set's work. :func:`update_dictionary` is *not* that
method: it is the conventional joint update the paper says it avoids, joint NMF on the
stacked pairs ``[V_src; V_tgt] ~ [W_src; W_tgt] H`` (shared activations keep the two
dictionaries paired), started from the exemplars. The loss, the corpus (generated spectra,
not speech) and the update rule are our choices.
"""

from __future__ import annotations

import math

import torch

from parlearn.core.checks import check_bool, check_float, check_int, check_seed, check_tensor

__all__ = ["objective", "mu_step", "mu_step_loop", "nmf", "random_init", "make_corpus",
           "activations", "convert", "conversion_error", "exemplar_dictionary",
           "update_dictionary"]


def _gen(seed: int | torch.Generator) -> torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    return torch.Generator().manual_seed(check_seed("seed", seed))


def _nonneg(name: str, x: torch.Tensor, ndim: int = 2) -> torch.Tensor:
    check_tensor(name, x, ndim=ndim, floating=True, finite=True)
    if bool((x < 0).any()):
        raise ValueError(f"{name} must be nonnegative")
    return x


# scikit-learn's guard for a zero denominator (an all-zero row or column of V drives a row of
# W or a column of H to zero, and then its denominator is 0 too): 0 / EPSILON = 0 keeps that
# entry at zero where 0 / 0 would be NaN. A denominator that is not zero is left as it is, so
# the iterates stay scikit-learn's.
EPSILON = float(torch.finfo(torch.float32).eps)


def _safe(den: torch.Tensor) -> torch.Tensor:
    return torch.where(den == 0, torch.full_like(den, EPSILON), den)


def _check_vwh(v, w, h) -> None:
    _nonneg("v", v)
    _nonneg("w", w)
    _nonneg("h", h)
    if w.shape[0] != v.shape[0] or h.shape[1] != v.shape[1] or w.shape[1] != h.shape[0]:
        raise ValueError(f"w {tuple(w.shape)} and h {tuple(h.shape)} do not fit "
                         f"v {tuple(v.shape)} (need w (F, k), h (k, N) for v (F, N))")
    if not v.dtype == w.dtype == h.dtype:
        raise TypeError(f"v, w and h must share one dtype, got {v.dtype}, {w.dtype}, {h.dtype}")


def objective(v: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> float:
    """``0.5 ||V - W H||_F^2`` (scikit-learn's ``NMF`` reports this for Frobenius loss)."""
    _check_vwh(v, w, h)
    return 0.5 * float(((v - w @ h) ** 2).sum())


def mu_step(v: torch.Tensor, w: torch.Tensor, h: torch.Tensor, *, update_w: bool = True,
            update_h: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One multiplicative update, every entry at once: ``W <- W * (V H^T) / (W H H^T)``, then
    ``H <- H * (W^T V) / (W^T W H)`` with the new W (scikit-learn's order). A zero
    denominator is replaced by scikit-learn's ``EPSILON`` (float32's machine epsilon): its
    numerator is then zero too, and the entry stays 0 instead of becoming NaN."""
    _check_vwh(v, w, h)
    check_bool("update_w", update_w)
    check_bool("update_h", update_h)
    if update_w:
        w = w * (v @ h.T) / _safe(w @ (h @ h.T))
    if update_h:
        h = h * (w.T @ v) / _safe((w.T @ w) @ h)
    return w, h


def mu_step_loop(v: torch.Tensor, w: torch.Tensor, h: torch.Tensor, *, update_w: bool = True,
                 update_h: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mu_step` one entry at a time with Python loops (the serial reference)."""
    _check_vwh(v, w, h)
    check_bool("update_w", update_w)
    check_bool("update_h", update_h)
    f, n = v.shape
    k = w.shape[1]
    if update_w:
        wh = w @ h
        new = w.clone()
        for i in range(f):
            for a in range(k):
                num = sum(float(v[i, j] * h[a, j]) for j in range(n))
                den = sum(float(wh[i, j] * h[a, j]) for j in range(n))
                new[i, a] = w[i, a] * num / (den if den != 0 else EPSILON)
        w = new
    if update_h:
        wh = w @ h
        new = h.clone()
        for a in range(k):
            for j in range(n):
                num = sum(float(w[i, a] * v[i, j]) for i in range(f))
                den = sum(float(w[i, a] * wh[i, j]) for i in range(f))
                new[a, j] = h[a, j] * num / (den if den != 0 else EPSILON)
        h = new
    return w, h


def random_init(v: torch.Tensor, k: int, seed: int | torch.Generator = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Positive random ``W (F, k), H (k, N)`` scaled like scikit-learn's ``init='random'``
    (entries ``|N(0,1)| * sqrt(mean(V) / k)``), in V's dtype."""
    _nonneg("v", v)
    k = check_int("k", k, lo=1)
    g = _gen(seed)
    scale = math.sqrt(float(v.mean()) / k)
    w = (torch.randn(v.shape[0], k, generator=g, dtype=v.dtype).abs() + 1e-3) * scale
    h = (torch.randn(k, v.shape[1], generator=g, dtype=v.dtype).abs() + 1e-3) * scale
    return w, h


def nmf(v: torch.Tensor, k: int | None = None, *, steps: int = 200,
        init: tuple[torch.Tensor, torch.Tensor] | None = None, update_w: bool = True,
        seed: int = 0) -> dict:
    """``steps`` multiplicative updates from ``init`` (default :func:`random_init` with ``k``).

    ``update_w=False`` keeps W fixed (activations for a given dictionary). Returns
    ``{"w", "h", "objective": [value before the first step, after each step]}``.
    """
    _nonneg("v", v)
    steps = check_int("steps", steps, lo=0)
    check_bool("update_w", update_w)
    check_seed("seed", seed)
    if k is not None:
        k = check_int("k", k, lo=1)
    if init is not None and (not isinstance(init, tuple | list) or len(init) != 2):
        raise TypeError(f"init must be a pair (W, H), got {type(init).__name__}")
    if init is not None and k is not None and k != init[0].shape[-1]:
        raise ValueError(f"k={k} disagrees with init's {init[0].shape[-1]} components; "
                         "give one of them")
    if init is None:
        if k is None:
            raise ValueError("give k (the number of components) or init=(W, H)")
        w, h = random_init(v, k, seed)
    else:
        w, h = (_nonneg("init[0]", init[0]), _nonneg("init[1]", init[1]))
        if w.shape[0] != v.shape[0] or h.shape[1] != v.shape[1] or w.shape[1] != h.shape[0]:
            raise ValueError(f"init shapes {tuple(w.shape)}, {tuple(h.shape)} do not fit "
                             f"v {tuple(v.shape)}")
    hist = [objective(v, w, h)]
    for _ in range(steps):
        w, h = mu_step(v, w, h, update_w=update_w)
        hist.append(objective(v, w, h))
    return {"w": w, "h": h, "objective": hist}


# -- paired dictionaries for spectral conversion ---------------------------------------------
def _check_pair(name: str, pair, rows: int | None = None) -> None:
    """A corpus or dictionary: ``{"src", "tgt"}``, nonnegative (F, n) tensors, same shape."""
    if not isinstance(pair, dict) or not {"src", "tgt"} <= set(pair):
        raise TypeError(f"{name} must be a dict with 'src' and 'tgt', got {type(pair).__name__}")
    _nonneg(f"{name}['src']", pair["src"])
    _nonneg(f"{name}['tgt']", pair["tgt"])
    if pair["src"].shape[1] != pair["tgt"].shape[1]:
        raise ValueError(f"{name}['src'] and {name}['tgt'] must pair the same number of "
                         f"frames, got {pair['src'].shape[1]} and {pair['tgt'].shape[1]}")
    if rows is not None and pair["src"].shape[0] != rows:
        raise ValueError(f"{name}['src'] must have {rows} rows, got {pair['src'].shape[0]}")


def _bumps(freqs: torch.Tensor, centres: torch.Tensor, width: float) -> torch.Tensor:
    return torch.exp(-0.5 * ((freqs[:, None] - centres[None, :]) / width) ** 2)


def make_corpus(frames: int, *, bins: int = 64, units: int = 12, active: int = 3,
                warp: float = 1.15, noise: float = 0.01, seed: int = 0) -> dict:
    """A generated parallel corpus: ``units`` spectral templates (three formant-like bumps
    each) for the source speaker and the same templates with every frequency scaled by
    ``warp`` for the target. Each frame mixes ``active`` random templates with random positive
    gains, identically for both speakers, plus ``noise`` (absolute value, so spectra stay
    nonnegative). Returns ``{"src", "tgt"}``: (bins, frames) float64 each."""
    frames = check_int("frames", frames, lo=1)
    bins = check_int("bins", bins, lo=1)
    units = check_int("units", units, lo=1)
    active = check_int("active", active, lo=1, hi=units)
    warp = check_float("warp", warp, lo=0, lo_open=True)
    noise = check_float("noise", noise, lo=0)
    g = _gen(seed)
    f = torch.linspace(0, 1, bins, dtype=torch.float64)
    centres = torch.rand(units, 3, generator=g, dtype=torch.float64) * 0.8 + 0.05
    amps = torch.rand(units, 3, generator=g, dtype=torch.float64) + 0.2
    src = sum(_bumps(f, centres[:, i], 0.03) * amps[:, i] for i in range(3))
    tgt = sum(_bumps(f, centres[:, i] * warp, 0.03 * warp) * amps[:, i] for i in range(3))
    gains = torch.zeros(units, frames, dtype=torch.float64)
    pick = torch.rand(units, frames, generator=g).argsort(0)[:active]
    gains.scatter_(0, pick, torch.rand(active, frames, generator=g, dtype=torch.float64) + 0.3)

    def noisy(x: torch.Tensor) -> torch.Tensor:
        return x + noise * torch.randn(x.shape, generator=g, dtype=x.dtype).abs()

    return {"src": noisy(src @ gains), "tgt": noisy(tgt @ gains)}


def exemplar_dictionary(corpus: dict, size: int, seed: int = 0) -> dict:
    """``size`` paired exemplars: the same randomly chosen frames from source and target."""
    _check_pair("corpus", corpus)
    size = check_int("size", size, lo=1, hi=corpus["src"].shape[1])
    pick = torch.randperm(corpus["src"].shape[1], generator=_gen(seed))[:size]
    return {"src": corpus["src"][:, pick].clone(), "tgt": corpus["tgt"][:, pick].clone()}


def update_dictionary(corpus: dict, dictionary: dict, *, steps: int = 200,
                      seed: int = 0) -> dict:
    """Joint NMF on ``[src; tgt]`` from the paired exemplars: both halves of every atom and
    the shared activations updated together, so the dictionaries stay paired (the joint
    update that Hsu et al. 2016 replace by an encoder-decoder update; see the module)."""
    _check_pair("corpus", corpus)
    _check_pair("dictionary", dictionary, rows=corpus["src"].shape[0])
    steps = check_int("steps", steps, lo=0)
    v = torch.cat([corpus["src"], corpus["tgt"]])
    w = torch.cat([dictionary["src"], dictionary["tgt"]])
    h0 = activations(corpus["src"], dictionary["src"], steps=50, seed=seed)
    out = nmf(v, init=(w, h0), steps=steps)
    f = corpus["src"].shape[0]
    return {"src": out["w"][:f], "tgt": out["w"][f:], "objective": out["objective"]}


def activations(v: torch.Tensor, w: torch.Tensor, *, steps: int = 200,
                seed: int = 0) -> torch.Tensor:
    """Nonnegative ``H`` with ``V ~ W H`` for the fixed dictionary ``W`` (multiplicative
    updates of H only, from a positive random start)."""
    _nonneg("v", v)
    _nonneg("w", w)
    if w.shape[0] != v.shape[0] or w.dtype != v.dtype:
        raise ValueError(f"w must be (F={v.shape[0]}, k) of v's dtype {v.dtype}, got "
                         f"{tuple(w.shape)} {w.dtype}")
    check_int("steps", steps, lo=0)
    _, h = random_init(v, w.shape[1], seed)
    return nmf(v, init=(w, h), steps=steps, update_w=False)["h"]


def convert(src: torch.Tensor, dictionary: dict, *, steps: int = 200) -> torch.Tensor:
    """Source frames to target frames: activations on the source dictionary, applied to the
    target dictionary."""
    _nonneg("src", src)
    _check_pair("dictionary", dictionary, rows=src.shape[0])
    check_int("steps", steps, lo=0)
    return dictionary["tgt"] @ activations(src, dictionary["src"], steps=steps)


def conversion_error(test: dict, dictionary: dict, *, steps: int = 200) -> float:
    """``||converted - true target||_F / ||true target||_F`` on a held-out parallel set."""
    _check_pair("test", test)
    out = convert(test["src"], dictionary, steps=steps)
    return float((out - test["tgt"]).norm() / test["tgt"].norm())
