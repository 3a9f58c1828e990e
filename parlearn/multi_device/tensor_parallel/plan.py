"""Automatic parallelisation plans on a communication cost model.

SoyBean (Wang, Huang, Li 2018, arXiv 1805.04170) asks how to tile every tensor of a network
so that communication is smallest; data and model parallelism are special cases. Here a
network is a chain of layers (:class:`Dense`: ``Y = X W``; :class:`Conv`: a 1-D convolution,
stride 1, "same" padding), and each layer takes one **cut** over the device groups:

- ``batch``: split the batch (data parallel): the weight gradient is all-reduced;
- ``column``: split the output features/channels: the input must be replicated, and its
  gradient is all-reduced (when it is needed: the network's input is data);
- ``row``: split the input features/channels: the partial sums of ``Y`` are all-reduced;
- ``spatial`` (convolutions only): split the positions, with a halo exchange of the
  ``(kernel - 1) / 2`` cells next to each boundary forward and its adjoint (halo gradients
  added back to their owners) backward, and, the weight being replicated, its gradient
  all-reduced as under ``batch``.

A cut fixes the tiling its input needs and the tiling its output leaves (``r`` rows/batch
split, ``c`` features/channels split, ``s`` positions split, ``R`` replicated); between
layers a conversion re-tiles the activation and the adjoint conversion re-tiles its
gradient. The cost of a plan (:func:`plan_cost`) is the ring bytes each group sends
(:func:`parlearn.dist.cost.ring_bytes`) over all of them: a sum of per-layer terms and of
terms between neighbours, so a dynamic program over the chain finds the optimum
(:func:`best_one_cut`; serial reference :func:`brute_force_cut`). Biases are ignored.

For ``2^k`` devices SoyBean applies the one-cut optimum recursively: cut in two, then cut
each half in two on the local shapes the first cut left (:func:`recursive_plan`). Every
level is priced as a separate one-cut over 2 groups on the local shapes (so a batch cut at
two levels costs two all-reduces of ``|W|``, as a hierarchical all-reduce would).
:func:`joint_plan` minimises the same total over all ``k``-level tilings at once (a dynamic
program over each layer's sequence of cuts; serial reference :func:`brute_force_joint`).
In this model the greedy recursion is **not** always optimal: it never beats the joint
optimum (it is one of the plans the joint search considers) and it can be worse (the
lesson shows a case). SoyBean presents its recursion as optimal under its own cost
formulation, which we did not reproduce; the claim does not carry over to this model.

SplitBrain (2021) trains convolutions data-parallel and the fully-connected layers
model-parallel. Here that hybrid (every :class:`Conv` ``batch``, every :class:`Dense`
``column`` or ``row``) is simply one point of the planner's space: it is chosen exactly
when it is cheapest (:func:`is_splitbrain`; ``allowed=`` of :func:`best_one_cut` prices the
best hybrid and the best pure data-parallel plan for comparison). Our reconstruction from
the paper's abstract, on a 1-D convolution and the bytes-only model.

Alpa (Zheng et al. 2022) plans at two levels, pipeline stages x sharding inside each stage;
:func:`two_level_plan` is a much simplified version on a flop/byte model.

Reconstructions throughout: the cost formulations are ours, not the papers'. The dense
chain's predicted bytes are checked against the collectives XLA inserts on a JAX mesh of
fake CPU devices (:func:`hlo_collectives`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from parlearn.core.checks import check_choice, check_float, check_int

__all__ = ["Dense", "Conv", "CUTS", "CONV_CUTS", "network", "plan_collectives", "plan_cost",
           "best_one_cut", "brute_force_cut", "recursive_plan", "joint_plan",
           "brute_force_joint", "plan_levels_cost", "is_splitbrain", "hlo_collectives",
           "bytes_by_kind", "two_level_plan"]


# ---------------------------------------------------------------------------------------
# Layers and what each cut of each layer communicates.

CUTS = ("batch", "column", "row")
"""The cuts of a :class:`Dense` layer ``(B x d_in) @ (d_in x d_out)``: along the batch,
along ``d_out`` (W by columns), along ``d_in`` (W by rows, partial sums). Replicating an
operator's work is not offered: with communication as the only cost it would always win,
which is why SoyBean splits every operator."""

CONV_CUTS = ("batch", "column", "row", "spatial")
"""The cuts of a :class:`Conv` layer: batch, output channels, input channels, positions."""

# The tiling of X a cut needs, and the tiling of Y it leaves.
_NEEDS = {"batch": "r", "column": "R", "row": "c", "spatial": "s"}
_LEAVES = {"batch": "r", "column": "c", "row": "R", "spatial": "s"}


@dataclass(frozen=True)
class Dense:
    """``Y = X W`` with ``X`` of shape ``(B, d_in)``. Local dims: ``(B, d_in, d_out)``."""

    d_in: int
    d_out: int

    cuts: ClassVar[tuple[str, ...]] = CUTS
    axis: ClassVar[dict[str, int]] = {"batch": 0, "row": 1, "column": 2}  # dim each cut divides

    def dims(self, batch: int) -> tuple[int, ...]:
        return (batch, self.d_in, self.d_out)

    def in_features(self) -> int:
        return self.d_in

    def out_features(self) -> int:
        return self.d_out

    @staticmethod
    def flops(dims: Sequence[int]) -> float:  # forward multiply-adds x 2
        b, di, do = dims
        return 2.0 * b * di * do

    @staticmethod
    def in_bytes(dims: Sequence[int], itemsize: int) -> int:
        return dims[0] * dims[1] * itemsize

    @staticmethod
    def collectives(cut: str, dims: Sequence[int], itemsize: int, need_dx: bool,
                    groups: int) -> list[tuple[str, str, int]]:
        """``(phase, kind, payload bytes)`` of the layer's own collectives under ``cut`` on
        local ``dims`` over ``groups`` groups; ``need_dx``: its input's gradient is used."""
        b, di, do = dims
        x, w, y = b * di * itemsize, di * do * itemsize, b * do * itemsize
        if cut == "batch":
            return [("backward", "all_reduce", w)]  # dW: every group holds a partial sum
        if cut == "column":
            return [("backward", "all_reduce", x)] if need_dx else []  # dX partial sums
        return [("forward", "all_reduce", y)]  # the partial sums of Y


@dataclass(frozen=True)
class Conv:
    """A 1-D convolution ``c_in -> c_out`` channels over ``length`` positions, odd
    ``kernel``, stride 1, "same" zero padding; flattened channel-major when a
    :class:`Dense` follows. Local dims: ``(B, c_in, c_out, length)``."""

    c_in: int
    c_out: int
    length: int
    kernel: int = 3

    cuts: ClassVar[tuple[str, ...]] = CONV_CUTS
    axis: ClassVar[dict[str, int]] = {"batch": 0, "row": 1, "column": 2, "spatial": 3}

    def dims(self, batch: int) -> tuple[int, ...]:
        return (batch, self.c_in, self.c_out, self.length)

    def in_features(self) -> int:
        return self.c_in * self.length

    def out_features(self) -> int:
        return self.c_out * self.length

    def flops(self, dims: Sequence[int]) -> float:
        b, ci, co, n = dims
        return 2.0 * b * ci * co * self.kernel * n

    @staticmethod
    def in_bytes(dims: Sequence[int], itemsize: int) -> int:
        return dims[0] * dims[1] * dims[3] * itemsize

    def collectives(self, cut: str, dims: Sequence[int], itemsize: int, need_dx: bool,
                    groups: int) -> list[tuple[str, str, int]]:
        """As :meth:`Dense.collectives`; a halo is a ``send`` (per group, worst case)."""
        b, ci, co, n = dims
        x, w, y = b * ci * n * itemsize, ci * co * self.kernel * itemsize, b * co * n * itemsize
        if cut == "batch":
            return [("backward", "all_reduce", w)]
        if cut == "column":
            return [("backward", "all_reduce", x)] if need_dx else []
        if cut == "row":
            return [("forward", "all_reduce", y)]
        # spatial: a group sends its (kernel-1)/2 boundary cells of every channel and sample
        # to each neighbour (one neighbour when there are two groups) forward; backward the
        # adjoint sends the halo gradients back (if dX is needed); the weight is replicated.
        halo = (self.kernel - 1) // 2 * b * ci * itemsize * min(2, groups - 1)
        out = [("forward", "send", halo)] if halo else []
        if halo and need_dx:
            out.append(("backward", "send", halo))
        return out + [("backward", "all_reduce", w)]


Layer = Dense | Conv


def network(net: Sequence) -> list[Layer]:
    """``net`` as a list of layers: widths ``(d_0, ..., d_L)`` of a chain of :class:`Dense`
    layers, or a list of :class:`Dense` / :class:`Conv` layers whose sizes chain (a layer's
    input features equal the previous layer's output features)."""
    net = list(net)
    if net and all(isinstance(n, Dense | Conv) for n in net):
        layers = net
    else:
        widths = [check_int("widths", w, lo=1) for w in net]
        if len(widths) < 2:
            raise ValueError("widths needs at least 2 entries (one layer)")
        layers = [Dense(widths[i], widths[i + 1]) for i in range(len(widths) - 1)]
    for layer in layers:
        for name, v in vars(layer).items():
            check_int(name, v, lo=1)
        if isinstance(layer, Conv) and layer.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd (same padding), got {layer.kernel}")
    for a, b in itertools.pairwise(layers):
        if a.out_features() != b.in_features():
            raise ValueError(f"layer sizes do not chain: {a} gives {a.out_features()} "
                             f"features, {b} takes {b.in_features()}")
    return layers


def _input_tiling(prev: Layer, layer: Layer, tiling: str) -> str:
    # A conv's position split, flattened, is a split of the dense layer's input features
    # (each group owns the features of its positions; a row cut takes W's matching rows).
    if isinstance(prev, Conv) and isinstance(layer, Dense) and tiling == "s":
        return "c"
    return tiling


def _conversion(src: str, dst: str, size: int, groups: int) -> list[tuple[str, str, int]]:
    """Collectives to re-tile an activation of ``size`` bytes from ``src`` to ``dst`` and
    its gradient back (the adjoint movement): R -> split is a free slice whose adjoint is an
    all-gather; split -> R an all-gather whose adjoint is a free slice; split -> another
    split an all-to-all both ways (payload: one group's block, ``size / groups``)."""
    if src == dst:
        return []
    if src == "R":
        return [("backward", "all_gather", size)]
    if dst == "R":
        return [("forward", "all_gather", size)]
    return [("forward", "all_to_all", size // groups), ("backward", "all_to_all", size // groups)]


def _cost(items) -> float:
    from parlearn.dist.cost import ring_bytes

    return float(sum(ring_bytes(k, n, g) for g, (*_, k, n) in items))


def _feasible(layer: Layer, dims: Sequence[int], groups: int,
              allowed: Sequence[str] | None = None) -> list[str]:
    """The cuts of ``layer`` that divide its local dims evenly over ``groups`` (a spatial
    cut also needs each block at least as long as the halo: neighbours only)."""
    return [c for c in (layer.cuts if allowed is None else allowed)
            if dims[layer.axis[c]] % groups == 0
            and (c != "spatial" or dims[3] // groups >= (layer.kernel - 1) // 2)]


def _level_terms(layers: list[Layer], dims: list[Sequence[int]], cuts: Sequence[str],
                 groups: int, itemsize: int) -> list[tuple[int, str, str, int]]:
    """The collectives of one level: ``(layer, phase, kind, bytes)``."""
    out = []
    for i, (layer, d, cut) in enumerate(zip(layers, dims, cuts, strict=True)):
        if i:
            src = _input_tiling(layers[i - 1], layer, _LEAVES[cuts[i - 1]])
            out += [(i, *t) for t in _conversion(src, _NEEDS[cut],
                                                 layer.in_bytes(d, itemsize), groups)]
        out += [(i, *t) for t in layer.collectives(cut, d, itemsize, i > 0, groups)]
    return out


def _check_cuts(layers: list[Layer], cuts: Sequence[str]) -> None:
    if len(cuts) != len(layers):
        raise ValueError(f"cuts must have one entry per layer ({len(layers)}), "
                         f"got {len(cuts)}")
    for layer, cut in zip(layers, cuts, strict=True):
        check_choice("cuts", cut, layer.cuts)


def plan_collectives(cuts: Sequence[str], batch: int, net: Sequence, groups: int = 2,
                     itemsize: int = 4) -> list[tuple[int, str, str, int]]:
    """The collectives one training step of ``net`` (see :func:`network`) issues under
    ``cuts`` (one per layer) over ``groups`` groups: ``(layer, phase, kind, payload
    bytes)``. The input's gradient is not needed (it is data), the input arrives in
    whatever tiling layer 0 needs, the output is left in its layer's tiling."""
    layers = network(net)
    batch = check_int("batch", batch, lo=1)
    groups = check_int("groups", groups, lo=2)
    _check_cuts(layers, cuts)
    return _level_terms(layers, [x.dims(batch) for x in layers], cuts, groups, itemsize)


def plan_cost(cuts: Sequence[str], batch: int, net: Sequence, groups: int = 2,
              itemsize: int = 4) -> float:
    """Bytes each group sends in one step under ``cuts``: the ring bytes
    (:func:`parlearn.dist.cost.ring_bytes`) of every collective of :func:`plan_collectives`
    (a halo ``send`` counts its payload once)."""
    groups = check_int("groups", groups, lo=2)
    return _cost((groups, t) for t in plan_collectives(cuts, batch, net, groups, itemsize))


def _chain_dp(layers: list[Layer], states: list[list], node, edge) -> tuple[list, float]:
    """Minimise ``sum_l node(l, s_l) + sum_l edge(l, s_{l-1}, s_l)`` over one state per
    layer from ``states[l]``: the best path ending in state ``s`` at layer ``l`` extends a
    best path ending at layer ``l-1``. Ties go to the earlier state."""
    best = {s: (node(0, s), [s]) for s in states[0]}
    for i in range(1, len(layers)):
        best = {s: min(((c + edge(i, p, s) + node(i, s), path + [s])
                        for p, (c, path) in best.items()), key=lambda t: t[0])
                for s in states[i]}
    if not best:
        raise ValueError("no layer can be cut evenly: every cut needs a divisible size")
    cost, path = min(best.values(), key=lambda t: t[0])
    return path, cost


def best_one_cut(batch: int, net: Sequence, groups: int = 2, itemsize: int = 4,
                 allowed: Sequence[Sequence[str]] | None = None) -> tuple[list[str], float]:
    """The cuts minimising :func:`plan_cost`, by dynamic programming over the chain (the
    cost is a sum of per-layer terms and terms between consecutive layers). Only cuts that
    divide their dimension evenly by ``groups`` are considered; ``allowed`` (one sequence
    of cut names per layer) restricts the search further. ``O(L * 16)`` term evaluations."""
    layers = network(net)
    batch = check_int("batch", batch, lo=1)
    groups = check_int("groups", groups, lo=2)
    dims = [x.dims(batch) for x in layers]
    if allowed is not None:
        if len(allowed) != len(layers):
            raise ValueError(f"allowed must have one entry per layer ({len(layers)})")
        for layer, a in zip(layers, allowed, strict=True):
            for c in a:
                check_choice("allowed", c, layer.cuts)
    states = [_feasible(x, d, groups, None if allowed is None else allowed[i])
              for i, (x, d) in enumerate(zip(layers, dims, strict=True))]
    return _best_dims(layers, dims, states, groups, itemsize)


def _best_dims(layers: list[Layer], dims: list[Sequence[int]], states: list[list[str]],
               groups: int, itemsize: int, first_dx: bool = False) -> tuple[list[str], float]:
    """The DP of :func:`best_one_cut` on given local dims; ``first_dx``: the first layer's
    input gradient is needed too (a pipeline stage after the first)."""
    def node(i, c):
        return _cost((groups, t) for t in layers[i].collectives(c, dims[i], itemsize,
                                                                 i > 0 or first_dx, groups))

    def edge(i, p, c):
        src = _input_tiling(layers[i - 1], layers[i], _LEAVES[p])
        return _cost((groups, t) for t in _conversion(src, _NEEDS[c],
                                                      layers[i].in_bytes(dims[i], itemsize),
                                                      groups))

    return _chain_dp(layers, states, node, edge)


def brute_force_cut(batch: int, net: Sequence, groups: int = 2,
                    itemsize: int = 4) -> tuple[list[str], float]:
    """The serial reference of :func:`best_one_cut`: every plan of evenly dividing cuts."""
    layers = network(net)
    states = [_feasible(x, x.dims(batch), groups) for x in layers]
    return min(((list(p), plan_cost(p, batch, layers, groups, itemsize))
                for p in itertools.product(*states)), key=lambda t: t[1])


def is_splitbrain(cuts: Sequence[str], net: Sequence) -> bool:
    """Whether ``cuts`` is SplitBrain's hybrid: every convolution cut along the batch (data
    parallel) and every dense layer along its features (``column`` or ``row``)."""
    layers = network(net)
    _check_cuts(layers, cuts)
    return all((c == "batch") if isinstance(x, Conv) else c in ("column", "row")
               for x, c in zip(layers, cuts, strict=True))


# ---------------------------------------------------------------------------------------
# 2^k devices: SoyBean's recursion (greedy, level by level) against the joint optimum.

def _halve(layer: Layer, dims: Sequence[int], cut: str) -> tuple[int, ...]:
    d = list(dims)
    d[layer.axis[cut]] //= 2
    return tuple(d)


def plan_levels_cost(per_level: Sequence[Sequence[str]], batch: int, net: Sequence,
                     itemsize: int = 4) -> float:
    """Bytes each device sends under a ``k``-level tiling (cuts per level, level 1 first):
    the sum over levels of the one-cut cost over 2 groups on the local shapes the earlier
    levels left. Every cut must halve an even size."""
    layers = network(net)
    dims = [x.dims(check_int("batch", batch, lo=1)) for x in layers]
    total = 0.0
    for cuts in per_level:
        _check_cuts(layers, cuts)
        for x, d, c in zip(layers, dims, cuts, strict=True):
            if d[x.axis[c]] % 2:
                raise ValueError(f"a {c} cut needs an even size, got local dims {d} of {x}")
        total += _cost((2, t) for t in _level_terms(layers, dims, cuts, 2, itemsize))
        dims = [_halve(x, d, c) for x, d, c in zip(layers, dims, cuts, strict=True)]
    return total


def recursive_plan(batch: int, net: Sequence, levels: int,
                   itemsize: int = 4) -> tuple[list[list[str]], float]:
    """SoyBean's recursion for ``2^levels`` devices: the best one cut over 2 groups
    (:func:`best_one_cut`), then again inside each half on the local shapes that cut left,
    ``levels`` times. Returns the cuts per level and :func:`plan_levels_cost` of them.
    Greedy: each level is optimal given the levels before it, not jointly (compare
    :func:`joint_plan`)."""
    levels = check_int("levels", levels, lo=1)
    layers = network(net)
    batch = check_int("batch", batch, lo=1)
    dims = [x.dims(batch) for x in layers]
    per_level, total = [], 0.0
    for _ in range(levels):
        states = [_feasible(x, d, 2) for x, d in zip(layers, dims, strict=True)]
        if not all(states):
            raise ValueError(f"a layer has no even size left to cut at level "
                             f"{len(per_level) + 1}: local dims {dims}")
        cuts, cost = _best_dims(layers, dims, states, 2, itemsize)
        per_level.append(cuts)
        total += cost
        dims = [_halve(x, d, c) for x, d, c in zip(layers, dims, cuts, strict=True)]
    return per_level, total


def _sequences(layer: Layer, dims: Sequence[int], levels: int) -> list[tuple]:
    """Every sequence of ``levels`` cuts of ``layer`` that halves an even size each time,
    with the local dims before each level."""
    out = [((), (tuple(dims),))]
    for _ in range(levels):
        out = [(seq + (c,), ds + (_halve(layer, ds[-1], c),))
               for seq, ds in out for c in _feasible(layer, ds[-1], 2)]
    return [(seq, ds[:-1]) for seq, ds in out]


def joint_plan(batch: int, net: Sequence, levels: int,
               itemsize: int = 4) -> tuple[list[list[str]], float]:
    """The ``levels``-level tiling minimising :func:`plan_levels_cost` jointly. A layer's
    own terms depend only on its own sequence of cuts, a conversion only on the two
    neighbours' sequences, so a dynamic program over the chain whose states are each
    layer's whole sequence of cuts (at most ``4^levels``) is exact. Returns the cuts per
    level and the cost."""
    levels = check_int("levels", levels, lo=1)
    layers = network(net)
    batch = check_int("batch", batch, lo=1)
    seqs = [_sequences(x, x.dims(batch), levels) for x in layers]
    if not all(seqs):
        raise ValueError(f"a layer cannot be halved {levels} times evenly")

    def node(i, s):
        return _cost((2, t) for c, d in zip(*s, strict=True)
                     for t in layers[i].collectives(c, d, itemsize, i > 0, 2))

    def edge(i, p, s):
        return _cost((2, t) for cp, c, d in zip(p[0], *s, strict=True)
                     for t in _conversion(_input_tiling(layers[i - 1], layers[i], _LEAVES[cp]),
                                          _NEEDS[c], layers[i].in_bytes(d, itemsize), 2))

    path, cost = _chain_dp(layers, seqs, node, edge)
    return [[s[0][k] for s in path] for k in range(levels)], cost


def brute_force_joint(batch: int, net: Sequence, levels: int,
                      itemsize: int = 4) -> tuple[list[list[str]], float]:
    """The serial reference of :func:`joint_plan`: :func:`plan_levels_cost` of every
    ``levels``-level tiling of evenly dividing cuts."""
    layers = network(net)
    seqs = [[s for s, _ in _sequences(x, x.dims(batch), levels)] for x in layers]
    best = None
    for combo in itertools.product(*seqs):
        per_level = [[s[k] for s in combo] for k in range(levels)]
        cost = plan_levels_cost(per_level, batch, layers, itemsize)
        if best is None or cost < best[1]:
            best = (per_level, cost)
    if best is None:
        raise ValueError(f"a layer cannot be halved {levels} times evenly")
    return best


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
    widths = [check_int("widths", w, lo=1) for w in widths]
    plans = [list(p) for p in plans]
    for p in plans:
        plan_collectives(p, batch, widths, devices)  # validates cuts and sizes
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
    out: dict[str, int] = {}
    for *_, kind, nbytes in ops:
        out[kind] = out.get(kind, 0) + int(nbytes)
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------
# An Alpa-style two-level plan on the cost model: pipeline stages x sharding inside each.

def _stage_time(batch: int, layers: list[Layer], i: int, j: int, group: int, last: bool,
                flops_per_s: float, bytes_per_s: float, itemsize: int) -> tuple[float, list]:
    """Modeled seconds one microbatch of ``batch`` rows spends in stage ``[i, j)`` on
    ``group`` devices (compute, its intra-stage collectives, and sending its activation
    forward and receiving that gradient back), and the stage's cuts. A stage after the
    first needs its input's gradient (it goes back to the previous stage)."""
    stage = layers[i:j]
    dims = [x.dims(batch) for x in stage]
    flops = 3.0 * sum(x.flops(d) for x, d in zip(stage, dims, strict=True))  # fwd + 2x bwd
    if group > 1:
        states = [_feasible(x, d, group) for x, d in zip(stage, dims, strict=True)]
        cuts, comm = _best_dims(stage, dims, states, group, itemsize, first_dx=i > 0)
    else:
        cuts, comm = ["whole"] * (j - i), 0.0  # one device holds each layer
    p2p = 0.0 if last else 2.0 * batch * layers[j - 1].out_features() * itemsize
    return flops / group / flops_per_s + (comm + p2p) / bytes_per_s, cuts


def two_level_plan(batch: int, net: Sequence, devices: int, microbatches: int,
                   flops_per_s: float, bytes_per_s: float, itemsize: int = 4) -> dict:
    """The plan minimising modeled step time ``(m + S - 1) * max_s t_s`` (GPipe's schedule
    with ``m`` microbatches over ``S`` stages) for ``devices`` devices and ``net`` (see
    :func:`network`): ``S`` divides ``devices``, each stage is a contiguous run of layers on
    ``devices / S`` devices, and each stage's layers take the communication-optimal one cut
    over its devices. The inner problem (contiguous split minimising the slowest stage) is
    a dynamic program over (stages, layers); the outer one tries every ``S``. Data
    parallelism (``S = 1``, all cuts batch), tensor parallelism (``S = 1``, column/row), a
    pure pipeline (one device per stage) and SplitBrain's hybrid are all points of it.

    A simplified reconstruction of Alpa's two levels (Alpa solves the inner level by an
    ILP over a richer sharding space and profiles stages): here times are modeled from
    flops and bytes only, every collective is paid per microbatch (weight gradients are
    synchronised as each microbatch produces them, as DDP does without ``no_sync``), and
    no memory limit is imposed. Returns ``{"step_s", "stages" ([start, end) per stage),
    "group", "cuts" (per stage; ``"whole"`` on one device), "stage_s"}``."""
    layers = network(net)
    batch = check_int("batch", batch, lo=1)
    devices = check_int("devices", devices, lo=1)
    m = check_int("microbatches", microbatches, lo=1)
    flops_per_s = check_float("flops_per_s", flops_per_s, lo=0, lo_open=True)
    bytes_per_s = check_float("bytes_per_s", bytes_per_s, lo=0, lo_open=True)
    if batch % m:
        raise ValueError(f"batch {batch} must be divisible by microbatches={m}")
    n_layers, mb = len(layers), batch // m
    best = None
    for stages in range(1, min(n_layers, devices) + 1):
        if devices % stages:
            continue
        group = devices // stages
        if group > 1 and mb % group:
            continue  # a batch cut could not split the microbatch evenly
        t = {(i, j): _stage_time(mb, layers, i, j, group, j == n_layers, flops_per_s,
                                 bytes_per_s, itemsize)
             for i in range(n_layers) for j in range(i + 1, n_layers + 1)}
        # dp[s][j]: the smallest slowest-stage time covering layers [0, j) with s stages.
        dp = [{0: (0.0, [])}] + [{} for _ in range(stages)]
        for s in range(1, stages + 1):
            for j in range(s, n_layers - (stages - s) + 1):
                dp[s][j] = min(((max(dp[s - 1][i][0], t[i, j][0]), dp[s - 1][i][1] + [(i, j)])
                                for i in range(s - 1, j) if i in dp[s - 1]),
                               key=lambda v: v[0])
        slowest, parts = dp[stages][n_layers]
        step = (m + stages - 1) * slowest
        if best is None or step < best["step_s"]:
            best = {"step_s": step, "stages": parts, "group": group,
                    "cuts": [t[p][1] for p in parts], "stage_s": [t[p][0] for p in parts]}
    if best is None:
        raise ValueError(f"no plan: the microbatch ({mb} rows) splits evenly over none of "
                         f"the device groups that divide devices={devices}")
    return best
