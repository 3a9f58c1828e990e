"""Goodput under failures: how often to checkpoint, modeled and measured.

A job that saves a checkpoint after every ``tau`` seconds of work, at a cost of ``C``
seconds per save, on a machine that fails on average once every ``M`` seconds of work and
takes ``R`` seconds to restart and reload, spends per second of useful work (first order
in ``tau/M``, Young 1974):

- ``C / tau`` saving,
- ``(tau / 2 + R) / M`` on failures: each one costs the restart and, on average, half an
  interval of work done since the last save and done again.

So the fraction of wall time that is useful work, the *goodput*, is about
``1 / (1 + C/tau + (tau/2 + R)/M)`` (``1 - C/tau - (tau/2 + R)/M`` to first order), and it
is largest at ``tau* = sqrt(2 C M)``: Young's interval, refined by Daly (2006) for
intervals that are not small against ``M``. :func:`modeled_goodput` is that formula;
:func:`simulated_goodput` draws exponential failures and replays the schedule exactly (no
first-order step), which matters where ``tau`` or ``R`` approach ``M``;
:func:`measured_goodput` runs the real trainer (:mod:`.train`) on real gloo ranks, kills a
rank at random steps, restarts the job from its last real checkpoint, and times all of it.

Failures here strike during computation: the clock to the next one runs while steps run,
from each (re)start, which is how :func:`measured_goodput` injects them.

References: J. W. Young, "A first order approximation to the optimum checkpoint interval",
CACM 17(9), 1974; J. T. Daly, "A higher order estimate of the optimum checkpoint interval
for restart dumps", FGCS 22(3), 2006.
"""

from __future__ import annotations

import dataclasses
import math
import random
import tempfile
import time

from parlearn.core.checks import check_float, check_int

__all__ = ["young_daly", "modeled_goodput", "simulated_goodput", "measured_goodput"]


def young_daly(cost: float, mtbf: float) -> float:
    """Young's optimal checkpoint interval ``sqrt(2 C M)`` (seconds of work between saves)
    for a save costing ``cost`` seconds and a mean time between failures ``mtbf``."""
    cost = check_float("cost", cost, lo=0, lo_open=True)
    mtbf = check_float("mtbf", mtbf, lo=0, lo_open=True)
    return math.sqrt(2 * cost * mtbf)


def modeled_goodput(interval: float, cost: float, mtbf: float, restart: float = 0.0) -> float:
    """``1 / (1 + C/tau + (tau/2 + R)/M)``: useful work over wall time when every second of
    work carries the save and failure overheads of the module docstring (first order in
    ``tau/M``; ``tau`` = ``interval``, ``C`` = ``cost``, ``M`` = ``mtbf``, ``R`` =
    ``restart``, all in seconds)."""
    interval = check_float("interval", interval, lo=0, lo_open=True)
    cost = check_float("cost", cost, lo=0)
    mtbf = check_float("mtbf", mtbf, lo=0, lo_open=True)
    restart = check_float("restart", restart, lo=0)
    return 1 / (1 + cost / interval + (interval / 2 + restart) / mtbf)


def simulated_goodput(interval: float, cost: float, mtbf: float, restart: float = 0.0, *,
                      work: float = 1e4, setup: float = 0.0, seed: int = 0) -> float:
    """Replay a job of ``work`` seconds of useful work that starts after ``setup`` seconds
    and saves after every ``interval`` seconds of work (each save ``cost`` seconds; none
    after the last). A failure strikes after an exponential amount of work of mean
    ``mtbf`` since the last (re)start; the work since the last save is lost, and the job
    restarts (``restart`` seconds) from that save. Returns ``work / wall time``; after
    ``10**5`` failures it stops and returns the work done so far over the time so far
    (where segments almost never complete, the job would not end)."""
    interval = check_float("interval", interval, lo=0, lo_open=True)
    cost = check_float("cost", cost, lo=0)
    mtbf = check_float("mtbf", mtbf, lo=0, lo_open=True)
    restart = check_float("restart", restart, lo=0)
    work = check_float("work", work, lo=0, lo_open=True)
    setup = check_float("setup", setup, lo=0)
    rng = random.Random(check_int("seed", seed, lo=0))
    done, wall = 0.0, setup
    clock = rng.expovariate(1 / mtbf)       # work until the next failure, from this start
    failures = 0
    while done < work:
        if failures >= 10**5:
            return done / wall
        segment = min(interval, work - done)
        if segment <= clock:
            clock -= segment
            wall += segment
            done += segment
            if done < work:
                wall += cost
            continue
        wall += clock + restart             # the partial segment is lost
        clock = rng.expovariate(1 / mtbf)
        failures += 1
    return work / wall


def measured_goodput(every: int, mtbf_steps: float, *, steps: int = 40, seed: int = 0,
                     max_restarts: int = 50, **spec) -> dict:
    """Train ``steps`` steps of the mesh trainer (``spec``: :class:`~.train.TrainSpec`
    fields) on real ranks, saving every ``every`` steps, while a failure strikes after a
    number of steps drawn from an exponential law of mean ``mtbf_steps`` (counted from each
    start): that rank kills itself with SIGKILL, the job fails, and it is started again
    from its last checkpoint, as ``torchrun --max-restarts`` would (here the restart is a
    new :func:`parlearn.dist.run`). A failure-free run without checkpoints is timed first,
    the same way.

    Returns ``{"goodput": steps x step_s / wall_s (useful training time over all the
    time the job took, its first start included), "failures",
    "steps_redone", "save_s": median seconds per save, "restart_s": the median over the
    failed attempts of their seconds outside steps and saves (start, load, noticing the
    dead rank, stopping the others): what a failure costs beyond the work it loses, an
    estimate that prices the attempt's steps and saves at medians of other runs, so on a
    busy machine it can come out small or even below 0,
    "step_s": median step seconds of the failure-free run, "setup_s": its seconds
    outside its steps, "wall_s", "clean_s", "param_diff": max |difference| between rank
    0's final parameters with failures and without}``: every figure measured here. Rank
    0's figures are the ones reported."""
    from parlearn.at_scale import checkpoint as ckpt
    from parlearn.at_scale.train import TrainSpec, train
    from parlearn.distributed import RankError

    every = check_int("every", every, lo=1)
    mtbf_steps = check_float("mtbf_steps", mtbf_steps, lo=0, lo_open=True)
    steps = check_int("steps", steps, lo=1)
    max_restarts = check_int("max_restarts", max_restarts, lo=0)
    rng = random.Random(check_int("seed", seed, lo=0))
    base = TrainSpec(**{"log": False, **spec, "steps": steps})
    if base.ckpt is not None or base.every or base.fail_at is not None:
        raise ValueError("measured_goodput sets ckpt, every and fail_at itself")

    t0 = time.perf_counter()
    clean = train(base)
    clean_s = time.perf_counter() - t0
    step_s = sorted(clean[0]["step_s"])
    clean_setup = clean_s - sum(step_s)
    failures = redone = 0
    failed = []             # (seconds, steps run, saves made) of each attempt that failed
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        while True:
            found = ckpt.latest(root)
            start = found[0] if found else 0
            gap = math.ceil(rng.expovariate(1 / mtbf_steps))
            fail_at = start + gap if start + gap < steps else None
            run_spec = dataclasses.replace(base, ckpt=root, every=every, fail_at=fail_at,
                                           fail_rank=rng.randrange(base.world))
            launched = time.perf_counter()
            try:
                ranks = train(run_spec)
                attempt_s = time.perf_counter() - launched
            except RankError:
                failures += 1
                redone += fail_at - start - (fail_at - start) // every * every
                failed.append((time.perf_counter() - launched, fail_at - start,
                               fail_at // every - start // every))
                if failures > max_restarts:
                    raise RuntimeError(f"more than max_restarts={max_restarts} failures: "
                                       f"mtbf_steps={mtbf_steps} is too short for every="
                                       f"{every}") from None
                continue
            break
        wall_s = time.perf_counter() - t0
    saves = sorted(s[1] for s in ranks[0]["saves"]) or [0.0]
    median, save_s = step_s[len(step_s) // 2], saves[len(saves) // 2]
    # What a failure costs beyond the work it loses: each failed attempt's time outside its
    # steps and saves (launch, group, model, loading the checkpoint, then noticing the dead
    # rank and stopping the others), the last attempt's set-up standing in for the final
    # start. Their median is the R of the model.
    costs = sorted([d - n * median - k * save_s for d, n, k in failed]
                   or [attempt_s - sum(ranks[0]["step_s"]) - sum(s[1] for s in ranks[0]["saves"])])
    diff = max((ranks[0]["params"][n] - t).abs().max().item()
               for n, t in clean[0]["params"].items())
    return {"goodput": steps * median / wall_s, "failures": failures, "steps_redone": redone,
            "param_diff": diff,
            "save_s": save_s, "step_s": median, "setup_s": clean_setup,
            "restart_s": costs[len(costs) // 2],
            "wall_s": wall_s, "clean_s": clean_s, "every": every, "mtbf_steps": mtbf_steps}
