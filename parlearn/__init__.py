"""parlearn: run parallelism in deep-learning training to understand it.

Importing parlearn is cheap and never starts JAX. Technique modules are imported
on use: ``import parlearn.dither`` or ``from parlearn import leapfrog``.
"""

from __future__ import annotations

import importlib

from . import device, settings, timing, viz

__version__ = "0.1.0"
__all__ = ["device", "settings", "timing", "viz", "__version__"]

_LAZY = {"basics", "bench", "datasets", "widgets", "leapfrog", "multigrid", "dither",
         "diffusion", "decoding", "dist", "dist_model", "collectives", "pipeline"}


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'parlearn' has no attribute {name!r}")
