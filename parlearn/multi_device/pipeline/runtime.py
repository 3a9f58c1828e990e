"""Pipeline parallelism: GPipe, 1F1B and zero-bubble schedules as loops over send/recv.

A model is a chain of layers cut into ``P`` contiguous *stages*, one per rank; a batch is
cut into ``M`` *micro-batches*. Stage ``s`` runs ``F m`` (forward of micro-batch ``m``:
receive the activation from ``s-1``, compute, send to ``s+1``) and ``B m`` (backward:
receive the output gradient from ``s+1``, compute, send the input gradient to ``s-1``).

One source of truth. :func:`schedule` lists, for every rank, the order of its operations;
the real ranks (:func:`run_pipeline`, through :func:`parlearn.dist.run`) execute exactly that
list, and the simulator (:func:`simulate`) draws the timeline of the same list from
per-stage costs (modeled). Schedules:

- ``"gpipe"``: all forwards, then all backwards (Huang et al. 2019). Every stage holds
  the activations of all ``M`` micro-batches.
- ``"1f1b"``: ``P-s-1`` warm-up forwards, then one-forward-one-backward, then the
  remaining backwards (PipeDream-Flush, Narayanan et al. 2021). Same bubble as GPipe,
  at most ``P-s`` micro-batches in flight on stage ``s``.
- ``"zb"``: zero-bubble in the style of ZB-H1 (Qi et al. 2024): each backward is split into
  ``B`` (input gradient, the delta chain, which the previous stage waits for) and ``W``
  (weight gradient ``G = delta x activation``, which nobody waits for) -- the delta/G split
  of lesson 20. ``W`` fills the idle slots. Built by our own greedy list scheduler under
  unit costs (see :func:`_zero_bubble`), not copied from the paper's figure.

The ranks are CPU processes on gloo (also on a machine with GPUs): the point is the
schedule and its exactness; timing at scale comes from the simulator.

For equal stage costs GPipe and 1F1B idle a fraction ``(P-1)/(M+P-1)`` of the time
(:func:`bubble_formula`): the pipeline fills for ``P-1`` slots and drains for ``P-1``.

Beside them: the same model through ``torch.distributed.pipelining``
(:func:`run_torch_pipeline`), balanced partitioning by measured layer cost in the spirit
of LAMP (:func:`partition_balanced`), Hydra-style shard parallelism (several models
interleaved through one pipeline, :func:`hydra_train`), and a reconstruction of AMDP
(:func:`simulate_bidirectional`, modeled only).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as tdist
from torch import nn

from parlearn.core.checks import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_module,
    check_tensor,
)

__all__ = ["SCHEDULES", "Op", "schedule", "bubble_formula", "Simulation", "simulate",
           "make_model", "make_data", "split_layers", "reference_grads", "PipelineRun",
           "run_pipeline", "measured_bubble", "stage_op_costs", "TORCH_SCHEDULES",
           "run_torch_pipeline",
           "partition_equal", "partition_balanced", "stage_costs", "layer_costs",
           "hydra_schedule", "hydra_train", "hydra_reference", "simulate_bidirectional",
           "bench"]

SCHEDULES = ("gpipe", "1f1b", "zb")


class Op(NamedTuple):
    """One operation of a rank: ``kind`` is ``"F"`` (forward), ``"B"`` (backward; in
    ``"zb"`` only its input-gradient part) or ``"W"`` (weight gradient, ``"zb"`` only);
    ``mb`` is the micro-batch."""

    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"


# ---------------------------------------------------------------------------------------
# Schedules: the order of operations on each rank.

def _gpipe(stage: int, stages: int, m: int) -> list[Op]:
    # All forwards (fill), then all backwards (drain), in micro-batch order.
    return [Op("F", i) for i in range(m)] + [Op("B", i) for i in range(m)]


def _one_f_one_b(stage: int, stages: int, m: int) -> list[Op]:
    warmup = min(stages - stage - 1, m)
    ops = [Op("F", i) for i in range(warmup)]                # warm-up: fill the pipe
    for i in range(warmup, m):                               # steady: one F, one B
        ops += [Op("F", i), Op("B", i - warmup)]
    ops += [Op("B", i) for i in range(m - warmup, m)]        # cool-down: drain
    return ops


def _zero_bubble(stages: int, m: int) -> list[list[Op]]:
    """Greedy list scheduling at unit cost F = B = W = 1 and free communication: at each
    time step every idle stage runs the first ready op by priority

    1. ``B`` (its input gradient unblocks the stage before),
    2. ``W`` if more than ``P-1`` weight gradients are pending (bounds their memory),
    3. ``F`` if fewer than ``P-s`` micro-batches await their ``B`` (1F1B's bound),
    4. ``W`` (needed by nobody, so it fills what would be idle time).

    For ``M >= P`` this reaches ZB-H1's makespan ``3M + P - 1`` (bubble ``(P-1)/(3M+P-1)``,
    a third of 1F1B's at equal F, B, W)."""
    orders: list[list[Op]] = [[] for _ in range(stages)]
    f_end = [[None] * m for _ in range(stages)]   # time each F / B finishes
    b_end = [[None] * m for _ in range(stages)]
    nf, nb, nw = [0] * stages, [0] * stages, [0] * stages
    t = 0

    def arrived(end: int | None) -> bool:
        return end is not None and end <= t

    while any(n < m for n in nw):
        for s in range(stages):
            # B m needs the output gradient: from stage s+1, or the loss on the last stage.
            source = f_end[s] if s == stages - 1 else b_end[s + 1]
            ready_b = nb[s] < nf[s] and arrived(source[nb[s]])
            ready_f = nf[s] < m and nf[s] - nb[s] < stages - s and (
                s == 0 or arrived(f_end[s - 1][nf[s]]))
            if ready_b:
                b_end[s][nb[s]] = t + 1
                orders[s].append(Op("B", nb[s]))
                nb[s] += 1
            elif nb[s] - nw[s] > stages - 1 or (not ready_f and nw[s] < nb[s]):
                orders[s].append(Op("W", nw[s]))
                nw[s] += 1
            elif ready_f:
                f_end[s][nf[s]] = t + 1
                orders[s].append(Op("F", nf[s]))
                nf[s] += 1
        t += 1
    return orders


def schedule(kind: str, stages: int, micro_batches: int) -> list[list[Op]]:
    """The order of operations of each rank: ``schedule(kind, P, M)[s]`` is stage ``s``'s
    list of :class:`Op`. ``kind`` is one of :data:`SCHEDULES`."""
    check_choice("kind", kind, SCHEDULES)
    stages = check_int("stages", stages, lo=1)
    micro_batches = check_int("micro_batches", micro_batches, lo=1)
    if kind == "zb":
        return _zero_bubble(stages, micro_batches)
    make = _gpipe if kind == "gpipe" else _one_f_one_b
    return [make(s, stages, micro_batches) for s in range(stages)]


def bubble_formula(stages: int, micro_batches: int) -> float:
    """Idle fraction of GPipe and 1F1B with equal stage costs and free communication:
    ``(P-1)/(M+P-1)``. Each stage is busy ``M(F+B)`` out of a makespan ``(M+P-1)(F+B)``."""
    stages = check_int("stages", stages, lo=1)
    micro_batches = check_int("micro_batches", micro_batches, lo=1)
    return (stages - 1) / (micro_batches + stages - 1)


# ---------------------------------------------------------------------------------------
# The simulator (modeled): the timeline of a list of orders under per-stage costs.

@dataclass
class Simulation:
    """A modeled timeline. ``events`` are ``(lane, label, start, end)`` in cost units
    (for :func:`parlearn.viz.timeline`); ``makespan`` is the last end; ``bubble`` the idle
    fraction ``1 - busy / (P * makespan)``; ``peak_in_flight[s]`` the most micro-batches whose
    activations stage ``s`` holds at once (from the start of F until the end of the op that
    frees them: B, or W in ``"zb"``)."""

    events: list[tuple[str, str, float, float]]
    makespan: float
    bubble: float
    busy: list[float]
    peak_in_flight: list[int]


def _per_stage(name: str, value, stages: int) -> list[float]:
    if isinstance(value, (int, float)):
        value = [value] * stages
    value = [check_float(name, v, lo=0) for v in value]
    if len(value) != stages:
        raise ValueError(f"{name} must have one cost per stage ({stages}), got {len(value)}")
    return value


def simulate(orders: Sequence[Sequence[Op]], cost_f: float | Sequence[float] = 1.0,
             cost_b: float | Sequence[float] = 2.0, cost_w: float | Sequence[float] = 0.0,
             comm: float = 0.0, *, lanes: Sequence[str] | None = None) -> Simulation:
    """Run ``orders`` (one list of :class:`Op` per stage, e.g. from :func:`schedule`) on a
    model machine: every op starts when its rank is free and its input has arrived, where
    ``F m`` on stage ``s`` needs ``F m`` of ``s-1``, ``B m`` needs ``B m`` of ``s+1`` (the last
    stage: its own ``F m``), and ``W m`` its own ``B m``; a message takes ``comm``. Costs are
    per stage (a number means equal stages). When the orders contain ``W`` ops, ``cost_b`` is
    the input-gradient part only and ``cost_w`` the weight-gradient part; otherwise a ``B``
    costs ``cost_b`` and ``cost_w`` must be 0 (include it in ``cost_b``). Raises ValueError
    if the orders deadlock."""
    stages = len(orders)
    if stages < 1:
        raise ValueError("orders must list at least one stage")
    cf, cb, cw = (_per_stage(n, v, stages) for n, v in
                  (("cost_f", cost_f), ("cost_b", cost_b), ("cost_w", cost_w)))
    comm = check_float("comm", comm, lo=0)
    has_w = any(op.kind == "W" for ops in orders for op in ops)
    if not has_w and any(cw):
        raise ValueError("cost_w > 0 but the orders have no W ops: add it to cost_b")
    lanes = [f"stage {s}" for s in range(stages)] if lanes is None else list(lanes)
    cost = {"F": cf, "B": cb, "W": cw}
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    pos = [0] * stages
    events = []
    mem, peak = [0] * stages, [0] * stages
    release = "W" if has_w else "B"
    held: list[list[tuple[float, int]]] = [[] for _ in range(stages)]   # (time, +-1)
    while any(pos[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while pos[s] < len(orders[s]):
                op = orders[s][pos[s]]
                if op.kind == "F":
                    dep = ("F", s - 1, op.mb) if s > 0 else None
                elif op.kind == "B":
                    dep = ("B", s + 1, op.mb) if s < stages - 1 else ("F", s, op.mb)
                elif op.kind == "W":
                    dep = ("B", s, op.mb)
                else:
                    raise ValueError(f"unknown op kind {op.kind!r} in orders[{s}]")
                if dep is not None and dep not in done:
                    break
                arrive = 0.0 if dep is None else done[dep] + (comm if dep[1] != s else 0.0)
                start = max(free[s], arrive)
                end = start + cost[op.kind][s]
                done[(op.kind, s, op.mb)] = end
                free[s] = end
                events.append((lanes[s], f"{op.kind} {op.mb}", start, end))
                if op.kind == "F":
                    held[s].append((start, 1))
                if op.kind == release:
                    held[s].append((end, -1))
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: str(orders[s][pos[s]]) for s in range(stages) if pos[s] < len(orders[s])}
            raise ValueError(f"the orders deadlock: stages wait at {stuck}")
    for s in range(stages):
        # Frees before takes at the same instant: a slot reused at once is not two slots.
        for _, delta in sorted(held[s], key=lambda e: (e[0], e[1])):
            mem[s] += delta
            peak[s] = max(peak[s], mem[s])
    makespan = max(free)
    busy = [sum(e[3] - e[2] for e in events if e[0] == lanes[s]) for s in range(stages)]
    bubble = 1.0 - sum(busy) / (stages * makespan) if makespan > 0 else 0.0
    return Simulation(events, makespan, bubble, busy, peak)


# ---------------------------------------------------------------------------------------
# The model, its stages, and the single-process reference.

def make_model(widths: Sequence[int], seed: int = 0, dtype: torch.dtype = torch.float64
               ) -> nn.Sequential:
    """A chain of ``len(widths) - 1`` layers ``Linear(widths[i], widths[i+1])``, each but
    the last followed by ``Tanh``; every layer is one element of the returned
    ``nn.Sequential`` (the unit a partition cuts at). Initialised from ``seed`` by a
    private generator (the global RNG is untouched)."""
    if len(widths) < 2:
        raise ValueError(f"widths needs at least 2 entries, got {list(widths)}")
    widths = [check_int("widths", w, lo=1) for w in widths]
    gen = torch.Generator().manual_seed(check_int("seed", seed, lo=0))
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        # skip_init: nn.Linear's own init would draw from the caller's global RNG.
        lin = nn.utils.skip_init(nn.Linear, a, b, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(b, a, generator=gen, dtype=dtype) / a ** 0.5)
            lin.bias.copy_(0.1 * torch.randn(b, generator=gen, dtype=dtype))
        layers.append(nn.Sequential(lin, nn.Tanh()) if i < len(widths) - 2 else lin)
    return nn.Sequential(*layers)


def make_data(model: nn.Sequential, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random inputs and regression targets of the model's first/last widths."""
    check_module("model", model)
    n = check_int("n", n, lo=1)
    gen = torch.Generator().manual_seed(check_int("seed", seed, lo=0))
    first, last = _linears(model)[0], _linears(model)[-1]
    dtype = first.weight.dtype
    x = torch.randn(n, first.in_features, generator=gen, dtype=dtype)
    y = torch.randn(n, last.out_features, generator=gen, dtype=dtype)
    return x, y


def _linears(model: nn.Module) -> list[nn.Linear]:
    found = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not found:
        raise ValueError("model has no nn.Linear layer")
    return found


def _loss(out: torch.Tensor, target: torch.Tensor, n_total: int) -> torch.Tensor:
    # Summed squared error over the FULL batch size: micro-batch losses add up exactly
    # to the full-batch mean loss, whatever the micro-batch sizes.
    return ((out - target) ** 2).sum() / n_total


def reference_grads(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor
                    ) -> list[torch.Tensor]:
    """Single-process gradients of the full-batch loss ``sum((model(x) - y)^2) / len(x)``,
    one per parameter in ``model.parameters()`` order (the caller's ``.grad`` untouched)."""
    check_module("model", model)
    check_tensor("x", x, ndim=2)
    check_tensor("y", y, ndim=2)
    params = list(model.parameters())
    return [g.detach() for g in torch.autograd.grad(_loss(model(x), y, len(x)), params)]


def split_layers(n_layers: int, counts: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` layer ranges of the stages with ``counts[s]`` layers each."""
    counts = [check_int("counts", c, lo=1) for c in counts]
    if sum(counts) != n_layers:
        raise ValueError(f"counts {counts} must add up to the {n_layers} layers")
    ends = [sum(counts[:i + 1]) for i in range(len(counts))]
    return [(e - c, e) for e, c in zip(ends, counts, strict=True)]


# ---------------------------------------------------------------------------------------
# The real ranks: each runs its stage's list of ops with send/recv.

class _Stage:
    """One rank's stage: its layers of each model (Hydra trains several; one usually),
    run op by op. Each layer's input is detached, so every layer has its own small graph:
    ``B`` walks the delta chain layer by layer and ``W`` forms each layer's weight gradient
    from its saved output delta, the delta/G split of lesson 20. (Stage 0's first layer has
    no input gradient to form: the data needs none.)"""

    def __init__(self, rank: int, world: int, layers: list[list[nn.Module]], split: bool,
                 t0: float):
        self.rank, self.world, self.layers, self.split, self.t0 = rank, world, layers, split, t0
        self.first, self.last = rank == 0, rank == world - 1
        self.saved: dict[int, list] = {}      # mb -> [(layer input, target, grad)] per layer
        self.pending_w: dict[int, list] = {}
        self.sends: list = []
        self.events: list[tuple[str, str, float, float]] = []
        self.log: list[tuple[float, str]] = []

    def _note(self, text: str) -> None:
        self.log.append((time.perf_counter() - self.t0, f"rank {self.rank}: {text}"))

    def _send(self, t: torch.Tensor, dst: int, tag: int, what: str) -> None:
        self._note(f"send {what} mb {tag} -> rank {dst}")
        self.sends.append((tdist.isend(t, dst, tag=tag), t))  # keep t alive until waited

    def _recv(self, shape, dtype, src: int, tag: int, what: str) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype)
        self._note(f"recv {what} mb {tag} <- rank {src} (waiting)")
        tdist.recv(buf, src, tag=tag)
        self._note(f"recv {what} mb {tag} <- rank {src} (done)")
        return buf

    def forward(self, j: int, model: int, x: torch.Tensor | None, target: torch.Tensor | None,
                n_total: int, in_shape) -> None:
        layers = self.layers[model]
        h = x if self.first else self._recv(in_shape, torch.float64 if x is None else x.dtype,
                                            self.rank - 1, j, "activation")
        start = time.perf_counter()
        saved = []
        for i, layer in enumerate(layers):
            inp = h.detach().requires_grad_(not (self.first and i == 0))
            h = layer(inp)
            saved.append([inp, h, None])
        if self.last:
            saved[-1][1] = _loss(h, target, n_total)   # the last target is the loss itself
        self.saved[j] = saved
        self._record("F", j, start)
        if not self.last:
            self._send(h.detach(), self.rank + 1, j, "activation")

    def backward(self, j: int, model: int) -> None:
        saved = self.saved.pop(j)
        grad = None
        if not self.last:
            out = saved[-1][1]
            grad = self._recv(out.shape, out.dtype, self.rank + 1, j, "gradient")
        start = time.perf_counter()
        layers = self.layers[model]
        for i in reversed(range(len(layers))):
            inp, out, _ = saved[i]
            params = list(layers[i].parameters())
            wants_input = inp.requires_grad
            if self.split:
                # B: the input gradient (delta) only; the graph is kept for W.
                saved[i][2] = grad
                if wants_input:
                    grad = torch.autograd.grad(out, inp, grad, retain_graph=True)[0]
            else:
                grads = torch.autograd.grad(out, ([inp] if wants_input else []) + params, grad)
                if wants_input:
                    grad, grads = grads[0], grads[1:]
                _accumulate(params, grads)
        if self.split:
            self.pending_w[j] = saved
        self._record("B", j, start)
        if not self.first:
            self._send(grad, self.rank - 1, j, "gradient")

    def weight_grad(self, j: int, model: int) -> None:
        start = time.perf_counter()
        for layer, (_, out, grad) in zip(self.layers[model], self.pending_w.pop(j), strict=True):
            params = list(layer.parameters())
            _accumulate(params, torch.autograd.grad(out, params, grad))
        self._record("W", j, start)

    def _record(self, kind: str, j: int, start: float) -> None:
        self.events.append((f"rank {self.rank}", f"{kind} {j}", start - self.t0,
                            time.perf_counter() - self.t0))
        self._note(f"{kind} {j} done")

    def wait_sends(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


def _accumulate(params: list[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g.detach().clone() if p.grad is None else p.grad + g


def _run_orders(rank: int, world: int, order: Sequence[Op], layers: list[list[nn.Module]],
                xs: list[torch.Tensor], ys: list[torch.Tensor], m: int, split: bool,
                widths_in: list[int]) -> _Stage:
    """Execute one rank's ``order`` over ``len(layers)`` models, whose micro-batches are
    interleaved: op micro-batch ``j`` is micro-batch ``j // K`` of model ``j % K``."""
    k = len(layers)
    chunks_x = [torch.tensor_split(x, m) for x in xs]
    chunks_y = [torch.tensor_split(y, m) for y in ys]
    tdist.barrier()   # a common start, so the ranks' clocks line up in the timeline
    stage = _Stage(rank, world, layers, split, time.perf_counter())
    for op in order:
        model, i = op.mb % k, op.mb // k
        if op.kind == "F":
            stage.forward(op.mb, model, chunks_x[model][i] if rank == 0 else None,
                          chunks_y[model][i] if rank == world - 1 else None, len(xs[model]),
                          (len(chunks_x[model][i]), widths_in[model]))
        elif op.kind == "B":
            stage.backward(op.mb, model)
        else:
            stage.weight_grad(op.mb, model)
    stage.wait_sends()
    return stage


def _stage_layers(model: nn.Sequential, counts: Sequence[int], rank: int) -> list[nn.Module]:
    a, b = split_layers(len(model), counts)[rank]
    return [copy.deepcopy(model[i]) for i in range(a, b)]


def _in_width(model: nn.Sequential, counts: Sequence[int], rank: int) -> int:
    a, _ = split_layers(len(model), counts)[rank]
    return _linears(model[a])[0].in_features


def _worker_schedule(rank: int, world: int, kind: str, model: nn.Sequential, x: torch.Tensor,
                     y: torch.Tensor, counts: Sequence[int], ms: Sequence[int]) -> list[dict]:
    """Rank ``rank`` runs ``schedule(kind, world, m)[rank]`` for each ``m`` in ``ms`` on a
    fresh copy of its stage; returns per ``m`` its gradients, ops, events and log."""
    out = []
    for m in ms:
        layers = _stage_layers(model, counts, rank)
        order = schedule(kind, world, m)[rank]
        st = _run_orders(rank, world, order, [layers], [x], [y], m, kind == "zb",
                         [_in_width(model, counts, rank)])
        out.append({"grads": [p.grad.detach().clone() for lay in layers
                              for p in lay.parameters()],
                    "ops": [f"{e[1].replace(' ', '')}" for e in st.events],
                    "events": st.events, "log": st.log})
    return out


@dataclass
class PipelineRun:
    """What :func:`run_pipeline` measured. ``grads`` are the model's parameter gradients in
    ``model.parameters()`` order; ``ops[s]`` the ops rank ``s`` executed, in order (e.g.
    ``"F0"``); ``events`` the measured timeline ``(lane, label, start_s, end_s)`` of every
    op's compute (waiting for a message is not inside it); ``log`` every send/recv/op with
    its time, sorted; ``bubble`` from :func:`measured_bubble`."""

    kind: str
    stages: int
    micro_batches: int
    grads: list[torch.Tensor]
    ops: list[list[str]]
    events: list[tuple[str, str, float, float]]
    log: list[str] = field(repr=False)
    bubble: float = 0.0


def measured_bubble(events: Sequence[tuple[str, str, float, float]]) -> float:
    """Idle fraction of a timeline: ``1 - sum(op durations) / (lanes * (last end - first
    start))``."""
    if not events:
        raise ValueError("events is empty")
    lanes = {e[0] for e in events}
    span = max(e[3] for e in events) - min(e[2] for e in events)
    busy = sum(e[3] - e[2] for e in events)
    return 1.0 - busy / (len(lanes) * span) if span > 0 else 0.0


def _preimport() -> None:
    # autograd.grad with a grad_outputs tensor imports torch.fx's symbolic shapes (sympy)
    # on first use: seconds. Import it once here so forked ranks inherit it.
    import torch.fx.experimental.symbolic_shapes  # noqa: F401
    import torch.nested._internal.nested_tensor  # noqa: F401


def stage_op_costs(run: PipelineRun) -> dict[str, list[float]]:
    """Median measured seconds of each op kind (``"F"``, ``"B"``, ``"W"`` when present) on
    each stage of ``run``: the per-stage costs to feed :func:`simulate`."""
    out: dict[str, list[float]] = {}
    for kind in "FBW":
        per = [sorted(e[3] - e[2] for e in run.events
                      if e[0] == f"rank {s}" and e[1].split()[0] == kind)
               for s in range(run.stages)]
        if all(per):
            out[kind] = [d[len(d) // 2] for d in per]
    return out


def _check_pipeline_args(model, x, y, stages, counts):
    check_module("model", model)
    if not isinstance(model, nn.Sequential):
        raise TypeError("model must be an nn.Sequential whose elements are the layers")
    check_tensor("x", x, ndim=2)
    check_tensor("y", y, ndim=2)
    if len(x) != len(y):
        raise ValueError(f"x and y must have the same rows, got {len(x)} and {len(y)}")
    stages = check_int("stages", stages, lo=2, hi=len(model))
    counts = partition_equal(len(model), stages) if counts is None else list(counts)
    if len(counts) != stages:
        raise ValueError(f"counts has {len(counts)} stages, stages={stages}")
    split_layers(len(model), counts)
    return stages, counts


def _micro_list(micro_batches, n: int) -> tuple[list[int], bool]:
    single = isinstance(micro_batches, int)
    ms = [micro_batches] if single else list(micro_batches)
    if not ms:
        raise ValueError("micro_batches is empty")
    ms = [check_int("micro_batches", m, lo=1, hi=n) for m in ms]
    return ms, single


def run_pipeline(kind: str, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor,
                 stages: int = 2, micro_batches: int | Sequence[int] = 4, *,
                 counts: Sequence[int] | None = None, verbose: bool = False,
                 timeout: float = 30) -> PipelineRun | list[PipelineRun]:
    """One training step of ``model`` (an ``nn.Sequential`` of layers) on ``(x, y)`` with
    schedule ``kind`` on ``stages`` real ranks (:func:`parlearn.dist.run`), ``counts[s]``
    layers on stage ``s`` (default :func:`partition_equal`), the batch cut into
    ``micro_batches`` (``torch.tensor_split``). The loss is the full-batch
    ``sum((model(x) - y)^2) / len(x)``. ``verbose`` prints every send/recv and op with its
    time on its rank (a text timeline). A sequence of micro-batch counts runs them all in
    one launch and returns a list. ``timeout`` is the group's per-message timeout; the
    whole run is stopped after ``4 * timeout`` seconds (:class:`parlearn.dist.RankError`)."""
    check_choice("kind", kind, SCHEDULES)
    stages, counts = _check_pipeline_args(model, x, y, stages, counts)
    ms, single = _micro_list(micro_batches, len(x))
    check_bool("verbose", verbose)
    from parlearn import dist

    _preimport()
    per_rank = dist.run(_worker_schedule, stages, args=(kind, model, x, y, counts, ms),
                        backend="gloo", timeout=timeout, deadline=4 * timeout)
    runs = []
    for i, m in enumerate(ms):
        results = [r[i] for r in per_rank]
        events = [e for r in results for e in r["events"]]
        log = [f"{t * 1e3:9.3f} ms  {text}" for t, text in
               sorted(entry for r in results for entry in r["log"])]
        runs.append(PipelineRun(kind, stages, m, [g for r in results for g in r["grads"]],
                                [r["ops"] for r in results], events, log,
                                measured_bubble(events)))
        if verbose:
            print(f"--- {kind}, P={stages}, M={m}")
            print("\n".join(log))
    return runs[0] if single else runs


# ---------------------------------------------------------------------------------------
# Partitioning (in the spirit of LAMP): balanced contiguous stages from measured costs.

def partition_equal(n_layers: int, stages: int) -> list[int]:
    """The naive split: layer counts as equal as they can be (the first stages get the
    extra ones), whatever each layer costs."""
    n_layers = check_int("n_layers", n_layers, lo=1)
    stages = check_int("stages", stages, lo=1, hi=n_layers)
    q, r = divmod(n_layers, stages)
    return [q + (s < r) for s in range(stages)]


def stage_costs(costs: Sequence[float], counts: Sequence[int]) -> list[float]:
    """The summed cost of each stage's layers."""
    return [sum(costs[a:b]) for a, b in split_layers(len(costs), counts)]


def partition_balanced(costs: Sequence[float], stages: int) -> list[int]:
    """Layer counts of the contiguous split of ``costs`` into ``stages`` non-empty stages
    whose largest stage cost is smallest (the slowest stage sets a pipeline's pace).
    Dynamic programming: ``best[k][i]`` = the smallest max-stage cost of the first ``i``
    layers in ``k`` stages ``= min_j max(best[k-1][j], sum(costs[j:i]))``; O(P n^2)."""
    costs = [check_float("costs", c, lo=0) for c in costs]
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
    repeat = check_int("repeat", repeat, lo=1)
    costs, h = [], x.detach()
    for layer in model:
        inp = h.detach().requires_grad_(True)
        layer_copy = copy.deepcopy(layer)

        def step(layer=layer_copy, inp=inp):
            out = layer(inp)
            torch.autograd.grad(out.sum(), [inp, *layer.parameters()])

        costs.append(measure(step, warmup=1, repeat=repeat, threads=1).median)
        with torch.no_grad():
            h = layer(h)
    return costs


# ---------------------------------------------------------------------------------------
# The real engine: the same stages through torch.distributed.pipelining.

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "zb": "ScheduleInterleavedZeroBubble"}


def _worker_torch(rank: int, world: int, kind: str, model: nn.Sequential, x: torch.Tensor,
                  y: torch.Tensor, counts: Sequence[int], ms: Sequence[int]) -> list[list]:
    from torch.distributed import pipelining

    out = []
    n_total = len(x)
    for m in ms:
        sub = nn.Sequential(*_stage_layers(model, counts, rank))
        stage = pipelining.PipelineStage(sub, rank, world, torch.device("cpu"))
        cls = getattr(pipelining, TORCH_SCHEDULES[kind])
        # Losses summed over the full batch size and no rescaling: as in run_pipeline.
        sched = cls([stage] if kind == "zb" else stage, m,
                    loss_fn=lambda o, t: _loss(o, t, n_total), scale_grads=False)
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        out.append([p.grad.detach().clone() for p in sub.parameters()])
    return out


def run_torch_pipeline(kind: str, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor,
                       stages: int = 2, micro_batches: int | Sequence[int] = 4, *,
                       counts: Sequence[int] | None = None, timeout: float = 30
                       ) -> list[torch.Tensor] | list[list[torch.Tensor]]:
    """The gradients of the same step as :func:`run_pipeline` computed by
    ``torch.distributed.pipelining``: a ``PipelineStage`` per rank holding the same layers,
    driven by :data:`TORCH_SCHEDULES` ``[kind]`` (``ScheduleInterleavedZeroBubble`` with one
    stage per rank for ``"zb"``). torch splits the batch with ``torch.tensor_split``, so
    ``len(x)`` should be divisible by the micro-batch count for equal shapes."""
    check_choice("kind", kind, SCHEDULES)
    stages, counts = _check_pipeline_args(model, x, y, stages, counts)
    ms, single = _micro_list(micro_batches, len(x))
    from parlearn import dist

    _preimport()
    import torch.distributed.pipelining  # noqa: F401  (imported once here, not per rank)
    per_rank = dist.run(_worker_torch, stages, args=(kind, model, x, y, counts, ms),
                        backend="gloo", timeout=timeout, deadline=4 * timeout)
    grads = [[g for r in per_rank for g in r[i]] for i in range(len(ms))]
    return grads[0] if single else grads


# ---------------------------------------------------------------------------------------
# Hydra-style shard parallelism: several independent models through the same stages.

def hydra_schedule(kind: str, stages: int, micro_batches: int, models: int) -> list[list[Op]]:
    """:func:`schedule` of ``models * micro_batches`` micro-batches, interleaved: op
    micro-batch ``j`` is micro-batch ``j // models`` of model ``j % models``. One model's
    idle slots hold another's work: the bubble is ``(P-1)/(K M + P-1)`` instead of
    ``(P-1)/(M+P-1)`` per model trained one after another."""
    models = check_int("models", models, lo=1)
    return schedule(kind, stages, check_int("micro_batches", micro_batches, lo=1) * models)


def _worker_hydra(rank: int, world: int, kind: str, models: list[nn.Sequential],
                  data: list[tuple[torch.Tensor, torch.Tensor]], counts: Sequence[int], m: int,
                  steps: int, lr: float) -> list[list[torch.Tensor]]:
    layers = [_stage_layers(model, counts, rank) for model in models]
    order = hydra_schedule(kind, world, m, len(models))[rank]
    xs, ys = [d[0] for d in data], [d[1] for d in data]
    widths = [_in_width(model, counts, rank) for model in models]
    for _ in range(steps):
        _run_orders(rank, world, order, layers, xs, ys, m, kind == "zb", widths)
        with torch.no_grad():   # plain SGD on this rank's shard of every model
            for p in (p for lays in layers for lay in lays for p in lay.parameters()):
                p -= lr * p.grad
                p.grad = None
    return [[p.detach().clone() for lay in lays for p in lay.parameters()] for lays in layers]


def _check_hydra(models, data, steps, lr):
    if not isinstance(models, (list, tuple)) or not models:
        raise TypeError("models must be a non-empty list of nn.Sequential")
    for model in models:
        check_module("models", model)
        if not isinstance(model, nn.Sequential) or len(model) != len(models[0]):
            raise ValueError("models must be nn.Sequential with the same number of layers")
    if not isinstance(data, (list, tuple)) or len(data) != len(models):
        raise ValueError(f"data must hold one (x, y) per model ({len(models)})")
    for x, y in data:
        check_tensor("x", x, ndim=2)
        check_tensor("y", y, ndim=2)
    return check_int("steps", steps, lo=1), check_float("lr", lr, lo=0, lo_open=True)


def hydra_train(models: Sequence[nn.Sequential], data: Sequence[tuple[torch.Tensor, torch.Tensor]],
                stages: int = 2, micro_batches: int = 2, *, steps: int = 3, lr: float = 0.1,
                kind: str = "1f1b", counts: Sequence[int] | None = None, timeout: float = 30
                ) -> list[nn.Sequential]:
    """Train every model of ``models`` on its own ``data[i] = (x, y)`` for ``steps`` full-batch
    SGD steps of rate ``lr``, all at once through one pipeline of ``stages`` real ranks:
    stage ``s`` holds layers ``counts`` of every model, and the models' micro-batches are
    interleaved by :func:`hydra_schedule`. Returns trained copies (the inputs untouched)."""
    check_choice("kind", kind, SCHEDULES)
    steps, lr = _check_hydra(models, data, steps, lr)
    stages, counts = _check_pipeline_args(models[0], data[0][0], data[0][1], stages, counts)
    m = check_int("micro_batches", micro_batches, lo=1, hi=min(len(x) for x, _ in data))
    from parlearn import dist

    _preimport()
    per_rank = dist.run(_worker_hydra, stages,
                        args=(kind, list(models), list(data), counts, m, steps, lr),
                        backend="gloo", timeout=timeout, deadline=4 * timeout)
    trained = []
    for i, model in enumerate(models):
        new = copy.deepcopy(model)
        with torch.no_grad():
            for p, value in zip(new.parameters(), [t for r in per_rank for t in r[i]],
                                strict=True):
                p.copy_(value)
        trained.append(new)
    return trained


def hydra_reference(models: Sequence[nn.Sequential],
                    data: Sequence[tuple[torch.Tensor, torch.Tensor]], *, steps: int = 3,
                    lr: float = 0.1) -> list[nn.Sequential]:
    """Each model trained alone in one process, as :func:`hydra_train` trains it."""
    steps, lr = _check_hydra(models, data, steps, lr)
    trained = []
    for model, (x, y) in zip(models, data, strict=True):
        new = copy.deepcopy(model)
        for _ in range(steps):
            grads = reference_grads(new, x, y)
            with torch.no_grad():
                for p, g in zip(new.parameters(), grads, strict=True):
                    p -= lr * g
        trained.append(new)
    return trained


# ---------------------------------------------------------------------------------------
# AMDP, reconstructed: pipelines running in opposite directions over the same devices.

def simulate_bidirectional(stages: int, micro_batches: int, cost_f: float = 1.0,
                           cost_b: float = 2.0) -> Simulation:
    """RECONSTRUCTION (modeled). Of "Asynchronous Multi-Directional Pipeline Parallelism for
    Large-Scale Models Training" (2026) only the title could be read; this is our own
    reading of it, in the spirit of bidirectional schedules such as Chimera (Li & Hoefler
    2021), not the paper's algorithm. Two replicas of the model run as two pipelines over the
    same ``P`` devices, one mapping stage ``s`` to device ``s`` ("down"), the other to device
    ``P-1-s`` ("up"); each takes ``micro_batches / 2`` micro-batches in 1F1B order. Each
    device runs, among the next ops of its two stages, the one that can start first (ties:
    backward first): list scheduling with no global step. Equal stage costs; the gradient
    all-reduce between the replicas and their doubled weight memory are NOT modeled.
    Compare its ``bubble`` with ``simulate(schedule("1f1b", P, M))``."""
    stages = check_int("stages", stages, lo=2)
    micro_batches = check_int("micro_batches", micro_batches, lo=2)
    if micro_batches % 2:
        raise ValueError(f"micro_batches must be even (half per direction), got {micro_batches}")
    cf, cb = check_float("cost_f", cost_f, lo=0), check_float("cost_b", cost_b, lo=0)
    half = micro_batches // 2
    one = schedule("1f1b", stages, half)
    dirs = ("down", "up")
    device = {("down", s): s for s in range(stages)} | {("up", s): stages - 1 - s
                                                      for s in range(stages)}
    pos = {key: 0 for key in device}
    done: dict[tuple[str, str, int, int], float] = {}
    free = [0.0] * stages
    events = []
    while any(pos[key] < len(one[key[1]]) for key in device):
        best = None
        for (d, s), dev in device.items():
            if pos[(d, s)] == len(one[s]):
                continue
            op = one[s][pos[(d, s)]]
            if op.kind == "F":
                dep = (d, "F", s - 1, op.mb) if s > 0 else None
            else:
                dep = (d, "B", s + 1, op.mb) if s < stages - 1 else (d, "F", s, op.mb)
            if dep is not None and dep not in done:
                continue
            start = max(free[dev], 0.0 if dep is None else done[dep])
            rank = (start, op.kind != "B", dirs.index(d))
            if best is None or rank < best[0]:
                best = (rank, d, s, dev, op)
        if best is None:
            raise AssertionError("bidirectional schedule deadlocked")  # cannot happen
        (start, _, _), d, s, dev, op = best
        end = start + (cf if op.kind == "F" else cb)
        done[(d, op.kind, s, op.mb)] = end
        free[dev] = end
        pos[(d, s)] += 1
        events.append((f"device {dev}", f"{op.kind}{d} {op.mb}", start, end))
    makespan = max(free)
    busy = [sum(e[3] - e[2] for e in events if e[0] == f"device {v}") for v in range(stages)]
    peak = []
    for v in range(stages):
        held = sorted([(e[2], 1) for e in events if e[0] == f"device {v}" and e[1][0] == "F"]
                      + [(e[3], -1) for e in events if e[0] == f"device {v}" and e[1][0] == "B"])
        level, top = 0, 0
        for _, delta in held:
            level += delta
            top = max(top, level)
        peak.append(top)
    return Simulation(events, makespan, 1.0 - sum(busy) / (stages * makespan), busy, peak)


# ---------------------------------------------------------------------------------------
# Bench: measured bubble vs formula; balanced vs naive partition.

def _makespan(run: PipelineRun) -> float:
    return max(e[3] for e in run.events) - min(e[2] for e in run.events)


def bench(device: torch.device, quick: bool) -> list:
    """Rows for ``python -m parlearn.bench pipeline``, on 2 real gloo ranks on the CPU
    (``device`` is not used: the stages are CPU processes): (1) the measured bubble of 1F1B
    with equal stages against ``(P-1)/(M+P-1)`` (ratio measured/modeled; communication and
    a busy machine push it above 1); (2) the step time (first op start to last op end, median
    of repeats in one launch) of a skewed model cut into equal layer counts vs cut by
    :func:`partition_balanced` of :func:`layer_costs` (ratio naive/balanced). Each row's
    detail gives the spread of the step times and whether it was readable."""
    from parlearn.core.bench import Row
    from parlearn.core.timing import Timing

    del device
    repeat, m, rows = (3 if quick else 7), 4, []
    where = f"2 gloo ranks on CPU ({__import__('os').cpu_count()} cores)"

    def readable(t: Timing) -> str:
        return (f"spread {t.spread:.2f}, "
                f"{'reliable' if t.reliable else 'UNRELIABLE (busy machine)'}")

    model = make_model([256] * 5, seed=0)
    x, y = make_data(model, 512 if quick else 2048, seed=1)
    runs = run_pipeline("1f1b", model, x, y, 2, [m] * (repeat + 1))[1:]   # first: warm-up
    spans = Timing(tuple(_makespan(r) for r in runs), where, threads=1)
    measured = sorted(r.bubble for r in runs)[len(runs) // 2]
    rows.append(Row("pipeline", f"bubble formula (P-1)/(M+P-1), P=2 M={m}",
                    "1F1B measured bubble", measured / bubble_formula(2, m), where,
                    detail=f"ratio = measured/modeled; measured {measured:.3f}, "
                           f"formula {bubble_formula(2, m):.3f}; step {readable(spans)}"))
    skewed = make_model([128, 128, 128, 128, 128, 1024, 128], seed=0)
    xs, ys = make_data(skewed, 512 if quick else 2048, seed=1)
    balanced = partition_balanced(layer_costs(skewed, xs, repeat=repeat), 2)
    naive = partition_equal(len(skewed), 2)
    steps = {}
    for name, counts in (("naive", naive), ("balanced", balanced)):
        got = run_pipeline("1f1b", skewed, xs, ys, 2, [m] * (repeat + 1), counts=counts)[1:]
        steps[name] = Timing(tuple(_makespan(r) for r in got), where, threads=1)
    rows.append(Row("pipeline", f"equal layer counts {naive}",
                    f"balanced by measured cost {balanced}",
                    steps["naive"].median / steps["balanced"].median, where,
                    detail=f"1F1B step, M={m}: naive {steps['naive'].median * 1e3:.1f} ms "
                           f"({readable(steps['naive'])}), balanced "
                           f"{steps['balanced'].median * 1e3:.1f} ms "
                           f"({readable(steps['balanced'])})"))
    return rows
