"""Pooling R replicas: averaged probabilities, averaged weights, permutation symmetry."""

from __future__ import annotations

import torch

from parlearn.core.checks import (
    check_tensor,
)
from parlearn.many_copies.replicas.stacked import Params

__all__ = ["ensemble_probs", "ensemble_nll", "mean_replica_nll", "accuracies", "average_weights",
           "permute_hidden", "plurality_votes"]

# --- pooling ------------------------------------------------------------------------------


def ensemble_probs(logits: torch.Tensor) -> torch.Tensor:
    """The ensemble's prediction: the replicas' softmax probabilities averaged, (n, classes)."""
    check_tensor("logits", logits, ndim=3, floating=True)
    return logits.softmax(-1).mean(0)


def plurality_votes(logits: torch.Tensor) -> torch.Tensor:
    """Plurality vote of the first k replicas, for every k: ``(R, n)`` predicted classes.

    Row ``k - 1`` is the class most of replicas ``1..k`` predict (each replica votes
    for its argmax; a tie goes to the lowest class index). This is *voting*, the pooling
    Condorcet's jury theorem is about; :func:`ensemble_probs` averages probabilities
    instead, and so also counts how sure each replica is.
    """
    check_tensor("logits", logits, ndim=3, floating=True)
    votes = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).cumsum(0)
    return votes.argmax(-1)  # torch.argmax returns the first maximum: lowest class on ties


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
