"""Data parallelism measured on real ranks: lesson 11's workers and the bench rows.

Each ``worker_*`` function runs under :func:`parlearn.distributed.run` (one call per rank);
the engines themselves are in :mod:`parlearn.data_parallel.ddp`, the 8-bit all-reduce in
:mod:`parlearn.data_parallel.compression`. Everything measured here is wall-clock time on the ranks
of this machine; everything modeled comes from ``dp_step_model`` and the alpha-beta
model of :mod:`parlearn.distributed`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence

import torch
from torch import nn

from parlearn.core.checks import check_bool, check_choice, check_device, check_float, check_int
from parlearn.core.datasets import Split
from parlearn.core.models import _check_widths, mlp, mlp_param_bytes
from parlearn.core.timing import UNRELIABLE
from parlearn.multi_device.data_parallel.ddp import (
    BucketedDP,
    CompressedDP,
    NaiveDP,
    make_ddp,
)
from parlearn.multi_device.data_parallel.spans import step_spans
from parlearn.multi_device.data_parallel.step_model import dp_step_model

__all__ = ["STEP_KINDS", "worker_step_time", "DIGITS_METHODS", "worker_digits",
           "summarize_steps", "step_spans", "rank_coding_seconds", "worker_rank_coding",
           "worker_slow_link",
           "slow_link_check",
           "CLUSTER_LINK", "bench"]


STEP_KINDS = ("local", "naive", "bucketed", "one_bucket", "compressed", "compressed_reference",
              "ddp")


def _check_rank(rank: int, world_size: int) -> None:
    world_size = check_int("world_size", world_size, lo=1)
    check_int("rank", rank, lo=0, hi=world_size - 1)


def _check_pair(name: str, value, first: str, second: str, *, second_open: bool = False
                ) -> tuple[float, float]:
    """``value`` as a pair of finite floats >= 0 (the second > 0 if ``second_open``)."""
    if isinstance(value, str) or not isinstance(value, tuple | list) or len(value) != 2:
        raise TypeError(f"{name} must be a pair ({first}, {second}), got {value!r}")
    return (check_float(f"{name}[0] ({first})", value[0], lo=0),
            check_float(f"{name}[1] ({second})", value[1], lo=0, lo_open=second_open))


def _wrap(kind: str, model: nn.Module, bucket_bytes: int):
    if kind == "local":
        return model
    if kind == "naive":
        return NaiveDP(model)
    if kind == "bucketed":
        return BucketedDP(model, bucket_bytes=bucket_bytes)
    if kind == "one_bucket":    # every gradient in one all-reduce after backward
        return BucketedDP(model, bucket_bytes=sum(p.numel() * p.element_size()
                                                  for p in model.parameters()))
    if kind == "compressed":
        return CompressedDP(model)
    if kind == "compressed_reference":      # the same all-reduce, serial reference coders
        return CompressedDP(model, reference_coding=True)
    return make_ddp(model, bucket_bytes=bucket_bytes)


def worker_step_time(rank: int, world_size: int, kinds: Sequence[str], widths: Sequence[int],
                     batch: int, steps: int, bucket_bytes: int = 2**20, seed: int = 0,
                     link: tuple[float, float] | None = None) -> dict:
    """Time training steps of :func:`mlp` (``widths``) on random data (batch ``batch`` per
    rank), one replica per kind in ``kinds`` (from :data:`STEP_KINDS`; ``"local"`` is the
    same model with no communication: the compute alone). The kinds take turns step by
    step (interleaved, so a busy machine slows them alike). Returns, per kind, each
    step's wall seconds on this rank (forward + backward + communication + SGD step), the
    events of its last step relative to that step's start ``t0`` (empty for local and DDP;
    ``t0`` is ``time.perf_counter()``, one clock for all ranks of a machine) and
    the ledger's payload bytes per kind of collective in that step (DDP's C++ collectives
    are not seen by the ledger). ``link`` = ``(alpha, bandwidth)`` runs the steps on an
    EMULATED slow link (:func:`parlearn.data_parallel.slow_link.emulated_link`); each
    kind's ``charged`` then holds the link's wire bytes and seconds of its last step."""
    from parlearn.distributed import ledger
    from parlearn.multi_device.data_parallel.slow_link import emulated_link

    _check_rank(rank, world_size)
    if isinstance(kinds, str) or not isinstance(kinds, Sequence) or not kinds:
        raise TypeError(f"kinds must be a non-empty sequence of {STEP_KINDS}, got {kinds!r}")
    kinds = [check_choice("kinds[i]", k, STEP_KINDS) for k in kinds]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"kinds must not repeat a kind (one replica each), got {kinds}")
    widths = _check_widths(widths)
    check_int("steps", steps, lo=1)
    check_int("batch", batch, lo=1)
    check_int("bucket_bytes", bucket_bytes, lo=1)
    seed = check_int("seed", seed, lo=0)
    if link is not None:
        link = _check_pair("link", link, "alpha", "bandwidth", second_open=True)
    gen = torch.Generator().manual_seed(seed + 1 + rank)
    x = torch.randn(batch, widths[0], generator=gen)
    y = torch.randint(0, widths[-1], (batch,), generator=gen)
    runs = {}
    for k in kinds:
        model = mlp(widths, seed=seed)
        runs[k] = (_wrap(k, model, bucket_bytes), torch.optim.SGD(model.parameters(), lr=1e-3))
    out = {k: {"times": [], "events": [], "bytes": {}, "charged": (0.0, 0.0)} for k in kinds}
    with emulated_link(*link) if link is not None else contextlib.nullcontext() as emu:
        for _ in range(steps):
            for k in kinds:
                wrapped, opt = runs[k]
                log = getattr(wrapped, "events", None)
                start = len(log) if log is not None else 0
                charged = len(emu.charges) if emu is not None else 0
                with ledger() as led:
                    t0 = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    nn.functional.cross_entropy(wrapped(x), y).backward()
                    opt.step()
                    out[k]["times"].append(time.perf_counter() - t0)
                out[k]["events"] = [(w, lab, t - t0) for w, lab, t in (log or [])[start:]]
                out[k]["t0"] = t0
                out[k]["bytes"] = {kind: v[1] for kind, v in led.summary().items()}
                if emu is not None:
                    new = emu.charges[charged:]
                    out[k]["charged"] = (sum(c.wire_bytes for c in new),
                                         sum(c.seconds for c in new))
    return out


DIGITS_METHODS = ("fp32", "8bit", "8bit_ef", "ddp_fp16_hook", "ddp_powersgd_hook",
                  "ddp_dettmers8_hook")


def worker_digits(rank: int, world_size: int, method: str, data, steps: int, batch: int,
                  lr: float, hidden: int = 64, seed: int = 0, eval_every: int = 10) -> dict:
    """Train an MLP on ``data`` (a ``parlearn.datasets.digits()`` split, loaded once by
    the caller) with data parallelism, averaging gradients by ``method`` (one of
    :data:`DIGITS_METHODS`: fp32 bucketed all-reduce, our 8-bit all-reduce without / with
    error feedback, or DDP with torch's fp16 or PowerSGD hook or our 8-bit hook). Each
    step every rank draws its own ``batch`` examples (seeded by rank and step); plain
    SGD. Returns ``steps_at``, the test accuracy there (of this rank's replica), and the
    ledger's payload bytes of the last step by kind (PowerSGD's hook sends plain fp32 in
    its first 2 steps). The comm hooks, torch's and ours, issue their collectives from
    Python, so the ledger sees them; plain DDP without a hook is not used here."""
    from parlearn.distributed import ledger
    from parlearn.multi_device.data_parallel.compression import Dettmers8HookState, dettmers8_hook

    _check_rank(rank, world_size)
    check_choice("method", method, DIGITS_METHODS)
    if not isinstance(data, Split):
        raise TypeError(f"data must be a parlearn.datasets Split (digits()), got "
                        f"{type(data).__name__}")
    steps = check_int("steps", steps, lo=1)
    batch = check_int("batch", batch, lo=1)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    hidden = check_int("hidden", hidden, lo=1)
    seed = check_int("seed", seed, lo=0)
    eval_every = check_int("eval_every", eval_every, lo=1)
    model = mlp([data.n_features, hidden, data.n_classes], seed=seed)
    if method == "fp32":
        wrapped = BucketedDP(model)
    elif method in ("8bit", "8bit_ef"):
        wrapped = CompressedDP(model, error_feedback=method == "8bit_ef")
    else:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        wrapped = make_ddp(model)
        if method == "ddp_fp16_hook":
            wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif method == "ddp_powersgd_hook":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                                start_powerSGD_iter=2, random_seed=seed)
            wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            wrapped.register_comm_hook(Dettmers8HookState(), dettmers8_hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    n = data.x_train.shape[0]
    steps_at, acc, last = [], [], {}
    for step in range(steps):
        gen = torch.Generator().manual_seed(seed * 100003 + step * 101 + rank)
        idx = torch.randint(0, n, (batch,), generator=gen)
        with ledger() as led:
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(wrapped(data.x_train[idx]), data.y_train[idx]).backward()
        last = {k: v[1] for k, v in led.summary().items()}
        opt.step()
        if (step + 1) % eval_every == 0 or step == steps - 1:
            with torch.no_grad():
                pred = model(data.x_test).argmax(1)
            steps_at.append(step + 1)
            acc.append(float((pred == data.y_test).double().mean()))
    return {"steps_at": steps_at, "accuracy": acc, "bytes": last}


def summarize_steps(results: Sequence[dict], *, skip: int = 1) -> dict[str, dict]:
    """Per kind of a :func:`worker_step_time` run (``results`` = every rank's return):
    a step's time is its slowest rank's; returns the median over steps after the first
    ``skip``, the quartiles, and rank 0's ledger bytes."""
    import statistics

    if isinstance(results, str | dict) or not isinstance(results, Sequence) or not results:
        raise TypeError(f"results must be a non-empty list of worker_step_time returns (one per "
                        f"rank), got {results!r:.80}")
    for r, res in enumerate(results):
        if not isinstance(res, dict) or not res or set(res) != set(results[0]) or not all(
                isinstance(v, dict) and isinstance(v.get("times"), list | tuple)
                and isinstance(v.get("bytes"), dict) for v in res.values()):
            raise ValueError(f"results[{r}] must be a worker_step_time return (kind -> times "
                             f"and bytes) with the kinds of results[0], got {res!r:.80}")
        for k, v in res.items():
            if len(v["times"]) != len(results[0][k]["times"]):
                raise ValueError(f"results[{r}][{k!r}] holds {len(v['times'])} steps, "
                                 f"results[0] {len(results[0][k]['times'])}")
            for t in v["times"]:
                check_float("results times", t, lo=0)
    skip = check_int("skip", skip, lo=0)
    out = {}
    for k in results[0]:
        per_step = [max(r[k]["times"][i] for r in results)
                    for i in range(len(results[0][k]["times"]))][skip:]
        if not per_step:
            raise ValueError(f"skip={skip} leaves no steps to summarize")
        q = statistics.quantiles(per_step, n=4) if len(per_step) > 1 else [per_step[0]] * 3
        out[k] = {"median": statistics.median(per_step), "q1": q[0], "q3": q[2],
                  "bytes": dict(results[0][k]["bytes"])}
    return out


def rank_coding_seconds(numel: int, repeat: int = 5, seed: int = 0) -> tuple[float, float]:
    """Seconds per element ``(quantize_s, dequantize_s)`` of the 8-bit all-reduce's own
    local work on ``numel`` gradients of 2 ranks, as a rank runs it: ONE intra-op
    thread, medians of ``repeat`` interleaved calls (the caller's thread count is
    restored). See :func:`parlearn.data_parallel.compression.path_coding_seconds`: the
    coders plus the padding, float64 reduction and casts around them, in the units
    :func:`~parlearn.data_parallel.compression.compressed_all_reduce_time` counts."""
    from parlearn.multi_device.data_parallel.compression import path_coding_seconds

    return path_coding_seconds(check_int("numel", numel, lo=1), 2,
                               repeat=check_int("repeat", repeat, lo=1), seed=seed, threads=1)


def worker_rank_coding(rank: int, world_size: int, numel: int, repeat: int = 5
                       ) -> tuple[float, float]:
    """:func:`rank_coding_seconds` on every rank at once: the coding timed under the load
    the steps run under (both ranks coding on the shared cores)."""
    _check_rank(rank, world_size)
    return rank_coding_seconds(numel, repeat)


_SLOW_KINDS = ("local", "bucketed", "compressed")


def worker_slow_link(rank: int, world_size: int, widths: Sequence[int], batch: int, steps: int,
                     real: tuple[float, float], alpha: float, factor: float,
                     coding: tuple[float, float] | None = None) -> dict:
    """The ranks' half of :func:`slow_link_check`: the coders timed on every rank at once
    (:func:`rank_coding_seconds`, same load as the steps; rank 0's figures are broadcast
    so every rank picks the same links) unless ``coding`` gives them; then the emulated
    bandwidths of :func:`emulated_bandwidths` for the real link ``real`` = (alpha, beta);
    then, per side whose bandwidth is finite and positive, :func:`worker_step_time` of
    local, fp32 one-bucket and 8-bit steps on that EMULATED link."""
    import torch.distributed as tdist

    from parlearn.distributed import AlphaBeta
    from parlearn.multi_device.data_parallel.slow_link import emulated_bandwidths

    _check_rank(rank, world_size)
    _check_slow_link(widths, batch, steps, alpha, factor, coding, lo_steps=1)
    real = _check_pair("real", real, "alpha", "beta")
    numel = sum(mlp_param_bytes(widths)) // 4
    if coding is None:
        qd = torch.tensor(rank_coding_seconds(numel), dtype=torch.float64)
        tdist.broadcast(qd, src=0)
        coding = (float(qd[0]), float(qd[1]))
    q, d = coding
    cross, below, above = emulated_bandwidths(numel, world_size, AlphaBeta(*real), alpha=alpha,
                                              quantize_s=q, dequantize_s=d, factor=factor)
    out = {"coding": coding, "crossover": cross, "numel": numel, "sides": {}}
    for side, bw in (("below", below), ("above", above)):
        runs = None
        if 0 < bw < math.inf:
            runs = worker_step_time(rank, world_size, _SLOW_KINDS, widths, batch, steps,
                                    4 * numel, 0, (alpha, bw))   # one bucket: no overlap
        out["sides"][side] = (bw, runs)
    return out


def _check_slow_link(widths, batch, steps, alpha, factor, coding, *, lo_steps: int) -> int:
    _check_widths(widths)
    check_int("batch", batch, lo=1)
    steps = check_int("steps", steps, lo=lo_steps)
    check_float("alpha", alpha, lo=0)
    check_float("factor", factor, lo=1, lo_open=True)
    if coding is not None:
        _check_pair("coding", coding, "quantize_s", "dequantize_s")
    return steps


def slow_link_check(widths: Sequence[int], real, *, coding: tuple[float, float] | None = None,
                    alpha: float = 1e-4, factor: float = 4.0, batch: int = 32,
                    steps: int = 6) -> dict:
    """8-bit vs fp32 DP steps of :func:`mlp` (``widths``) on 2 gloo ranks over an EMULATED
    slow link, on both sides of the modeled crossover, in one launch of the ranks
    (:func:`worker_slow_link`).

    The emulated bandwidths are :func:`emulated_bandwidths`: ``factor`` below and above
    the crossover computed from ``real`` (this machine's fitted link, an AlphaBeta), the
    coding seconds per element (``coding`` = (quantize, dequantize); None: measured on
    the ranks just before the steps) and ``alpha`` seconds per emulated message. On each
    side the fp32 path (:class:`BucketedDP` with one bucket: nothing to overlap, as in the
    modeled ``all_reduce``), the 8-bit path (:class:`CompressedDP`) and the compute alone
    take turns for ``steps`` steps. Returns ``crossover`` (emulated bytes/s), ``coding``,
    the arguments, and per side: ``bandwidth``; ``measured``, the median fp32 / 8-bit
    step-time ratio over the interleaved steps after the first (slowest rank per step),
    with ``q1`` and ``q3`` of those per-step ratios; ``modeled``, ``(compute +
    all_reduce time) / (compute + compressed_all_reduce_time with coding)`` on the total
    link ``AlphaBeta(real.alpha + alpha, real.beta + 1 / bandwidth)`` with the measured
    compute; the ``steps`` summary; rank 0's per-step ``charged`` (wire bytes, seconds)
    and ledger ``wire`` bytes per path. A side whose bandwidth is 0 or infinite (8-bit
    pays nowhere or everywhere) holds only ``bandwidth`` and ``skipped``, the reason."""
    import statistics

    from parlearn.distributed import AlphaBeta, ring_bytes, run
    from parlearn.multi_device.data_parallel.compression import modeled_step_ratio

    if not isinstance(real, AlphaBeta):
        raise TypeError(f"real must be an AlphaBeta, got {type(real).__name__}")
    # steps >= 3: the quartiles of the per-step ratios after the first need two of them
    steps = _check_slow_link(widths, batch, steps, alpha, factor, coding, lo_steps=3)
    res = run(worker_slow_link, 2, args=(widths, batch, steps, (real.alpha, real.beta), alpha,
                                         factor, coding), timeout=120)
    q, d = res[0]["coding"]
    numel = res[0]["numel"]
    out: dict = {"crossover": res[0]["crossover"], "alpha": alpha, "factor": factor,
                 "numel": numel, "coding": (q, d), "steps": steps}
    for side, (bw, _) in res[0]["sides"].items():
        if not 0 < bw < math.inf:
            out[side] = {"bandwidth": bw, "skipped": "8-bit pays at every bandwidth" if bw
                         else "8-bit pays at no bandwidth"}
            continue
        runs = [r["sides"][side][1] for r in res]
        s = summarize_steps(runs)
        slowest = {k: [max(r[k]["times"][i] for r in runs) for i in range(steps)][1:]
                   for k in _SLOW_KINDS}
        ratios = [a / b for a, b in zip(slowest["bucketed"], slowest["compressed"], strict=True)]
        qs = statistics.quantiles(ratios, n=4)
        total = AlphaBeta(real.alpha + alpha, real.beta + 1 / bw)
        modeled = modeled_step_ratio(numel, 2, total, compute_s=s["local"]["median"],
                                     quantize_s=q, dequantize_s=d)
        out[side] = {"bandwidth": bw, "measured": statistics.median(ratios), "q1": qs[0],
                     "q3": qs[2], "modeled": modeled, "steps": s,
                     "charged": {k: runs[0][k]["charged"] for k in ("bucketed", "compressed")},
                     "wire": {k: sum(ring_bytes(c, b, 2) for c, b in s[k]["bytes"].items())
                              for k in ("bucketed", "compressed")}}
    return out


# Assumed cluster link for the modeled figures at scale (an assumption, not a
# measurement): 5 us per message and 25 GB/s per rank, the order of an HDR InfiniBand link.
CLUSTER_LINK = (5e-6, 1 / 25e9)


def bench(device: torch.device, quick: bool) -> list:
    """Measured on 2 gloo CPU ranks: bucketed vs naive DP step time, and 8-bit
    compressed vs fp32 DP (time and ledger bytes), each beside the alpha-beta model's
    figure from this machine's fitted alpha and beta; the 8-bit step with the serial
    reference coders vs the table coders (same result); and the coders' throughput,
    whose per-element seconds enter the modeled 8-bit step. ``device`` is not used: gloo
    ranks run on the CPU."""
    from parlearn.core.bench import Row
    from parlearn.distributed import AlphaBeta, measure_links, ring_bytes, run
    from parlearn.multi_device.data_parallel.compression import (
        coding_seconds,
        compressed_all_reduce_time,
        crossover_bandwidth,
    )
    from parlearn.multi_device.data_parallel.slow_link import _slow_link_rows

    check_device("device", device)   # checked, then unused: see the docstring
    check_bool("quick", quick)
    widths = [128, 256, 256, 10] if quick else [256, 1024, 1024, 1024, 10]
    steps = 5 if quick else 12
    # one fit per collective the paths issue, interleaved in one sweep (gloo's all_gather
    # and all_to_all are not priced well by its all_reduce's fit), up to 16 MiB, past the
    # fp32 gradient's 9.5 MB: fitted only up to 4 MiB, the bandwidth put a 9.5 MB
    # all-reduce anywhere from 5 to 14 ms over four fits (measured)
    links = measure_links(2, sizes=[2**k for k in range(8, 25, 2)], repeat=3 if quick else 5)
    ab = links["all_reduce"]
    kinds = ("local", "naive", "bucketed", "one_bucket", "compressed", "compressed_reference")
    res = run(worker_step_time, 2, args=(kinds, widths, 32, steps, 2**18), timeout=300)
    s = summarize_steps(res)
    sizes = mlp_param_bytes(widths)
    numel = sum(sizes) // 4
    compute = s["local"]["median"]
    mod = {k: dp_step_model(sizes, 2, ab, compute_seconds=compute, strategy=k,
                            bucket_bytes=2**18).step for k in ("naive", "bucketed")}
    big = [4 * 350_000_000 // 96] * 96
    ib = AlphaBeta(*CLUSTER_LINK)
    at_scale = {k: dp_step_model(big, 64, ib, compute_seconds=0.5, strategy=k)
                for k in ("naive", "bucketed")}
    wire = {k: sum(ring_bytes(kind, b, 2) for kind, b in s[k]["bytes"].items())
            for k in ("bucketed", "compressed")}
    # the coders on one process, same size as the gradient, interleaved with their
    # references, on ONE thread as each gloo rank codes (the caller's 2 would flatter them)
    coding = coding_seconds(numel, repeat=3 if quick else 7, threads=1)
    t = coding.timings
    # the model's coding: the 8-bit path's own local work (coders, padding, float64
    # reduction, casts), timed on both ranks at once as they run it; the slower rank's
    per_rank = run(worker_rank_coding, 2, args=(numel, 3 if quick else 7), timeout=300)
    q, d = (max(r[i] for r in per_rank) for i in (0, 1))
    q_alone, d_alone = t["quantize"].median / numel, t["dequantize"].median / numel
    mod8 = compute + compressed_all_reduce_time(numel, 2, links, quantize_s=q, dequantize_s=d)
    mod8_one_fit = compute + compressed_all_reduce_time(numel, 2, ab, quantize_s=q,
                                                        dequantize_s=d)
    mod8_bytes_only = compute + compressed_all_reduce_time(numel, 2, links)
    mod8_alone = compute + compressed_all_reduce_time(numel, 2, links, quantize_s=q_alone,
                                                      dequantize_s=d_alone)
    mod32 = dp_step_model(sizes, 2, ab, compute_seconds=compute, strategy="one_bucket").step
    fit32, fit8 = s["one_bucket"]["median"] / mod32, s["compressed"]["median"] / mod8
    cross = crossover_bandwidth(numel, 2, ab.alpha, quantize_s=q, dequantize_s=d)
    cross64 = crossover_bandwidth(350_000_000, 64, CLUSTER_LINK[0], quantize_s=q,
                                  dequantize_s=d)

    def gbs(name: str) -> str:
        tm = t[name]
        return f"{4 * numel / tm.median / 1e9:.2f} GB/s (spread {tm.spread:.0%})"

    def ms(k: str) -> str:
        return (f"{s[k]['median'] * 1e3:.1f} ms (IQR {s[k]['q1'] * 1e3:.1f}-"
                f"{s[k]['q3'] * 1e3:.1f})")

    dev = "cpu, 2 gloo ranks"
    lo, hi = coding.speedup_range("quantize")
    slow = slow_link_check([128, 256, 256, 10] if quick else [256, 512, 512, 512, 10], ab,
                           steps=4 if quick else 8)
    return _slow_link_rows(slow, ab) + [
        Row("data_parallel", "naive DP (all-reduce each grad after backward)",
            "bucketed DP (all-reduce launched from grad hooks)",
            s["naive"]["median"] / s["bucketed"]["median"], dev,
            target=f"modeled {mod['naive'] / mod['bucketed']:.2f}x ({ab})", met=None,
            detail=(f"measured step {s['bucketed']['median'] * 1e3:.1f} ms vs naive "
                    f"{s['naive']['median'] * 1e3:.1f} ms, compute alone "
                    f"{compute * 1e3:.1f} ms. On 2 shared CPU cores the overlap gain is "
                    f"bounded: backward and gloo's thread compete for the same cores. "
                    f"Modeled at scale (64 ranks, 350M fp32 params in 96 tensors, 0.5 s "
                    f"compute, assumed 5 us / 25 GB/s links): naive "
                    f"{at_scale['naive'].step:.2f} s, bucketed "
                    f"{at_scale['bucketed'].step:.2f} s "
                    f"({at_scale['bucketed'].hidden / at_scale['bucketed'].comm:.0%} of "
                    f"communication hidden).")),
        Row("data_parallel", "fp32 DP, one all-reduce after backward", "8-bit dynamic-tree DP",
            s["one_bucket"]["median"] / s["compressed"]["median"], dev,
            target="8-bit step within 25% of modeled", met=abs(fit8 - 1) <= 0.25,
            detail=(f"measured step: fp32 {ms('one_bucket')}, 8-bit {ms('compressed')}, "
                    f"compute alone {compute * 1e3:.1f} ms. Modeled (compute + alpha-beta "
                    f"collectives, each priced by its own fit: all_reduce {ab}, all_to_all "
                    f"{links['all_to_all']}, all_gather {links['all_gather']}; + the 8-bit "
                    f"path's coding timed on both ranks at once, 1 thread each: "
                    f"{q * 1e9:.1f} ns per element encoded, {d * 1e9:.1f} ns decoded): fp32 "
                    f"{mod32 * 1e3:.1f} ms, 8-bit {mod8 * 1e3:.1f} ms, ratio "
                    f"{mod32 / mod8:.2f}x; measured / modeled: fp32 {fit32:.2f}, 8-bit "
                    f"{fit8:.2f} (with the all_reduce fit for every collective: 8-bit "
                    f"{mod8_one_fit * 1e3:.1f} ms, measured / modeled "
                    f"{s['compressed']['median'] / mod8_one_fit:.2f}). Not modeled: the "
                    f"wrappers' packing of the gradients into one buffer and back, and the "
                    f"wait at each collective for the slower rank, paid at the 8-bit path's "
                    f"4 collectives and at fp32's 1 (a per-phase profile on 2 quiet ranks: "
                    f"about 2 ms and 3 ms of the 8-bit step). The coders alone, "
                    f"timed warm on one input in this "
                    f"process ({q_alone * 1e9:.1f} and {d_alone * 1e9:.1f} ns), would "
                    f"model {mod32 / mod8_alone:.2f}x. Bytes alone would give "
                    f"{mod32 / mod8_bytes_only:.2f}x. Modeled crossover: 8 bits pay below a "
                    f"link of {cross / 1e9:.3g} GB/s on 2 ranks (this machine's fitted "
                    f"link: {ab.bandwidth / 1e9:.2f} GB/s), below {cross64 / 1e9:.3g} GB/s "
                    f"for 350M params on 64 ranks at 5 us. Ledger wire bytes per step per "
                    f"rank: fp32 {wire['bucketed']:.0f}, 8-bit {wire['compressed']:.0f} "
                    f"({wire['compressed'] / wire['bucketed']:.3f} of fp32; modeled 0.25 + "
                    f"scales). Bucketed fp32 (overlapped): {ms('bucketed')}.")),
        Row("data_parallel", "8-bit DP step, reference coders (binary search, per chunk)",
            "8-bit DP step, table coders (one lookup, all chunks)",
            s["compressed_reference"]["median"] / s["compressed"]["median"], dev,
            detail=(f"measured side by side, steps interleaved: reference "
                    f"{ms('compressed_reference')}, table {ms('compressed')}; same "
                    f"result bit for bit (tests).")),
        Row("data_parallel", "quantize_reference (torch.bucketize)",
            "quantize (table lookup on float64 bits)", coding.speedup("quantize"),
            f"cpu, {coding.threads} threads",
            detail=(f"{numel} float32 values, {t['quantize'].repeats} interleaved repeats, "
                    f"ratio IQR {lo:.2f}-{hi:.2f}: quantize {gbs('quantize')} vs reference "
                    f"{gbs('quantize_reference')}; dequantize {gbs('dequantize')} vs "
                    f"reference {gbs('dequantize_reference')} "
                    f"({coding.speedup('dequantize', 'dequantize_reference'):.2f}x)"
                    + ("" if coding.reliable else f"; WARNING: {UNRELIABLE}"))),
    ]
