"""Automatic parallelisation plans on a communication cost model: one cut per layer.

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
(:func:`parlearn.distributed.cost.ring_bytes`) over all of them: a sum of per-layer terms and of
terms between neighbours, so a dynamic program over the chain finds the optimum
(:func:`best_one_cut`; serial reference :func:`brute_force_cut`). Biases are ignored.

SplitBrain (2021) trains convolutions data-parallel and the fully-connected layers
model-parallel. Here that hybrid (every :class:`Conv` ``batch``, every :class:`Dense`
``column`` or ``row``) is simply one point of the planner's space: it is chosen exactly
when it is cheapest (:func:`is_splitbrain`; ``allowed=`` of :func:`best_one_cut` prices the
best hybrid and the best pure data-parallel plan for comparison). Our reconstruction from
the paper's abstract, on a 1-D convolution and the bytes-only model.

Plans over ``2^k`` devices and Alpa's two levels build on this one cut in
:mod:`parlearn.multi_device.tensor_parallel.plan_levels`; the predicted bytes are checked
against XLA in :mod:`parlearn.multi_device.tensor_parallel.plan_hlo`. Reconstructions
throughout: the cost formulations are ours, not the papers'.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from parlearn.core.checks import check_choice, check_int

__all__ = ["Dense", "Conv", "CUTS", "CONV_CUTS", "network", "plan_collectives", "plan_cost",
           "best_one_cut", "brute_force_cut", "is_splitbrain"]


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

    def __post_init__(self):
        check_int("d_in", self.d_in, lo=1)
        check_int("d_out", self.d_out, lo=1)

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

    def __post_init__(self):
        for name in ("c_in", "c_out", "length", "kernel"):
            check_int(name, getattr(self, name), lo=1)
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd (same padding), got {self.kernel}")

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
    if isinstance(net, (str, bytes)) or not isinstance(net, Sequence):
        raise TypeError(f"net must be a list of widths or of Dense/Conv layers, got {net!r}")
    net = list(net)
    if net and all(isinstance(n, Dense | Conv) for n in net):
        layers = net
    else:
        widths = [check_int("net", w, lo=1) for w in net]
        if len(widths) < 2:
            raise ValueError(f"net needs at least 2 widths (one layer), got {net}")
        layers = [Dense(widths[i], widths[i + 1]) for i in range(len(widths) - 1)]
    for layer in layers:
        for name, v in vars(layer).items():
            check_int(name, v, lo=1)
        if isinstance(layer, Conv) and layer.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd (same padding), got {layer.kernel}")
    for a, b in itertools.pairwise(layers):
        if a.out_features() != b.in_features():
            raise ValueError(f"net: layer sizes do not chain: {a} gives {a.out_features()} "
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
    from parlearn.distributed.cost import ring_bytes

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


def _check_cuts(layers: list[Layer], cuts: Sequence[str], name: str = "cuts",
                dims: list[Sequence[int]] | None = None, groups: int | None = None) -> None:
    """``cuts`` one cut name per layer; with ``dims`` and ``groups``, each cut must divide
    its dimension evenly (a modeled uneven split would be silently wrong bytes)."""
    if isinstance(cuts, (str, bytes)) or not isinstance(cuts, Sequence):
        raise TypeError(f"{name} must be a list of cut names, got {cuts!r}")
    if len(cuts) != len(layers):
        raise ValueError(f"{name} must have one entry per layer ({len(layers)}), "
                         f"got {len(cuts)}")
    for i, (layer, cut) in enumerate(zip(layers, cuts, strict=True)):
        check_choice(name, cut, layer.cuts)
        if dims is not None and groups is not None and cut not in _feasible(
                layer, dims[i], groups, [cut]):
            raise ValueError(f"{name}[{i}]={cut!r} must split {layer} evenly: local dims "
                             f"{tuple(dims[i])} (batch first) over groups={groups}")


def _check_itemsize(itemsize) -> int:
    return check_int("itemsize", itemsize, lo=1)


def plan_collectives(cuts: Sequence[str], batch: int, net: Sequence, groups: int = 2,
                     itemsize: int = 4) -> list[tuple[int, str, str, int]]:
    """The collectives one training step of ``net`` (see :func:`network`) issues under
    ``cuts`` (one per layer) over ``groups`` groups: ``(layer, phase, kind, payload
    bytes)``. The input's gradient is not needed (it is data), the input arrives in
    whatever tiling layer 0 needs, the output is left in its layer's tiling."""
    layers = network(net)
    batch = check_int("batch", batch, lo=1)
    groups = check_int("groups", groups, lo=2)
    itemsize = _check_itemsize(itemsize)
    dims = [x.dims(batch) for x in layers]
    _check_cuts(layers, cuts, dims=dims, groups=groups)
    return _level_terms(layers, dims, cuts, groups, itemsize)


def plan_cost(cuts: Sequence[str], batch: int, net: Sequence, groups: int = 2,
              itemsize: int = 4) -> float:
    """Bytes each group sends in one step under ``cuts``: the ring bytes
    (:func:`parlearn.distributed.cost.ring_bytes`) of every collective of :func:`plan_collectives`
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
    itemsize = _check_itemsize(itemsize)
    dims = [x.dims(batch) for x in layers]
    if allowed is not None:
        if isinstance(allowed, (str, bytes)) or not isinstance(allowed, Sequence) or any(
                isinstance(a, (str, bytes)) or not isinstance(a, Sequence) for a in allowed):
            raise TypeError(f"allowed must be a list of cut-name lists, got {allowed!r}")
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
    batch = check_int("batch", batch, lo=1)
    groups = check_int("groups", groups, lo=2)
    itemsize = _check_itemsize(itemsize)
    states = [_feasible(x, x.dims(batch), groups) for x in layers]
    if not all(states):
        raise ValueError(f"no plan: a layer of net has no cut that divides evenly over "
                         f"groups={groups} at batch={batch}")
    return min(((list(p), plan_cost(p, batch, layers, groups, itemsize))
                for p in itertools.product(*states)), key=lambda t: t[1])


def is_splitbrain(cuts: Sequence[str], net: Sequence) -> bool:
    """Whether ``cuts`` is SplitBrain's hybrid: every convolution cut along the batch (data
    parallel) and every dense layer along its features (``column`` or ``row``)."""
    layers = network(net)
    _check_cuts(layers, cuts)
    return all((c == "batch") if isinstance(x, Conv) else c in ("column", "row")
               for x, c in zip(layers, cuts, strict=True))
