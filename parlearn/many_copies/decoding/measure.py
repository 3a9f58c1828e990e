"""How parallel decoders compare: sweeps of their settings, the language-family table, bench.

Every figure is measured in the call that returns it: passes per sequence, validity of the
decoded sequences, and the denoiser's and the strategy's own time.
"""

from __future__ import annotations

from functools import partial

import torch

from parlearn.core.bench import Row
from parlearn.core.checks import check_callable, check_choice, check_float, check_int
from parlearn.core.timing import UNRELIABLE
from parlearn.many_copies.decoding.loop import STRATEGIES, DecodeResult, _check_params, decode
from parlearn.many_copies.decoding.mean_field import overlap_coupling

__all__ = ["GRIDS", "FAMILY_TAUS", "sweep", "best_setting", "family_table",
           "format_family_table", "bench"]


# --- bench -------------------------------------------------------------------------


def _check_language(name: str, lang) -> None:
    """A language of parlearn.diffusion (or one like it): ``length``, ``mask_id``, ``valid``."""
    if not all(hasattr(lang, a) for a in ("length", "mask_id", "valid", "denoiser")):
        raise TypeError(f"{name} must be a language such as diffusion.PairedPhrase (with "
                        f"length, mask_id, valid and denoiser), got {type(lang).__name__}")


def sweep(denoiser, lang, strategy: str, grid: list[dict], *, batch: int = 256,
          seed: int = 0, device=None) -> list[tuple[dict, DecodeResult, float]]:
    """Decode ``batch`` sequences with every setting in ``grid``: ``(params, result, validity)``.

    ``device`` goes to :func:`decode` (where the tokens live; default: the denoiser's)."""
    check_callable("denoiser", denoiser)
    _check_language("lang", lang)
    if not isinstance(grid, list | tuple) or not grid or not all(isinstance(p, dict)
                                                                 for p in grid):
        raise TypeError(f"grid must be a non-empty list of parameter dicts, got {grid!r:.80}")
    check_int("batch", batch, lo=1)
    check_int("seed", seed, lo=0)
    check_choice("strategy", strategy, tuple(STRATEGIES))
    for params in grid:
        try:
            _check_params(strategy, params)
        except (TypeError, ValueError) as e:
            raise type(e)(f"grid entry {params!r}: {e}") from None
    out = []
    for params in grid:
        res = decode(denoiser, length=lang.length, batch=batch, mask_id=lang.mask_id,
                     strategy=strategy, generator=torch.Generator().manual_seed(seed),
                     device=device, **params)
        out.append((params, res, lang.valid(res.tokens.cpu()).double().mean().item()))
    return out


def best_setting(rows: list[tuple[dict, DecodeResult, float]],
                 target: float = 0.99) -> tuple[dict, DecodeResult, float]:
    """Among :func:`sweep` rows, the fewest passes reaching ``target`` validity (or,
    if none does, the most valid)."""
    if not isinstance(rows, list | tuple) or not rows:
        raise ValueError("rows must be a list holding at least one sweep row")
    for r in rows:
        if not (isinstance(r, tuple | list) and len(r) == 3 and isinstance(r[0], dict)
                and isinstance(r[1], DecodeResult)):
            raise TypeError(f"rows must hold sweep's (setting, DecodeResult, validity) rows, "
                            f"got {r!r:.80}")
        check_float("rows' validity", r[2], lo=0, hi=1)
    check_float("target", target, lo=0, hi=1)
    return min(rows, key=lambda r: (r[2] < target, r[1].mean_passes if r[2] >= target else -r[2]))


# Settings swept for the frontier plot and the bench (lam = 0.5 is avoided: with
# beta = 8 it is the critical coupling, where the fixed point converges slowly).
GRIDS = {
    "sequential": [{}],
    "fixed_k": [{"k": k} for k in (1, 2, 4, 8, 16)],
    "random": [{"steps": s} for s in (2, 4, 8, 16, 32, 64)],
    "threshold": [{"tau": t} for t in (0.1, 0.2, 0.3, 0.5, 0.9)],
    "factor": [{"f": f} for f in (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)],
    "entropy_bound": [{"gamma": g} for g in (0.1, 0.5, 1.0, 2.0, 4.0, 8.0)],
    "mean_field": [{"tau": 0.2, "lam": lam} for lam in (0.05, 0.2, 1.0, 2.0, 4.0)]
    + [{}],  # {} = the defaults (tau="auto")
}

# The threshold settings the language-family table searches for the best one.
FAMILY_TAUS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)


def family_table(languages=None, *, batch: int = 128, seed: int = 0, target: float = 0.95,
                 taus: tuple[float, ...] = FAMILY_TAUS) -> list[dict]:
    """Mean field at its defaults against sequential and the best threshold setting.

    For each language (default: :func:`parlearn.diffusion.language_family`), with its
    exact denoiser, ``batch`` sequences per setting: ``sequential`` passes (one per
    generated position, so the length), the threshold ``tau`` in ``taus`` with the
    fewest passes reaching ``target`` validity (None if none does), and mean field's
    passes, validity, own time and the denoiser's time. ``half`` says whether mean
    field reached ``target`` in at most half the sequential passes; ``vs_threshold``
    whether it reached ``target`` in at most one pass more than the best threshold.
    All figures are measured in this call.
    """
    from parlearn.many_copies.diffusion import language_family

    if languages is not None:
        if not isinstance(languages, list | tuple) or not languages:
            raise TypeError(f"languages must be a non-empty list of languages, got "
                            f"{type(languages).__name__}")
        for lang in languages:
            _check_language("languages", lang)
    languages = language_family() if languages is None else list(languages)
    check_int("batch", batch, lo=1)
    check_int("seed", seed, lo=0)
    check_float("target", target, lo=0, hi=1)
    if not isinstance(taus, list | tuple) or not taus:
        raise TypeError(f"taus must be a non-empty tuple of thresholds in (0, 1), got {taus!r}")
    for t in taus:
        check_float("taus[...]", t, lo=0, hi=1, lo_open=True, hi_open=True)
    rows = []
    for lang in languages:
        thr = sweep(lang.denoiser, lang, "threshold", [{"tau": t} for t in taus], batch=batch,
                    seed=seed)
        ok = [(r.mean_passes, p["tau"], v) for p, r, v in thr if v >= target]
        best = min(ok) if ok else None
        (_, mf, v), = sweep(lang.denoiser, lang, "mean_field", [{}], batch=batch, seed=seed)
        reached = v >= target
        rows.append({
            "language": lang.name, "length": lang.length, "sequential": float(lang.length),
            "threshold_tau": None if best is None else best[1],
            "threshold_passes": None if best is None else best[0],
            "threshold_validity": None if best is None else best[2],
            "mean_field_passes": mf.mean_passes, "mean_field_validity": v,
            "mean_field_seconds": mf.strategy_seconds, "denoiser_seconds": mf.denoiser_seconds,
            "half": reached and mf.mean_passes <= lang.length / 2,
            "vs_threshold": reached and (best is None or mf.mean_passes <= best[0] + 1),
        })
    return rows


def format_family_table(rows: list[dict]) -> str:
    """:func:`family_table` rows as text."""
    keys = ("language", "length", "threshold_tau", "threshold_passes", "mean_field_passes",
            "mean_field_validity", "half", "vs_threshold")
    if not isinstance(rows, list | tuple) or not all(
            isinstance(r, dict) and all(k in r for k in keys) for r in rows):
        raise TypeError(f"rows must be a list of family_table rows (dicts with {list(keys)})")
    head = (f"{'language':32s} {'L':>3s} {'threshold best':>16s} {'mean field':>17s} "
            f"{'<= L/2':>6s} {'<= thr+1':>8s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        thr = ("none >= target" if r["threshold_tau"] is None else
               f"tau {r['threshold_tau']:.2f}: {r['threshold_passes']:5.2f}")
        lines.append(f"{r['language']:32s} {r['length']:3d} {thr:>16s} "
                     f"{r['mean_field_passes']:5.2f} p, v {r['mean_field_validity']:.3f} "
                     f"{'yes' if r['half'] else 'NO':>6s} "
                     f"{'yes' if r['vs_threshold'] else 'NO':>8s}")
    return "\n".join(lines)


def bench(device: torch.device, quick: bool) -> list[Row]:
    """The decoding rows (:func:`_bench_on`). On the CPU mean field's sweeps are a JAX
    program, and JAX must not start in the process that forks gloo ranks for other
    entries: there they are measured in a fresh Python process."""
    from parlearn.core.bench import rows_in_fresh_process

    if torch.device(device).type == "cpu":
        return rows_in_fresh_process(__name__, quick)
    return _bench_on(torch.device(device), quick)


def _bench_rows(quick: bool) -> list[Row]:
    """:func:`_bench_on` the CPU (what :func:`bench` runs in a fresh process)."""
    return _bench_on(torch.device("cpu"), quick)


def _bench_on(device: torch.device, quick: bool) -> list[Row]:
    from parlearn.many_copies.diffusion import PairedPhrase, train_mdlm

    lang = PairedPhrase(slots=8, m=4)
    batch = 64 if quick else 256
    denoisers = {"exact": partial(_on_device, lang.denoiser, device)}
    if not quick:
        denoisers["tiny MDLM"] = train_mdlm(lang, device=device, progress=False)
    rows = []
    for dname, den in denoisers.items():
        # Untimed: mean-field's CPU kernel compiles once per padded shape (about 0.2 s
        # each), a one-off that the first setting to meet a shape would otherwise carry.
        sweep(den, lang, "mean_field", GRIDS["mean_field"], batch=batch, device=device)
        found = {s: best_setting(sweep(den, lang, s, GRIDS[s], batch=batch, device=device))
                 for s in STRATEGIES}
        base = found["threshold"][1].mean_passes
        for s, (params, res, v) in found.items():
            ratio = base / res.mean_passes
            met = (ratio >= 3 and v >= 0.99) if s == "mean_field" else None
            rows.append(Row(
                f"decoding {dname}", "threshold, best setting", s, ratio, str(device),
                ">= 3x fewer passes" if s == "mean_field" else "", met,
                ("" if v >= 0.99 else "BELOW 99% VALIDITY at every setting tried; best: ")
                + f"{params or 'default'}: validity {v:.3f}, {res.mean_passes:.2f} passes/seq, "
                f"{res.tokens_per_pass:.2f} tokens/pass; wall {res.seconds * 1e3:.0f} ms for "
                f"batch {batch}: denoiser {res.denoiser_seconds * 1e3:.0f} ms, strategy (the "
                f"decoder's own cost) {res.strategy_seconds * 1e3:.0f} ms (ratio = passes, "
                "not time)"))
    for dname, den in denoisers.items():
        rows.append(_own_time_row(dname, den, lang, batch, device, quick))
    # The family's exact denoisers run on the CPU whatever ``device`` is: the row says so.
    languages = None if not quick else _quick_family()
    family_table(languages, batch=batch // 2)  # untimed, as above: compiles the kernel
    fam = family_table(languages, batch=batch // 2)
    rows.append(Row(
        "decoding family (exact)", "sequential", "mean_field defaults",
        sum(r["half"] for r in fam) / len(fam), "cpu", "most languages <= L/2 passes",
        sum(r["half"] for r in fam) > len(fam) / 2 and all(r["vs_threshold"] for r in fam),
        f"ratio = share of {len(fam)} languages reaching 95% validity in <= L/2 passes; "
        f"{sum(r['vs_threshold'] for r in fam)}/{len(fam)} within one pass of the best "
        f"threshold; mean-field time {sum(r['mean_field_seconds'] for r in fam):.2f} s vs "
        f"denoiser {sum(r['denoiser_seconds'] for r in fam):.2f} s"))
    return rows


def _quick_family():
    from parlearn.many_copies.diffusion import language_family

    fam = language_family()
    return [fam[0], fam[6], fam[-1]]


def _on_device(fn, device, tokens):
    return fn(tokens.cpu()).to(device)


def _previous_commit(conf, J, masked, *, tau, beta, eta, tol=1e-7, max_iter=200):
    """:func:`mean_field_commit` as it was first written (ten small kernels per rank
    and step), kept only as the "before" of the bench's own-time row."""
    import math

    from parlearn.many_copies.decoding.mean_field import _update_order

    order, h, Jp, n = _update_order(conf, J, masked, tau)
    q = torch.sigmoid(beta * h)
    residual, sweeps = (math.inf if n else 0.0), 0
    while residual > tol and sweeps < max_iter:
        before = q.clone()
        for r in range(n):
            field_r = h[:, r] - (Jp[:, r, :] * q).sum(-1)
            q[:, r] = (1 - eta) * q[:, r] + eta * torch.sigmoid(beta * field_r)
        residual = (q - before).abs().max().item()
        sweeps += 1
    q_full = torch.zeros_like(conf, dtype=q.dtype).scatter_(-1, order, q)
    return (q_full > 0.5) & masked, q_full, sweeps, residual


def _own_time_row(dname: str, den, lang, batch: int, device, quick: bool) -> Row:
    """The decoder's own work on the first (all-masked, heaviest) pass against one
    denoiser pass and against the decoder as first written, measured interleaved."""
    from parlearn.core.timing import compare
    from parlearn.many_copies.decoding.loop import _probabilities
    from parlearn.many_copies.decoding.mean_field import (
        _overlap_coupling_gather,
        auto_tau,
        coupling_matrix,
        mean_field_commit,
    )
    from parlearn.many_copies.decoding.strategies import confidence

    tokens = torch.full((batch, lang.length), lang.mask_id, dtype=torch.int64,
                        device=device)
    masked = tokens == lang.mask_id

    def denoise():
        with torch.no_grad():
            return _probabilities(den(tokens), tokens, lang.mask_id)

    probs = denoise()

    def decoder(coupling, commit):
        def run():
            conf = confidence(probs, masked)
            J = coupling_matrix(probs, masked, lam=8.0, coupling=coupling)
            return commit(conf, J, masked, tau=auto_tau(conf, masked), beta=8.0, eta=0.5)
        return run

    cmp = compare({"denoiser": denoise,
                   "before": decoder(_overlap_coupling_gather, _previous_commit),
                   "after": decoder(overlap_coupling, mean_field_commit)},
                  baseline="before", repeat=3 if quick else 9, device=device)
    t = cmp.timings
    lo, hi = cmp.speedup_range("after")
    # The target is set against a network's pass (what a real MDLM pays per step). The
    # exact denoiser is a table lookup (a few ms at batch 256): its row has no target.
    network = dname != "exact"
    return Row(f"decoding {dname}", "mean-field decoder, first version (one pass)",
               "mean-field decoder now (one pass)", cmp.speedup("after"), str(device),
               "decoder's own time <= one denoiser pass" if network else "",
               # no verdict from timings too noisy to read
               (t["after"].median <= t["denoiser"].median if cmp.reliable else None)
               if network else None,
               f"first pass, batch {batch}, L={lang.length}, defaults; {cmp.threads} "
               f"thread(s), {t['after'].repeats} interleaved repeats, ratio IQR "
               f"{lo:.2f}-{hi:.2f}: decoder {t['after'].median * 1e3:.1f} ms (spread "
               f"{t['after'].spread:.0%}), before {t['before'].median * 1e3:.1f} ms, one "
               f"denoiser pass {t['denoiser'].median * 1e3:.1f} ms (spread "
               f"{t['denoiser'].spread:.0%})"
               + ("" if cmp.reliable else f"; WARNING: {UNRELIABLE}"))
