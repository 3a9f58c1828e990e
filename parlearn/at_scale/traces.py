"""Where a step's time goes, read from profiler traces of real ranks.

:func:`profile_ranks` runs a worker on every rank of :func:`parlearn.distributed.run` under
``torch.profiler`` and writes one Chrome trace per rank (open it in Perfetto or
``chrome://tracing``). The worker labels its phases with ``record_function`` (``"forward"``,
``"backward"``, ``"optimizer"``), which set the step's window; the collectives label
themselves: gloo runs each on a worker thread as a ``gloo:<collective>`` span, NCCL as a
``nccl:<collective>`` span and a ``ncclKernel``/``ncclDevKernel`` on the GPU.

:func:`breakdown` reads one rank's trace and splits the step window ``T`` into time sets:

- ``compute``: the union of the operator spans (``aten::*``, and GPU kernels other than
  NCCL's on a GPU). Not the phase labels: a label such as "backward" also covers the time
  the thread sat *waiting* for a collective, which is exactly what must not count as
  compute;
- ``comm``: the union of the collective spans;
- ``hidden``: communication that ran while compute ran (``comm`` and ``compute`` both);
- ``exposed``: communication nothing computed beside (``comm`` minus ``compute``);
- ``idle``: neither.

So ``compute + exposed + idle = T`` exactly, and ``hidden + exposed = comm``. Overlap is
real when ``hidden`` is large; what an overlapping schedule saves is at most ``hidden``.
(Holistic Trace Analysis computes the same breakdown from GPU kernel streams; CPU traces
have none, so this module reads the spans itself.)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from parlearn.core.checks import check_callable, check_float, check_int

__all__ = ["PHASES", "COMPUTE_PREFIXES", "COMM_PREFIXES", "spans", "breakdown", "step_windows",
           "median_breakdown", "timeline_events", "profile_ranks", "dp_step_worker",
           "dp_timed_worker"]

PHASES = ("forward", "backward", "optimizer")
COMPUTE_PREFIXES = ("aten::",)
COMM_PREFIXES = ("gloo:", "nccl:", "ncclKernel", "ncclDevKernel")


def _load(trace) -> list[dict]:
    if isinstance(trace, str | os.PathLike):
        if not Path(trace).is_file():
            raise ValueError(f"trace: no file at {str(trace)!r}")
        trace = json.loads(Path(trace).read_text())
    if isinstance(trace, dict):
        trace = trace.get("traceEvents")
    if not isinstance(trace, list):
        raise TypeError("trace must be a Chrome trace (a path, its dict, or its traceEvents "
                        f"list), got {type(trace).__name__}")
    return trace


def spans(trace, names: Iterable[str] = PHASES, prefixes: Iterable[str] = ()
          ) -> list[tuple[float, float]]:
    """``(start, end)`` in seconds of the complete (``"ph": "X"``) events of ``trace``
    named one of ``names`` or starting with one of ``prefixes``, sorted."""
    names, prefixes = set(names), tuple(prefixes)
    out = []
    for e in _load(trace):
        if e.get("ph") != "X" or not isinstance(e.get("name"), str):
            continue
        if e["name"] in names or (prefixes and e["name"].startswith(prefixes)):
            start, dur = float(e["ts"]), float(e.get("dur", 0.0))
            if dur < 0:
                raise ValueError(f"trace has an event with negative duration: {e['name']!r}")
            out.append((start * 1e-6, (start + dur) * 1e-6))   # Chrome traces are in us
    return sorted(out)


def _union(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs, ys) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def _window(window) -> list[tuple[float, float]]:
    """``window`` checked (a ``(start, end)`` pair, start < end) as a one-interval list."""
    if (not isinstance(window, tuple) or len(window) != 2
            or not float(window[0]) < float(window[1])):
        raise ValueError(f"window must be a (start, end) pair with start < end, got {window!r}")
    return [(float(window[0]), float(window[1]))]


def breakdown(trace, *, compute_prefixes: Iterable[str] = COMPUTE_PREFIXES,
              comm_prefixes: Iterable[str] = COMM_PREFIXES, phases: Iterable[str] = PHASES,
              window: tuple[float, float] | None = None) -> dict[str, float]:
    """Seconds of ``compute``, ``comm``, ``hidden``, ``exposed`` and ``idle`` in ``window``
    of one rank's ``trace`` (module docstring), and the window's length as ``"step"``.
    ``window`` defaults to the span of the ``phases`` labels (else of every span read)."""
    comp = _union(spans(trace, (), compute_prefixes))
    comm = _union(spans(trace, (), comm_prefixes))
    if window is None:
        marks = spans(trace, phases) or comp + comm
        if not marks:
            raise ValueError("trace has no phase labels, operators or collective spans")
        w = [(min(a for a, _ in marks), max(b for _, b in marks))]
    else:
        w = _window(window)
    comp, comm = _intersect(comp, w), _intersect(comm, w)
    hidden = _length(_intersect(comp, comm))
    total, c, m = w[0][1] - w[0][0], _length(comp), _length(comm)
    return {"step": total, "compute": c, "comm": m, "hidden": hidden, "exposed": m - hidden,
            "idle": total - c - (m - hidden)}


def step_windows(trace, first: str = "forward", last: str = "optimizer"
                 ) -> list[tuple[float, float]]:
    """One ``(start, end)`` per training step: from each ``first`` label's start to the end
    of the ``last`` label that follows it (labels from :data:`PHASES`)."""
    starts = [a for a, _ in spans(trace, (first,))]
    ends = spans(trace, (last,))
    out = []
    for i, a in enumerate(starts):
        nxt = starts[i + 1] if i + 1 < len(starts) else float("inf")
        mine = [b for x, b in ends if a <= x < nxt]
        if not mine:
            raise ValueError(f"the step starting at {a:.6f} s has no span named last={last!r}")
        out.append((a, max(mine)))
    if not out:
        raise ValueError(f"trace has no spans named first={first!r} to cut it into steps")
    return out


class _QuietStderr:
    """Send file descriptor 2 to /dev/null for the block: torch's profiler prints a line
    per start and stop from C++ on some builds, which Python cannot filter."""

    def __enter__(self):
        import sys

        sys.stderr.flush()
        self.saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)
        return False


def _profiled(rank: int, world_size: int, worker: Callable, args: tuple, out_dir: str):
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    with _QuietStderr():            # only around the profiler's start and stop: the
        prof.__enter__()            # worker's own messages still reach the user
    try:
        result = worker(rank, world_size, *args)
    finally:
        with _QuietStderr():
            prof.__exit__(None, None, None)
    path = os.path.join(out_dir, f"rank{rank}.json")
    prof.export_chrome_trace(path)
    return result, path


def profile_ranks(worker: Callable, world_size: int, *, args: Sequence = (), out_dir: str,
                  timeout: float = 120) -> list[tuple[object, str]]:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` gloo (or NCCL) ranks under
    ``torch.profiler``; ``[(its result, the path of its Chrome trace)]`` per rank, the
    traces written to ``out_dir/rank<r>.json``."""
    from parlearn.distributed import run

    check_callable("worker", worker)
    world_size = check_int("world_size", world_size, lo=1)
    check_float("timeout", timeout, lo=0, lo_open=True)
    if not isinstance(out_dir, str | os.PathLike):
        raise TypeError(f"out_dir must be a path, got {out_dir!r}")
    os.makedirs(out_dir, exist_ok=True)
    return run(_profiled, world_size, args=(worker, tuple(args), str(out_dir)), timeout=timeout)


def dp_step_worker(rank: int, world_size: int, kind: str, steps: int = 3,
                   widths: Sequence[int] = (256, 1024, 1024, 10), bucket_bytes: int = 2**20,
                   seed: int = 0, slow_rank: int | None = None, extra_s: float = 0.0) -> int:
    """Worker: ``steps`` SGD steps of an MLP under ``kind`` (``"naive"``, ``"bucketed"``
    data parallelism from lesson 11, ``"ddp"``, torch's, or ``"zero3"``: the MLP under
    :func:`parlearn.sharding.shard_module`, lesson 12's FSDP-style wrapper, which
    all-gathers each layer's parameters in forward and again in backward and
    reduce-scatters its gradient), each phase labelled for the trace (``forward``,
    ``backward``, ``optimizer``). ``slow_rank`` computes ``extra_s`` seconds more at the
    start of each step (matmuls labelled ``extra``: an uneven batch, a straggler).
    Returns the number of steps."""
    if slow_rank is not None:
        check_int("slow_rank", slow_rank, lo=0, hi=world_size - 1)
    check_float("extra_s", extra_s, lo=0)
    _dp_steps(rank, world_size, kind, steps, widths, bucket_bytes, seed, None,
              extra_s if rank == slow_rank else 0.0)
    return steps


def _busy(seconds: float) -> None:
    """Compute (small matmuls) for ``seconds``."""
    import time

    import torch

    a = torch.ones(64, 64)
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        a = (a @ a) * (1 / 64)


def _dp_steps(rank, world_size, kind, steps, widths, bucket_bytes, seed, times,
              extra_s: float = 0.0) -> None:
    """The model and wrapper are built once; with ``times`` a list, each step is timed
    (after a barrier, so every rank starts it together) and appended."""
    import time

    import torch
    import torch.distributed as tdist
    from torch.profiler import record_function

    from parlearn.core.checks import check_choice
    from parlearn.core.models import mlp
    from parlearn.multi_device.data_parallel import ddp as D

    check_choice("kind", kind, ("naive", "bucketed", "ddp", "zero3"))
    steps = check_int("steps", steps, lo=1)
    model = mlp(list(widths), seed=seed, dtype=torch.float32)

    def zero3():
        from parlearn.multi_device.sharding import shard_module

        return shard_module(model)     # the optimizer below then steps this rank's shards

    wrapped = {"naive": lambda: D.NaiveDP(model, record=False),
               "bucketed": lambda: D.BucketedDP(model, bucket_bytes=bucket_bytes, record=False),
               "ddp": lambda: D.make_ddp(model, bucket_bytes=bucket_bytes),
               "zero3": zero3}[kind]()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(seed + 1 + rank)
    x = torch.randn(32, widths[0], generator=g)
    y = torch.randint(0, widths[-1], (32,), generator=g)
    for _ in range(steps):
        if times is not None:
            tdist.barrier()
            t0 = time.perf_counter()
        with record_function("forward"):
            if extra_s:
                with record_function("extra"):
                    _busy(extra_s)
            loss = torch.nn.functional.cross_entropy(wrapped(x), y)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        if times is not None:
            times.append(time.perf_counter() - t0)


def median_breakdown(trace, *, skip: int = 1) -> dict[str, float]:
    """:func:`breakdown` of the median step (by step time) among the steps
    (:func:`step_windows`) after the first ``skip`` (warm-up): one real step, so its parts
    still add up; ``"steps"`` says how many steps it was chosen from."""
    skip = check_int("skip", skip, lo=0)
    windows = step_windows(trace)[skip:]
    if not windows:
        raise ValueError(f"skip={skip} leaves no step to read")
    parts = sorted((breakdown(trace, window=w) for w in windows), key=lambda p: p["step"])
    out = dict(parts[(len(parts) - 1) // 2])
    out["steps"] = len(parts)
    return out


def timeline_events(trace, rank: int, window: tuple[float, float]
                    ) -> list[tuple[str, str, float, float]]:
    """``(lane, label, start, end)`` for :func:`parlearn.viz.timeline`: this rank's compute
    and collective spans (merged) inside ``window``, seconds from its start."""
    check_int("rank", rank, lo=0)
    w = [(float(window[0]), float(window[1]))]
    out = []
    for lane, found in (("compute", spans(trace, (), COMPUTE_PREFIXES)),
                        ("comm", spans(trace, (), COMM_PREFIXES))):
        for a, b in _intersect(_union(found), w):
            out.append((f"rank {rank} {lane}", lane, a - w[0][0], b - w[0][0]))
    return out


def dp_timed_worker(rank: int, world_size: int, kind: str, steps: int, profiled: bool,
                    widths: Sequence[int] = (256, 1024, 1024, 10)) -> list[float]:
    """Worker: :func:`dp_step_worker`'s steps, each timed by the rank itself (seconds),
    under the profiler when ``profiled``: what watching costs."""
    import torch

    from parlearn.core.checks import check_bool

    check_bool("profiled", profiled)
    times: list[float] = []
    if not profiled:
        _dp_steps(rank, world_size, kind, steps, widths, 2**20, 0, times)
        return times
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                     else [])
    prof = profile(activities=acts)
    with _QuietStderr():
        prof.__enter__()
    try:
        _dp_steps(rank, world_size, kind, steps, widths, 2**20, 0, times)
    finally:
        with _QuietStderr():
            prof.__exit__(None, None, None)
    return times
