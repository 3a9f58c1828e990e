"""parlearn: run parallelism in deep-learning training to understand it.

The package is laid out as the course (``lessons/NN_*.ipynb``, the tens digit the part):

- ``core``: device, timing, settings, checks, viz, widgets, datasets, the bench's rows and
  their GPU reference figures, and lesson 00's basics;
- ``distributed`` (short name ``dist``): real ``torch.distributed`` ranks, the collectives
  ledger, the alpha-beta model, collectives from send/recv (lesson 10);
- ``multi_device``: Part 1, training on many devices (lessons 11-19);
- ``serial_chain``: Part 2, beyond backprop's serial chain (lessons 20-29);
- ``many_copies``: Part 3, many copies at once (lessons 30-39);
- ``elsewhere``: Part 4, the same parallel patterns elsewhere in ML (lessons 40-49).

Every technique also answers to its short name, which is what lessons and users type:
``from parlearn import pipeline`` and ``import parlearn.pipeline`` give the very module
object ``parlearn.multi_device.pipeline`` is (:data:`SHORT_NAMES` is the map). Importing
parlearn is cheap and never starts JAX: a technique is imported on first use.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"
__all__ = ["SHORT_NAMES", "__version__"]

# short name -> where the module lives, in course order.
SHORT_NAMES: dict[str, str] = {
    # core
    "device": "core.device", "timing": "core.timing", "settings": "core.settings",
    "checks": "core.checks", "viz": "core.viz", "widgets": "core.widgets",
    "datasets": "core.datasets", "models": "core.models", "basics": "core.basics",
    "recipe": "core.recipe", "overhead": "core.overhead", "reference": "core.reference",
    # distributed (lesson 10); the folder is not named "dist": pytest, ruff and .gitignore
    # templates all skip folders of that name by default.
    "dist": "distributed",
    "collectives": "distributed.collectives", "card": "distributed.card",
    # Part 1: training on many devices
    "data_parallel": "multi_device.data_parallel",
    "compression": "multi_device.data_parallel.compression",
    "stragglers": "multi_device.data_parallel.stragglers",
    "sharding": "multi_device.sharding",
    "pipeline": "multi_device.pipeline",
    "tensor_parallel": "multi_device.tensor_parallel",
    "batching": "multi_device.batching",
    "transformer": "multi_device.transformer",
    "memory": "multi_device.memory",
    "context_parallel": "multi_device.context_parallel",
    "moe": "multi_device.moe",
    "mesh": "multi_device.mesh",
    "planner": "multi_device.mesh.planner",
    # Part 2: beyond backprop's serial chain
    "leapfrog": "serial_chain.leapfrog",
    "multigrid": "serial_chain.multigrid",
    "local": "serial_chain.local",
    "neq": "serial_chain.neq",
    "repurpose": "serial_chain.repurpose",
    "strads": "serial_chain.strads",
    "duality": "serial_chain.duality",
    # Part 3: many copies at once
    "dither": "many_copies.dither",
    "qd": "many_copies.qd",
    "rl": "many_copies.rl",
    "eigengame": "many_copies.eigengame",
    "diffusion": "many_copies.diffusion",
    "decoding": "many_copies.decoding",
    "replicas": "many_copies.replicas",
    # Part 4: the same patterns elsewhere in ML
    "value": "elsewhere.value",
    "filters": "elsewhere.filters",
    "nmf": "elsewhere.nmf",
    # Part 5: running it for real
    "mfu": "at_scale.mfu",
    "hangs": "at_scale.hangs",
    "checkpoint": "at_scale.checkpoint",
    "train": "at_scale.train",
}


def _home(fullname: str) -> str | None:
    """``parlearn.pipeline.x`` -> ``parlearn.multi_device.pipeline.x``; None if not a short name."""
    top, _, rest = fullname.partition(".")
    short, _, tail = rest.partition(".")
    if top != __name__ or short not in SHORT_NAMES:
        return None
    return f"{__name__}.{SHORT_NAMES[short]}" + (f".{tail}" if tail else "")


class _ShortNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import ``parlearn.<short>[.sub]`` as the module that lives at its home: one module
    object under two names, so ``isinstance`` checks and pickled workers agree."""

    def find_spec(self, fullname, path=None, target=None):
        home = _home(fullname)
        if home is None or importlib.util.find_spec(home) is None:
            return None   # not a short name, or no such module at home: ModuleNotFoundError
        return importlib.util.spec_from_loader(fullname, self, origin=home)

    def create_module(self, spec):
        module = importlib.import_module(spec.origin)
        spec.loader_state = module.__spec__  # the home spec, which importlib overwrites next
        return module

    # runpy (``python -m parlearn.dist``, ``torchrun -m parlearn.dist``) asks the loader whether
    # the name is a package and for its code: answer for the home module.
    def is_package(self, fullname):
        return importlib.util.find_spec(_home(fullname)).submodule_search_locations is not None

    def get_code(self, fullname):
        home = _home(fullname)
        return importlib.util.find_spec(home).loader.get_code(home)

    def exec_module(self, module):
        # Already executed under its home name; importlib has just set ``__spec__`` to the
        # alias's spec, so put the home spec back (reload, pickle and -m look there).
        module.__spec__ = module.__spec__.loader_state


# First on the path: for ``parlearn.data_parallel.workers`` the parent's ``__path__`` is the
# home folder, so the ordinary path finder would load a second copy under the alias name.
if not any(isinstance(f, _ShortNames) for f in sys.meta_path):
    sys.meta_path.insert(0, _ShortNames())


def __getattr__(name: str):
    if name in SHORT_NAMES:
        return importlib.import_module(f"{__name__}.{SHORT_NAMES[name]}")
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # a part: parlearn.multi_device
    raise AttributeError(f"module 'parlearn' has no attribute {name!r}")
