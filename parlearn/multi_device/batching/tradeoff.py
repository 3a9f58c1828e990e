"""What adapting buys: the steps-examples trade-off, modeled, and the measured frontier.

**What adapting buys** (modeled, :func:`tradeoff_model`). If the noise scale changes over a
run and each piece of the run costs McCandlish's ``1 + b / B`` steps, holding ``B = k b``
(SimiGrad at its fixed point) lands exactly on the fixed-batch trade-off curve, at the fixed
batch ``k mean(b)``; the schedule that beats every fixed batch is ``B ~ sqrt(b)``. The
controller's value is finding a sensible batch without a sweep, not beating the best fixed
one; measured on digits, :func:`bench` puts it beside the measured fixed-batch frontier.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from parlearn.core.checks import (
    check_bool,
    check_callable,
    check_device,
    check_float,
    check_int,
    check_module,
)
from parlearn.multi_device.batching.noise_scale import critical_batch_fit
from parlearn.multi_device.batching.tasks import DigitsTask
from parlearn.multi_device.batching.training import samples_to_target, train, worker_train

__all__ = ["batch_sweep", "tradeoff_model", "frontier_samples", "bench"]


# ---------------------------------------------------------------------------------------
# The fixed-batch frontier, measured and modeled; the bench.

def batch_sweep(model: nn.Module, task, batches: Sequence[int], lrs: Sequence[float],
                target_loss: float, *, steps: int = 2000, progress=None) -> dict:
    """Steps and examples to ``target_loss`` with a fixed batch, for each of ``batches``,
    each at its best learning rate of ``lrs`` (fewest steps), and the fit of
    ``S = S_min (1 + B_crit / B)`` to them (:func:`critical_batch_fit`). A batch that no
    rate brings to the target within ``steps`` is reported with ``steps=None`` and left
    out of the fit. ``progress(fraction, text)`` is called after each batch.

    Each run stops at the best step count found so far for its batch, which changes no row
    (the draws depend only on the step). ``"trained_steps"`` counts the steps trained,
    ``"full_steps"`` the ``steps x len(batches) x len(lrs)`` an uncapped grid would bound."""
    import copy

    check_module("model", model)
    for attr in ("draw", "loss_fn", "eval_loss"):
        if not callable(getattr(task, attr, None)):
            raise TypeError(f"task must have draw, loss_fn and eval_loss methods (a "
                            f"RegressionTask, a DigitsTask), got {type(task).__name__}")
    for name, seq in (("batches", batches), ("lrs", lrs)):
        if isinstance(seq, str | bytes) or not isinstance(seq, Sequence):
            raise TypeError(f"{name} must be a sequence, got {seq!r}")
    batches = [check_int("batches[i]", b, lo=2) for b in batches]
    lrs = [check_float("lrs[i]", lr, lo=0, lo_open=True) for lr in lrs]
    if not batches or not lrs:
        raise ValueError("batches and lrs must not be empty")
    # train takes None (no target) and checks steps itself, before any step
    target_loss = check_float("target_loss", target_loss)
    if progress is not None:
        check_callable("progress", progress)
    rows, trained, prev = [], 0, None
    for i, b in enumerate(batches):
        # Fewest steps wins, so a rate need not run past the best one's count: each run is
        # capped there (the draws depend only on the step, so a capped run is the same run
        # cut short). The previous batch's best rate goes first, to make the cap tight early.
        # The rows equal the uncapped sweep's (ties keep the earlier rate in ``lrs``).
        order = sorted(range(len(lrs)), key=lambda j: (lrs[j] != prev, j))
        best = None
        for j in order:
            lr = lrs[j]
            cap = steps if best is None else max(1, min(steps, best[1]))
            h = train(copy.deepcopy(model), task, method="fixed", batch=b, lr=lr, steps=cap,
                      target_loss=target_loss, max_batch=b)
            trained += h.steps
            hit = samples_to_target(h, target_loss)
            if hit is not None and (best is None or hit[0] < best[1]
                                    or (hit[0] == best[1] and j < best[3])):
                best = (lr, *hit, j)
        prev = best[0] if best else None
        rows.append({"batch": b, "lr": best[0] if best else None,
                     "steps": best[1] if best else None, "samples": best[2] if best else None})
        if progress is not None:
            progress((i + 1) / len(batches), f"batch {b}")
    ok = [r for r in rows if r["steps"] is not None]
    fit = critical_batch_fit([r["batch"] for r in ok], [r["steps"] for r in ok])
    return {"rows": rows, "fit": fit, "target_loss": target_loss, "trained_steps": trained,
            "full_steps": steps * len(batches) * len(lrs)}


def tradeoff_model(b_noise: Sequence[float], *, batch: float | None = None,
                   factor: float | None = None, power: float = 1.0) -> dict:
    """Modeled steps and examples of a whole run whose noise scale changes: ``b_noise[i]``
    is the noise scale during the ``i``-th of ``len(b_noise)`` equal pieces of the run's
    ``S_min`` (each piece takes 1 step at infinite batch). A piece at noise scale ``b``
    with batch ``B`` takes ``1 + b / B`` steps of ``B`` examples (McCandlish's
    ``S = S_min (1 + B_noise / B)``, piece by piece). Either a fixed ``batch``, or an
    adaptive one ``B = factor x b^power``. ``power = 1`` is what a controller tracking the
    noise scale holds (SimiGrad's target ``s`` gives ``factor = 2 s / (1 - s)``).

    Two consequences, both exact in this model: tracking ``B = k b`` costs ``(1 + 1/k)
    S_min`` steps and ``(1 + k) E_min`` examples, *the same* as the fixed batch ``k`` x
    mean(``b``); and the schedule that minimises ``steps + lambda x examples`` is
    ``B ~ sqrt(b)`` (``d/dB [b/B + lambda B] = 0``), ``power = 0.5``, which beats every
    fixed batch when ``b`` varies. Returns ``{"steps", "samples", "batch": per piece}``."""
    bn = [check_float("b_noise[i]", b, lo=0, lo_open=True) for b in b_noise]
    if not bn:
        raise ValueError("b_noise must not be empty")
    if (batch is None) == (factor is None):
        raise ValueError("give exactly one of batch (fixed) and factor (adaptive)")
    power = check_float("power", power, lo=0, lo_open=True)
    if batch is not None:
        bs = [check_float("batch", batch, lo=0, lo_open=True)] * len(bn)
    else:
        f = check_float("factor", factor, lo=0, lo_open=True)
        bs = [f * b**power for b in bn]
    steps = [1 + b / big for b, big in zip(bn, bs, strict=True)]
    return {"steps": sum(steps), "samples": sum(s * big for s, big in zip(steps, bs,
                                                                           strict=True)),
            "batch": bs}


def frontier_samples(rows: Sequence[dict], steps: float) -> float | None:
    """Examples a fixed batch needs to reach the target in ``steps`` steps, interpolated
    (log-log, between neighbouring batches) on the measured rows of :func:`batch_sweep`;
    None when ``steps`` lies outside the swept range."""
    if isinstance(rows, str) or not isinstance(rows, Sequence):
        raise TypeError(f"rows must be a sequence of batch_sweep rows, got {rows!r}")
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or "steps" not in r or "samples" not in r:
            raise TypeError(f"rows[{i}] must be a dict with 'steps' and 'samples', got {r!r}")
    steps = check_float("steps", steps, lo=0, lo_open=True)
    pts = sorted((r["steps"], r["samples"]) for r in rows if r["steps"] is not None)
    for (s0, e0), (s1, e1) in zip(pts, pts[1:], strict=False):
        if s0 <= steps <= s1:
            if s1 == s0:
                return float(min(e0, e1))
            t = math.log(steps / s0) / math.log(s1 / s0)
            return math.exp(math.log(e0) + t * math.log(e1 / e0))
    return None


def bench(device: torch.device, quick: bool) -> list:
    """See :func:`_bench`; runs it with one torch thread (the caller's count is restored):
    the models are tiny, and extra threads only contend for shared cores."""
    from parlearn.core.device import threads

    check_device("device", device)   # checked, then unused: see _bench
    check_bool("quick", quick)
    with threads(1):
        return _bench(quick)


def _bench(quick: bool) -> list:
    """Rows for ``python -m parlearn.bench batching``: examples to a target training loss
    on digits (an MLP 64-64-10, plain SGD, every run at its best learning rate of a grid),
    SimiGrad (from batch 16) and AdaScale (16 x 16) against the fixed-batch frontier: the
    examples a fixed batch needs to reach the target in as many steps, interpolated on a
    measured sweep of fixed batches. Ratio = frontier examples / method's examples
    (counts, not times; > 1: the adaptive method beats every fixed batch); when the
    method took fewer steps than any fixed batch, the row compares steps instead. SimiGrad is
    repeated on 2 real gloo ranks to check it takes the same batches. ``device`` is not
    used: the counts do not depend on it."""
    import copy

    from parlearn.core.bench import Row
    from parlearn.core.datasets import digits
    from parlearn.core.models import mlp
    from parlearn.distributed import run

    task = DigitsTask(digits(), seed=0)
    model = mlp([64, 64, 10], seed=0)
    target_loss = 0.15
    lrs = (0.4, 0.8, 1.2) if quick else (0.1, 0.2, 0.4, 0.8, 1.2)
    # Every best run here reaches the target within ~250 steps; the cap bounds the runs
    # whose rate never gets there (too small, or oscillating without diverging).
    max_steps = 400 if quick else 1500
    sweep = batch_sweep(model, task, (16, 32, 64, 128, 256) if quick
                        else (8, 16, 32, 64, 128, 256, 512), lrs, target_loss, steps=max_steps)
    methods = {"SimiGrad from 16": {"method": "simigrad", "batch": 16, "lr_scaling": "gain"},
               "AdaScale 16 x 16": {"method": "adascale", "batch": 256, "base_batch": 16}}
    rows, notes = [], []
    for label, kw in methods.items():
        best = None
        for lr in lrs:
            h = train(copy.deepcopy(model), task, lr=lr, steps=max_steps,
                      target_loss=target_loss, max_batch=1024, **kw)
            hit = samples_to_target(h, target_loss)
            if hit is not None and (best is None or hit[1] < best[2][1]):
                best = (lr, h, hit)
        if best is None:
            raise RuntimeError(f"{label} did not reach loss {target_loss} with lr in {lrs}")
        lr, h, (steps, samples) = best
        front = frontier_samples(sweep["rows"], steps)
        same = None
        if kw["method"] == "simigrad":
            ranks = run(worker_train, 2, args=(copy.deepcopy(model), task,
                                               {**kw, "lr": lr, "steps": h.steps,
                                                "max_batch": 1024, "target_loss": target_loss}),
                        timeout=120)[0]
            same = ranks.batch == h.batch
            notes.append(f"SimiGrad on 2 gloo ranks took {'the same' if same else 'DIFFERENT'}"
                         f" batches")
        notes.append(f"{label}: lr {lr}, {steps} steps, {samples} examples, batches "
                     f"{min(h.batch)}-{max(h.batch)}")
        dev = "counted (device-independent); digits MLP, SGD"
        fewest = min(r["steps"] for r in sweep["rows"] if r["steps"] is not None)
        if front is not None:
            rows.append(Row("batching", "fixed-batch frontier: examples at equal steps",
                            f"{label} (examples)", front / samples, dev,
                            target="> 1 beats every fixed batch",
                            met=front > samples and same is not False))
        else:   # outside the swept range: compare steps with the fewest any fixed batch took
            rows.append(Row("batching", "fixed batches: fewest steps to target",
                            f"{label} (steps)", fewest / steps, dev,
                            target="> 1 fewer steps than any fixed batch",
                            met=fewest > steps and same is not False))
    fixed = "; ".join(f"B={r['batch']}: {r['steps']} steps, {r['samples']} ex (lr {r['lr']})"
                      for r in sweep["rows"])
    rows[0].detail = (f"target training loss {target_loss}. Fixed batches (best lr): {fixed}; "
                      f"fit B_crit = {sweep['fit']['b_crit']:.0f}. " + "; ".join(notes) + ".")
    return rows
