"""parlearn: run parallelism in deep-learning training to understand it.

Importing parlearn is cheap and never starts JAX. Technique modules are imported
on use: ``import parlearn.dither`` or ``from parlearn import leapfrog``.
"""

from __future__ import annotations

import importlib
import importlib.util

from . import device, settings, timing, viz

__version__ = "0.1.0"
__all__ = ["device", "settings", "timing", "viz", "__version__"]

def __getattr__(name: str):
    # Any technique module on first use (``parlearn.dist``), so new modules need no list here.
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'parlearn' has no attribute {name!r}")
