"""The lesson's experiment: SGD in five regimes at equal updates, and what it costs.

:func:`train` runs one update scheme (minibatch SGD, single-example SGD, or single-example SGD
with P noisy copies averaged by :func:`parlearn.many_copies.dither.gradients.parallel_grad`)
on a seeded :func:`mlp`; :func:`compare_regimes` runs the lesson's whole plan over seeds (five
regimes: batch and single-example SGD, clean and with each noise, and parallel noisy copies), and
:func:`summarise` and :func:`paired_difference` read the result. :func:`throughput` and
:func:`bench` measure one P-copy gradient batched against the loop over copies.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from parlearn.core.bench import Row
from parlearn.core.checks import (
    check_bool,
    check_callable,
    check_choice,
    check_float,
    check_int,
    check_ints,
    check_seed,
    check_tensor,
)
from parlearn.core.device import threads as _threads
from parlearn.core.timing import compare, sweep
from parlearn.many_copies.dither.gradients import (
    LossFn,
    _check_model,
    _check_xy,
    _own_grads,
    parallel_grad,
    sequential_grad,
)
from parlearn.many_copies.dither.noise import _check_noise, draw_noise

__all__ = ["REGIMES", "mlp", "History", "train", "compare_regimes", "summarise",
           "paired_difference", "throughput", "bench"]

REGIMES = ("batch", "single", "parallel")


# --- the regime experiment ------------------------------------------------------------


def mlp(n_in: int, hidden: int, n_out: int, *, dropout: float = 0.0,
        seed: int | torch.Generator = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """A one-hidden-layer ReLU MLP (optionally with a Dropout layer after the ReLU).

    Weights and biases are drawn as ``nn.Linear`` draws them (uniform on
    ``+-1/sqrt(fan_in)``) but from ``seed`` (an int or a ``torch.Generator``), never
    from torch's global generator.
    """
    n_in = check_int("n_in", n_in, lo=1)
    hidden = check_int("hidden", hidden, lo=1)
    n_out = check_int("n_out", n_out, lo=1)
    dropout = check_float("dropout", dropout, lo=0.0, hi=1.0, hi_open=True)
    seed = check_seed("seed", seed)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    # skip_init: nn.Linear's own initialisation would draw from the global generator.
    first = nn.utils.skip_init(nn.Linear, n_in, hidden, dtype=dtype)
    last = nn.utils.skip_init(nn.Linear, hidden, n_out, dtype=dtype)
    with torch.no_grad():
        for layer in (first, last):
            bound = 1 / math.sqrt(layer.in_features)
            for p in (layer.weight, layer.bias):
                p.uniform_(-bound, bound, generator=g)
    layers: list[nn.Module] = [first, nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(last)
    return nn.Sequential(*layers)


@dataclass
class History:
    """Record of one training run (after every pass, or every ``record_every`` updates),
    with the compute it spent."""

    regime: str
    updates: list[int] = field(default_factory=list)
    forwards: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    test_loss: list[float] = field(default_factory=list)
    test_acc: list[float] = field(default_factory=list)

    @property
    def test_error(self) -> list[float]:
        return [1 - a for a in self.test_acc]


def _evaluate(model, x, y):
    with torch.no_grad():
        out = model(x)
        loss = nn.functional.cross_entropy(out, y).item()
        acc = (out.argmax(1) == y).double().mean().item()
    return loss, acc


def _check_split(data) -> None:
    for name in ("x_train", "y_train", "x_test", "y_test"):
        if not isinstance(getattr(data, name, None), torch.Tensor):
            raise TypeError(f"data must be a parlearn.datasets.Split (with {name}), got "
                            f"{type(data).__name__}")
    _check_xy(data.x_train, data.y_train)
    _check_xy(data.x_test, data.y_test)
    check_tensor("data.x_train", data.x_train, ndim=2, floating=True, finite=True)
    check_tensor("data.y_train", data.y_train, ndim=1, floating=False)


def train(regime: str, data, *, epochs: int = 5, lr: float = 0.05, hidden: int = 64,
          batch_size: int | None = None, copies: int | None = None,
          dither: str | None = None, scale: float = 0.0, dropout: float | None = None,
          seed: int = 0, record_every: int | None = None, progress: bool = False) -> History:
    """Train an MLP on ``data`` (a :class:`parlearn.datasets.Split`) with one update scheme.

    * ``"batch"``: minibatch SGD (``batch_size`` examples per update), one noisy copy each;
    * ``"single"``: one example per update, one noisy copy;
    * ``"parallel"``: one example per update, ``copies`` noisy copies averaged.

    ``batch_size`` (default 32) is used by ``"batch"`` only and ``copies`` (default 16)
    by ``"parallel"`` only; giving either to another regime is an error. ``seed`` fixes the
    initial weights, the data order and the noise; torch's global generator is not used.
    The model has no random layers (the noise is on the input, see :func:`draw_noise`).
    Records updates, forward passes (examples pushed through the model, copies included),
    train loss (mean over the examples since the previous record), test loss and accuracy:
    after every pass over the data when ``record_every`` is None, else after every
    ``record_every`` updates and after the last one. ``progress`` shows a text progress
    bar (tqdm) on stderr.
    """
    regime = check_choice("regime", regime, REGIMES)
    _check_split(data)
    epochs = check_int("epochs", epochs, lo=1)
    lr = check_float("lr", lr, lo=0.0, lo_open=True)
    hidden = check_int("hidden", hidden, lo=1)
    if regime != "batch" and batch_size is not None:
        raise ValueError(f"batch_size={batch_size!r} is only used by regime='batch', not "
                         f"{regime!r}")
    if regime != "parallel" and copies is not None:
        raise ValueError(f"copies={copies!r} is only used by regime='parallel', not {regime!r}")
    bs = p = 1
    if regime == "batch":
        bs = check_int("batch_size", 32 if batch_size is None else batch_size, lo=1)
    if regime == "parallel":
        p = check_int("copies", 16 if copies is None else copies, lo=1)
    seed = check_int("seed", seed, lo=0)
    if record_every is not None:
        record_every = check_int("record_every", record_every, lo=1)
    check_bool("progress", progress)
    _check_noise(p, dither, scale, dropout)
    n_classes = int(torch.cat([data.y_train, data.y_test]).max()) + 1
    model = mlp(data.n_features, hidden, n_classes, seed=seed, dtype=data.x_train.dtype)
    model.to(data.x_train.device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 1)
    hist = History(regime)
    n = data.x_train.shape[0]
    updates = forwards = 0
    running, seen = 0.0, 0  # train loss summed over the examples since the last record
    bar = None

    def record():
        nonlocal running, seen
        test_loss, test_acc = _evaluate(model, data.x_test, data.y_test)
        hist.updates.append(updates)
        hist.forwards.append(forwards)
        hist.train_loss.append(running / seen)
        hist.test_loss.append(test_loss)
        hist.test_acc.append(test_acc)
        running, seen = 0.0, 0

    if progress:
        from tqdm.std import tqdm  # the text bar: no widget, nothing left waiting in a kernel

        bar = tqdm(total=epochs * math.ceil(n / bs), desc=f"{regime} SGD", leave=False)
    try:
        for _ in range(epochs):
            order = torch.randperm(n, generator=g).to(data.x_train.device)
            for start in range(0, n, bs):
                idx = order[start:start + bs]
                opt.zero_grad(set_to_none=True)
                running += parallel_grad(model, nn.functional.cross_entropy, data.x_train[idx],
                                         data.y_train[idx], copies=p, dither=dither, scale=scale,
                                         dropout=dropout, generator=g) * len(idx)
                seen += len(idx)
                opt.step()
                updates += 1
                forwards += p * len(idx)
                if bar is not None:
                    bar.update()
                if record_every is not None and updates % record_every == 0:
                    record()
            if record_every is None:
                record()
        if seen:  # updates after the last multiple of record_every
            record()
    finally:
        if bar is not None:
            bar.close()
    return hist


def _regime_plan(epochs: int, batch_size: int, copies: int,
                 noises: dict[str, dict]) -> dict[str, dict]:
    plan = {
        "batch SGD": dict(regime="batch", epochs=epochs * batch_size, batch_size=batch_size),
        "single-example SGD": dict(regime="single", epochs=epochs),
    }
    for label, kw in noises.items():
        plan[f"batch SGD + {label}"] = dict(regime="batch", epochs=epochs * batch_size,
                                            batch_size=batch_size, **kw)
        plan[f"single-example SGD + {label}"] = dict(regime="single", epochs=epochs, **kw)
        plan[f"parallel {label}, P={copies}"] = dict(regime="parallel", epochs=epochs,
                                                    copies=copies, **kw)
    return plan


def compare_regimes(data, *, epochs: int, batch_size: int = 16, copies: int = 16,
                    noises: dict[str, dict] | None = None, lr: float = 0.05, hidden: int = 64,
                    seeds: Sequence[int] = (0,), record_every: int | None = None,
                    progress: Callable[[float, str], None] | None = None,
                    threads: int | None = 1) -> dict[str, list[History]]:
    """The lesson's experiment, at equal updates, for each seed in ``seeds``.

    ``noises`` maps a label to the noise arguments of :func:`train`, e.g.
    ``{"dither": {"dither": "gaussian", "scale": 0.3}, "dropout": {"dropout": 0.2}}``
    (default: Gaussian dither of standard deviation 0.3). The runs are the two clean
    controls, batch SGD and single-example SGD, and for each noise: batch SGD +
    noise, single-example SGD + noise, and parallel noise with ``copies`` copies.

    Single-example runs make ``epochs`` passes over the data (``n * epochs`` updates);
    batch runs make ``epochs * batch_size`` passes, so they take as many updates, and
    with ``copies == batch_size`` the parallel run pushes as many examples through
    the model as batch SGD does. Returns ``{name: [History for each seed]}``.
    ``record_every`` is passed to :func:`train` (all runs take about as many updates, so
    their curves share the same points). ``progress(fraction, text)`` is called before
    every run. ``threads`` pins torch's
    intra-op thread count for the call and restores it (one thread is fastest for these
    tiny models and keeps a busy machine usable); ``None`` keeps the caller's count.
    """
    _check_split(data)
    epochs = check_int("epochs", epochs, lo=1)
    batch_size = check_int("batch_size", batch_size, lo=1)
    copies = check_int("copies", copies, lo=1)
    if noises is None:
        noises = {"dither": {"dither": "gaussian", "scale": 0.3}}
    if not isinstance(noises, dict) or not noises:
        raise TypeError(f"noises must be a non-empty dict of label -> noise arguments, got "
                        f"{noises!r}")
    for label, kw in noises.items():
        if not isinstance(label, str) or not isinstance(kw, dict):
            raise TypeError(f"noises[{label!r}] must map a str label to a dict, got {kw!r}")
        bad = set(kw) - {"dither", "scale", "dropout"}
        if bad:
            raise ValueError(f"noises[{label!r}] has unknown keys {sorted(bad)}; use dither, "
                             "scale, dropout")
        try:
            _check_noise(1, kw.get("dither"), kw.get("scale", 0.0), kw.get("dropout"))
        except (TypeError, ValueError) as e:
            raise type(e)(f"noises[{label!r}]: {e}") from None
        if kw.get("dither") is None and not kw.get("dropout"):
            raise ValueError(f"noises[{label!r}] adds no noise")
    check_float("lr", lr, lo=0.0, lo_open=True)
    check_int("hidden", hidden, lo=1)
    seeds = [check_int("seeds[]", s, lo=0) for s in seeds]
    if record_every is not None:
        record_every = check_int("record_every", record_every, lo=1)
    if not seeds:
        raise ValueError("seeds must name at least one seed")
    if progress is not None:
        check_callable("progress", progress)
    if threads is not None:
        threads = check_int("threads", threads, lo=1)
    plan = _regime_plan(epochs, batch_size, copies, noises)
    out: dict[str, list[History]] = {name: [] for name in plan}
    total, done = len(plan) * len(seeds), 0
    with _threads(threads) if threads is not None else contextlib.nullcontext():
        for seed in seeds:
            for name, kw in plan.items():
                if progress is not None:
                    progress(done / total, f"training {name} (seed {seed})")
                out[name].append(train(data=data, lr=lr, hidden=hidden, seed=seed,
                                       record_every=record_every, **kw))
                done += 1
    if progress is not None:
        progress(1.0, "done")
    return out


def _check_results(results) -> None:
    """``results`` as :func:`compare_regimes` returns it: regime -> non-empty list of
    :class:`History`, each with at least one test accuracy."""
    if not isinstance(results, dict) or not results:
        raise TypeError(f"results must be a non-empty dict regime -> [History], got "
                        f"{type(results).__name__}")
    for name, hists in results.items():
        if not isinstance(hists, list | tuple) or not hists or not all(
                isinstance(h, History) and h.test_acc for h in hists):
            raise ValueError(f"results[{name!r}] must be a non-empty list of History, each "
                             "with a test accuracy")


def summarise(results: dict[str, list[History]]) -> dict[str, dict]:
    """Final test accuracy of each regime over its seeds: mean, sample std, min, max, n."""
    _check_results(results)
    out = {}
    for name, hists in results.items():
        accs = [h.test_acc[-1] for h in hists]
        out[name] = {"mean": statistics.fmean(accs),
                     "std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                     "min": min(accs), "max": max(accs), "n": len(accs)}
    return out


def paired_difference(results: dict[str, list[History]], a: str, b: str) -> dict:
    """Final test accuracy of regime ``a`` minus that of ``b``, paired by seed.

    Returns ``{"mean", "se", "n", "low", "high", "verdict"}``: the mean difference, its
    standard error, the 95% Student-t interval and ``"better"``/``"worse"`` when that
    interval excludes 0, else ``"not distinguishable"`` (always so with one seed).
    """
    _check_results(results)
    for arg, name in (("a", a), ("b", b)):
        if not isinstance(name, str) or name not in results:
            raise ValueError(f"{arg}={name!r} is not one of the regimes {list(results)}")
    if len(results[a]) != len(results[b]):
        raise ValueError(f"{a!r} and {b!r} were run with different numbers of seeds")
    d = [ha.test_acc[-1] - hb.test_acc[-1] for ha, hb in zip(results[a], results[b],
                                                            strict=True)]
    n, mean = len(d), statistics.fmean(d)
    if n < 2:
        return {"mean": mean, "se": math.nan, "n": n, "low": -math.inf, "high": math.inf,
                "verdict": "not distinguishable"}
    from scipy.stats import t as student_t

    se = statistics.stdev(d) / math.sqrt(n)
    half = float(student_t.ppf(0.975, n - 1)) * se
    low, high = mean - half, mean + half
    verdict = "better" if low > 0 else "worse" if high < 0 else "not distinguishable"
    return {"mean": mean, "se": se, "n": n, "low": low, "high": high, "verdict": verdict}


def throughput(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, *,
               copies_list: Sequence[int], dither: str | None = "gaussian", scale: float = 0.1,
               dropout: float | None = None, repeat: int = 5, device="cpu",
               threads: int | None = 1) -> dict:
    """Measured time of one P-copy gradient, batched vs looped, for each P in ``copies_list``.

    Both candidates use the same noise. ``threads`` pins torch's intra-op thread count
    for the measurement (see :data:`parlearn.device.THREAD_POLICY`) and restores it; the
    model's ``.grad`` are left as the caller had them. Returns the
    :func:`parlearn.timing.sweep` result (``r["speedup"]["batched"]`` is loop / batched,
    with its spread) with ``copies``, ``loop_s`` and ``batched_s`` (median seconds) added.
    """
    _check_model(model)
    check_callable("loss_fn", loss_fn)
    _check_xy(x, y)
    ps = check_ints("copies_list", copies_list, lo=1)
    _check_noise(1, dither, scale, dropout)
    repeat = check_int("repeat", repeat, lo=1)
    if threads is not None:
        threads = check_int("threads", threads, lo=1)

    def candidates(p):
        noise = draw_noise(x, p, dither=dither, scale=scale, dropout=dropout,
                           generator=torch.Generator().manual_seed(0))
        return {"loop": partial(sequential_grad, model, loss_fn, x, y, noise=noise),
                "batched": partial(parallel_grad, model, loss_fn, x, y, copies=p,
                                   noise=noise)}

    with _own_grads(model):
        r = sweep(ps, candidates, repeat=repeat, device=device, threads=threads)
    r.update(copies=r["values"], loop_s=r["median_s"]["loop"],
             batched_s=r["median_s"]["batched"])
    return r


# --- bench --------------------------------------------------------------------------


def bench(device: torch.device, quick: bool) -> list[Row]:
    """P=64 copies, one batched pass vs a loop over copies, one intra-op thread."""
    from parlearn.core.datasets import digits

    device = torch.device(device)
    check_bool("quick", quick)
    data = digits(device=device)
    model = mlp(data.n_features, 64, 10).to(device)
    loss_fn = nn.functional.cross_entropy
    rows = []
    copies = 64
    target = ">= 5x" if device.type == "cpu" else ">= 20x"
    need = 5.0 if device.type == "cpu" else 20.0
    for batch in (1, 8) if quick else (1, 4, 32):
        x, y = data.x_train[:batch], data.y_train[:batch]
        noise = draw_noise(x, copies, dither="gaussian", scale=0.1,
                           generator=torch.Generator().manual_seed(0))
        with _own_grads(model):
            cmp = compare({
                "loop": partial(sequential_grad, model, loss_fn, x, y, noise=noise),
                "batched": partial(parallel_grad, model, loss_fn, x, y, copies=copies,
                                   noise=noise),
            }, warmup=2, repeat=5 if quick else 15, device=device, threads=1)
        ratio = cmp.speedup("batched")
        lo, hi = cmp.speedup_range("batched")
        detail = f"IQR {lo:.1f}-{hi:.1f}x, {cmp.threads} thread(s)"
        if not cmp.reliable:
            detail += "; unreliable (busy machine)"
        rows.append(Row(f"dither P={copies} batch={batch}", "loop over copies",
                        "one batched pass", ratio, str(device), target, ratio >= need, detail))
    return rows
