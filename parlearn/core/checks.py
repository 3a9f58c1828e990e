"""Argument checks shared by every public function.

Each check raises before any work starts, with a message that names the argument,
what it must be and what it got. ``bool`` is never accepted as a number, NaN and
infinity never as a float (unless ``finite=False``), and nothing is clipped.

    n = check_int("workers", workers, lo=1)
    sizes = check_ints("sizes", sizes, lo=1, min_len=2)
    tau = check_float("tau", tau, lo=0, hi=1, lo_open=True)
    mode = check_choice("mode", mode, ("serial", "leapfrog"))
    x = check_tensor("x", x, ndim=2, floating=True)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = ["check_int", "check_ints", "check_float", "check_bool", "check_choice", "check_callable",
           "check_tensor", "check_module", "check_seed", "check_device", "check_str"]

T = TypeVar("T")


def _range_text(lo, hi, lo_open: bool = False, hi_open: bool = False) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi}")
    return " and ".join(parts)


def check_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an ``int`` in ``[lo, hi]``; bools and floats (even 4.0) are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an int {_range_text(lo, hi)}, got {value}")
    return value


def check_ints(name: str, value: Any, *, lo: int | None = None, hi: int | None = None,
               min_len: int = 1) -> list[int]:
    """``value`` as a ``list`` of ints, each in ``[lo, hi]``, at least ``min_len`` of them.

    A list, a tuple or a 1-D NumPy array counts; a string, a set, a scalar or a tensor does not.
    Each element is checked like :func:`check_int` (so a bool or a float is refused, and its
    error names ``name[i]``).
    """
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise TypeError(f"{name} must be a sequence of ints, got a {value.ndim}-D array")
        value = list(value)
    elif isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {value!r}")
    out = [check_int(f"{name}[{i}]", v, lo=lo, hi=hi) for i, v in enumerate(value)]
    if len(out) < min_len:
        raise ValueError(f"{name} must hold at least {min_len} int{'s' if min_len > 1 else ''}, "
                         f"got {out}")
    return out


def check_float(name: str, value: Any, *, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, hi_open: bool = False, finite: bool = True) -> float:
    """``value`` as a ``float`` in the given range; NaN and (by default) +-inf are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{name} must be a finite number, got {value}")
    bad = ((lo is not None and (value < lo or (lo_open and value == lo)))
           or (hi is not None and (value > hi or (hi_open and value == hi))))
    if bad:
        raise ValueError(f"{name} must be {_range_text(lo, hi, lo_open, hi_open)}, got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a real ``bool`` (not 0/1, not a string; NumPy's bool counts)."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _same_choice(value: Any, choice: Any) -> bool:
    """``value == choice`` with the kinds kept apart: ``True == 1`` and ``1.0 == 1`` in Python,
    but a bool is never a number, and a float never stands for an int choice."""
    if isinstance(value, bool) != isinstance(choice, bool):
        return False
    if isinstance(choice, numbers.Integral) and not isinstance(value, numbers.Integral):
        return False
    try:
        return bool(value == choice)
    except (TypeError, ValueError, RuntimeError):  # tensors, arrays: never a choice
        return False


def check_choice(name: str, value: T, choices: Iterable[T]) -> T:
    """``value`` if it is one of ``choices`` (``True`` is not ``1``, ``1.0`` is not ``1``)."""
    choices = tuple(choices)
    for choice in choices:
        if _same_choice(value, choice):
            return choice
    raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_callable(name: str, value: Any) -> Callable:
    """``value`` if it can be called."""
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {type(value).__name__}")
    return value


def check_module(name: str, value: Any) -> torch.nn.Module:
    """``value`` if it is a ``torch.nn.Module``."""
    if not isinstance(value, torch.nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(value).__name__}")
    return value


def check_tensor(name: str, value: Any, *, ndim: int | Sequence[int] | None = None,
                 shape: Sequence[int | None] | None = None, floating: bool | None = None,
                 dtype: torch.dtype | None = None, finite: bool = False) -> torch.Tensor:
    """``value`` if it is a tensor of the given rank, shape, dtype kind.

    ``shape`` may hold ``None`` for any size. ``floating=True`` asks for a floating
    dtype, ``floating=False`` for an integer one. ``finite=True`` refuses NaN/inf.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{name} must have {want} dimensions, got shape "
                             f"{tuple(value.shape)}")
    if shape is not None:
        ok = value.dim() == len(shape) and all(
            s is None or s == v for s, v in zip(shape, value.shape, strict=True))
        if not ok:
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name} must have shape {want}, got {tuple(value.shape)}")
    if dtype is not None and value.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {value.dtype}")
    if floating is True and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if floating is False and (value.is_floating_point() or value.is_complex()
                              or value.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    if finite and value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise ValueError(f"{name} must not contain NaN or infinity")
    return value


def check_seed(name: str, value: Any) -> int | torch.Generator:
    """A seed: an int >= 0 or a ``torch.Generator``."""
    if isinstance(value, torch.Generator):
        return value
    return check_int(name, value, lo=0)


def check_str(name: str, value: Any) -> str:
    """``value`` if it is a ``str`` (a label, a name: free text, but text)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {value!r} ({type(value).__name__})")
    return value


def check_device(name: str, value: Any) -> torch.device:
    """``value`` (a ``torch.device`` or a string such as ``"cpu"``, ``"cuda:0"``) as a device;
    torch's own RuntimeError for a bad string becomes a ValueError naming the argument."""
    if isinstance(value, torch.device):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a torch.device or a str such as 'cpu' or 'cuda', got "
                        f"{value!r} ({type(value).__name__})")
    try:
        return torch.device(value)
    except RuntimeError:
        raise ValueError(f"{name} must name a device such as 'cpu', 'cuda' or 'cuda:1', got "
                         f"{value!r}") from None
