"""The plan on a JAX mesh: the collectives XLA inserts, read from the compiled HLO.

The planner of :mod:`parlearn.multi_device.tensor_parallel.plan` predicts the payload of
every collective a plan issues (its ``plan_collectives``); :func:`hlo_collectives`
constrains a dense chain to the same tilings on a mesh of fake CPU devices and reads back
what XLA actually put in, and :func:`bytes_by_kind` totals either side per kind, which is
what to compare.
"""

from __future__ import annotations

from collections.abc import Sequence

from parlearn.core.checks import check_float, check_int, check_ints
from parlearn.multi_device.tensor_parallel.plan import network, plan_collectives

__all__ = ["hlo_collectives", "bytes_by_kind"]


# ---------------------------------------------------------------------------------------
# The plan on a JAX mesh: the collectives XLA inserts, read from the compiled HLO.

_HLO_SCRIPT = r'''
import json, re, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
plans, batch, widths, devices = json.loads(sys.argv[1])
mesh = jax.make_mesh((devices,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
sh = lambda s: NamedSharding(mesh, s)
x_spec = {"batch": P("d", None), "column": P(None, None), "row": P(None, "d")}
w_spec = {"batch": P(None, None), "column": P(None, "d"), "row": P("d", None)}
y_spec = {"batch": P("d", None), "column": P(None, "d"), "row": P(None, None)}
size = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}

def collectives(cuts):
    def chain(ws, x):
        for i, (w, c) in enumerate(zip(ws, cuts)):
            x = jax.lax.with_sharding_constraint(x, sh(x_spec[c])) @ w
            x = jax.lax.with_sharding_constraint(x, sh(y_spec[c]))
            if i < len(cuts) - 1:
                x = jnp.tanh(x)
        return x

    def step(ws, x, g):  # the output (a loss needs it) and the weight gradients
        y, back = jax.vjp(lambda v: chain(v, x), ws)
        return y, back(g)[0]

    ws = [jnp.ones((widths[i], widths[i + 1]), jnp.float32) for i in range(len(cuts))]
    x = jnp.ones((batch, widths[0]), jnp.float32)
    g = jnp.ones((batch, widths[-1]), jnp.float32)
    fn = jax.jit(step, in_shardings=([sh(w_spec[c]) for c in cuts], sh(x_spec[cuts[0]]),
                                     sh(y_spec[cuts[-1]])),
                 out_shardings=(sh(y_spec[cuts[-1]]), [sh(w_spec[c]) for c in cuts]))
    ops = []
    for line in fn.lower(ws, x, g).compile().as_text().splitlines():
        line = re.sub(r"/\*index=[0-9]+\*/", "", line)  # tuple results carry these
        m = re.search(r"=\s*(\(?[^=]*?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                      r"collective-permute)(-start)?\(", line)
        if not m:
            continue
        total = 0  # a tuple-shaped op (one piece per peer, or fused ops) counts as one
        for dt, dims in re.findall(r"(f32|f64|bf16|f16|s32|u32|pred)\[([0-9,]*)\]",
                                   m.group(1)):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * size[dt]
        ops.append((m.group(2).replace("-", "_"), total))
    return ops

print(json.dumps([collectives(c) for c in plans]))
'''


def hlo_collectives(plans: Sequence[Sequence[str]], batch: int, widths: Sequence[int],
                    devices: int = 8, timeout: float = 300) -> list[list[tuple[str, int]]]:
    """For each plan (cuts, one per layer): ``(kind, bytes)`` of every collective XLA
    puts in one training step of the chain (output and weight gradients by ``jax.vjp``,
    float32, ``tanh`` between layers, the output's cotangent given in the output's tiling)
    when each layer's input, weight and output are constrained to the tilings of its cut,
    on a mesh of ``devices`` fake CPU devices. Bytes are of the shape the compiled HLO
    gives each op's result (summed over a tuple's elements: XLA fuses collectives and
    gives an all-to-all one element per peer): the payloads :func:`plan_collectives`
    predicts. Runs JAX in
    one subprocess with ``JAX_NUM_CPU_DEVICES`` set, so it works after JAX started here."""
    import json
    import os
    import subprocess
    import sys

    devices = check_int("devices", devices, lo=2)
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    widths = check_ints("widths", widths, lo=1)
    try:
        network(widths)
    except (TypeError, ValueError) as e:   # its message names "net": say which argument
        raise type(e)(f"widths: {e}") from None
    if isinstance(plans, str) or not isinstance(plans, Sequence):
        raise TypeError(f"plans must be a sequence of plans (one cut per layer), got {plans!r}")
    for i, p in enumerate(plans):
        if isinstance(p, str) or not isinstance(p, Sequence):
            raise TypeError(f"plans[{i}] must be a sequence of cuts, got {p!r}")
        try:
            plan_collectives(list(p), batch, widths, devices)  # validates cuts and sizes
        except (TypeError, ValueError) as e:
            raise type(e)(f"plans[{i}]: {e}") from None
    plans = [list(p) for p in plans]
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", _HLO_SCRIPT,
                           json.dumps([plans, batch, widths, devices])],
                          capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"the JAX subprocess failed:\n{done.stderr[-3000:]}")
    return [[(k, int(b)) for k, b in ops]
            for ops in json.loads(done.stdout.strip().splitlines()[-1])]


def bytes_by_kind(ops: Sequence[tuple]) -> dict[str, int]:
    """Total payload bytes per collective kind of ``ops`` (tuples ending ``kind, bytes``,
    as :func:`plan_collectives` and :func:`hlo_collectives` give them). Totals, not op
    lists, are what to compare: XLA fuses several all-reduces into one tuple-shaped op."""
    if isinstance(ops, (str, bytes)) or not isinstance(ops, Sequence):
        raise TypeError(f"ops must be a list of tuples ending (kind, bytes), got {ops!r}")
    for op in ops:
        if (not isinstance(op, (list, tuple)) or len(op) < 2 or not isinstance(op[-2], str)
                or isinstance(op[-1], bool) or not isinstance(op[-1], int) or op[-1] < 0):
            raise ValueError(f"ops must hold tuples ending (kind, bytes >= 0 as an int), got "
                             f"{op!r}")
    out: dict[str, int] = {}
    for *_, kind, nbytes in ops:
        out[kind] = out.get(kind, 0) + int(nbytes)
    return dict(sorted(out.items()))
