"""FAST mode and the size presets lessons read.

Lessons pick every size through :func:`size`, so one environment variable,
``PARLEARN_FAST=1``, shrinks a whole lesson to run headless in about a minute
(that is how the test suite executes them). Without it, lessons use sizes worth
looking at.
"""

from __future__ import annotations

import os
from typing import TypeVar

__all__ = ["ENV_VAR", "is_fast", "size", "banner"]

ENV_VAR = "PARLEARN_FAST"

T = TypeVar("T")


def is_fast() -> bool:
    """True when ``PARLEARN_FAST`` is set to ``1`` (read at call time, not import time)."""
    value = os.environ.get(ENV_VAR, "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"{ENV_VAR} must be '0' or '1', got {value!r}")
    return value == "1"


def size(*, full: T, fast: T) -> T:
    """Return ``fast`` in FAST mode and ``full`` otherwise.

    >>> size(full=1024, fast=64)  # doctest: +SKIP
    """
    return fast if is_fast() else full


def banner() -> str:
    """One line saying which mode is on; lessons print it in their first cell."""
    if is_fast():
        return f"FAST mode is ON ({ENV_VAR}=1): small sizes, as in the test suite."
    return f"FAST mode is off: full sizes. Set {ENV_VAR}=1 before starting Jupyter to shrink them."
