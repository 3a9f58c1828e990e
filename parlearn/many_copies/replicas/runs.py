"""Convolutional bootstrapping, training runs, instant learning, throughput and the bench."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from parlearn.core.bench import Row
from parlearn.core.checks import (
    check_bool,
    check_callable,
    check_choice,
    check_float,
    check_int,
    check_tensor,
)
from parlearn.core.datasets import Split
from parlearn.core.device import threads as _threads
from parlearn.core.timing import compare, sweep
from parlearn.many_copies.replicas.pooling import (
    accuracies,
    average_weights,
    ensemble_nll,
    mean_replica_nll,
    plurality_votes,
)
from parlearn.many_copies.replicas.stacked import (
    Params,
    _check_buffers,
    _check_model,
    check_stacked,
    make_replicas,
    predict,
    sgd_step_batched,
    sgd_step_looped,
    stack,
)

__all__ = ["convolutional_bootstrap", "train_batched", "train_looped", "BOOTSTRAPS",
           "instant_learning", "throughput", "bench"]

# --- convolutional bootstrapping (reconstruction) ------------------------------------------


def convolutional_bootstrap(images: torch.Tensor, y: torch.Tensor, replicas: int, *,
                            side: int = 8, resample: bool = True, shift: bool = True,
                            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Reconstruction: give each of R replicas its own, independent copy of the training set.

    The paper (abstract and introduction, all we could read) names the enhancement
    "convolutional bootstrapping" and motivates it as making "each local instance of the
    training data independent (e.g. data augmentation)". We read the two words literally:

    * bootstrapping: replica r trains on n examples drawn with replacement (Efron's
      bootstrap; bagging) when ``resample``;
    * convolutional: replica r's images are convolved with its own 3x3 kernel, a one-hot
      kernel at a random position (a shift by up to one pixel, zero fill) when ``shift``.

    ``images`` is ``(n, side*side)``; returns ``(x, y)`` of shapes ``(R, n, side*side)`` and
    ``(R, n)``. Test images are left as they are. Seeded; the global RNG is not used.
    """
    check_tensor("images", images, ndim=2, floating=True)
    side = check_int("side", side, lo=1)
    if images.shape[1] != side * side:
        raise ValueError(f"images must have side*side={side * side} columns, "
                         f"got {images.shape[1]}")
    check_tensor("y", y, shape=(images.shape[0],), floating=False)
    replicas = check_int("replicas", replicas, lo=1)
    check_bool("resample", resample)
    check_bool("shift", shift)
    g = torch.Generator().manual_seed(check_int("seed", seed, lo=0))
    n = images.shape[0]
    idx = (torch.randint(n, (replicas, n), generator=g) if resample
           else torch.arange(n).expand(replicas, n)).to(images.device)
    kernels = torch.zeros(replicas, 1, 3, 3, dtype=images.dtype, device=images.device)
    where = torch.randint(9, (replicas,), generator=g) if shift else torch.full((replicas,), 4)
    kernels.view(replicas, 9)[torch.arange(replicas), where] = 1.0
    # One conv2d applies every replica's kernel to every image: output channel r = replica r.
    conv = nn.functional.conv2d(images.view(n, 1, side, side), kernels, padding=1)
    x = conv.view(n, replicas, side * side).transpose(0, 1)
    return torch.gather(x, 1, idx[..., None].expand(-1, -1, side * side)), y[idx]


# --- training runs --------------------------------------------------------------------------


def _batches(n: int, batch_size: int, epochs: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
        yield from (order[s:s + batch_size] for s in range(0, n, batch_size))


def _check_run(x, y, epochs, lr, batch_size, seed):
    check_tensor("x", x, ndim=(2, 3), floating=True)
    check_tensor("y", y, ndim=(1, 2), floating=False)
    if x.shape[:-1] != y.shape:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} disagree on examples")
    if x.shape[-2] == 0:
        raise ValueError("x must hold at least one example, got 0")
    check_int("epochs", epochs, lo=1)
    check_float("lr", lr, lo=0, lo_open=True)
    check_int("batch_size", batch_size, lo=1)
    check_int("seed", seed, lo=0)


def train_batched(base: nn.Module, params: Params, buffers: Params, x: torch.Tensor,
                  y: torch.Tensor, *, epochs: int = 1, lr: float = 0.1, batch_size: int = 32,
                  seed: int = 0) -> Params:
    """Minibatch SGD of all replicas at once (:func:`sgd_step_batched`); every replica sees
    the same minibatch positions (order from ``seed``) of its own data when x is per replica."""
    _check_model("base", base)
    _check_buffers(base, buffers, check_stacked(base, params))
    _check_run(x, y, epochs, lr, batch_size, seed)
    for idx in _batches(x.shape[-2], batch_size, epochs, seed):
        idx = idx.to(x.device)
        params = sgd_step_batched(base, params, buffers, x[..., idx, :], y[..., idx], lr)
    return params


def train_looped(models: Sequence[nn.Module], x: torch.Tensor, y: torch.Tensor, *,
                 epochs: int = 1, lr: float = 0.1, batch_size: int = 32,
                 seed: int = 0) -> None:
    """:func:`train_batched`'s serial reference: the same minibatches, a loop over models."""
    if isinstance(models, nn.Module) or not isinstance(models, Sequence) or not models:
        raise TypeError(f"models must be a non-empty sequence of nn.Module, got {models!r}")
    for i, m in enumerate(models):
        _check_model(f"models[{i}]", m)
    _check_run(x, y, epochs, lr, batch_size, seed)
    if x.dim() == 3 and x.shape[0] != len(models):
        raise ValueError(f"x has {x.shape[0]} per-replica slices, expected R={len(models)}")
    for idx in _batches(x.shape[-2], batch_size, epochs, seed):
        idx = idx.to(x.device)
        sgd_step_looped(models, x[..., idx, :], y[..., idx], lr)


def _evaluate(base, params, buffers, x_test, y_test) -> dict:
    logits = predict(base, params, buffers, x_test)
    out = accuracies(logits, y_test)
    avg = {k: v[None] for k, v in average_weights(params).items()}
    out["averaged"] = accuracies(predict(base, avg, buffers, x_test)[:1], y_test)["ensemble"]
    out["ensemble_nll"] = ensemble_nll(logits, y_test)
    out["mean_replica_nll"] = mean_replica_nll(logits, y_test)
    # Ensemble of the first k replicas, k = 1..R: how pooling grows with R.
    probs = logits.softmax(-1).cumsum(0)
    out["first_k"] = (probs.argmax(-1) == y_test).double().mean(1).tolist()
    # The same first k replicas pooled by plurality vote instead (argmax counts).
    out["first_k_vote"] = (plurality_votes(logits) == y_test).double().mean(1).tolist()
    return out


BOOTSTRAPS = ("none", "resample", "convolutional")


def _check_runs(data, replicas_list, hidden, batch_size, threads) -> list[int]:
    """The arguments :func:`instant_learning` and :func:`throughput` share."""
    if not isinstance(data, Split):
        raise TypeError(f"data must be a parlearn.datasets.Split, got {type(data).__name__}")
    if isinstance(replicas_list, str) or not isinstance(replicas_list, Sequence):
        raise TypeError(f"replicas_list must be a list of replica counts, got {replicas_list!r}")
    rs = [check_int("replicas_list[]", r, lo=1) for r in replicas_list]
    if not rs:
        raise ValueError("replicas_list must name at least one replica count")
    check_int("hidden", hidden, lo=1)
    check_int("batch_size", batch_size, lo=1)
    if threads is not None:
        check_int("threads", threads, lo=1)
    return rs


def instant_learning(data, replicas_list: Sequence[int] = (1, 8, 64), *, epochs: int = 1,
                     hidden: int = 32, lr: float = 0.3, batch_size: int = 16,
                     bootstrap: str = "convolutional", shared_init: bool = False,
                     looped: bool = False, seed: int = 0, threads: int | None = 1,
                     progress: Callable[[float, str], None] | None = None) -> dict:
    """Train R replicas for ``epochs`` (batched) on ``data`` (a :class:`parlearn.datasets.Split`
    of digits) for each R in ``replicas_list``, timing each run on this device.

    ``bootstrap`` gives each replica its own copy of the training set by
    :func:`convolutional_bootstrap`: ``"convolutional"`` (resample and shift, our
    reconstruction), ``"resample"`` (resample only) or ``"none"`` (all share the data).
    ``looped`` trains with :func:`train_looped` (a loop over R models, the best serial
    code for R = 1) instead of :func:`train_batched`; the results are equal. ``threads``
    pins torch's intra-op thread count for the call and restores it (one thread is fastest
    for these tiny models on a shared machine); ``None`` keeps the caller's. Returns
    ``{"R": [...], "wall_s": [...], "runs": [evaluation per R], "device", "threads"}``; each
    evaluation has per-replica, mean-replica, ensemble and weight-averaged test accuracy,
    both cross-entropies, ``first_k`` (accuracy of the ensemble of the first k replicas)
    and ``first_k_vote`` (the same replicas pooled by plurality vote).
    """
    rs = _check_runs(data, replicas_list, hidden, batch_size, threads)
    check_int("epochs", epochs, lo=1)
    check_float("lr", lr, lo=0, lo_open=True)
    check_choice("bootstrap", bootstrap, BOOTSTRAPS)
    check_bool("shared_init", shared_init)
    check_bool("looped", looped)
    check_int("seed", seed, lo=0)
    if progress is not None:
        check_callable("progress", progress)
    if threads is not None:
        with _threads(check_int("threads", threads, lo=1)):
            return instant_learning(data, rs, epochs=epochs, hidden=hidden, lr=lr,
                                    batch_size=batch_size, bootstrap=bootstrap,
                                    shared_init=shared_init, looped=looped, seed=seed,
                                    threads=None, progress=progress)
    x_tr, y_tr = data.x_train, data.y_train
    out: dict = {"R": [], "wall_s": [], "runs": [], "device": str(x_tr.device),
                 "threads": torch.get_num_threads()}
    for i, r in enumerate(rs):
        if progress is not None:
            progress(i / len(rs), f"training {r} replica(s)")
        models = make_replicas(data.n_features, hidden, data.n_classes, r, seed=seed,
                               shared_init=shared_init, dtype=x_tr.dtype)
        start = time.perf_counter()
        params, buffers = stack(models)
        params = {k: v.to(x_tr.device) for k, v in params.items()}
        x, y = (x_tr, y_tr) if bootstrap == "none" else convolutional_bootstrap(
            x_tr, y_tr, r, seed=seed, shift=bootstrap == "convolutional")
        models = [m.to(x_tr.device) for m in models]
        if looped:
            train_looped(models, x, y, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed)
            params, buffers = stack(models)
        else:
            params = train_batched(models[0], params, buffers, x, y, epochs=epochs, lr=lr,
                                   batch_size=batch_size, seed=seed)
        out["wall_s"].append(time.perf_counter() - start)
        out["R"].append(r)
        out["runs"].append(_evaluate(models[0], params, buffers, data.x_test, data.y_test))
    if progress is not None:
        progress(1.0, "done")
    return out


# --- speed: replicas trained per second, batched vs looped -----------------------------------


def throughput(data, replicas_list: Sequence[int], *, steps: int = 10, hidden: int = 32,
               batch_size: int = 32, repeat: int = 5, threads: int | None = 1) -> dict:
    """Measured seconds for ``steps`` SGD steps of R replicas, looped vs batched, per R.

    Both run the same steps on the same minibatches (interleaved repeats,
    :func:`parlearn.timing.sweep`, ``threads`` intra-op threads). Returns the sweep with
    ``replicas_per_s`` added: ``{"loop": [R / time], "batched": [R / time]}``.
    """
    rs = _check_runs(data, replicas_list, hidden, batch_size, threads)
    steps = check_int("steps", steps, lo=1)
    check_int("repeat", repeat, lo=1)
    if len(data.x_train) < steps * batch_size:
        raise ValueError(f"steps * batch_size = {steps * batch_size} must not exceed the "
                         f"{len(data.x_train)} training rows of data")
    xs = data.x_train[:steps * batch_size].reshape(steps, -1, data.n_features)
    ys = data.y_train[:steps * batch_size].reshape(steps, -1)

    def candidates(r):
        models = make_replicas(data.n_features, hidden, data.n_classes, r,
                               dtype=data.x_train.dtype)
        models = [m.to(data.x_train.device) for m in models]
        params, buffers = stack(models)

        def loop():
            for x, y in zip(xs, ys, strict=True):
                sgd_step_looped(models, x, y, 0.01)

        def batched():
            p = params
            for x, y in zip(xs, ys, strict=True):
                p = sgd_step_batched(models[0], p, buffers, x, y, 0.01)

        return {"loop": loop, "batched": batched}

    res = sweep(rs, candidates, repeat=repeat, device=data.x_train.device, threads=threads)
    res["replicas_per_s"] = {k: [r / t for r, t in zip(rs, ts, strict=True)]
                             for k, ts in res["median_s"].items()}
    return res


def bench(device: torch.device, quick: bool) -> list[Row]:
    """R=64 replicas, 10 SGD steps each: one vmapped program vs a loop of 64 models, 1 thread."""
    from parlearn.core.datasets import digits

    device = torch.device(device)
    check_bool("quick", quick)
    data = digits(device=device)
    rows = []
    for r in (8, 64) if quick else (8, 64, 256):
        models = [m.to(device) for m in make_replicas(64, 32, 10, r)]
        params, buffers = stack(models)
        x, y = data.x_train[:32], data.y_train[:32]

        def loop(models=models, x=x, y=y):
            for _ in range(10):
                sgd_step_looped(models, x, y, 0.01)

        def batched(models=models, params=params, buffers=buffers, x=x, y=y):
            p = params
            for _ in range(10):
                p = sgd_step_batched(models[0], p, buffers, x, y, 0.01)

        cmp = compare({"loop": loop, "batched": batched}, warmup=2,
                      repeat=5 if quick else 15, device=device, threads=1)
        ratio = cmp.speedup("batched")
        lo, hi = cmp.speedup_range("batched")
        per_s = r * 10 / cmp.timings["batched"].median
        detail = (f"IQR {lo:.1f}-{hi:.1f}x; batched {per_s:.0f} replica-steps/s, loop "
                  f"{r * 10 / cmp.timings['loop'].median:.0f}; {cmp.threads} thread(s)")
        if not cmp.reliable:
            detail += "; unreliable (busy machine)"
        rows.append(Row(f"replicas R={r}", "Python loop of R models", "one vmap program",
                        ratio, str(device), "", None, detail))
    return rows
