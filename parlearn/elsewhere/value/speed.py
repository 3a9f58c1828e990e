"""EBU's targets for many episodes: one batched backward sweep vs a loop over episodes.

Both run the same code, :func:`~parlearn.elsewhere.value.backups.ebu_targets`: the loop
calls it once per episode (``B = 1``, no padding: the best a user writing one episode at
a time gets), the batched version once for all ``B`` episodes padded to the longest. The
loop takes ``sum_b T_b`` time steps, the batched sweep ``L = max_b T_b`` steps of ``B``-wide
ops, so while a step's fixed cost (Python, op launch) dominates, the modeled speedup is
``sum_b T_b / L``; it falls below that once the ``B``-wide arithmetic costs more than the
fixed cost. With the batching model of :mod:`parlearn.core.overhead`, a step of ``B``-wide
ops costing ``t(B) = t0 + c B`` (fitted to the batched sweeps' time per step), the loop costs
``sum_b T_b t(1)`` and the sweep ``L t(B)``, so the fitted speedup is
``sum_b T_b t(1) / (L t(B))``: the overhead bound when ``c = 0``.
"""

from __future__ import annotations

import torch

from parlearn.core.checks import check_float, check_int, check_seed
from parlearn.core.overhead import fit_batching
from parlearn.elsewhere.value.backups import ebu_targets

__all__ = ["random_episodes", "ebu_speed", "bench"]


def random_episodes(n: int, length: int, n_actions: int = 2, seed: int = 0) -> list[dict]:
    """``n`` episodes of random lengths in ``[length // 2, length]`` with random target
    values, actions and rewards (float32), as the inputs of :func:`ebu_targets`."""
    n, length = check_int("n", n, lo=1), check_int("length", length, lo=2)
    n_actions = check_int("n_actions", n_actions, lo=1)
    g = torch.Generator().manual_seed(check_int("seed", seed, lo=0))
    lengths = torch.randint(length // 2, length + 1, (n,), generator=g)
    return [{"q_next": torch.randn(int(T), n_actions, generator=g),
             "actions": torch.randint(0, n_actions, (int(T),), generator=g),
             "rewards": torch.randn(int(T), generator=g),
             "terminal": bool(torch.rand(1, generator=g) < 0.5)} for T in lengths]


def _padded(eps: list[dict]) -> tuple:
    L, A = max(len(e["rewards"]) for e in eps), eps[0]["q_next"].shape[1]
    q = torch.zeros(len(eps), L, A)
    a = torch.zeros(len(eps), L, dtype=torch.long)
    r = torch.zeros(len(eps), L)
    for b, e in enumerate(eps):
        T = len(e["rewards"])
        q[b, :T], a[b, :T], r[b, :T] = e["q_next"], e["actions"], e["rewards"]
    return (q, a, r, torch.tensor([e["terminal"] for e in eps]),
            torch.tensor([len(e["rewards"]) for e in eps]))


def _calls(eps: list[dict], beta: float, gamma: float) -> dict:
    one = [(e["q_next"][None], e["actions"][None], e["rewards"][None],
            torch.tensor([e["terminal"]]), torch.tensor([len(e["rewards"])])) for e in eps]
    allb = _padded(eps)
    return {"loop over episodes": lambda: [ebu_targets(*x, beta, gamma) for x in one],
            "batched": lambda: ebu_targets(*allb, beta, gamma)}


def ebu_speed(episodes, length: int = 100, *, repeat: int = 5, seed: int = 0,
              beta: float = 0.5, gamma: float = 0.99, threads: int | None = 1) -> dict:
    """Measured: EBU targets for ``B`` episodes (each ``B`` in ``episodes``), loop vs batched,
    interleaved on the CPU with ``threads`` torch threads (restored after; ``None``: the
    caller's count). Returns :func:`parlearn.core.timing.sweep`'s dict plus, per B,
    ``"steps"`` (``L = max T_b``), ``"loop_steps"`` (``sum T_b``) and ``"modeled"``
    (``sum T_b / L``, the overhead bound); with two distinct B or more also ``"step_fit"``
    (:func:`~parlearn.core.overhead.fit_batching` of the batched seconds per step against B)
    and ``"fitted"`` (``sum T_b t(1) / (L t(B))`` per B), else both None.
    """
    from parlearn.core.timing import sweep

    if not isinstance(episodes, list | tuple) or not episodes:
        raise TypeError(f"episodes must be a non-empty list of sizes >= 1, got {episodes!r}")
    sizes = [check_int("episodes[i]", b, lo=1) for b in episodes]
    check_int("length", length, lo=2)
    check_int("repeat", repeat, lo=1)
    check_seed("seed", seed)
    check_float("beta", beta, lo=0, hi=1)
    check_float("gamma", gamma, lo=0, hi=1)
    if threads is not None:
        check_int("threads", threads, lo=1)
    data = {b: random_episodes(b, length, seed=seed) for b in sizes}
    out = sweep(sizes, lambda b: _calls(data[b], beta, gamma), repeat=repeat, threads=threads)
    out["steps"] = [max(len(e["rewards"]) for e in data[b]) for b in sizes]
    out["loop_steps"] = [sum(len(e["rewards"]) for e in data[b]) for b in sizes]
    out["modeled"] = [s / L for s, L in zip(out["loop_steps"], out["steps"], strict=True)]
    out["step_fit"] = out["fitted"] = None
    if len(set(sizes)) >= 2:
        fit = fit_batching(sizes, [t / L for t, L in zip(out["median_s"]["batched"],
                                                          out["steps"], strict=True)])
        out["step_fit"] = fit
        out["fitted"] = [float(s * fit.predict(1) / (L * fit.predict(b))) for s, L, b in
                         zip(out["loop_steps"], out["steps"], sizes, strict=True)]
    return out


def bench(device: torch.device, quick: bool) -> list:
    """EBU targets for B episodes of cart-pole-like lengths: batched vs a loop (CPU)."""
    from parlearn.core.bench import Row
    from parlearn.core.timing import UNRELIABLE

    B, length = (32, 100) if quick else (128, 200)
    r = ebu_speed([B], length, repeat=3 if quick else 9)
    lo, hi = r["speedup_lo"]["batched"][0], r["speedup_hi"]["batched"][0]
    return [Row("value", f"EBU targets, loop over {B} episodes (lengths {length // 2}-{length})",
                f"one batched sweep over {B} padded episodes", r["speedup"]["batched"][0],
                f"cpu, {r['threads']} threads",
                detail=(f"IQR {lo:.1f}-{hi:.1f}x; modeled sum(T)/max(T) = "
                        f"{r['modeled'][0]:.1f}x (per-step overhead bound); "
                        f"{r['median_s']['batched'][0] * 1e3:.1f} ms vs "
                        f"{r['median_s']['loop over episodes'][0] * 1e3:.1f} ms"
                        + ("" if r["reliable"] else f"; WARNING: {UNRELIABLE}")))]
