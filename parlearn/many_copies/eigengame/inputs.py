"""EigenGame's inputs and yardsticks: data whose eigenvectors are known, starting vectors,
the exact answer from ``numpy.linalg.eigh``, and how close the players came to it.

Plain numpy: nothing here starts JAX.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from parlearn.core.checks import check_float, check_int

__all__ = ["synthetic_data", "init_vectors", "top_eigenvectors", "abs_cosines", "longest_streak"]


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

def _data(name: str, x: Any) -> np.ndarray:
    """``x`` as a finite float64 (n, d) numpy array, or a clear error."""
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().numpy()
    if not isinstance(x, np.ndarray) and not hasattr(x, "__array__"):
        raise TypeError(f"{name} must be an array (n, d), got {type(x).__name__}")
    x = np.asarray(x)
    if x.ndim != 2 or min(x.shape) < 1:
        raise ValueError(f"{name} must be a 2-D array (n, d) with n, d >= 1, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"{name} must hold floating-point numbers, got {x.dtype}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} must not contain NaN or infinity")
    return x.astype(np.float64)


def _vectors(name: str, v: Any, d: int) -> np.ndarray:
    v = _data(name, v)
    if v.shape[0] != d:
        raise ValueError(f"{name} must have d={d} rows (one column per player), got {v.shape}")
    if v.shape[1] > d:
        raise ValueError(f"{name} has {v.shape[1]} players; at most d={d}")
    return v


def synthetic_data(n: int, d: int, *, decay: float = 0.7, seed: int = 0) -> np.ndarray:
    """``n`` centred Gaussian rows in ``d`` dimensions whose covariance has eigenvalues
    ``decay**i`` (i = 0..d-1) along random orthonormal directions.

    Distinct eigenvalues with a gap of ``1 - decay`` relative to the larger: the top
    eigenvectors are well defined. Uses ``numpy.random.default_rng(seed)`` only.
    """
    n, d = check_int("n", n, lo=2), check_int("d", d, lo=1)
    decay = check_float("decay", decay, lo=0, hi=1, lo_open=True, hi_open=True)
    seed = check_int("seed", seed, lo=0)
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    x = rng.standard_normal((n, d)) * np.sqrt(decay ** np.arange(d)) @ q.T
    return x - x.mean(axis=0)


def init_vectors(d: int, k: int, *, seed: int = 0) -> np.ndarray:
    """``k`` random unit columns in ``d`` dimensions (a (d, k) array), from ``seed``."""
    d, k = check_int("d", d, lo=1), check_int("k", k, lo=1, hi=d)
    v = np.random.default_rng(check_int("seed", seed, lo=0)).standard_normal((d, k))
    return v / np.linalg.norm(v, axis=0)


def _snapshots(name: str, x: Any) -> np.ndarray:
    """``x`` as a finite float64 array of one (d, k) or a stack (..., d, k), d, k >= 1."""
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().numpy()
    if not isinstance(x, np.ndarray) and not hasattr(x, "__array__"):
        raise TypeError(f"{name} must be an array (d, k) or (..., d, k), got {type(x).__name__}")
    x = np.asarray(x)
    if x.ndim < 2 or min(x.shape[-2:]) < 1:
        raise ValueError(f"{name} must be (d, k) or (..., d, k) with d, k >= 1, got {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"{name} must hold floating-point numbers, got {x.dtype}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} must not contain NaN or infinity")
    return x.astype(np.float64)


def top_eigenvectors(x: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(eigenvalues, eigenvectors)`` of ``M = X^T X / n`` from ``numpy.linalg.eigh``, the
    top ``k`` in decreasing order (vectors as the columns of a (d, k) array)."""
    x = _data("x", x)
    k = check_int("k", k, lo=1, hi=x.shape[1])
    lam, u = np.linalg.eigh(x.T @ x / x.shape[0])
    return lam[::-1][:k].copy(), u[:, ::-1][:, :k].copy()


# ---------------------------------------------------------------------------------------------
# Measures of convergence
# ---------------------------------------------------------------------------------------------

def abs_cosines(v: Any, u: Any) -> np.ndarray:
    """``|cos|`` between each player ``v[:, i]`` and eigenvector ``u[:, i]`` (1 = found it;
    the sign of an eigenvector is arbitrary). Works on one (d, k) array or a stack
    (..., d, k) of snapshots."""
    v, u = _snapshots("v", v), _snapshots("u", u)
    if v.shape[-2:] != u.shape[-2:]:
        raise ValueError(f"v and u must have the same (d, k) shape, got {v.shape}, {u.shape}")
    num = np.abs(np.sum(v * u, axis=-2))
    return num / (np.linalg.norm(v, axis=-2) * np.linalg.norm(u, axis=-2))


def longest_streak(v: Any, u: Any, *, angle: float = math.pi / 8) -> np.ndarray:
    """How many leading players in a row lie within ``angle`` radians of their eigenvector
    (Gemp et al.'s "longest correct eigenvector streak"); per snapshot for a stack."""
    angle = check_float("angle", angle, lo=0, hi=math.pi / 2, lo_open=True)
    ok = abs_cosines(v, u) >= math.cos(angle)
    return np.cumprod(ok, axis=-1).sum(axis=-1)
