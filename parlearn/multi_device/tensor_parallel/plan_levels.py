"""Plans over many levels: SoyBean's 2^k recursion, the joint optimum, Alpa's two levels.

For ``2^k`` devices SoyBean applies the one-cut optimum of
:mod:`parlearn.multi_device.tensor_parallel.plan` recursively: cut in two, then cut
each half in two on the local shapes the first cut left (:func:`recursive_plan`). Every
level is priced as a separate one-cut over 2 groups on the local shapes (so a batch cut at
two levels costs two all-reduces of ``|W|``, as a hierarchical all-reduce would).
:func:`joint_plan` minimises the same total over all ``k``-level tilings at once (a dynamic
program over each layer's sequence of cuts; serial reference :func:`brute_force_joint`).
In this model the greedy recursion is **not** always optimal: it never beats the joint
optimum (it is one of the plans the joint search considers) and it can be worse (the
lesson shows a case). SoyBean presents its recursion as optimal under its own cost
formulation, which we did not reproduce; the claim does not carry over to this model.

Alpa (Zheng et al. 2022) plans at two levels, pipeline stages x sharding inside each stage;
:func:`two_level_plan` is a much simplified version on a flop/byte model.

Reconstructions throughout: the cost formulations are ours, not the papers'.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from parlearn.core.checks import check_float, check_int
from parlearn.multi_device.tensor_parallel.plan import (
    _LEAVES,
    _NEEDS,
    Layer,
    _best_dims,
    _chain_dp,
    _check_cuts,
    _check_itemsize,
    _conversion,
    _cost,
    _feasible,
    _input_tiling,
    _level_terms,
    network,
)

__all__ = ["plan_levels_cost", "recursive_plan", "joint_plan", "brute_force_joint",
           "two_level_plan"]


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
    itemsize = _check_itemsize(itemsize)
    if isinstance(per_level, (str, bytes)) or not isinstance(per_level, Sequence) or not (
            per_level):
        raise TypeError(f"per_level must be a non-empty list of cut lists, got {per_level!r}")
    for cuts in per_level:   # every level's names checked before any cost is summed
        _check_cuts(layers, cuts, "per_level")
    total = 0.0
    for cuts in per_level:
        for x, d, c in zip(layers, dims, cuts, strict=True):
            if d[x.axis[c]] % 2:
                raise ValueError(f"per_level: a {c} cut needs an even size, got local dims "
                                 f"{d} of {x} (batch={batch})")
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
    itemsize = _check_itemsize(itemsize)
    dims = [x.dims(batch) for x in layers]
    per_level, total = [], 0.0
    for _ in range(levels):
        states = [_feasible(x, d, 2) for x, d in zip(layers, dims, strict=True)]
        if not all(states):
            raise ValueError(f"levels={levels}: a layer has no even size left to cut at level "
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
        if not out:   # no even size left: more levels cannot bring one back
            break
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
    itemsize = _check_itemsize(itemsize)
    seqs = [_sequences(x, x.dims(batch), levels) for x in layers]
    if not all(seqs):
        raise ValueError(f"levels={levels}: a layer of net cannot be halved that many times "
                         f"evenly at batch={batch}")

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
    levels = check_int("levels", levels, lo=1)
    layers = network(net)
    batch = check_int("batch", batch, lo=1)
    itemsize = _check_itemsize(itemsize)
    seqs = [[s for s, _ in _sequences(x, x.dims(batch), levels)] for x in layers]
    best = None
    for combo in itertools.product(*seqs):
        per_level = [[s[k] for s in combo] for k in range(levels)]
        cost = plan_levels_cost(per_level, batch, layers, itemsize)
        if best is None or cost < best[1]:
            best = (per_level, cost)
    if best is None:
        raise ValueError(f"levels={levels}: a layer of net cannot be halved that many times "
                         f"evenly at batch={batch}")
    return best


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
    itemsize = _check_itemsize(itemsize)
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
