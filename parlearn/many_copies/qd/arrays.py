"""Argument checks for the QD arrays (NumPy or JAX): shapes always, values where they are
known (under ``jax.jit`` they are tracers). JAX is imported inside the functions."""

from __future__ import annotations

from typing import Any

import numpy as np


def _traced(a: Any) -> bool:
    """Whether ``a`` is a JAX tracer (inside ``jax.jit``/``vmap``: shapes known, values not)."""
    import jax

    return isinstance(a, jax.core.Tracer)


def _array(name: str, a: Any, shape: tuple[int | None, ...]) -> Any:
    """``a`` if it is a floating NumPy or JAX array of ``shape`` (None: any size), else a
    TypeError/ValueError naming ``name``. Values are not looked at (see :func:`_values`)."""
    import jax

    if not isinstance(a, np.ndarray | jax.Array):
        raise TypeError(f"{name} must be a NumPy or JAX array, got {type(a).__name__}")
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"{name} must hold floating-point numbers, got dtype {a.dtype}")
    ok = len(a.shape) == len(shape) and all(
        s is None or s == n for s, n in zip(shape, a.shape, strict=True))
    if not ok:
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{name} must have shape {want}, got {tuple(a.shape)}")
    return a


def _values(name: str, a: Any, *, unit: bool = False, neg_inf: bool = False) -> None:
    """Refuse NaN (and +-inf, or only +inf with ``neg_inf``) in ``a``, and with ``unit``
    any value outside [0, 1]. Under ``jax.jit`` the values are tracers: nothing to check."""
    if _traced(a):
        return
    v = np.asarray(a)
    if np.isnan(v).any() or np.isposinf(v).any() or (not neg_inf and np.isneginf(v).any()):
        allowed = "-inf (a child that never enters) but no NaN or +inf" if neg_inf else \
            "no NaN or infinity"
        raise ValueError(f"{name} must hold finite numbers ({allowed}), got {v.ravel()[:8]}")
    if unit and v.size and (v.min() < 0 or v.max() > 1):
        raise ValueError(f"{name} must lie in [0, 1], got values from {v.min()} to {v.max()}")


def _check_key(name: str, key: Any) -> None:
    """One JAX PRNG key: a typed key of shape (), or a raw uint32 array of shape (2,)."""
    import jax

    if not isinstance(key, np.ndarray | jax.Array):
        raise TypeError(f"{name} must be a JAX PRNG key (jax.random.key(seed)), got "
                        f"{type(key).__name__}")
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(f"{name} must be one key (shape ()), got shape {key.shape}")
    elif key.dtype != np.uint32 or tuple(key.shape) != (2,):
        raise ValueError(f"{name} must be a JAX PRNG key: a typed key or a uint32 array of "
                         f"shape (2,), got dtype {key.dtype} shape {tuple(key.shape)}")
