"""RePurpose: a trained MLP split into K parallel sub-models (lesson 24). Reconstruction.

Abdi, Rashidi, Fekri & Krishna (arXiv 2008.08289; AAAI 2023) take an already-trained
network, rearrange the neurons of each layer into one group per worker, and prune and
adjust the weights so that the workers exchange few activations. Only the abstract (and a
summary: a per-layer objective of a Frobenius-norm fit, an L0 sparsity term and a
communication cost, solved with L0 optimisation and the Munkres assignment) could be
read, so everything below is a **reconstruction**; what it does, exactly:

1. **Permute** (:func:`assign_groups`). The net is ``Linear, ReLU, ..., Linear`` with the
   input given to every worker and the logits summed over workers (an all-reduce). Hidden
   layer ``l``'s neurons go into ``K`` equal groups; neuron ``j`` of group ``k`` on worker
   ``k`` needs activation ``i`` of worker ``g(i) != k`` whenever ``W[j, i] != 0``. The
   *off-block mass* is ``sum_{g(j) != g(i)} W[j, i]^2 E[x_i^2]`` over the hidden-to-hidden
   matrices (``E[x_i^2]`` from calibration data: the output energy a cross weight
   carries). Given the groups of the layers beside it, the best balanced grouping of one
   layer is a linear assignment of neurons to ``K * n/K`` slots, solved exactly by
   ``scipy.optimize.linear_sum_assignment`` (Munkres/Hungarian); sweeping over the layers
   is coordinate descent, so the mass never rises. The net is then permuted so that group
   ``k`` is the ``k``-th contiguous block: the function is unchanged.
2. **Prune** (:func:`prune_and_refit`). A *message* is (source neuron ``i``, destination
   worker ``b``): one activation per example sent over the wire if any weight from ``i``
   into ``b``'s block is kept. Messages are ranked by their mass ``sum_{j in b} W[j,i]^2
   E[x_i^2]`` and the smallest fraction ``prune`` of them is dropped with all their weights
   (an L0 budget on messages, chosen greedily: the reconstruction's stand-in for the
   paper's L0 optimisation). In-block weights are never pruned.
3. **Re-fit**. Layer by layer, each neuron's kept weights and bias are refitted by least
   squares so that its pre-activation on the *pruned* net's inputs matches the original
   net's pre-activation on the calibration data (a small ridge ``1e-8`` keeps it defined).

:func:`split_inference` runs the result on ``K`` real gloo ranks (each holds its block
rows, sends exactly the kept messages by ``all_to_all_single``, and all-reduces its partial
logits); the serial reference is the pruned net in one process. :func:`megatron_inference`
runs the unsplit net as lesson 14's Megatron pairs (column- then row-parallel, one
all-reduce per pair) for the byte count it is compared with. Bytes are *wire* bytes summed
over ranks: the all-to-all payload as sent, ring all-reduce ``2(K-1)/K n`` per rank.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch import nn

from parlearn.core.checks import (
    check_bool,
    check_float,
    check_int,
    check_module,
    check_seed,
    check_tensor,
)
from parlearn.core.datasets import Split, digits

__all__ = ["digits_mlp", "linears", "accuracy", "calibration_energy", "off_block_mass",
           "assign_groups", "permute", "restructure", "prune_and_refit", "message_mask",
           "comm_bytes", "megatron_bytes", "split_worker", "split_inference",
           "megatron_worker", "megatron_inference", "tradeoff"]

_RIDGE = 1e-8


def digits_mlp(hidden: int = 64, depth: int = 3, steps: int = 300, lr: float = 0.01,
               seed: int = 0, n_train: int | None = None) -> tuple[nn.Sequential, Split]:
    """An MLP ``64 -> hidden x depth -> 10`` with ReLUs, float64, trained full-batch by Adam
    for ``steps`` steps on scikit-learn's digits (split seed 0; weights from ``seed`` on a
    private generator). Returns the net and the split (float64)."""
    hidden, depth = check_int("hidden", hidden, lo=1), check_int("depth", depth, lo=1)
    steps, seed = check_int("steps", steps, lo=0), check_seed("seed", seed)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    data = digits(n_train=n_train, dtype=torch.float64)
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    widths = [data.n_features] + [hidden] * depth + [data.n_classes]
    layers: list[nn.Module] = []
    with torch.random.fork_rng(devices=[]):  # nn.Linear's init uses the global RNG
        for a, b in zip(widths[:-1], widths[1:], strict=True):
            layers += [nn.Linear(a, b, dtype=torch.float64), nn.ReLU()]
    net = nn.Sequential(*layers[:-1])
    with torch.no_grad():
        for lin in linears(net):
            bound = lin.in_features ** -0.5
            lin.weight.copy_((torch.rand(lin.weight.shape, generator=g, dtype=torch.float64)
                              * 2 - 1) * bound)
            lin.bias.zero_()
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(net(data.x_train), data.y_train).backward()
        opt.step()
    for p in net.parameters():
        p.grad = None
    return net, data


def linears(net: nn.Module) -> list[nn.Linear]:
    """The Linear layers of ``net``, which must be ``Linear, ReLU, ..., Linear`` (>= 2), each
    with a bias (the refit solves for it), all of one floating dtype."""
    check_module("net", net)
    mods = list(net.children()) if isinstance(net, nn.Sequential) else []
    ok = (len(mods) >= 3 and len(mods) % 2 == 1
          and all(isinstance(m, nn.Linear) for m in mods[::2])
          and all(isinstance(m, nn.ReLU) for m in mods[1::2]))
    if not ok:
        layers = ", ".join(type(m).__name__ for m in net.children())
        raise TypeError("net must be an nn.Sequential of Linear, ReLU, ..., Linear "
                        f"with at least two Linear layers, got {type(net).__name__}({layers})")
    for i, m in enumerate(mods[::2]):
        if m.bias is None:
            raise ValueError(f"net[{2 * i}] is a Linear without bias: restructuring and "
                             "refitting here solve for each neuron's bias")
    dtypes = {m.weight.dtype for m in mods[::2]}
    if len(dtypes) != 1:
        raise TypeError(f"net's Linear layers must share one dtype, got "
                        f"{sorted(map(str, dtypes))}")
    return mods[::2]


def _check_x(name: str, x: torch.Tensor, lins: list[nn.Linear],
             finite: bool = False) -> torch.Tensor:
    # finite: calibration data drives the grouping and the refit, where NaN would spread.
    check_tensor(name, x, shape=(None, lins[0].in_features), floating=True, finite=finite)
    if x.dtype != lins[0].weight.dtype:
        raise TypeError(f"{name} must have the net's dtype {lins[0].weight.dtype}, got {x.dtype}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} must hold at least one row, got 0")
    return x


@torch.no_grad()
def accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of rows of ``x`` whose arg-max logit is the label ``y``."""
    lins = linears(net)
    _check_x("x", x, lins)
    check_tensor("y", y, shape=(x.shape[0],), floating=False)
    return float((net(x).argmax(1) == y).double().mean())


def _check_k(net: nn.Module, k: int) -> list[nn.Linear]:
    lins = linears(net)
    k = check_int("k", k, lo=1)
    for lin in lins[:-1]:
        if lin.out_features % k:
            raise ValueError(f"k={k} must divide every hidden width, got "
                             f"{[m.out_features for m in lins[:-1]]}")
    return lins


@torch.no_grad()
def calibration_energy(net: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """``E[h_i^2]`` over the rows of ``x`` for the input of every Linear of ``net``
    (entry 0 is the input, entry ``l`` hidden layer ``l``'s activation)."""
    lins = linears(net)
    _check_x("x", x, lins)
    out, h = [], x
    for i, lin in enumerate(lins):
        out.append((h ** 2).mean(0))
        h = lin(h) if i == len(lins) - 1 else torch.relu(lin(h))
    return out


def _blocks(n: int, k: int) -> torch.Tensor:
    return torch.arange(n) // (n // k)  # the contiguous grouping: neuron j in group j // (n/k)


def _cross(groups_out: torch.Tensor, groups_in: torch.Tensor) -> torch.Tensor:
    return groups_out[:, None] != groups_in[None, :]


def _check_energy(lins: list[nn.Linear], energy) -> None:
    """``energy[l]``: a finite (in_features,) tensor >= 0 for every Linear (as
    :func:`calibration_energy` returns)."""
    if not isinstance(energy, list | tuple) or len(energy) != len(lins):
        raise ValueError(f"energy must be a list of {len(lins)} tensors (one per Linear), "
                         f"got {type(energy).__name__}")
    for lin, e in zip(lins, energy, strict=True):
        check_tensor("energy", e, shape=(lin.in_features,), floating=True, finite=True)
        if bool((e < 0).any()):
            raise ValueError("energy must hold mean squares >= 0")


def _saliency(net: nn.Module, energy: list[torch.Tensor]) -> list[torch.Tensor]:
    """``W[j, i]^2 E[x_i^2]`` for every hidden-to-hidden matrix (layers 1 .. L-2)."""
    lins = linears(net)
    # float64 whatever the net's dtype: the assignment's costs are sums of many small terms.
    return [lins[l].weight.detach().double() ** 2 * energy[l].double()[None, :]
            for l in range(1, len(lins) - 1)]


def off_block_mass(net: nn.Module, k: int, energy: list[torch.Tensor] | None = None,
                   groups: list[torch.Tensor] | None = None) -> float:
    """Share of the hidden-to-hidden saliency ``W[j,i]^2 E[x_i^2]`` (``E`` = 1 when
    ``energy`` is None) that crosses groups; ``groups[l]`` is hidden layer ``l``'s group of
    each neuron (default: the contiguous blocks)."""
    lins = _check_k(net, k)
    hidden = [m.out_features for m in lins[:-1]]
    energy = energy or [torch.ones(m.in_features, dtype=torch.float64) for m in lins]
    groups = groups or [_blocks(n, k) for n in hidden]
    sal = _saliency(net, energy)
    off = sum(float(s[_cross(groups[l + 1], groups[l])].sum()) for l, s in enumerate(sal))
    total = sum(float(s.sum()) for s in sal)
    return off / total if total > 0 else 0.0


def assign_groups(net: nn.Module, k: int, energy: list[torch.Tensor], sweeps: int = 4,
                  restarts: int = 8, seed: int = 0) -> tuple[list[torch.Tensor], list[float]]:
    """Balanced groups for every hidden layer by coordinate descent over the layers, each
    step an exact Hungarian assignment of one layer's neurons given its neighbours' groups
    (module docstring, step 1). Coordinate descent stops in local minima, so it starts
    from the contiguous blocks and from ``restarts - 1`` random balanced groupings (drawn
    from ``seed``) and keeps the best. Returns the groups and the best run's off-block
    share before and after each sweep (never increasing)."""
    lins = _check_k(net, k)
    _check_energy(lins, energy)
    sweeps = check_int("sweeps", sweeps, lo=0)
    restarts = check_int("restarts", restarts, lo=1)
    gen = torch.Generator().manual_seed(check_int("seed", seed, lo=0))
    hidden = [m.out_features for m in lins[:-1]]
    sal = _saliency(net, energy)  # sal[l]: hidden layer l+1 (rows) <- hidden layer l (cols)
    best: tuple[list[torch.Tensor], list[float]] | None = None
    for start in range(restarts):
        groups = [_blocks(n, k) if start == 0 else _blocks(n, k)[torch.randperm(n, generator=gen)]
                  for n in hidden]
        onehot = [F.one_hot(g, k).double() for g in groups]
        history = [off_block_mass(net, k, energy, groups)]
        for _ in range(sweeps):
            for l, n in enumerate(hidden):
                # cost[j, c]: the mass neuron j sends or receives across groups if in group c
                cost = torch.zeros(n, k, dtype=torch.float64)
                if l > 0:
                    cost += sal[l - 1].sum(1, keepdim=True) - sal[l - 1] @ onehot[l - 1]
                if l < len(hidden) - 1:
                    cost += sal[l].sum(0)[:, None] - sal[l].T @ onehot[l + 1]
                slots = np.repeat(cost.numpy(), n // k, axis=1)  # n/k seats a group: balanced
                rows, cols = linear_sum_assignment(slots)
                groups[l] = torch.as_tensor(cols[np.argsort(rows)] // (n // k))
                onehot[l] = F.one_hot(groups[l], k).double()
            history.append(off_block_mass(net, k, energy, groups))
        if best is None or history[-1] < best[1][-1]:
            best = (groups, history)
    return best


@torch.no_grad()
def permute(net: nn.Module, perms: list[torch.Tensor]) -> nn.Sequential:
    """A copy of ``net`` whose hidden layer ``l`` has neuron ``perms[l][j]`` at position
    ``j`` (rows of its Linear and bias, columns of the next Linear): the same function."""
    lins = linears(net)
    if len(perms) != len(lins) - 1:
        raise ValueError(f"perms must hold one permutation per hidden layer "
                         f"({len(lins) - 1}), got {len(perms)}")
    out = copy.deepcopy(net)
    new = linears(out)
    for l, p in enumerate(perms):
        check_tensor(f"perms[{l}]", p, ndim=1, floating=False)
        if not torch.equal(p.sort().values, torch.arange(lins[l].out_features)):
            raise ValueError(f"perms[{l}] must be a permutation of 0..{lins[l].out_features - 1}")
        new[l].weight.copy_(new[l].weight[p])
        new[l].bias.copy_(new[l].bias[p])
        new[l + 1].weight.copy_(new[l + 1].weight[:, p])
    return out


def restructure(net: nn.Module, k: int, x_calib: torch.Tensor, sweeps: int = 4,
                restarts: int = 8, seed: int = 0) -> tuple[nn.Sequential, list[float]]:
    """:func:`assign_groups` then :func:`permute` (group ``c`` becomes the ``c``-th block).
    Returns the permuted net and the best run's off-block share history."""
    _check_x("x_calib", x_calib, linears(net), finite=True)
    energy = calibration_energy(net, x_calib)
    groups, history = assign_groups(net, k, energy, sweeps, restarts, seed)
    return permute(net, [torch.argsort(g, stable=True) for g in groups]), history


@torch.no_grad()
def prune_and_refit(net: nn.Module, k: int, x_calib: torch.Tensor, prune: float,
                    refit: bool = True) -> nn.Sequential:
    """Drop the fraction ``prune`` of cross-worker messages with the least mass, then (if
    ``refit``) refit each neuron's kept weights by least squares (module docstring, steps
    2-3). Groups are the contiguous blocks, so call :func:`restructure` first. Pruned
    weights are exactly 0. ``prune=0`` keeps every message (the net is copied unchanged)."""
    lins = _check_k(net, k)
    prune = check_float("prune", prune, lo=0, hi=1)
    refit = check_bool("refit", refit)
    out = copy.deepcopy(net)
    new = linears(out)
    h_ref = h_new = _check_x("x_calib", x_calib, lins, finite=True)
    for l in range(len(lins)):
        z_ref = lins[l](h_ref)
        if 0 < l < len(lins) - 1:
            w = lins[l].weight
            e = (h_ref ** 2).mean(0)
            n_out, n_in = w.shape
            src, dst = _blocks(n_in, k), _blocks(n_out, k)
            # mass[i, b]: what message (i -> worker b) carries; own-group entries never cut
            mass = (F.one_hot(dst, k).double().T @ (w.double() ** 2)).T * e.double()[:, None]
            own = F.one_hot(src, k).bool()
            cand = (~own).nonzero()
            n_drop = int(round(prune * len(cand)))
            order = torch.argsort(mass[~own], stable=True)[:n_drop]
            keep_msg = torch.ones(n_in, k, dtype=torch.bool)
            keep_msg[cand[order, 0], cand[order, 1]] = False
            keep = keep_msg[:, dst].T  # keep[j, i]: weight j <- i survives
            new[l].weight.mul_(keep)
            if refit and n_drop:
                xb = torch.cat([h_new, torch.ones(len(h_new), 1, dtype=h_new.dtype)], 1)
                for j in range(n_out):
                    cols = torch.cat([keep[j].nonzero().flatten(), torch.tensor([n_in])])
                    a = xb[:, cols]
                    coef = torch.linalg.solve(a.T @ a + _RIDGE * torch.eye(len(cols),
                                              dtype=a.dtype), a.T @ z_ref[:, j])
                    new[l].weight[j].zero_()
                    new[l].weight[j, cols[:-1]] = coef[:-1]
                    new[l].bias[j] = coef[-1]
        last = l == len(lins) - 1
        h_ref = z_ref if last else torch.relu(z_ref)
        h_new = new[l](h_new) if last else torch.relu(new[l](h_new))
    return out


def message_mask(net: nn.Module, k: int) -> list[torch.Tensor]:
    """For each hidden-to-hidden Linear, ``need[i, b]``: worker ``b != g(i)`` needs
    activation ``i`` (some weight from ``i`` into ``b``'s block is non-zero)."""
    lins = _check_k(net, k)
    out = []
    for lin in lins[1:-1]:
        n_out, n_in = lin.weight.shape
        src, dst = _blocks(n_in, k), _blocks(n_out, k)
        used = (F.one_hot(dst, k).double().T @ (lin.weight.detach() != 0).double()).T > 0
        out.append(used & ~F.one_hot(src, k).bool())
    return out


def comm_bytes(net: nn.Module, k: int, batch: int = 1, itemsize: int = 8) -> dict[str, float]:
    """Wire bytes, summed over ranks, of :func:`split_inference` on ``batch`` examples
    (counted from the weights): ``exchange`` (the kept messages) and ``logits`` (ring
    all-reduce of the partial logits, ``2(K-1)/K`` of the payload per rank)."""
    lins = _check_k(net, k)
    batch, itemsize = check_int("batch", batch, lo=1), check_int("itemsize", itemsize, lo=1)
    exch = sum(int(m.sum()) for m in message_mask(net, k)) * batch * itemsize
    logits = 2 * (k - 1) * lins[-1].out_features * batch * itemsize
    return {"exchange": float(exch), "logits": float(logits)}


def megatron_bytes(net: nn.Module, k: int, batch: int = 1, itemsize: int = 8) -> float:
    """Wire bytes, summed over ranks, of :func:`megatron_inference`: a ring all-reduce of
    the output of every second Linear (and of the last one), ``2(K-1)`` times its size."""
    lins = _check_k(net, k)
    batch, itemsize = check_int("batch", batch, lo=1), check_int("itemsize", itemsize, lo=1)
    reduced = [m.out_features for i, m in enumerate(lins) if i % 2 == 1 or i == len(lins) - 1]
    return float(2 * (k - 1) * sum(reduced) * batch * itemsize)


def _wire(summary: dict, k: int) -> float:
    # all_to_all_single's payload is what this rank sends; all_reduce sends 2(K-1)/K of it
    return sum(b * (2 * (k - 1) / k if kind == "all_reduce" else 1.0)
               for kind, (_, b, _) in summary.items())


@torch.no_grad()
def split_worker(rank: int, world_size: int, net: nn.Module, x: torch.Tensor) -> dict:
    """Worker: this rank's sub-model (its block of rows of every Linear, only the input
    columns it owns or receives), fed the replicated input ``x``. Hidden-to-hidden layers
    exchange exactly the needed activations by ``all_to_all_single``; the partial logits
    are all-reduced. Returns the logits and this rank's ledger summary."""
    import torch.distributed as tdist

    from parlearn.distributed import ledger

    k, lins = world_size, linears(net)
    masks = message_mask(net, k)
    with ledger() as led:
        rows = _blocks(lins[0].out_features, k) == rank
        h = torch.relu(F.linear(x, lins[0].weight[rows], lins[0].bias[rows]))
        for l in range(1, len(lins) - 1):
            need, n_in = masks[l - 1], lins[l].in_features
            src = _blocks(n_in, k)
            own = (src == rank).nonzero().flatten()
            # neurons (global index) I send to each rank / receive from each rank, in order
            send = [own[need[own, d]] for d in range(k)]
            recv = [((src == s) & need[:, rank]).nonzero().flatten() for s in range(k)]
            if int(need.sum()):
                out = torch.cat([h[:, i - own[0]].T.reshape(-1) for i in send])
                into = torch.empty(sum(len(r) for r in recv) * len(x), dtype=x.dtype)
                tdist.all_to_all_single(into, out.contiguous(),
                                        [len(r) * len(x) for r in recv],
                                        [len(i) * len(x) for i in send])
                got = into.view(-1, len(x)).T
            else:
                got = x.new_zeros(len(x), 0)
            cols = torch.cat([own, *recv])
            inp = torch.cat([h, got], 1)
            rows = _blocks(lins[l].out_features, k) == rank
            h = torch.relu(F.linear(inp, lins[l].weight[rows][:, cols], lins[l].bias[rows]))
        own = _blocks(lins[-1].in_features, k) == rank
        part = F.linear(h, lins[-1].weight[:, own]).contiguous()
        tdist.all_reduce(part)
        logits = part + lins[-1].bias
    return {"logits": logits, "ledger": led.summary()}


def split_inference(net: nn.Module, k: int, x: torch.Tensor, timeout: float = 30) -> dict:
    """Run :func:`split_worker` on ``k`` real gloo ranks. Returns rank 0's logits, the
    largest difference between ranks' logits, and the wire bytes the ledgers saw (summed
    over ranks; module docstring)."""
    from parlearn.distributed import run

    _check_x("x", x, _check_k(net, k))
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    res = run(split_worker, k, args=(net, x), backend="gloo", timeout=timeout,
              deadline=4 * timeout)
    spread = max(float((r["logits"] - res[0]["logits"]).abs().max()) for r in res)
    return {"logits": res[0]["logits"], "rank_spread": spread,
            "bytes": sum(_wire(r["ledger"], k) for r in res)}


@torch.no_grad()
def megatron_worker(rank: int, world_size: int, net: nn.Module, x: torch.Tensor) -> dict:
    """Worker: the unsplit net as lesson 14's Megatron pairs: Linear ``2m`` column-parallel
    (no communication), Linear ``2m+1`` row-parallel (one all-reduce). An unpaired last
    Linear is row-parallel on this rank's slice of the (replicated) input. Returns the
    logits and this rank's ledger summary."""
    from parlearn.distributed import ledger
    from parlearn.multi_device.tensor_parallel.megatron import (
        ColumnParallelLinear,
        RowParallelLinear,
    )

    lins = linears(net)
    with ledger() as led:
        h = x
        for i, lin in enumerate(lins):
            last = i == len(lins) - 1
            if i % 2 == 0 and not last:
                h = ColumnParallelLinear(lin, rank, world_size)(h)
            else:
                if i % 2 == 0:  # a column-parallel pair is open only after an even layer
                    h = h.tensor_split(world_size, 1)[rank]
                h = RowParallelLinear(lin, rank, world_size)(h)
            h = h if last else torch.relu(h)
    return {"logits": h, "ledger": led.summary()}


def megatron_inference(net: nn.Module, k: int, x: torch.Tensor, timeout: float = 30) -> dict:
    """Run :func:`megatron_worker` on ``k`` gloo ranks; same fields as
    :func:`split_inference`."""
    from parlearn.distributed import run

    _check_x("x", x, _check_k(net, k))
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    res = run(megatron_worker, k, args=(net, x), backend="gloo", timeout=timeout,
              deadline=4 * timeout)
    spread = max(float((r["logits"] - res[0]["logits"]).abs().max()) for r in res)
    return {"logits": res[0]["logits"], "rank_spread": spread,
            "bytes": sum(_wire(r["ledger"], k) for r in res)}


def tradeoff(net: nn.Module, data: Split, k: int, prunes: list[float], *,
             permute_first: bool = True, refit: bool = True, sweeps: int = 4) -> dict:
    """Test accuracy and wire bytes per example (counted from the weights) of the split net
    at each pruning fraction in ``prunes``, restructured first when ``permute_first``.
    Calibration data: the training set."""
    _check_k(net, k)
    if not isinstance(data, Split):
        raise TypeError(f"data must be a parlearn.datasets.Split, got {type(data).__name__}")
    if not isinstance(prunes, list | tuple) or not prunes:
        raise TypeError(f"prunes must be a non-empty list of fractions in [0, 1], got {prunes!r}")
    for p in prunes:
        check_float("prunes", p, lo=0, hi=1)
    check_bool("permute_first", permute_first)
    check_bool("refit", refit)
    check_int("sweeps", sweeps, lo=0)
    base = restructure(net, k, data.x_train, sweeps)[0] if permute_first else net
    acc, byts = [], []
    for p in prunes:
        pruned = prune_and_refit(base, k, data.x_train, p, refit)
        acc.append(accuracy(pruned, data.x_test, data.y_test))
        byts.append(sum(comm_bytes(pruned, k).values()))
    return {"prune": list(prunes), "accuracy": acc, "bytes": byts,
            "megatron": megatron_bytes(net, k), "dense": accuracy(net, data.x_test, data.y_test)}
