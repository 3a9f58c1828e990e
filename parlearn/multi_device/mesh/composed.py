"""The tiny GPT trained on a ``pp x dp x tp`` device mesh, from the course's own pieces.

Each rank builds the whole float64 GPT from its config (same seed, same weights everywhere,
no message needed) and keeps only its piece (:class:`parlearn.mesh.stage.StageGPT`):

- **PP** (lesson 13): stage ``s`` keeps blocks ``[s L/P, (s+1) L/P)``; the first stage also
  the token embedding, the last the final LayerNorm and the output layer. The GPT's output
  layer IS its embedding (tied weights), so with ``pp > 1`` two stages hold a copy of one
  tensor: their gradients are summed over the *embedding group* (first and last stage)
  before the update, as Megatron-LM does. The micro-batches run the 1F1B order of
  :func:`parlearn.pipeline.schedule` with isend/recv between neighbouring stages.
- **TP** (lesson 14): q, k, v and the MLP's first projection are split by output features
  (whole heads per rank), the attention output and the MLP's second projection by input
  features; Megatron's ``f``/``g`` (:class:`~parlearn.tensor_parallel.CopyToRanks`,
  :class:`~parlearn.tensor_parallel.SumOverRanks`) on the tp group place the all-reduces.
- **SP** (lesson 17, ``sp=True``): between the TP regions each tp rank keeps only its
  ``S/tp`` tokens; ``g`` and ``g-bar`` become all-gather and reduce-scatter along the
  sequence (:class:`~parlearn.context_parallel.GatherSequence`, ``ScatterSequence``).
  LayerNorms, the embedding and the output layer then see a rank's tokens only, so their
  gradients are partial sums, all-reduced over the tp group. Pipeline messages shrink by
  ``tp``.
- **DP / ZeRO-1** (lessons 11-12): :class:`parlearn.sharding.ShardedAdam` over the dp group
  averages the gradients (reduce-scatter, Adam on a 1/dp shard, all-gather: stage 1; or
  all-reduce: stage 0). Each dp replica takes ``batch / dp`` sequences.
- **The whole recipe** (``recipe=``, a :class:`parlearn.core.recipe.Recipe`): torch's AdamW
  with weight decay on matrices only, wrapped in :class:`parlearn.sharding.ShardedOptimizer`
  over the dp group (ZeRO-1 or 2; plain AdamW after a dp all-reduce for ``zero=0``), a
  warm-up + cosine schedule, and clipping by the global gradient norm of the *whole* model:
  each rank sums the squares of the gradient elements it alone is responsible for (a
  tp-replicated tensor on tp rank 0 only, the tied embedding on the first stage only, a
  dp-replicated gradient on replica 0 only), one all-reduce over every rank adds them, and
  every rank scales its gradients by the same factor (what Megatron-LM's
  ``clip_grad_norm`` does over its model-parallel group).

The loss of a micro-batch on a rank is its tokens' summed cross-entropy over
``(batch / dp) * seq``: summed over micro-batches (and tp ranks under SP) it is the
replica's mean loss, and the dp average makes it the whole batch's. So after each step
every rank holds exactly its shard of what one process would have (:func:`mesh_check`).

**Order of composition** (what torchtitan#1554 asks): apply TP first, then data
parallelism, then the pipeline split around them. TP changes what a parameter IS (a shard
with its own shape), so the optimizer, FSDP's flat buffers and DP's buckets must be built
on the already-sharded module; DP only averages whatever gradients exist, so it wraps last
over each stage's own parameters; the pipeline decides which parameters a rank has at all,
so it is decided first and the tied embedding's two copies become a cross-stage group. In
torchtitan the same order reads ``parallelize_module`` (TP/SP), then ``fully_shard``
(FSDP2), on each pipeline stage's module (:mod:`parlearn.mesh.torch_composed`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as tdist
from torch import nn
from torch.profiler import record_function

from parlearn.core.checks import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_tensor,
)
from parlearn.core.recipe import Recipe, _clip_to
from parlearn.multi_device.context_parallel.gpt import serial_train, train_batches
from parlearn.multi_device.mesh.layout import AXES, MeshShape
from parlearn.multi_device.mesh.stage import StageGPT, check_plan, shard_dim
from parlearn.multi_device.pipeline.schedules import schedule
from parlearn.multi_device.transformer.model import GPT, GPTConfig

__all__ = ["MeshRank", "mesh_train_worker", "mesh_train", "assemble", "mesh_check"]


def _saved_bytes(model: nn.Module, fn):
    """Run ``fn()``; bytes of the storages autograd saved that are not parameters or
    buffers (each storage once), and ``fn``'s result."""
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and t.dtype.is_floating_point:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


_P2P = ("send", "recv", "isend", "irecv")


def _summary(records) -> dict[str, tuple[int, int]]:
    """``{kind: (calls, payload bytes)}`` of ledger records."""
    out: dict[str, tuple[int, int]] = {}
    for r in records:
        n, b = out.get(r.kind, (0, 0))
        out[r.kind] = (n + 1, b + r.bytes)
    return out


def check_train_args(cfg: GPTConfig, shape: MeshShape, steps: int, batch: int, seq: int,
                     micro_batches: int, lr: float, seed: int, sp: bool, zero: int,
                     recompute: str, schedule_kind: str, recipe: Recipe | None = None) -> None:
    """Refuse, naming the argument, what :func:`mesh_train` and its worker cannot run."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a parlearn.core.recipe.Recipe or None, got "
                        f"{type(recipe).__name__}")
    for name, v in (("steps", steps), ("batch", batch), ("seq", seq),
                    ("micro_batches", micro_batches)):
        check_int(name, v, lo=1)
    check_float("lr", lr, lo=0, lo_open=True)
    check_int("seed", seed, lo=0)
    check_bool("sp", sp)
    # ShardedAdam (no recipe) has stages 0-1 on the mesh; ShardedOptimizer adds ZeRO-2.
    check_choice("zero", zero, (0, 1) if recipe is None else (0, 1, 2))
    check_choice("recompute", recompute, ("none", "full"))
    check_choice("schedule_kind", schedule_kind, ("1f1b", "gpipe"))
    check_plan(cfg, shape, batch, seq, micro_batches, sp)


class MeshRank:
    """One rank's share of a mesh run: its mesh and groups, its piece of the model
    (:class:`StageGPT`), its optimizer and its pipeline schedule. Build it on every rank of
    the group (it creates process groups, which is collective), then call :meth:`step` with
    the whole batch of each step: the rank cuts out its replica's share. ``steps`` counts
    the steps taken (restored from a checkpoint by :func:`parlearn.at_scale.checkpoint.load`).

    The optimizer is lesson 12's from-scratch :class:`parlearn.sharding.ShardedAdam` over the
    dp group (Adam at ``lr``), or with ``recipe`` the whole recipe (module docstring): AdamW
    in :class:`parlearn.sharding.ShardedOptimizer`, peak learning rate ``lr``, its schedule
    over ``total_steps`` and the global-norm clip (:meth:`clip_grad_norm_`)."""

    def __init__(self, rank: int, cfg: GPTConfig, shape: MeshShape, *, batch: int, seq: int,
                 micro_batches: int = 2, lr: float = 1e-2, seed: int = 0, sp: bool = True,
                 zero: int = 1, recompute: str = "none", kind: str = "1f1b",
                 recipe: Recipe | None = None, total_steps: int | None = None) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from parlearn.multi_device.sharding import ShardedAdam, ShardedOptimizer

        # Every rank checks before its first collective (the mesh's own set-up is one).
        check_train_args(cfg, shape, 1, batch, seq, micro_batches, lr, seed, sp, zero,
                         recompute, kind, recipe)
        if recipe is None and total_steps is not None:
            raise ValueError("total_steps is the recipe's schedule length: pass a recipe too")
        if recipe is not None:
            check_int("total_steps", total_steps, lo=1)
        if not tdist.is_initialized() or tdist.get_world_size() != shape.world:
            have = tdist.get_world_size() if tdist.is_initialized() else "no group"
            raise ValueError(f"shape.world={shape.world} must equal the process group's world "
                             f"size ({have})")
        self.cfg, self.shape, self.batch, self.seq, self.sp = cfg, shape, batch, seq, sp
        self.mesh = init_device_mesh("cpu", shape.dims, mesh_dim_names=AXES)
        self.tp_group, self.dp_group = self.mesh.get_group("tp"), self.mesh.get_group("dp")
        self.coords = me = shape.coords(rank)
        self.stage, self.shard, self.replica = me["pp"], me["tp"], me["dp"]
        self.emb_group = None
        if shape.pp > 1:  # every rank creates every group, in the same order
            for ranks in shape.groups("embedding"):
                g = tdist.new_group(ranks)
                if rank in ranks:
                    self.emb_group = g
        self.model = StageGPT(GPT(cfg, dtype=torch.float64), shape, self.stage, self.shard,
                              sp=sp, tp_group=self.tp_group, recompute=recompute)
        self.recipe, self.zero, self.grad_norm, self._taken = recipe, zero, None, 0
        self.total_steps = total_steps
        if recipe is None:
            self.opt = ShardedAdam(self.model, stage=zero, lr=lr, group=self.dp_group)
            self.sched = None
        else:
            groups = recipe.param_groups(self.model.parameters())
            self.opt = (torch.optim.AdamW(groups, lr=lr, betas=recipe.betas) if zero == 0 else
                        ShardedOptimizer(groups, torch.optim.AdamW, stage=zero,
                                         group=self.dp_group, lr=lr, betas=recipe.betas))
            self.sched = recipe.scheduler(self.opt, total_steps)
        s = self.stage
        self.prev = shape.rank(s - 1, self.replica, self.shard) if s > 0 else None
        self.nxt = shape.rank(s + 1, self.replica, self.shard) if s < shape.pp - 1 else None
        self.local_b = batch // shape.dp
        self.mb = self.local_b // micro_batches
        self.act_shape = (self.mb, seq // shape.tp if sp else seq, cfg.d_model)
        self.ops = schedule(kind, shape.pp, micro_batches)[s]
        self.act_peak = self.act_per_mb = 0

    @property
    def steps(self) -> int:
        """Optimizer steps taken (the Adam step count)."""
        return self.opt.steps if self.recipe is None else self._taken

    def optimizer_state(self) -> dict:
        """The optimizer's state as whole local tensors keyed by parameter name, loadable
        on any mesh: ``{"step": n, "state": {name: {"exp_avg": t, "exp_avg_sq": t}}}``.
        ShardedAdam's all-gathers its moment shards; the recipe's broadcasts each tensor's
        moments from its dp owner (zeros before the first step). Collective over the dp
        group: call it on every rank."""
        if self.recipe is None:
            return self.opt.state_dict()
        inner = self.opt if self.zero == 0 else self.opt.optim
        state = {}
        for name, p in self.model.named_parameters():
            held = inner.state.get(p, {})
            moments = {k: held[k].detach().clone() if k in held else torch.zeros_like(p)
                       for k in ("exp_avg", "exp_avg_sq")}
            if self.zero > 0:
                owner = self.opt._global[self.opt._owner[id(p)]]
                for t in moments.values():
                    tdist.broadcast(t, owner, group=self.dp_group)
            state[name] = moments
        return {"step": self._taken, "state": state}

    @torch.no_grad()
    def load_optimizer_state(self, state_dict: dict) -> None:
        """Load what :meth:`optimizer_state` returned (from any mesh): each rank keeps the
        moments of the tensors it updates, and with a recipe the schedule resumes at the
        saved step. Refuses, before changing anything, a state of other parameters."""
        if self.recipe is None:
            self.opt.load_state_dict(state_dict)
            return
        from torch.optim.optimizer import _get_scalar_dtype

        if not isinstance(state_dict, dict) or set(state_dict) != {"step", "state"}:
            raise TypeError("state_dict must be a dict with keys 'step' and 'state', as "
                            "optimizer_state() returns")
        step = check_int("state_dict['step']", state_dict["step"], lo=0)
        params = dict(self.model.named_parameters())
        state = state_dict["state"]
        if not isinstance(state, dict) or set(state) != set(params):
            raise ValueError("state_dict['state'] must hold exactly this rank's parameters "
                             f"{sorted(params)}")
        for name, p in params.items():
            for key in ("exp_avg", "exp_avg_sq"):
                check_tensor(f"state_dict['state'][{name!r}][{key!r}]", state[name].get(key),
                             shape=tuple(p.shape), dtype=p.dtype)
        inner = self.opt if self.zero == 0 else self.opt.optim
        for name, p in params.items():
            if self.zero == 0 or self.opt._owner[id(p)] == self.opt.rank:
                inner.state[p] = {"step": torch.tensor(float(step), dtype=_get_scalar_dtype()),
                                  **{k: state[name][k].clone() for k in ("exp_avg",
                                                                         "exp_avg_sq")}}
        self._taken = step
        # The schedule at ``step``: what ``step`` calls of the scheduler would have left.
        self.sched.last_epoch = step
        lrs = [base * self.recipe.factor(step, self.total_steps) for base in self.sched.base_lrs]
        for group, lr in zip(self.opt.param_groups, lrs, strict=True):
            group["lr"] = lr
        self.sched._last_lr = lrs

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds now."""
        if self.recipe is None:
            return self.opt.held_bytes()
        from parlearn.multi_device.sharding.zero import storage_bytes

        params = list(self.model.parameters())
        inner = self.opt if self.zero == 0 else self.opt.optim
        state = [v for st in inner.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        out = {"params": storage_bytes(params),
               "grads": storage_bytes([p.grad for p in params if p.grad is not None]),
               "optimizer": storage_bytes(state)}
        out["total"] = sum(out.values())
        return out

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every gradient of the whole mesh so that their global L2 norm is at most
        ``max_norm`` (torch's ``clip_grad_norm_`` formula, factor ``max_norm / (norm +
        1e-6)`` when below 1); a collective over every rank. Each gradient element is
        counted once: a tensor replicated over tp on tp rank 0, the tied embedding on the
        first stage, a gradient every dp replica holds (ZeRO-0/1) on replica 0. Returns
        the norm before clipping."""
        max_norm = check_float("max_norm", max_norm, lo=0, lo_open=True)
        total = torch.zeros((), dtype=torch.float64)
        for name, p in self.model.named_parameters():
            if (p.grad is None or (shard_dim(name) is None and self.shard != 0)
                    or (name == "tok.weight" and not self.model.first)
                    or (self.zero < 2 and self.replica != 0)):
                continue
            total += p.grad.detach().double().pow(2).sum()
        tdist.all_reduce(total)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return float(_clip_to(grads, total, max_norm))

    def _update(self) -> None:
        """The optimizer step: ShardedAdam's, or the recipe's exchange, clip, step and
        schedule."""
        if self.recipe is None:
            self.opt.step()
            return
        if self.zero == 0:
            for p in self.model.parameters():
                if p.grad is not None:
                    tdist.all_reduce(p.grad, group=self.dp_group)
                    p.grad.div_(self.shape.dp)
        else:
            self.opt.reduce_gradients()
        self.grad_norm = self.clip_grad_norm_(self.recipe.clip)
        self.opt.step()
        self.sched.step()
        self._taken += 1

    def step(self, idx: torch.Tensor, tgt: torch.Tensor) -> dict:
        """One training step on the whole batch ``(idx, tgt)`` (each ``(batch, seq)``, the
        same on every rank). Returns ``{"loss": the batch's mean loss (last stage; None
        elsewhere), "seconds": the step's wall time, "records": {"pipe", "embedding", "dp"}:
        the ledger records of each phase}``. For ``torch.profiler`` the step is labelled
        ``step``, each micro-batch's forward and backward ``forward`` and ``backward``, the
        tied embedding's all-reduce ``embedding`` and the update ``optimizer``
        (:mod:`parlearn.at_scale.plan_trace` reads them)."""
        check_tensor("idx", idx, shape=(self.batch, self.seq), dtype=torch.int64)
        check_tensor("tgt", tgt, shape=(self.batch, self.seq), dtype=torch.int64)
        with record_function("step"):
            out = self._step(idx, tgt)
        # The loss for the log: outside the timed, labelled step (no update depends on it).
        if self.model.last:
            total = torch.tensor(sum(self._losses), dtype=torch.float64)
            if self.sp and self.shape.tp > 1:
                tdist.all_reduce(total, group=self.tp_group)
            tdist.all_reduce(total, group=self.dp_group)
            out["loss"] = float(total) / self.shape.dp
        return out

    def _step(self, idx: torch.Tensor, tgt: torch.Tensor) -> dict:
        from parlearn.distributed import ledger

        model, mb = self.model, self.mb
        lo = self.replica * self.local_b
        idx, tgt = idx[lo:lo + self.local_b], tgt[lo:lo + self.local_b]
        self.opt.zero_grad()
        inputs, outputs, sends, live = {}, {}, [], {}
        self._losses: list[float] = []
        t0 = time.perf_counter()
        with ledger() as pipe_led:  # p2p is the pipeline's; the rest is TP's
            for op in self.ops:
                rows = slice(op.mb * mb, (op.mb + 1) * mb)
                with record_function("forward" if op.kind == "F" else "backward"):
                    self._op(op, rows, idx, tgt, inputs, outputs, sends, live)
            for work, _ in sends:
                work.wait()
            if self.sp and self.shape.tp > 1:  # partial sums of replicated parameters' grads
                for p in model.replicated():
                    tdist.all_reduce(p.grad, group=self.tp_group)
        with ledger() as emb_led, record_function("embedding"):
            if self.emb_group is not None:
                tdist.all_reduce(model.tok.weight.grad, group=self.emb_group)
        with ledger() as dp_led, record_function("optimizer"):
            self._update()
        seconds = time.perf_counter() - t0
        return {"loss": None, "seconds": seconds,
                "records": {"pipe": pipe_led.records, "embedding": emb_led.records,
                            "dp": dp_led.records}}

    def _op(self, op, rows, idx, tgt, inputs, outputs, sends, live) -> None:
        """One forward (F) or backward (B) of one micro-batch, with its messages."""
        model = self.model
        if op.kind == "F":
            if model.first:
                x = idx[rows]
            else:
                x = torch.empty(self.act_shape, dtype=torch.float64)
                tdist.recv(x, self.prev, tag=op.mb)
                x.requires_grad_(True)
            nbytes, y = _saved_bytes(model, lambda x=x, t=tgt[rows]: model(
                x, self.shard, t, float(self.local_b * self.seq)))
            live[op.mb] = nbytes
            self.act_peak = max(self.act_peak, sum(live.values()))
            self.act_per_mb = nbytes
            inputs[op.mb], outputs[op.mb] = x, y
            if self.nxt is not None:
                sends.append((tdist.isend(y.detach(), self.nxt, tag=op.mb), y))
            return
        y = outputs.pop(op.mb)
        if model.last:
            self._losses.append(float(y.detach()))
            y.backward()
        else:
            g = torch.empty_like(y)
            tdist.recv(g, self.nxt, tag=op.mb)
            y.backward(g)
        x = inputs.pop(op.mb)
        live.pop(op.mb)
        if self.prev is not None:
            sends.append((tdist.isend(x.grad, self.prev, tag=op.mb), x))


def mesh_train_worker(rank: int, world_size: int, cfg: GPTConfig, shape: MeshShape, steps: int,
                      batch: int, seq: int, micro_batches: int, lr: float, seed: int, sp: bool,
                      zero: int, recompute: str, kind: str, recipe: Recipe | None = None) -> dict:
    """Worker: :func:`parlearn.context_parallel.serial_train`'s loop (Adam, or ``recipe``)
    on this rank's piece of the mesh (:class:`MeshRank`). Returns its parameters (name ->
    local tensor), the loss per step (last stage; None elsewhere), step times, the global
    gradient norm per step (with a recipe), held bytes, the peak of saved activation bytes,
    and one step's collectives per axis (from the ledger)."""
    check_train_args(cfg, shape, steps, batch, seq, micro_batches, lr, seed, sp, zero,
                     recompute, kind, recipe)
    if world_size != shape.world:
        raise ValueError(f"world_size={world_size} must equal shape.world={shape.world}")
    me = MeshRank(rank, cfg, shape, batch=batch, seq=seq, micro_batches=micro_batches, lr=lr,
                  seed=seed, sp=sp, zero=zero, recompute=recompute, kind=kind, recipe=recipe,
                  total_steps=None if recipe is None else steps)
    out: dict = {"loss": [], "step_s": [], "grad_norm": [], "coords": me.coords}
    for step, (idx, tgt) in enumerate(train_batches(steps, batch, seq, seed)):
        res = me.step(idx, tgt)
        out["step_s"].append(res["seconds"])
        if me.grad_norm is not None:
            out["grad_norm"].append(me.grad_norm)
        if res["loss"] is not None:
            out["loss"].append(res["loss"])
        if step == 0:
            pipe = res["records"]["pipe"]
            out["collectives"] = {"pp": _summary([r for r in pipe if r.kind in _P2P]),
                                  "tp": _summary([r for r in pipe if r.kind not in _P2P]),
                                  "embedding": _summary(res["records"]["embedding"]),
                                  "dp": _summary(res["records"]["dp"])}
    out["act_peak"], out["act_per_mb"] = me.act_peak, me.act_per_mb
    out["held"] = me.held_bytes()
    out["params"] = {n: p.detach().clone() for n, p in me.model.named_parameters()}
    return out


def mesh_train(cfg: GPTConfig, shape: MeshShape, *, steps: int = 3, batch: int = 8,
               seq: int = 16, micro_batches: int = 2, lr: float = 1e-2, seed: int = 0,
               sp: bool = True, zero: int = 1, recompute: str = "none",
               schedule_kind: str = "1f1b", recipe: Recipe | None = None,
               timeout: float = 60) -> list[dict]:
    """Train ``cfg``'s GPT (float64; Adam, or the whole ``recipe``: AdamW with decay groups,
    global-norm clip, warm-up + cosine over ``steps``) for ``steps`` on ``shape.world`` real
    gloo ranks laid out as ``shape``; one dict per rank (:func:`mesh_train_worker`).
    ``zero``: 0, 1, or (with a recipe) 2."""
    from parlearn.distributed import run

    check_train_args(cfg, shape, steps, batch, seq, micro_batches, lr, seed, sp, zero,
                     recompute, schedule_kind, recipe)
    return run(mesh_train_worker, shape.world, backend="gloo", timeout=timeout,
               args=(cfg, shape, steps, batch, seq, micro_batches, lr, seed, sp, zero,
                     recompute, schedule_kind, recipe))


def assemble(results: list[dict], shape: MeshShape) -> dict[str, torch.Tensor]:
    """The whole model's parameters from the ranks' shards: replica 0's, tp shards
    concatenated along the dim they were cut, each stage's blocks where they belong (the
    tied embedding from the first stage)."""
    if not isinstance(shape, MeshShape):
        raise TypeError(f"shape must be a MeshShape, got {type(shape).__name__}")
    if not isinstance(results, list | tuple) or len(results) != shape.world:
        raise ValueError(f"results must be a list of one dict per rank of shape "
                         f"(shape.world={shape.world}), got {type(results).__name__}"
                         + (f" of {len(results)}" if isinstance(results, list | tuple) else ""))
    for r, res in enumerate(results):
        if not isinstance(res, dict) or not isinstance(res.get("params"), dict):
            raise TypeError(f"results[{r}] must be a rank's dict from mesh_train, with a "
                            f"'params' dict, got {type(res).__name__}")
    full: dict[str, torch.Tensor] = {}
    for stage in range(shape.pp):
        parts = [results[shape.rank(stage, 0, t)]["params"] for t in range(shape.tp)]
        for name, tensor in parts[0].items():
            if name in full:
                continue
            dim = shard_dim(name)
            full[name] = tensor if dim is None else torch.cat([p[name] for p in parts], dim)
    return full


def mesh_check(cfg: GPTConfig, shape: MeshShape, *, steps: int = 3, batch: int = 8,
               seq: int = 16, lr: float = 1e-2, seed: int = 0, **kwargs) -> dict:
    """:func:`mesh_train` against one process (:func:`parlearn.context_parallel.serial_train`
    with Adam, or with the same ``recipe=`` in ``kwargs``; the same batches): ``{"loss": max
    |loss difference| over steps, "params": max |parameter difference|, "replicas": max
    difference between dp replicas' shards, "grad_norm": max |global gradient norm
    difference| (with a recipe, else None), "results": the ranks' dicts}``."""
    same = dict(steps=steps, batch=batch, seq=seq, lr=lr, seed=seed)  # both runs see these
    results = mesh_train(cfg, shape, **same, **kwargs)
    return _against_serial(cfg, shape, results, same, kwargs.get("recipe"))


def _against_serial(cfg: GPTConfig, shape: MeshShape, results: list[dict], same: dict,
                   recipe: Recipe | None) -> dict:
    """:func:`mesh_check`'s comparison of the ranks' ``results`` with one process trained
    on ``same`` (steps, batch, seq, lr, seed) and ``recipe``."""
    ref = serial_train(cfg, **same, optimizer="adam" if recipe is None else "adamw",
                       recipe=recipe)
    got = assemble(results, shape)
    if set(got) != set(ref["params"]):
        raise RuntimeError(f"the mesh lost parameters: {set(ref['params']) ^ set(got)}")
    losses = results[shape.rank(shape.pp - 1, 0, 0)]["loss"]
    replicas = max((r["params"][n] - results[shape.rank(r["coords"]["pp"], 0, r["coords"]["tp"])]
                    ["params"][n]).abs().max().item() for r in results for n in r["params"])
    norms = results[0]["grad_norm"]
    return {"loss": max(abs(a - b) for a, b in zip(losses, ref["loss"], strict=True)),
            "params": max((got[n] - ref["params"][n]).abs().max().item() for n in got),
            "replicas": replicas,
            "grad_norm": None if recipe is None else max(
                abs(a - b) for a, b in zip(norms, ref["grad_norm"], strict=True)),
            "results": results}
