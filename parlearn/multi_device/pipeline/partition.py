"""Cutting the layers into stages: the equal split, and balanced by measured cost (LAMP).

A partition is a list of layer counts, one per stage (:func:`split_layers` turns it into
layer ranges). The private helpers at the end serve the runtimes: the shape and dtype of
what each stage receives, probed from the data, and the refusal of a weight tied across a
cut. :func:`partition_equal` is the naive split; :func:`partition_balanced` the
contiguous split whose slowest stage is fastest, from per-layer costs such as the
measured :func:`layer_costs`, in the spirit of LAMP.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from parlearn.core.checks import check_float, check_int, check_ints, check_module, check_tensor

__all__ = ["split_layers", "partition_equal", "partition_balanced", "stage_costs",
           "layer_costs"]


# ---------------------------------------------------------------------------------------
# Partitioning (in the spirit of LAMP): balanced contiguous stages from measured costs.

def _costs(costs) -> list[float]:
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Sequence):
        raise TypeError(f"costs must be a list of numbers, got {costs!r}")
    if not costs:
        raise ValueError("costs must list at least one layer")
    return [check_float("costs", c, lo=0) for c in costs]


def split_layers(n_layers: int, counts: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` layer ranges of the stages with ``counts[s]`` layers each."""
    n_layers = check_int("n_layers", n_layers, lo=1)
    counts = check_ints("counts", counts, lo=1)
    if sum(counts) != n_layers:
        raise ValueError(f"counts {counts} must add up to n_layers={n_layers}")
    ends = [sum(counts[:i + 1]) for i in range(len(counts))]
    return [(e - c, e) for e, c in zip(ends, counts, strict=True)]


def partition_equal(n_layers: int, stages: int) -> list[int]:
    """The naive split: layer counts as equal as they can be (the first stages get the
    extra ones), whatever each layer costs."""
    n_layers = check_int("n_layers", n_layers, lo=1)
    stages = check_int("stages", stages, lo=1, hi=n_layers)
    q, r = divmod(n_layers, stages)
    return [q + (s < r) for s in range(stages)]


def stage_costs(costs: Sequence[float], counts: Sequence[int]) -> list[float]:
    """The summed cost of each stage's layers."""
    costs = _costs(costs)
    if isinstance(counts, Sequence) and not isinstance(counts, (str, bytes)) and all(
            isinstance(c, int) for c in counts) and sum(counts) != len(costs):
        raise ValueError(f"costs has {len(costs)} layers but counts {list(counts)} add up to "
                         f"{sum(counts)}")
    return [sum(costs[a:b]) for a, b in split_layers(len(costs), counts)]


def partition_balanced(costs: Sequence[float], stages: int) -> list[int]:
    """Layer counts of the contiguous split of ``costs`` into ``stages`` non-empty stages
    whose largest stage cost is smallest (the slowest stage sets a pipeline's pace).
    Dynamic programming: ``best[k][i]`` = the smallest max-stage cost of the first ``i``
    layers in ``k`` stages ``= min_j max(best[k-1][j], sum(costs[j:i]))``; O(P n^2)."""
    costs = _costs(costs)
    n = len(costs)
    stages = check_int("stages", stages, lo=1, hi=max(n, 1))
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], n
    for k in range(stages, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def layer_costs(model: nn.Sequential, x: torch.Tensor, *, repeat: int = 5) -> list[float]:
    """Measured seconds of each layer's forward + backward on the activations ``x`` would
    give it (median of ``repeat`` timed runs after one warm-up), with one intra-op thread:
    what each rank of :func:`run_pipeline` runs with (the caller's count is restored)."""
    from parlearn.core.timing import measure

    check_module("model", model)
    check_tensor("x", x, ndim=2)
    if not isinstance(model, nn.Sequential):
        raise TypeError("model must be an nn.Sequential whose elements are the layers")
    repeat = check_int("repeat", repeat, lo=1)
    _probe(model, x, None)   # x fits the layers, or it names the one that fails (no RNG used)
    costs, h = [], x.detach()
    for layer in model:
        inp = h.detach().requires_grad_(True)
        layer_copy = copy.deepcopy(layer)

        def step(layer=layer_copy, inp=inp):
            out = layer(inp)
            # Frozen parameters take no gradient (autograd refuses them).
            torch.autograd.grad(out.sum(), [inp, *(p for p in layer.parameters()
                                                   if p.requires_grad)])

        costs.append(measure(step, warmup=1, repeat=repeat, threads=1).median)
        with torch.no_grad():
            h = layer(h)
    return costs


# ---------------------------------------------------------------------------------------
# What a cut must respect: the shapes each stage receives, weights tied across stages.

def _trainable(layers: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The parameters of ``layers`` that take a gradient, each once (a weight tied between
    two layers is one tensor), in ``parameters()`` order: what a stage trains."""
    seen: set[int] = set()
    out = []
    for layer in layers:
        for p in layer.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _probe(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor | None
           ) -> list[tuple[torch.Size, torch.dtype]]:
    """Per-row shape and dtype of every layer's input, then of the model's output: what
    each stage receives, found from the data (a stage may begin with any layer, not only
    an ``nn.Linear`` whose ``in_features`` would tell). Runs copies of the layers one by one
    on the first rows of ``x``, here, before any rank starts, so a model that cannot run
    is refused naming its layer; the global RNG and the layers' buffers are untouched."""
    h = x[:2].detach()
    specs = [(h.shape[1:], h.dtype)]
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for i, layer in enumerate(model):
            try:
                out = copy.deepcopy(layer)(h)
            except Exception as err:
                raise ValueError(f"model[{i}] ({type(layer).__name__}) fails on the "
                                 f"activations x gives it: {err}") from err
            if not isinstance(out, torch.Tensor) or out.dim() < 1 or len(out) != len(h):
                raise ValueError(f"model[{i}] ({type(layer).__name__}) must return one "
                                 "tensor with a row per input row, to be cut into "
                                 "micro-batches")
            specs.append((out.shape[1:], out.dtype))
            h = out
    if y is not None and specs[-1][0] != y.shape[1:]:
        raise ValueError(f"y has rows of shape {tuple(y.shape[1:])} but the model outputs "
                         f"rows of shape {tuple(specs[-1][0])}")
    return specs


def _check_ties(model: nn.Sequential, bounds: Sequence[tuple[int, int]]) -> None:
    """Refuse a parameter shared by layers cut into different stages: each rank would
    train its own copy of it (a weight tied within one stage is fine)."""
    where: dict[int, tuple[int, int]] = {}
    for s, (a, b) in enumerate(bounds):
        for i in range(a, b):
            for p in model[i].parameters():
                first = where.setdefault(id(p), (s, i))
                if first[0] != s:
                    raise ValueError(f"model[{first[1]}] and model[{i}] share a parameter "
                                     f"but are cut into different stages ({first[0]} and "
                                     f"{s}): each rank would train its own copy; cut them "
                                     "into one stage or untie them")
