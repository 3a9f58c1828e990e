"""Parallel equals serial on a mesh of JAX devices, in a child process when JAX already runs.

:func:`compare_sharded` runs :func:`~parlearn.many_copies.eigengame.training.fit` and
:func:`~parlearn.many_copies.eigengame.training.fit_sharded` side by side;
:func:`collective_bytes` reads the collectives XLA compiled into one sharded step; and
:func:`run_with_devices` calls any of the package's functions in a fresh Python with fake
CPU devices, since JAX fixes its device count when it starts.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from parlearn.core.checks import check_choice, check_float, check_int
from parlearn.many_copies.eigengame.game import _x64
from parlearn.many_copies.eigengame.training import (
    _batches,
    _check_devices,
    _check_fit,
    _fits_mesh,
    _mesh,
    _sharded_fit,
    fit,
    fit_sharded,
)

__all__ = ["compare_sharded", "collective_bytes", "run_with_devices"]

# ---------------------------------------------------------------------------------------------
# Parallel equals serial, on fake devices in a child process when JAX already runs here
# ---------------------------------------------------------------------------------------------

def compare_sharded(x: Any, k: int, mesh_shapes: Sequence[tuple[int, int]], **fit_kwargs
                    ) -> dict:
    """:func:`fit` and :func:`fit_sharded` on each of ``mesh_shapes`` with the same arguments.

    Returns ``{"serial": final (d, k) vectors, "sharded": {"DxP": final vectors},
    "max_abs_diff": {"DxP": max |sharded - serial| over all snapshots}}``. ``fit_kwargs``:
    :func:`fit`'s keyword arguments; every argument and mesh is checked before either runs.
    """
    if isinstance(mesh_shapes, str) or not isinstance(mesh_shapes, list | tuple):
        raise TypeError(f"mesh_shapes must be a list of (data, players) pairs, got "
                        f"{mesh_shapes!r}")
    if not mesh_shapes:
        raise ValueError("mesh_shapes must hold at least one (data, players) pair")
    meshes = [_mesh("mesh_shapes[i]", shape) for shape in mesh_shapes]
    params = inspect.signature(fit).parameters
    unknown = sorted(set(fit_kwargs) - {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY})
    if unknown:
        raise TypeError(f"compare_sharded got arguments fit does not take: {unknown}")
    args = {n: fit_kwargs.get(n, p.default) for n, p in params.items()
            if p.kind == p.KEYWORD_ONLY}
    _, k_, batch, *_ = _check_fit(x, k, args["method"], args["batch"], args["lr"],
                                  args["steps"], args["record_every"], args["seed"], args["v0"])
    for mesh in meshes:
        _fits_mesh("mesh_shapes[i]", mesh, batch, k_)
        _check_devices(*mesh)
    ref = fit(x, k, **fit_kwargs)
    out: dict = {"serial": ref["v"], "sharded": {}, "max_abs_diff": {}}
    for shape in mesh_shapes:
        res = fit_sharded(x, k, mesh_shape=tuple(shape), **fit_kwargs)
        name = f"{shape[0]}x{shape[1]}"
        out["sharded"][name] = res["v"]
        out["max_abs_diff"][name] = float(np.abs(res["snapshots"] - ref["snapshots"]).max())
    return out


_SIZES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "s64": 8, "pred": 1}


@_x64
def collective_bytes(x: Any, k: int, *, mesh_shape: tuple[int, int], batch: int,
                     method: str = "mu") -> dict[str, int]:
    """Bytes per device of the collectives XLA compiled into one :func:`fit_sharded` step.

    Reads the compiled HLO: ``{"all-reduce": bytes, "all-gather": bytes}``, each the total
    size of the arrays those ops return on one device (float64). Needs the mesh's devices.
    """
    import re

    if not isinstance(mesh_shape, tuple | list) or len(mesh_shape) != 2:
        raise TypeError(f"mesh_shape must be a pair (data, players), got {mesh_shape!r}")
    data, players = (check_int("mesh_shape", n, lo=1) for n in mesh_shape)
    x, k, batch, _, _, _, _, v0 = _check_fit(x, k, method, batch, 0.1, 1, 1, 0, None)
    if batch % data or k % players:
        raise ValueError(f"mesh {data}x{players}: batch={batch} must be a multiple of {data} "
                         f"and k={k} of {players}")
    run = _sharded_fit(data, players, method, 1, 1)
    text = run.lower(v0, _batches(x, batch, 0), 0.1).compile().as_text()
    out = {"all-reduce": 0, "all-gather": 0}
    for line in text.splitlines():
        m = re.search(r"=\s*(\S+)\s+(all-reduce|all-gather)(-start)?\(", line)
        if m:
            dt, dims = re.match(r"(\w+)\[([0-9,]*)\]", m.group(1)).groups()
            out[m.group(2)] += _SIZES[dt] * math.prod(int(n) for n in dims.split(",") if n)
    return out


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {"__array__": obj.tolist()}
    if isinstance(obj, dict):
        return {key: _jsonable(val) for key, val in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(val) for val in obj]
    return obj


def _from_json(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__array__"}:
            return np.asarray(obj["__array__"], dtype=np.float64)
        return {key: _from_json(val) for key, val in obj.items()}
    if isinstance(obj, list):
        return [_from_json(val) for val in obj]
    return obj


# What a child may call: every function parlearn.eigengame exports but run_with_devices and
# bench (the package's __all__ less those and METHODS, in its order).
_FUNCTIONS = ("synthetic_data", "init_vectors", "top_eigenvectors", "direction", "update", "fit",
              "fit_sharded", "abs_cosines", "longest_streak", "minibatch_bias", "compare_sharded",
              "collective_bytes", "throughput", "sharded_throughput")

_CHILD = ("import json, sys; from parlearn import eigengame as e; "
          "a = e._from_json(json.loads(sys.stdin.read())); "
          "print(json.dumps(e._jsonable(getattr(e, a['function'])(*a['args'], **a['kwargs']))))")


def run_with_devices(n_devices: int, function: str, *args: Any, timeout: float = 300,
                     **kwargs: Any) -> Any:
    """Call ``parlearn.eigengame.<function>(*args, **kwargs)`` in a fresh Python whose JAX
    has ``n_devices`` fake CPU devices, and return its result (numpy arrays round-trip).

    The device count is fixed when JAX starts, so a notebook or test where JAX may already
    run asks a child process (a few seconds of start-up and compilation).
    """
    n_devices = check_int("n_devices", n_devices, lo=1)
    check_choice("function", function, _FUNCTIONS)
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    # The checkout holding this parlearn (eigengame/ -> many_copies/ -> parlearn/ -> root),
    # first on the child's path, so the child runs this copy of the code.
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(n_devices), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    try:
        payload = json.dumps(_jsonable({"function": function, "args": list(args),
                                        "kwargs": kwargs}))
    except (TypeError, ValueError) as err:
        raise TypeError(f"args and kwargs of run_with_devices go to a child process as JSON "
                        f"(numbers, strings, lists, dicts, NumPy arrays): {err}") from None
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=payload, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the JAX child process failed:\n{proc.stderr[-3000:]}")
    return _from_json(json.loads(proc.stdout.strip().splitlines()[-1]))
