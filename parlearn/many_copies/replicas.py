"""Instant learning: R replicas of one network trained at once, and what pooling them buys.

Reconstruction of Simpson (2015), "Instant learning: parallel deep neural networks and
convolutional bootstrapping", arXiv 1505.05972, from its abstract and introduction: a DNN
is replicated many times, each replica is trained from its own starting weights, and the
replicas' predictions are integrated ("cumulative sampling of local solution space");
making each replica's copy of the training data independent (the paper names data
augmentation) is said to enhance this, under the name *convolutional bootstrapping*.

What this module implements, top to bottom:

* :func:`make_replicas` and :func:`stack`: R seeded MLPs and their parameters stacked
  along a leading replica axis (``torch.func.stack_module_state``);
* :func:`sgd_step_looped` (the serial reference: a Python loop over R models) beside
  :func:`sgd_step_batched` (one ``vmap`` of ``grad`` of a ``functional_call``): equal to
  round-off step by step when given the same data;
* pooling: :func:`ensemble_probs` (average the replicas' probabilities) and
  :func:`average_weights` (average their parameters, sound only near a shared
  initialisation), with :func:`permute_hidden` showing why (permutation symmetry);
* :func:`convolutional_bootstrap`: our reading of the paper's enhancement (see there);
* :func:`instant_learning`: accuracy vs wall time for several R; :func:`throughput` and
  :func:`bench`: replicas trained per second, batched vs looped, measured side by side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

from parlearn.core.bench import Row
from parlearn.core.checks import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_module,
    check_tensor,
)
from parlearn.core.device import threads as _threads
from parlearn.core.models import mlp
from parlearn.core.timing import compare, sweep

__all__ = ["make_replicas", "stack", "check_stacked", "sgd_step_looped", "sgd_step_batched",
           "predict", "ensemble_probs", "ensemble_nll", "mean_replica_nll", "accuracies",
           "average_weights", "permute_hidden", "convolutional_bootstrap", "train_batched",
           "train_looped", "BOOTSTRAPS", "instant_learning", "throughput", "bench"]

Params = dict[str, torch.Tensor]


# --- replicas and their stacked state ---------------------------------------------------


def make_replicas(n_in: int, hidden: int, n_out: int, replicas: int, *, seed: int = 0,
                  shared_init: bool = False, dtype: torch.dtype = torch.float32
                  ) -> list[nn.Sequential]:
    """``replicas`` MLPs ``n_in -> hidden -> ReLU -> n_out`` (:func:`parlearn.models.mlp`).

    Replica ``r`` is initialised from seed ``seed + r`` (its own starting weights, as in
    the paper), or every replica from ``seed`` when ``shared_init`` is True.
    """
    for name, v in (("n_in", n_in), ("hidden", hidden), ("n_out", n_out)):
        check_int(name, v, lo=1)
    replicas = check_int("replicas", replicas, lo=1)
    seed = check_int("seed", seed, lo=0)
    check_bool("shared_init", shared_init)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return [mlp([n_in, hidden, n_out], seed=seed if shared_init else seed + r, dtype=dtype)
            for r in range(replicas)]


def stack(models: Sequence[nn.Module]) -> tuple[Params, Params]:
    """``(params, buffers)`` of ``models`` stacked on a new leading axis of size R.

    The stacked tensors are fresh leaves (``torch.func.stack_module_state``): training
    them never touches the models. Models must share parameter names, shapes and dtypes.
    """
    if isinstance(models, nn.Module) or not isinstance(models, Sequence) or not models:
        raise TypeError(f"models must be a non-empty sequence of nn.Module, got {models!r}")
    first = check_module("models[0]", models[0])
    want = {k: (v.shape, v.dtype) for k, v in first.named_parameters()}
    for r, m in enumerate(models):
        check_module(f"models[{r}]", m)
        got = {k: (v.shape, v.dtype) for k, v in m.named_parameters()}
        if got != want:
            raise ValueError(f"models[{r}] has parameters {got}, unlike models[0]'s {want}")
    params, buffers = stack_module_state(list(models))
    return ({k: v.detach() for k, v in params.items()},
            {k: v.detach() for k, v in buffers.items()})


def check_stacked(base: nn.Module, params: Params) -> int:
    """R, the replica count of ``params``; ValueError unless every entry is ``base``'s
    parameter of that name with one leading axis of the same size R >= 1."""
    check_module("base", base)
    if not isinstance(params, dict):
        raise TypeError(f"params must be a dict of stacked tensors, got {type(params).__name__}")
    names = dict(base.named_parameters())
    if set(params) != set(names):
        raise ValueError(f"params has entries {sorted(params)}, base has {sorted(names)}")
    sizes = set()
    for k, v in params.items():
        check_tensor(f"params[{k!r}]", v, floating=True)
        if v.dim() != names[k].dim() + 1 or v.shape[1:] != names[k].shape:
            raise ValueError(f"params[{k!r}] must have shape (R, *{tuple(names[k].shape)}), "
                             f"got {tuple(v.shape)}")
        sizes.add(v.shape[0])
    if len(sizes) != 1:
        raise ValueError(f"params entries have different replica counts {sorted(sizes)}")
    return check_int("R", sizes.pop(), lo=1)


def _check_buffers(base: nn.Module, buffers: Params, r: int) -> None:
    """``buffers`` must be ``base``'s buffers, each with one leading axis of size ``r``."""
    if not isinstance(buffers, dict):
        raise TypeError(f"buffers must be a dict of stacked tensors, got "
                        f"{type(buffers).__name__}")
    names = dict(base.named_buffers())
    if set(buffers) != set(names):
        raise ValueError(f"buffers has entries {sorted(buffers)}, base has {sorted(names)}")
    for k, v in buffers.items():
        check_tensor(f"buffers[{k!r}]", v)
        if v.shape != (r, *names[k].shape):
            raise ValueError(f"buffers[{k!r}] must have shape ({r}, *{tuple(names[k].shape)}), "
                             f"got {tuple(v.shape)}")


def _check_model(name: str, model: nn.Module) -> nn.Module:
    """Refuse up front what the batched step cannot reproduce: a normalisation layer that
    updates running statistics in training mode (the loop would change the models' buffers,
    the batched step returns parameters only). In eval mode such a layer is fine."""
    check_module(name, model)
    for sub_name, sub in model.named_modules():
        if (isinstance(sub, nn.modules.batchnorm._NormBase) and sub.training
                and sub.track_running_stats):
            raise ValueError(f"{name} has {type(sub).__name__} {sub_name!r} in training mode: "
                             "its running statistics change on every forward, which the "
                             "replicated step does not carry; call .eval() on the model "
                             "first, or use one without running statistics")
    return model


def _check_data(x: torch.Tensor, y: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (n, d) or (R, n, d) floating, ``y`` (n,) or (R, n) integer, the same n."""
    check_tensor("x", x, ndim=(2, 3), floating=True)
    check_tensor("y", y, ndim=(1, 2), floating=False)
    if x.shape[-2] != y.shape[-1]:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} disagree on examples")
    if x.shape[-2] == 0:
        raise ValueError("x must hold at least one example, got 0")
    return _per_replica("x", x, r, 2), _per_replica("y", y, r, 1)


def _per_replica(name: str, t: torch.Tensor, r: int, ndim: int) -> torch.Tensor:
    """``t`` shared by all replicas (``ndim`` dims) or one per replica (``ndim + 1``)."""
    check_tensor(name, t, ndim=(ndim, ndim + 1))
    if t.dim() == ndim + 1 and t.shape[0] != r:
        raise ValueError(f"{name} has {t.shape[0]} per-replica slices, expected R={r}")
    return t if t.dim() == ndim + 1 else t.expand(r, *t.shape)


# --- one SGD step: the loop over models (reference) and the batched program --------------


def _loss(base: nn.Module, p: Params, fixed: Params, b: Params, x: torch.Tensor,
          y: torch.Tensor):
    # ``p``: the trainable parameters (differentiated); ``fixed``: the frozen ones.
    return nn.functional.cross_entropy(functional_call(base, ({**p, **fixed}, b), (x,)), y)


def sgd_step_looped(models: Sequence[nn.Module], x: torch.Tensor, y: torch.Tensor,
                    lr: float) -> list[float]:
    """Serial reference: for each model r, one SGD step ``p -= lr * grad CE(model(x_r), y_r)``.

    ``x`` is ``(n, d)`` shared or ``(R, n, d)`` per replica, ``y`` likewise. Trainable
    parameters are updated in place (a frozen one, ``requires_grad=False``, never moves);
    ``.grad`` is not touched (``torch.autograd.grad``). Returns the losses.
    """
    if isinstance(models, nn.Module) or not isinstance(models, Sequence) or not models:
        raise TypeError(f"models must be a non-empty sequence of nn.Module, got {models!r}")
    for i, m in enumerate(models):
        _check_model(f"models[{i}]", m)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    r = len(models)
    xs, ys = _check_data(x, y, r)
    losses = []
    for m, xr, yr in zip(models, xs, ys, strict=True):
        ps = [p for p in m.parameters() if p.requires_grad]
        loss = nn.functional.cross_entropy(m(xr), yr)
        if ps:
            with torch.no_grad():
                for p, g in zip(ps, torch.autograd.grad(loss, ps), strict=True):
                    p.sub_(lr * g)
        losses.append(loss.item())
    return losses


def sgd_step_batched(base: nn.Module, params: Params, buffers: Params, x: torch.Tensor,
                     y: torch.Tensor, lr: float) -> Params:
    """The same step for all R replicas in one program: ``vmap(grad(loss))`` over the
    replica axis of ``params`` (and of ``x``, ``y`` when they are per replica).

    Only ``base``'s trainable parameters are differentiated and stepped; a frozen one
    (``requires_grad=False``) is returned unchanged, as :func:`sgd_step_looped` leaves it.
    Returns the new stacked parameters (the inputs are not modified).
    """
    _check_model("base", base)
    r = check_stacked(base, params)
    _check_buffers(base, buffers, r)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    xs, ys = _check_data(x, y, r)
    trainable = {k for k, p in base.named_parameters() if p.requires_grad}
    train = {k: v for k, v in params.items() if k in trainable}
    fixed = {k: v for k, v in params.items() if k not in trainable}
    if not train:
        return dict(params)
    grads = vmap(grad(_loss, argnums=1), in_dims=(None, 0, 0, 0, 0, 0))(base, train, fixed,
                                                                        buffers, xs, ys)
    return {k: params[k] - lr * grads[k] if k in trainable else params[k] for k in params}


def predict(base: nn.Module, params: Params, buffers: Params, x: torch.Tensor) -> torch.Tensor:
    """Logits of every replica on the same inputs ``x`` (n, d): shape (R, n, classes)."""
    r = check_stacked(base, params)
    _check_buffers(base, buffers, r)
    check_tensor("x", x, ndim=2, floating=True)
    with torch.no_grad():
        return vmap(lambda p, b: functional_call(base, (p, b), (x,)))(params, buffers)


# --- pooling ------------------------------------------------------------------------------


def ensemble_probs(logits: torch.Tensor) -> torch.Tensor:
    """The ensemble's prediction: the replicas' softmax probabilities averaged, (n, classes)."""
    check_tensor("logits", logits, ndim=3, floating=True)
    return logits.softmax(-1).mean(0)


def _check_labels(logits: torch.Tensor, y: torch.Tensor) -> None:
    """``logits`` (R, n, C) floating, ``y`` (n,) integer labels in ``[0, C)``."""
    check_tensor("logits", logits, ndim=3, floating=True)
    check_tensor("y", y, shape=(logits.shape[1],), floating=False)
    c = logits.shape[2]
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= c):
        raise ValueError(f"y must hold labels in [0, {c - 1}], got values from {int(y.min())} "
                         f"to {int(y.max())}")


def ensemble_nll(logits: torch.Tensor, y: torch.Tensor) -> float:
    """Cross-entropy of the averaged probabilities: ``-mean_i log(mean_r p_r(y_i | x_i))``."""
    _check_labels(logits, y)
    p = ensemble_probs(logits)
    return -p.gather(1, y[:, None]).log().mean().item()


def mean_replica_nll(logits: torch.Tensor, y: torch.Tensor) -> float:
    """The replicas' cross-entropies averaged: ``mean_r -mean_i log p_r(y_i | x_i)``.

    By Jensen (``-log`` is convex) :func:`ensemble_nll` is never above this, for any logits.
    """
    _check_labels(logits, y)
    logp = logits.log_softmax(-1)
    return -logp.gather(2, y.expand(logits.shape[0], -1)[..., None]).mean().item()


def accuracies(logits: torch.Tensor, y: torch.Tensor) -> dict:
    """``{"replicas": [accuracy of each replica], "mean_replica", "ensemble"}`` on labels y.

    Unlike the cross-entropy, the ensemble's accuracy is *not* guaranteed to be at least
    the mean replica's: a majority of wrong replicas can outvote a right one.
    """
    _check_labels(logits, y)
    each = (logits.argmax(-1) == y).double().mean(1)
    ens = (ensemble_probs(logits).argmax(-1) == y).double().mean().item()
    return {"replicas": each.tolist(), "mean_replica": each.mean().item(), "ensemble": ens}


def average_weights(params: Params) -> Params:
    """The parameters averaged over the replica axis: one model's worth of parameters.

    Meaningful only when the replicas stayed in one basin, e.g. from a shared
    initialisation; from independent ones, hidden unit j of one replica need not match
    unit j of another (:func:`permute_hidden`) and the average is a different network.
    """
    if not isinstance(params, dict) or not params:
        raise TypeError("params must be a non-empty dict of stacked tensors")
    for k, v in params.items():
        check_tensor(f"params[{k!r}]", v, floating=True)
        if v.dim() == 0 or v.shape[0] == 0:
            raise ValueError(f"params[{k!r}] must have a leading replica axis of size >= 1, "
                             f"got shape {tuple(v.shape)}")
    return {k: v.mean(0) for k, v in params.items()}


def permute_hidden(params: Params, perm: torch.Tensor) -> Params:
    """One replica's MLP parameters (``0.weight``, ``0.bias``, ``2.weight``, ``2.bias``, as
    :func:`make_replicas` names them) with its hidden units reordered by ``perm``.

    The permuted network computes exactly the same function; averaging it with the
    original generally does not.
    """
    keys = {"0.weight", "0.bias", "2.weight", "2.bias"}
    if not isinstance(params, dict) or set(params) != keys:
        raise ValueError(f"params must hold exactly {sorted(keys)} (one hidden layer MLP)")
    h = params["0.weight"].shape[0]
    check_tensor("perm", perm, shape=(h,), floating=False)
    if not torch.equal(perm.sort().values, torch.arange(h, device=perm.device)):
        raise ValueError(f"perm must be a permutation of 0..{h - 1}")
    return {"0.weight": params["0.weight"][perm], "0.bias": params["0.bias"][perm],
            "2.weight": params["2.weight"][:, perm], "2.bias": params["2.bias"]}


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
    return out


BOOTSTRAPS = ("none", "resample", "convolutional")


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
    both cross-entropies and ``first_k`` (accuracy of the ensemble of the first k replicas).
    """
    rs = [check_int("replicas_list[]", r, lo=1) for r in replicas_list]
    if not rs:
        raise ValueError("replicas_list must name at least one replica count")
    check_choice("bootstrap", bootstrap, BOOTSTRAPS)
    check_bool("looped", looped)
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
    rs = [check_int("replicas_list[]", r, lo=1) for r in replicas_list]
    if not rs:
        raise ValueError("replicas_list must name at least one replica count")
    steps = check_int("steps", steps, lo=1)
    batch_size = check_int("batch_size", batch_size, lo=1)
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
