"""Training with a fixed batch, SimiGrad's controller, or AdaScale: one loop, two engines.

**SimiGrad's controller** (Qin et al. 2021) grows the batch when the two halves disagree
(``cos`` below a target ``s``) and shrinks it when they agree, every step; it settles where
``E[cos] = s``, i.e. at ``B* = 2 B_simple s / (1 - s)`` (:func:`controller_fixed_point`).
*A reconstruction*: we could read the paper's abstract and general description only. The
multiplicative step (``B <- B (1 + step)`` up, ``B <- B / (1 + step)`` down, so up and down
cancel in ``log B``), the per-step decision on the raw cosine, and scaling the learning rate
with the batch (``linear``, ``sqrt``, or AdaScale's ``gain``) are our choices. A larger batch
is realised by gradient accumulation: ``B = ranks x micro x accum``.

AdaScale keeps its batch and scales the learning rate by its gain
(:func:`parlearn.multi_device.batching.noise_scale.adascale_gain`), here computed from the
running noise-scale estimate. Serial reference and parallel version side by side:
:func:`train` (one process) vs :func:`worker_train` (real ranks, the same sampling), equal to
round-off.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from parlearn.core.checks import check_choice, check_float, check_int, check_module
from parlearn.multi_device.batching.halves import _check_world, _HalfProbe, half_gradients
from parlearn.multi_device.batching.noise_scale import NoiseScale, two_half_stats

__all__ = ["SimiGradController", "METHODS", "LR_SCALINGS", "History", "train", "worker_train",
           "train_runs", "samples_to_target"]


# ---------------------------------------------------------------------------------------
# SimiGrad's controller (a reconstruction): the batch follows the halves' cosine.

class SimiGradController:
    """Grow the batch when the halves' cosine is below ``target``, shrink it when above.

    The controller keeps a real-valued batch ``value``; each :meth:`update` multiplies it
    by ``1 + step`` (cosine below target) or divides by it (at or above), within
    ``[min_batch, max_batch]``. :meth:`batch` rounds it to a whole number of ``quantum``
    (ranks x micro-batch: the batch is realised by accumulation). A reconstruction of
    SimiGrad's controller (module docstring)."""

    def __init__(self, target: float = 0.5, *, step: float = 0.1, start: int = 32,
                 min_batch: int = 2, max_batch: int = 65536, quantum: int = 2) -> None:
        self.target = check_float("target", target, lo=0, hi=1, lo_open=True, hi_open=True)
        self.step = check_float("step", step, lo=0, hi=1, lo_open=True)
        self.quantum = check_int("quantum", quantum, lo=2)
        if quantum % 2:
            raise ValueError(f"quantum must be even (two halves), got {quantum}")
        self.min_batch = check_int("min_batch", min_batch, lo=quantum)
        self.max_batch = check_int("max_batch", max_batch, lo=self.min_batch)
        start = check_int("start", start, lo=self.min_batch, hi=self.max_batch)
        self.value = float(start)

    def update(self, cos: float) -> int:
        """One decision on this step's cosine; returns the next step's batch."""
        check_float("cos", cos, lo=-1 - 1e-9, hi=1 + 1e-9)
        f = 1.0 + self.step
        self.value = self.value * f if cos < self.target else self.value / f
        self.value = min(max(self.value, self.min_batch), self.max_batch)
        return self.batch()

    def batch(self) -> int:
        """``value`` rounded to a whole number of quanta (at least one)."""
        return self.quantum * max(1, round(self.value / self.quantum))


# ---------------------------------------------------------------------------------------
# Training with a fixed batch, SimiGrad's controller, or AdaScale: one loop, two engines.

METHODS = ("fixed", "simigrad", "adascale")
LR_SCALINGS = ("linear", "sqrt", "gain")


@dataclass
class History:
    """Per step of a :func:`train` run: ``batch``, ``lr``, ``cos`` (of that step's halves),
    ``b_simple`` (running estimate), ``gain`` (AdaScale's, from the estimate), ``samples``
    (examples used so far, this step included) and ``loss`` (evaluated after the step;
    ``loss[0]`` is the starting loss, so ``loss`` has one more entry); ``params`` after the
    last step; ``bytes``: the ledger's payload bytes of the last step (real ranks only)."""

    method: str
    batch: list[int] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    cos: list[float] = field(default_factory=list)
    b_simple: list[float] = field(default_factory=list)
    gain: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    params: dict | None = None
    bytes: dict = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.batch)


def _check_train(method, steps, lr, batch, base_batch, target, step, lr_scaling, max_batch,
                 decay, micro, world_size, target_loss):
    check_choice("method", method, METHODS)
    check_int("steps", steps, lo=1)
    check_float("lr", lr, lo=0)
    world_size = _check_world(world_size)
    micro = check_int("micro", micro, lo=1)
    quantum = world_size * micro
    batch = check_int("batch", batch, lo=quantum)
    if batch % quantum:
        raise ValueError(f"batch={batch} must be a multiple of world_size x micro = {quantum}")
    check_int("base_batch", base_batch, lo=1, hi=batch)
    check_float("target", target, lo=0, hi=1, lo_open=True, hi_open=True)
    check_float("step", step, lo=0, hi=1, lo_open=True)
    check_choice("lr_scaling", lr_scaling, LR_SCALINGS)
    check_int("max_batch", max_batch, lo=batch)
    check_float("decay", decay, lo=0, hi=1, hi_open=True)
    if target_loss is not None:
        check_float("target_loss", target_loss)
    return quantum


def _lr_ratio(b_simple: float, b_from: int, b_to: int) -> float:
    """McCandlish's optimal learning rate at ``b_to`` over that at ``b_from``,
    ``(1 + B_simple/b_from) / (1 + B_simple/b_to)``: AdaScale's gain for ``S = b_to/b_from``.
    A negative estimate counts as 0 (no noise: ratio 1), an infinite one as pure noise
    (ratio ``b_to / b_from``)."""
    if not math.isfinite(b_simple):
        return b_to / b_from
    b_simple = max(b_simple, 0.0)
    return (1.0 + b_simple / b_from) / (1.0 + b_simple / b_to)


def _loop(model: nn.Module, task, halves_fn, *, method: str, steps: int, lr: float,
          batch: int, base_batch: int, target: float, step: float, lr_scaling: str,
          max_batch: int, decay: float, quantum: int, target_loss: float | None) -> History:
    """The training loop both engines share; ``halves_fn(x, y, accum) -> (a, b)``."""
    params = [p for p in model.parameters() if p.requires_grad]
    hist = History(method=method, loss=[task.eval_loss(model)])
    noise = NoiseScale(decay)
    ctl = SimiGradController(target, step=step, start=batch, min_batch=quantum,
                             max_batch=max_batch, quantum=quantum)
    b, seen = batch, 0
    for t in range(steps):
        x, y = task.draw(t, b)
        a, bb = halves_fn(x, y, b // quantum)
        stats = two_half_stats(a, bb, b)
        b_simple = noise.update(stats)
        gain = _lr_ratio(b_simple, base_batch, b)
        if method == "adascale":
            step_lr = lr * gain
        elif method == "simigrad":
            ratio = b / batch
            step_lr = lr * {"linear": ratio, "sqrt": ratio**0.5,
                            "gain": _lr_ratio(b_simple, batch, b)}[lr_scaling]
        else:
            step_lr = lr
        g = (a + bb) / 2
        with torch.no_grad():
            offset = 0
            for p in params:
                p -= step_lr * g[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        seen += b
        hist.batch.append(b)
        hist.lr.append(step_lr)
        hist.cos.append(stats.cos)
        hist.b_simple.append(b_simple)
        hist.gain.append(gain)
        hist.samples.append(seen)
        hist.loss.append(task.eval_loss(model))
        if target_loss is not None and hist.loss[-1] <= target_loss:
            break
        if not math.isfinite(hist.loss[-1]):   # diverged: nothing more to learn from it
            break
        if method == "simigrad":
            b = ctl.update(stats.cos)
    hist.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return hist


def train(model: nn.Module, task, *, method: str = "simigrad", steps: int = 100,
          lr: float = 0.1, batch: int = 32, base_batch: int | None = None,
          target: float = 0.5, step: float = 0.1, lr_scaling: str = "gain",
          max_batch: int = 4096, decay: float = 0.9, micro: int = 1, world_size: int = 2,
          target_loss: float | None = None) -> History:
    """Serial reference: train ``model`` in place with plain SGD on ``task``
    (:class:`RegressionTask` or :class:`DigitsTask`), computing each step's two half-batch
    mean gradients in this process (:func:`half_gradients`) and stepping on their mean.
    ``world_size`` and ``micro`` only set the batch quantum ``world_size x micro`` the
    real ranks of :func:`worker_train` need, so that both engines take the same batches.

    ``method``: ``"fixed"`` keeps ``batch`` and ``lr``; ``"simigrad"`` starts at ``batch``
    and lets :class:`SimiGradController` (``target``, ``step``, up to ``max_batch``) move it
    every step, the learning rate following ``lr_scaling`` from ``lr`` at ``batch``
    (``linear``: ``B/B_0``, ``sqrt``: ``sqrt(B/B_0)``, ``gain``: McCandlish's optimal-rate
    ratio from the running ``B_simple``); ``"adascale"`` keeps ``batch`` = ``S`` x
    ``base_batch`` and multiplies ``lr`` (tuned for ``base_batch``) by the running gain.
    Stops after ``steps`` steps, once the evaluated loss is at most ``target_loss``, or
    once it is not finite (diverged).
    """
    check_module("model", model)
    base_batch = batch if base_batch is None else base_batch
    quantum = _check_train(method, steps, lr, batch, base_batch, target, step, lr_scaling,
                           max_batch, decay, micro, world_size, target_loss)

    def halves(x, y, accum):
        # Each half's mean gradient in one pass: the accumulation over ranks and micro-batches
        # that worker_train does computes the same mean (to round-off) in pieces.
        return half_gradients(model, task.loss_fn, x, y)

    return _loop(model, task, halves, method=method, steps=steps, lr=lr, batch=batch,
                 base_batch=base_batch, target=target, step=step, lr_scaling=lr_scaling,
                 max_batch=max_batch, decay=decay, quantum=quantum, target_loss=target_loss)


def _worker_args(world_size: int, kwargs) -> tuple[dict, int]:
    """``train``'s keyword arguments for a run on ``world_size`` ranks, every one checked,
    defaults filled in, and the batch quantum."""
    if not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict of train arguments, got {kwargs!r}")
    if "world_size" in kwargs and kwargs["world_size"] != world_size:
        raise ValueError(f"kwargs world_size={kwargs['world_size']} differs from the run's "
                         f"{world_size}")
    args = {k: p.default for k, p in inspect.signature(train).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and k != "world_size"}
    unknown = set(kwargs) - set(args) - {"world_size"}
    if unknown:
        raise ValueError(f"unknown train arguments {sorted(unknown)}; allowed {sorted(args)}")
    args.update({k: v for k, v in kwargs.items() if k != "world_size"})
    if args["base_batch"] is None:
        args["base_batch"] = args["batch"]
    quantum = _check_train(args["method"], args["steps"], args["lr"], args["batch"],
                           args["base_batch"], args["target"], args["step"],
                           args["lr_scaling"], args["max_batch"], args["decay"],
                           args["micro"], world_size, args["target_loss"])
    return args, quantum


def worker_train(rank: int, world_size: int, model: nn.Module, task, kwargs: dict) -> History:
    """A :func:`parlearn.distributed.run` worker: :func:`train` (``kwargs`` as there, ``micro``
    included) on real ranks. Each rank draws the same batch, takes its shard, accumulates
    ``B / (W micro)`` micro-batches under ``no_sync``, its half's group all-reduces, the
    partners exchange halves; every rank then holds the same ``a``, ``b`` and takes the
    same step and the same controller decision. Returns the history (every rank's is the
    same), its ``bytes`` the ledger's payload bytes of the last step by kind of collective."""
    check_module("model", model)
    args, quantum = _worker_args(world_size, kwargs)
    from parlearn.distributed import ledger

    probe = _HalfProbe(model, world_size)
    last: dict = {}

    def halves(x, y, accum):
        with ledger() as led:
            out = probe.halves(task.loss_fn, x, y, accum)
        last.clear()
        last.update({k: v[1] for k, v in led.summary().items()})
        return out

    del args["micro"]
    hist = _loop(model, task, halves, quantum=quantum, **args)
    probe.dp.remove_hooks()
    hist.bytes = dict(last)
    return hist


def train_runs(model: nn.Module, task, runs: list, *, world_size: int = 2,
               timeout: float = 60) -> list[list[History]]:
    """:func:`worker_train` once per dict of ``runs`` on ``world_size`` real ranks, each from
    its own copy of ``model``, in one launch (:func:`parlearn.distributed.run_many`: starting
    the ranks costs seconds). Every run's arguments are checked before the ranks start.
    Returns ``result[i][rank]``: run ``i``'s history on each rank (all the same)."""
    from parlearn.distributed import run_many

    check_module("model", model)
    world_size = check_int("world_size", world_size, lo=1)
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    if not isinstance(runs, list) or not runs:
        raise TypeError(f"runs must be a non-empty list of dicts of train arguments, "
                        f"got {runs!r}")
    for i, kw in enumerate(runs):
        try:
            _worker_args(world_size, kw)
        except (TypeError, ValueError) as err:
            raise type(err)(f"runs[{i}]: {err}") from None
    return run_many(worker_train, world_size, [(model, task, kw) for kw in runs],
                    timeout=timeout)


def samples_to_target(hist: History, target_loss: float) -> tuple[int, int] | None:
    """``(steps, samples)`` at the first step whose evaluated loss is at most
    ``target_loss``, or None if the run never got there."""
    if not isinstance(hist, History):
        raise TypeError(f"hist must be a History (from train), got {type(hist).__name__}")
    target_loss = check_float("target_loss", target_loss)
    for t, loss in enumerate(hist.loss[1:]):
        if loss <= target_loss:
            return t + 1, hist.samples[t]
    return None
