"""Argument checks of the rl functions: arrays, PRNG keys, rates (private).

The rl functions run eagerly and inside jitted programs (PPO calls :func:`gae`,
:func:`batch_step` and :func:`policy_logits_value` while tracing), so each check reads only
what a traced array has (shape, dtype) and checks the values (NaN, action ranges) only of
concrete arrays. Nothing here starts JAX: a JAX array or key means JAX is running already.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np

from parlearn.core.checks import check_float

KINDS = {"float": ("f", "a floating-point"), "int": ("iu", "an integer"), "bool": ("b", "a bool")}


def is_traced(x: Any) -> bool:
    """Whether ``x`` is a JAX tracer (an abstract value inside ``jit``, ``grad``, ``scan``)."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.core.Tracer)


def _dtype(name: str, x: Any) -> np.dtype:
    if isinstance(x, str | bytes) or not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be a NumPy or JAX array, got {type(x).__name__}")
    try:
        return np.dtype(x.dtype)
    except TypeError:
        raise TypeError(f"{name} must be a NumPy or JAX array, got {type(x).__name__} of "
                        f"dtype {x.dtype}") from None


def check_array(name: str, x: Any, *, ndim: int | None = None, kind: str = "float",
                finite: bool = True) -> tuple[int, ...]:
    """Refuse ``x`` unless it is an array of ``kind`` (``"float"``, ``"int"``, ``"bool"``) and
    rank ``ndim``; a concrete float array must also be finite. Returns its shape."""
    dtype = _dtype(name, x)
    codes, text = KINDS[kind]
    if dtype.kind not in codes:
        raise TypeError(f"{name} must be {text} array, got dtype {dtype}")
    shape = tuple(x.shape)
    if ndim is not None and len(shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {shape}")
    if finite and kind == "float" and not is_traced(x) and not np.isfinite(np.asarray(x)).all():
        raise ValueError(f"{name} must not contain NaN or infinity")
    return shape


def check_rate(name: str, value: Any) -> Any:
    """A number in [0, 1] (a discount, a GAE lambda); a 0-d float array counts, a tracer is
    passed on (it was checked where it was concrete, or is the caller's to check)."""
    if is_traced(value):
        return value
    if (hasattr(value, "shape") and hasattr(value, "dtype") and value.shape == ()
            and not isinstance(value, np.generic) and _dtype(name, value).kind == "f"):
        value = float(value)
    return check_float(name, value, lo=0, hi=1)


@functools.cache
def _raw_key_shape() -> tuple[int, ...]:
    import jax

    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


def check_keys(name: str, key: Any, batch: bool) -> int | None:
    """A JAX PRNG key (``jax.random.key``, or a raw ``uint32`` key such as
    ``jax.random.PRNGKey`` makes), or with ``batch`` a 1-D batch of them. Returns the batch
    size (None for one key)."""
    if isinstance(key, str | bytes) or not (hasattr(key, "shape") and hasattr(key, "dtype")):
        raise TypeError(f"{name} must be a JAX PRNG key (jax.random.key), got "
                        f"{type(key).__name__}")
    jax = sys.modules.get("jax")
    typed = jax is not None and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    if typed:
        lead = tuple(key.shape)
    else:
        if np.dtype(key.dtype) != np.uint32:
            raise TypeError(f"{name} must be a JAX PRNG key (jax.random.key) or raw uint32 "
                            f"key data, got dtype {key.dtype}")
        raw = _raw_key_shape()
        if tuple(key.shape[len(key.shape) - len(raw):]) != raw:
            raise ValueError(f"{name} holds raw key data of shape {raw} per key, got shape "
                             f"{tuple(key.shape)}")
        lead = tuple(key.shape[: len(key.shape) - len(raw)])
    want = 1 if batch else 0
    if len(lead) != want or (batch and lead[0] < 1):
        what = "a 1-D batch of at least one key" if batch else "one key (no batch axis)"
        raise ValueError(f"{name} must be {what}, got {lead or 'one key'} keys")
    return lead[0] if batch else None
