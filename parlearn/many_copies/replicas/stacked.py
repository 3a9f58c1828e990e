"""R replicas as one stacked state; one SGD step looped (the reference) and batched."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

from parlearn.core.checks import (
    check_bool,
    check_float,
    check_int,
    check_module,
    check_tensor,
)
from parlearn.core.models import mlp

Params = dict[str, torch.Tensor]


__all__ = ["make_replicas", "stack", "check_stacked", "sgd_step_looped", "sgd_step_batched",
           "predict"]

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
