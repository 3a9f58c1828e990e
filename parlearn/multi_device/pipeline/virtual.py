"""Any :class:`Schedule` on real ranks: chunks (virtual stages) that send to any rank.

:func:`run_schedule` cuts the model into ``P * v`` virtual stages of equal layer counts,
gives rank ``r`` the chunks :meth:`Schedule.stage_of` says, and has every rank execute
its op list with blocking ``recv`` and asynchronous ``isend`` through
:func:`parlearn.distributed.run` (gloo). The activation of virtual stage ``g`` goes to whichever
rank holds ``g+1`` (the next rank in the loop placement; in the V placement the same rank
at the turn, where it is handed over in memory, not sent); the gradient goes back the same
way. An overlapped F&B group (DualPipe-V) runs as its F, then its B and W: our
send/recv block, so nothing overlaps. The gradients must equal
:func:`parlearn.multi_device.pipeline.runtime.reference_grads` to round-off.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch
import torch.distributed as tdist
from torch import nn

from parlearn.core.checks import check_float, check_int
from parlearn.multi_device.pipeline.partition import partition_equal, split_layers
from parlearn.multi_device.pipeline.runtime import (
    PipelineRun,
    _accumulate,
    _check_pipeline_args,
    _check_ties,
    _loss,
    _preimport,
    _trainable,
    measured_bubble,
)
from parlearn.multi_device.pipeline.schedules import Schedule
from parlearn.multi_device.pipeline.zoo import validate

__all__ = ["run_schedule", "chunk_layers"]


def chunk_layers(n_layers: int, sched: Schedule) -> list[tuple[int, int]]:
    """The layer range ``(start, end)`` of each virtual stage: equal counts, in order."""
    n_layers = check_int("n_layers", n_layers, lo=1)
    if not isinstance(sched, Schedule):
        raise TypeError(f"sched must be a Schedule, got {type(sched).__name__}")
    if n_layers < sched.virtual_stages:
        raise ValueError(f"n_layers={n_layers}: the model has fewer layers than the schedule's "
                         f"{sched.virtual_stages} virtual stages")
    return split_layers(n_layers, partition_equal(n_layers, sched.virtual_stages))


class _Chunks:
    """One rank's chunks of one schedule, run op by op (each layer's input detached, so B
    and W can be split per layer as in :mod:`parlearn.multi_device.pipeline.runtime`)."""

    def __init__(self, rank: int, sched: Schedule, model: nn.Sequential, t0: float,
                 specs: list[tuple[torch.Size, torch.dtype]]):
        self.rank, self.sched, self.t0 = rank, sched, t0
        bounds = chunk_layers(len(model), sched)
        self.layers = {}
        self.specs_in = {}   # per chunk: shape and dtype of its input rows (from the probe)
        for c in range(sched.chunks):
            a, b = bounds[sched.stage_of(rank, c)]
            # One deepcopy per chunk: a weight tied within it stays tied.
            self.layers[c] = copy.deepcopy([model[i] for i in range(a, b)])
            self.specs_in[c] = specs[a]
        self.last = sched.virtual_stages - 1
        self.local: dict[tuple[str, int, int], torch.Tensor] = {}
        self.saved: dict[tuple[int, int], list] = {}
        self.pending_w: dict[tuple[int, int], list] = {}
        self.sends: list = []
        self.events: list[tuple[str, str, float, float]] = []

    def _tag(self, g: int, mb: int, grad: bool) -> int:
        return (g * self.sched.micro_batches + mb) * 2 + grad

    def _put(self, t: torch.Tensor, g_to: int, g_from: int, mb: int, grad: bool) -> None:
        dst = self.sched.where(g_to)[0]
        if dst == self.rank:
            self.local[("g" if grad else "a", g_to, mb)] = t
        else:
            self.sends.append((tdist.isend(t, dst, tag=self._tag(g_from, mb, grad)), t))

    def _get(self, g_from: int, g_to: int, mb: int, grad: bool, like: tuple,
             dtype: torch.dtype) -> torch.Tensor:
        key = ("g" if grad else "a", g_to, mb)
        if key in self.local:
            return self.local.pop(key)
        buf = torch.empty(like, dtype=dtype)
        tdist.recv(buf, self.sched.where(g_from)[0], tag=self._tag(g_from, mb, grad))
        return buf

    def forward(self, mb: int, c: int, x, y, n_total: int) -> None:
        g = self.sched.stage_of(self.rank, c)
        layers = self.layers[c]
        shape, dtype = self.specs_in[c]
        h = x[mb] if g == 0 else self._get(g - 1, g, mb, False, (len(x[mb]), *shape), dtype)
        start, saved = time.perf_counter(), []
        for i, layer in enumerate(layers):
            inp = h.detach().requires_grad_(not (g == 0 and i == 0))
            h = layer(inp)
            saved.append([inp, h, None])
        if g == self.last:
            saved[-1][1] = _loss(h, y[mb], n_total)
        self.saved[(mb, c)] = saved
        self._record("F", mb, c, start)
        if g < self.last:
            self._put(h.detach(), g + 1, g, mb, False)

    def backward(self, mb: int, c: int) -> None:
        g = self.sched.stage_of(self.rank, c)
        saved = self.saved.pop((mb, c))
        top = saved[-1][1]
        grad = None if g == self.last else self._get(g + 1, g, mb, True, top.shape, top.dtype)
        start = time.perf_counter()
        for i in reversed(range(len(saved))):
            inp, out, _ = saved[i]
            params = _trainable([self.layers[c][i]])   # none: an activation, a frozen layer
            wants = inp.requires_grad
            if self.sched.split:
                saved[i][2] = grad
                if wants:
                    grad = torch.autograd.grad(out, inp, grad, retain_graph=bool(params))[0]
            elif wants or params:   # else nothing here needs a gradient
                grads = torch.autograd.grad(out, ([inp] if wants else []) + params, grad)
                if wants:
                    grad, grads = grads[0], grads[1:]
                _accumulate(params, grads)
        if self.sched.split:
            self.pending_w[(mb, c)] = saved
        self._record("B", mb, c, start)
        if g > 0:
            self._put(grad, g - 1, g, mb, True)

    def weight_grad(self, mb: int, c: int) -> None:
        start = time.perf_counter()
        for layer, (_, out, grad) in zip(self.layers[c], self.pending_w.pop((mb, c)),
                                         strict=True):
            params = _trainable([layer])
            if params:   # W of a layer without weights is nothing (autograd refuses it)
                _accumulate(params, torch.autograd.grad(out, params, grad))
        self._record("W", mb, c, start)

    def _record(self, kind: str, mb: int, c: int, start: float) -> None:
        label = f"{kind} {mb}" + (f"c{c}" if c else "")
        self.events.append((f"rank {self.rank}", label, start - self.t0,
                            time.perf_counter() - self.t0))


def _worker(rank: int, world: int, scheds: Sequence[Schedule], model: nn.Sequential,
            x: torch.Tensor, y: torch.Tensor, specs: list) -> list[dict]:
    out = []
    for sched in scheds:
        xs = torch.tensor_split(x, sched.micro_batches)
        ys = torch.tensor_split(y, sched.micro_batches)
        tdist.barrier()   # a common start, so the ranks' clocks line up
        run = _Chunks(rank, sched, model, time.perf_counter(), specs)
        for op in sched[rank]:
            if op.kind == "F":
                run.forward(op.mb, op.chunk, xs, ys, len(x))
            elif op.kind == "B":
                run.backward(op.mb, op.chunk)
            else:
                run.weight_grad(op.mb, op.chunk)
        for work, _ in run.sends:
            work.wait()
        grads = {sched.stage_of(rank, c): [p.grad.detach().clone() for p in _trainable(layers)]
                 for c, layers in run.layers.items()}
        out.append({"grads": grads, "events": run.events})
    return out


def run_schedule(scheds: Schedule | Sequence[Schedule], model: nn.Sequential,
                 x: torch.Tensor, y: torch.Tensor, *, timeout: float = 30
                 ) -> PipelineRun | list[PipelineRun]:
    """One training step of ``model`` on ``(x, y)`` per schedule in ``scheds`` (all with the
    same rank count, run one after another in one launch of ``P`` gloo ranks), the model
    cut into the schedule's virtual stages (:func:`chunk_layers`). Returns a
    :class:`PipelineRun` per schedule: the gradients in ``model.parameters()`` order, the
    ops each rank executed, the measured timeline and its bubble."""
    single = isinstance(scheds, Schedule)
    scheds = [scheds] if single else list(scheds)
    if not scheds or not all(isinstance(s, Schedule) for s in scheds):
        raise TypeError("scheds must be a Schedule or a non-empty list of them")
    world = scheds[0].stages
    if any(s.stages != world for s in scheds):
        raise ValueError("scheds must all have the same number of stages (ranks)")
    specs = _check_pipeline_args(model, x, y, world, None)[2]
    for s in scheds:
        # A user's schedule that misses or repeats an op would run to completion with wrong
        # gradients (or hang): validate it first, naming the fault.
        try:
            validate(s)
        except ValueError as e:
            raise ValueError(f"scheds: schedule {s.kind!r} is not valid: {e}") from None
        _check_ties(model, chunk_layers(len(model), s))
        if s.micro_batches > len(x):
            raise ValueError(f"micro_batches={s.micro_batches} is more than the {len(x)} rows")
    from parlearn import distributed as dist

    _preimport()
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    per_rank = dist.run(_worker, world, args=(scheds, model, x, y, specs), backend="gloo",
                        timeout=timeout, deadline=4 * timeout)
    runs = []
    for i, s in enumerate(scheds):
        by_stage = {g: gr for r in per_rank for g, gr in r[i]["grads"].items()}
        events = [e for r in per_rank for e in r[i]["events"]]
        ops = [[e[1].replace(" ", "") for e in r[i]["events"]] for r in per_rank]
        runs.append(PipelineRun(s.kind, world, s.micro_batches,
                                [g for k in sorted(by_stage) for g in by_stage[k]], ops,
                                events, [], measured_bubble(events)))
    return runs[0] if single else runs
