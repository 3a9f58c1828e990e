"""The pipeline on real ranks: each runs its stage's list of ops with send/recv.

The model is an ``nn.Sequential`` of layers (:func:`make_model`, one element per layer: the
unit a partition cuts at) and :func:`reference_grads` the single-process reference.
:func:`run_pipeline` puts stage ``s`` on rank ``s`` of :func:`parlearn.distributed.run`, which
executes ``schedule(kind, P, M)[s]`` op by op (:class:`_Stage`), and returns the gradients
(equal to the reference to round-off), the measured timeline and its bubble
(:func:`measured_bubble`); :func:`stage_op_costs` turns the timeline into per-stage costs
for the simulator.

The ranks are CPU processes on gloo (also on a machine with GPUs): the point is the
schedule and its exactness; timing at scale comes from the simulator.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist
from torch import nn

from parlearn.core.checks import (
    check_bool,
    check_choice,
    check_device,
    check_float,
    check_int,
    check_module,
    check_str,
    check_tensor,
)
from parlearn.multi_device.pipeline.partition import (
    _check_ties,
    _probe,
    _trainable,
    layer_costs,
    partition_balanced,
    partition_equal,
    split_layers,
)
from parlearn.multi_device.pipeline.schedules import SCHEDULES, Op, bubble_formula, schedule

__all__ = ["make_model", "make_data", "reference_grads", "PipelineRun", "run_pipeline",
           "measured_bubble", "stage_op_costs", "bench"]


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
    one per parameter that requires grad, in ``model.parameters()`` order (a tied weight
    once, frozen ones left out; the caller's ``.grad`` untouched)."""
    check_module("model", model)
    check_tensor("x", x, ndim=2)
    check_tensor("y", y, ndim=2)
    if len(x) != len(y):
        raise ValueError(f"x and y must have the same rows, got {len(x)} and {len(y)}")
    _probe(model, x, y)   # x fits the first layer and the output y's shape, or it names which
    params = _trainable([model])
    return [g.detach() for g in torch.autograd.grad(_loss(model(x), y, len(x)), params)]


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
                n_total: int, in_spec: tuple[tuple[int, ...], torch.dtype]) -> None:
        layers = self.layers[model]
        h = x if self.first else self._recv(*in_spec, self.rank - 1, j, "activation")
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
            params = _trainable([layers[i]])   # an activation or a frozen layer has none
            wants_input = inp.requires_grad
            if self.split:
                # B: the input gradient (delta) only; the graph is kept for W, if W has
                # any weight to differentiate.
                saved[i][2] = grad
                if wants_input:
                    grad = torch.autograd.grad(out, inp, grad, retain_graph=bool(params))[0]
            elif wants_input or params:   # else nothing here needs a gradient
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
            params = _trainable([layer])
            if params:   # W of a layer without weights is nothing (autograd refuses it)
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
                specs_in: list[tuple[torch.Size, torch.dtype]]) -> _Stage:
    """Execute one rank's ``order`` over ``len(layers)`` models, whose micro-batches are
    interleaved: op micro-batch ``j`` is micro-batch ``j // K`` of model ``j % K``.
    ``specs_in[k]`` is the per-row shape and dtype of model ``k``'s input to this stage."""
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
                          ((len(chunks_x[model][i]), *specs_in[model][0]),
                           specs_in[model][1]))
        elif op.kind == "B":
            stage.backward(op.mb, model)
        else:
            stage.weight_grad(op.mb, model)
    stage.wait_sends()
    return stage


def _stage_layers(model: nn.Sequential, counts: Sequence[int], rank: int) -> list[nn.Module]:
    a, b = split_layers(len(model), counts)[rank]
    # One deepcopy of the whole list: a weight tied between two of its layers stays tied.
    return copy.deepcopy([model[i] for i in range(a, b)])


def _worker_schedule(rank: int, world: int, kind: str, model: nn.Sequential, x: torch.Tensor,
                     y: torch.Tensor, counts: Sequence[int], ms: Sequence[int],
                     specs_in: Sequence[tuple[torch.Size, torch.dtype]]) -> list[dict]:
    """Rank ``rank`` runs ``schedule(kind, world, m)[rank]`` for each ``m`` in ``ms`` on a
    fresh copy of its stage (whose input rows have shape and dtype ``specs_in[rank]``);
    returns per ``m`` its gradients, ops, events and log."""
    out = []
    for m in ms:
        layers = _stage_layers(model, counts, rank)
        order = schedule(kind, world, m)[rank]
        st = _run_orders(rank, world, order, [layers], [x], [y], m, kind == "zb",
                         [specs_in[rank]])
        out.append({"grads": [p.grad.detach().clone() for p in _trainable(layers)],
                    "ops": [f"{e[1].replace(' ', '')}" for e in st.events],
                    "events": st.events, "log": st.log})
    return out


@dataclass
class PipelineRun:
    """What :func:`run_pipeline` measured. ``grads`` are the gradients of the model's
    parameters that require grad, in ``model.parameters()`` order (as
    :func:`reference_grads`); ``ops[s]`` the ops rank ``s`` executed, in order (e.g.
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

    def __post_init__(self) -> None:
        # A record, but a public one: what it holds is checked like any argument.
        check_str("kind", self.kind)
        check_int("stages", self.stages, lo=1)
        check_int("micro_batches", self.micro_batches, lo=1)
        for name in ("grads", "ops", "events", "log"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise TypeError(f"{name} must be a list, got {value!r}")
        if any(not isinstance(g, torch.Tensor) for g in self.grads):
            raise TypeError("grads must be a list of tensors")
        check_float("bubble", self.bubble)


def measured_bubble(events: Sequence[tuple[str, str, float, float]]) -> float:
    """Idle fraction of a timeline: ``1 - sum(op durations) / (lanes * (last end - first
    start))``."""
    if isinstance(events, (str, bytes)) or not isinstance(events, Sequence) or not events:
        raise ValueError(f"events must be a non-empty list of (lane, label, t0, t1), got "
                         f"{events!r}")
    for e in events:
        if not isinstance(e, (list, tuple)) or len(e) != 4:
            raise ValueError(f"events must hold (lane, label, t0, t1) entries, got {e!r}")
        if check_float("events t1", e[3]) < check_float("events t0", e[2]):
            raise ValueError(f"events entry {e!r} ends before it starts")
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
    if not isinstance(run, PipelineRun):
        raise TypeError(f"run must be a PipelineRun (what run_pipeline returns), got "
                        f"{type(run).__name__}")
    out: dict[str, list[float]] = {}
    for kind in "FBW":
        per = [sorted(e[3] - e[2] for e in run.events
                      if e[0] == f"rank {s}" and e[1].split()[0] == kind)
               for s in range(run.stages)]
        if all(per):
            out[kind] = [d[len(d) // 2] for d in per]
    return out


def _check_pipeline_args(model, x, y, stages, counts):
    """Check everything before the ranks start; returns ``stages``, ``counts`` and
    :func:`_probe`'s shapes. Ties are checked by the caller, which knows the cut."""
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
    return stages, counts, _probe(model, x, y)


def _micro_list(micro_batches, n: int) -> tuple[list[int], bool]:
    single = not isinstance(micro_batches, Sequence)   # a number, or something to refuse
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
    schedule ``kind`` on ``stages`` real ranks (:func:`parlearn.distributed.run`), ``counts[s]``
    layers on stage ``s`` (default :func:`partition_equal`), the batch cut into
    ``micro_batches`` (``torch.tensor_split``). The loss is the full-batch
    ``sum((model(x) - y)^2) / len(x)``. Any layers that map rows to rows will do (a stage
    may begin with an activation or a LayerNorm: what it receives is probed from ``x``);
    frozen parameters get no gradient; a weight tied between layers of one stage is one
    tensor, and one tied across stages is refused. ``verbose`` prints every send/recv and
    op with its time on its rank (a text timeline). A sequence of micro-batch counts runs
    them all in one launch and returns a list. ``timeout`` is the group's per-message
    timeout; the whole run is stopped after ``4 * timeout`` seconds
    (:class:`parlearn.distributed.RankError`)."""
    check_choice("kind", kind, SCHEDULES)
    stages, counts, specs = _check_pipeline_args(model, x, y, stages, counts)
    bounds = split_layers(len(model), counts)
    _check_ties(model, bounds)
    ms, single = _micro_list(micro_batches, len(x))
    check_bool("verbose", verbose)
    from parlearn import distributed as dist

    _preimport()
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    per_rank = dist.run(_worker_schedule, stages,
                        args=(kind, model, x, y, counts, ms, [specs[a] for a, _ in bounds]),
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

    check_device("device", device)   # checked, then unused: see the docstring
    check_bool("quick", quick)
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
