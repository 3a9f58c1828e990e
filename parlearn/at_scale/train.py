"""A trainer that outgrows the notebook: the tiny GPT on a ``pp x dp x tp`` mesh, with
checkpoints, resume and an injected failure, under ``torchrun`` or from a notebook.

    torchrun --standalone --nproc_per_node 4 --max-restarts 1 -m parlearn.train \\
        --dp 2 --tp 2 --steps 20 --ckpt runs/a --every 5
    torchrun --standalone --nproc_per_node 4 -m parlearn.train --dp 2 --pp 2 --recipe 1 \\
        --zero 2 --steps 1000 --ckpt runs/b --every 100     # AdamW, clip, warm-up + cosine
    python -m parlearn.train --dp 2 --steps 20          # no torchrun: parlearn.dist.run
    dist.run(train.train_worker, 4, args=(TrainSpec(dp=2, tp=2),))   # from a notebook

Each rank is a :class:`parlearn.mesh.MeshRank` (lesson 19's composition: TP, then ZeRO-1
data parallelism, then the pipeline split). At start the trainer looks for the newest
complete checkpoint under ``--ckpt`` (:func:`parlearn.at_scale.checkpoint.latest`) and
resumes from it, on whatever mesh this run has; it saves every ``--every`` steps and at
the end. Because a step's batch is a function of the seed and the step number, a resumed
run takes exactly the steps the uninterrupted run would have taken: its final parameters
equal the uninterrupted run's (float64, to round-off).

``--trace DIR`` profiles the run's last ``--trace-steps`` steps with ``torch.profiler`` and
writes one Chrome trace per rank, ``DIR/rank<r>.json`` (open it in Perfetto): read them
with :func:`parlearn.at_scale.traces.breakdown` and, all ranks together,
:func:`parlearn.at_scale.critical.critical_path` (``labels=("step", "step")``).

``--fail-at S --fail-rank R`` kills rank R with SIGKILL after S steps, on the job's
FIRST attempt only (``TORCHELASTIC_RESTART_COUNT`` is 0): ``torchrun --max-restarts 1``
then stops the other ranks, starts all of them again, and they resume from the last
checkpoint. The steps after that checkpoint are the work lost.

Each logged line: the step, the batch's mean loss, the step's wall time, tokens per second
(``batch x seq / step time``, the whole job's), the model FLOP/s from
:func:`parlearn.transformer.flops_per_token` (``6 N_matmul + 12 L s h`` per token, the
PaLM convention: no credit for recomputation) and MFU against ``--peak-tflops`` per rank.
No CPU has a datasheet peak in :data:`parlearn.mfu.PEAKS`, so on a CPU MFU is printed only
when you give the peak you measured or trust.

Scope: float64 on CPU ranks with gloo (the course's exactness setting). The mesh code
allocates its messages on the CPU, so NCCL on GPUs is refused rather than run half-way.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from parlearn.core.checks import check_bool, check_choice, check_float, check_int

__all__ = ["TrainSpec", "train_worker", "train", "reshard_check", "main"]


@dataclass(frozen=True)
class TrainSpec:
    """Everything one training job needs; checked when built, before any rank starts.

    Mesh: ``dp``, ``tp``, ``pp``. Data: ``steps`` (total, counting resumed ones), ``batch``
    sequences of ``seq`` tokens per step, ``micro_batches`` per pipeline step. Model: the
    tiny GPT with ``d_model``, ``n_layers``, ``n_heads``. Optimizer: Adam with ``lr``,
    ZeRO stage ``zero`` (0 or 1) over dp; or with ``recipe`` the tiny GPT's whole recipe
    (:meth:`recipe_spec`: AdamW, weight decay 0.1 on matrices, global-norm clip 1.0, warm-up
    over 5% of ``steps`` then cosine; peak ``lr``; ZeRO 0, 1 or 2). ``sp``: sequence
    parallelism inside TP. ``stop_at``: stop after that many steps (saving, with ``ckpt``),
    as a job cut short would; the schedule still spans ``steps``.
    ``ckpt``: a folder for checkpoints (None: none); ``every``: save every that many steps
    (0: only at the end). ``fail_at``/``fail_rank``: an injected SIGKILL of that rank
    after ``fail_at`` steps (first attempt only). ``peak_tflops``: one rank's peak, for
    MFU. ``log``: print a line per step. ``trace``: a folder for one Chrome trace per rank
    of the last ``trace_steps`` steps (None: no profiler).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    steps: int = 20
    batch: int = 8
    seq: int = 32
    micro_batches: int = 2
    lr: float = 1e-2
    seed: int = 0
    sp: bool = True
    zero: int = 1
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ckpt: str | None = None
    every: int = 0
    fail_at: int | None = None
    fail_rank: int = 0
    peak_tflops: float | None = None
    log: bool = True
    recipe: bool = False
    stop_at: int | None = None
    trace: str | None = None
    trace_steps: int = 2

    def __post_init__(self) -> None:
        from parlearn.multi_device.mesh.composed import check_train_args

        for name in ("dp", "tp", "pp", "steps", "batch", "seq", "micro_batches", "d_model",
                     "n_layers", "n_heads"):
            check_int(name, getattr(self, name), lo=1)
        check_int("every", self.every, lo=0)
        if self.ckpt is not None and (not isinstance(self.ckpt, str) or not self.ckpt):
            raise TypeError(f"ckpt must be a folder path (str) or None, got {self.ckpt!r}")
        if self.every and self.ckpt is None:
            raise ValueError(f"every={self.every} needs ckpt= (a folder to save into)")
        if self.fail_at is not None:
            check_int("fail_at", self.fail_at, lo=0, hi=self.steps - 1)
        check_int("fail_rank", self.fail_rank, lo=0, hi=self.world - 1)
        if self.peak_tflops is not None:
            check_float("peak_tflops", self.peak_tflops, lo=0, lo_open=True)
        check_bool("log", self.log)
        check_bool("recipe", self.recipe)
        if self.stop_at is not None:
            check_int("stop_at", self.stop_at, lo=1, hi=self.steps)
        if self.trace is not None and (not isinstance(self.trace, str) or not self.trace):
            raise TypeError(f"trace must be a folder path (str) or None, got {self.trace!r}")
        check_int("trace_steps", self.trace_steps, lo=1,
                  hi=self.steps if self.trace is not None else None)
        check_train_args(self.cfg, self.shape, self.steps, self.batch, self.seq,
                         self.micro_batches, self.lr, self.seed, self.sp, self.zero, "none",
                         "1f1b", self.recipe_spec)

    @property
    def recipe_spec(self):
        """The :class:`parlearn.core.recipe.Recipe` this job runs (None: plain Adam)."""
        from parlearn.core.recipe import Recipe

        return (Recipe(weight_decay=0.1, clip=1.0, warmup=max(1, self.steps // 20))
                if self.recipe is True else None)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def shape(self):
        from parlearn.multi_device.mesh.layout import MeshShape

        return MeshShape(dp=self.dp, tp=self.tp, pp=self.pp)

    @property
    def cfg(self):
        from parlearn.multi_device.transformer.model import GPTConfig

        return GPTConfig(d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                         max_seq=max(64, self.seq))


def _attempt() -> int:
    """Which attempt of the job this is: torchrun's restart count, 0 outside torchrun."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _say(text: str) -> None:
    # One write per line: torchrun's ranks share one stdout.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (text + "\n").encode())


def train_worker(rank: int, world_size: int, spec: TrainSpec) -> dict:
    """Worker: train ``spec`` on this rank, resuming from ``spec.ckpt`` when it holds a
    checkpoint. Returns ``{"coords", "start": the step it resumed from (0: fresh),
    "loss": {step: mean loss} (last stage only), "step_s": [seconds], "saves": [(step,
    seconds, bytes)], "lines": the log lines, "params": this rank's parameters}``."""
    from parlearn.at_scale import checkpoint as ckpt
    from parlearn.multi_device.context_parallel.gpt import train_batches
    from parlearn.multi_device.mesh.composed import MeshRank
    from parlearn.multi_device.transformer.train import flops_per_token

    if not isinstance(spec, TrainSpec):
        raise TypeError(f"spec must be a TrainSpec, got {type(spec).__name__}")
    if world_size != spec.world:
        raise ValueError(f"world_size={world_size} must equal dp*tp*pp={spec.world}")
    me = MeshRank(rank, spec.cfg, spec.shape, batch=spec.batch, seq=spec.seq,
                  micro_batches=spec.micro_batches, lr=spec.lr, seed=spec.seed, sp=spec.sp,
                  zero=spec.zero, recipe=spec.recipe_spec,
                  total_steps=spec.steps if spec.recipe else None)
    start, lines = 0, []
    found = ckpt.latest(spec.ckpt) if spec.ckpt else None
    if found is not None:
        start = ckpt.load(me, found[1])
    # The logging rank: the last stage's first replica and shard holds the loss.
    speaker = rank == spec.shape.rank(spec.pp - 1, 0, 0)

    def say(text: str) -> None:
        lines.append(text)
        if spec.log and speaker:
            _say(text)

    say(f"parlearn.train: {spec.shape} on {world_size} ranks, attempt {_attempt()}, "
        + (f"resumed from step {start} ({found[1]})" if found else "fresh start"))
    end = spec.steps if spec.stop_at is None else spec.stop_at
    if start >= end:
        say(f"nothing to do: the checkpoint is at step {start}, the run ends at {end}")
    tokens = spec.batch * spec.seq
    flops = tokens * flops_per_token(spec.cfg, spec.seq)
    out: dict = {"coords": me.coords, "start": start, "loss": {}, "step_s": [], "saves": []}
    batches = train_batches(spec.steps, spec.batch, spec.seq, spec.seed)
    traced = max(start, end - spec.trace_steps) if spec.trace else None
    prof = None
    for step in range(start, end):
        if step == traced:
            prof = _start_profiler()
        if step == spec.fail_at and rank == spec.fail_rank and _attempt() == 0:
            lines.append(f"after {step} steps: injected failure, SIGKILL to rank {rank}")
            if spec.log:   # the dying rank says it, whichever rank logs the steps
                _say(lines[-1])
            os.kill(os.getpid(), signal.SIGKILL)
        res = me.step(*batches[step])
        out["step_s"].append(res["seconds"])
        if res["loss"] is not None:
            out["loss"][step] = res["loss"]
        rate = flops / res["seconds"]
        mfu = ("n/a (no --peak-tflops)" if spec.peak_tflops is None
               else f"{rate / (world_size * spec.peak_tflops * 1e12):.1%}")
        if speaker:
            say(f"step {step + 1:>5}/{spec.steps}  loss {res['loss']:.4f}  "
                f"{res['seconds'] * 1e3:7.1f} ms  {tokens / res['seconds']:9,.0f} tokens/s  "
                f"{rate / 1e9:6.2f} GFLOP/s (model)  MFU {mfu}")
        done = step + 1
        if prof is not None and done == end:
            path = _stop_profiler(prof, spec.trace, rank)
            say(f"wrote {os.path.join(spec.trace, 'rank<r>.json')} (one per rank): steps "
                f"{traced + 1}-{end} under torch.profiler")
            out["trace"] = path
        if spec.ckpt and (done == end or (spec.every and done % spec.every == 0)):
            saved = ckpt.save(me, ckpt.step_dir(spec.ckpt, done))
            out["saves"].append((done, saved["seconds"], saved["bytes"]))
            say(f"saved {ckpt.step_dir(spec.ckpt, done)}: {saved['bytes']:,} B in "
                f"{saved['seconds'] * 1e3:.0f} ms (modeled {saved['modeled']:,} B)")
    out["lines"] = lines
    out["params"] = {n: p.detach().clone() for n, p in me.model.named_parameters()}
    return out


def _start_profiler():
    from torch.profiler import ProfilerActivity, profile

    from parlearn.at_scale.traces import _QuietStderr

    prof = profile(activities=[ProfilerActivity.CPU])
    with _QuietStderr():
        prof.__enter__()
    return prof


def _stop_profiler(prof, folder: str, rank: int) -> str:
    from parlearn.at_scale.traces import _QuietStderr

    with _QuietStderr():
        prof.__exit__(None, None, None)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank{rank}.json")
    prof.export_chrome_trace(path)
    return path


def train(spec: TrainSpec, *, timeout: float = 120) -> list[dict]:
    """Run ``spec`` on ``spec.world`` local gloo ranks (:func:`parlearn.dist.run`): the same
    code torchrun runs. One dict per rank (:func:`train_worker`)."""
    from parlearn.distributed import run

    if not isinstance(spec, TrainSpec):
        raise TypeError(f"spec must be a TrainSpec, got {type(spec).__name__}")
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    if spec.ckpt is not None:
        # Imported once here, the forked ranks inherit it (0.6 s each time otherwise).
        import torch.distributed.checkpoint  # noqa: F401
    return run(train_worker, spec.world, args=(spec,), backend="gloo", timeout=timeout)


def reshard_check(before, after, *, steps: int = 4, at: int = 2, directory=None,
                  timeout: float = 120, **spec) -> dict:
    """Train ``at`` steps on mesh ``before`` (a :class:`parlearn.mesh.MeshShape`), save a
    checkpoint, load it on mesh ``after`` and train to ``steps``; compare with one process
    training all ``steps`` uninterrupted (:func:`parlearn.context_parallel.serial_train`,
    Adam or with ``recipe=True`` the whole recipe, float64, the same batches). ``spec``:
    further :class:`TrainSpec` fields.
    Returns ``{"loss": [per-step loss, before then after], "reference": [per-step loss],
    "loss_diff": max |difference|, "param_diff": max |parameter difference| of the final
    checkpoint read in one process, "save": (seconds, bytes) of the checkpoint at ``at``,
    "resumed_from": the step the second mesh resumed from}``. ``directory`` keeps the
    checkpoints there (None: a temporary folder, removed afterwards)."""
    import contextlib
    import tempfile

    from parlearn.at_scale import checkpoint as ckpt
    from parlearn.multi_device.context_parallel.gpt import serial_train
    from parlearn.multi_device.mesh.layout import MeshShape

    for name, shape in (("before", before), ("after", after)):
        if not isinstance(shape, MeshShape):
            raise TypeError(f"{name} must be a parlearn.mesh.MeshShape, got {shape!r}")
    steps = check_int("steps", steps, lo=2)
    at = check_int("at", at, lo=1, hi=steps - 1)
    if {"ckpt", "every", "steps", "stop_at"} & set(spec):
        raise ValueError("reshard_check sets steps, stop_at, ckpt and every itself")
    if directory is None:
        folder = tempfile.TemporaryDirectory()
    elif isinstance(directory, str | os.PathLike):
        os.makedirs(directory, exist_ok=True)
        folder = contextlib.nullcontext(str(directory))
    else:
        raise TypeError(f"directory must be a path or None, got {directory!r}")
    common = {"log": False, **spec}
    with folder as root:
        first = TrainSpec(dp=before.dp, tp=before.tp, pp=before.pp, steps=steps, stop_at=at,
                          ckpt=root, **common)
        second = TrainSpec(dp=after.dp, tp=after.tp, pp=after.pp, steps=steps, ckpt=root,
                           **common)
        a = train(first, timeout=timeout)
        b = train(second, timeout=timeout)
        final = ckpt.load_full(ckpt.step_dir(root, steps))
    last_a = a[before.rank(before.pp - 1, 0, 0)]
    last_b = b[after.rank(after.pp - 1, 0, 0)]
    loss = [last_a["loss"][k] for k in range(at)] + [last_b["loss"][k] for k in range(at, steps)]
    ref = serial_train(first.cfg, steps=steps, batch=first.batch, seq=first.seq, lr=first.lr,
                       seed=first.seed, optimizer="adamw" if first.recipe else "adam",
                       recipe=second.recipe_spec)
    return {"loss": loss, "reference": ref["loss"],
            "loss_diff": max(abs(x - y) for x, y in zip(loss, ref["loss"], strict=True)),
            "param_diff": max((final["params"][n] - t).abs().max().item()
                              for n, t in ref["params"].items()),
            "save": last_a["saves"][-1][1:], "resumed_from": last_b["start"]}


def _join_group(rank: int, world: int, timeout: float) -> None:
    """Join torchrun's group with keys of this attempt only. The elastic agent keeps one
    store across restarts, and a restarted rank that reads the default keys can find the
    DEAD attempt's addresses there and fail to connect (seen with gloo on torch 2.13;
    pytorch#167288 reports the same with NCCL); a prefix per attempt keeps them apart."""
    when = datetime.timedelta(seconds=timeout)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                           is_master=rank == 0 and not agent_store, timeout=when)
    store = tdist.PrefixStore(f"parlearn.train/attempt{_attempt()}", store)
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=when)


def _parser():
    import argparse

    p = argparse.ArgumentParser(prog="python -m parlearn.train",
                                description=__doc__.split("\n\n")[0])
    fields = {f.name: f for f in dataclasses.fields(TrainSpec)}
    for name, f in fields.items():
        flag = "--" + name.replace("_", "-")
        if f.type in ("bool",):
            p.add_argument(flag, type=lambda s: check_choice("flag", s, ("0", "1")) == "1",
                           default=f.default, help=f"0 or 1 (default {int(f.default)})")
        else:
            kind = {"int": int, "float": float, "str | None": str, "int | None": int,
                    "float | None": float}[f.type]
            p.add_argument(flag, type=kind, default=f.default, help=f"default {f.default}")
    p.add_argument("--timeout", type=float, default=120, help="collective timeout, seconds")
    p.add_argument("--backend", default="gloo", help="gloo (CPU ranks); nccl is refused")
    return p


def main(argv: list[str] | None = None) -> int:
    """The command line: under ``torchrun`` each process joins the group and trains its
    rank; without it, :func:`train` starts the ranks here."""
    opts = vars(_parser().parse_args(argv))
    timeout, backend = opts.pop("timeout"), opts.pop("backend")
    if backend != "gloo":
        raise SystemExit(f"--backend {backend}: this trainer runs float64 on CPU ranks with "
                         "gloo only (its pipeline messages live on the CPU)")
    spec = TrainSpec(**opts)
    if "RANK" not in os.environ:
        train(spec, timeout=timeout)
        return 0
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    _join_group(rank, world, timeout)
    try:
        train_worker(rank, world, spec)
    finally:
        tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
