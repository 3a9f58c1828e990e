"""The cost model of local learning against (pipelined) backprop, and the bench rows.

Pipelined backprop on the same ranks is :func:`parlearn.pipeline.run_pipeline` on
:func:`~parlearn.serial_chain.local.net.as_sequential` of the same network;
:func:`cost_model` gives step and idle time of all three (modeled, through
:func:`parlearn.pipeline.simulate`), and :func:`bench` measures the asynchronous local
pipeline against pipelined backprop on 2 gloo ranks.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from parlearn.core.checks import check_float, check_int, check_tensor
from parlearn.serial_chain.local.net import LocalNet, as_sequential, make_net
from parlearn.serial_chain.local.rules import _trainable, run_local

__all__ = ["local_orders", "block_costs", "cost_model", "bench"]


# ---------------------------------------------------------------------------------------
# The cost model (modeled): step and idle time of backprop, pipelined backprop, local.

def local_orders(blocks: int, steps: int) -> list[list]:
    """The asynchronous local pipeline as :func:`parlearn.pipeline.simulate` orders: every
    rank runs ``F t`` (its forward, local backward and update of minibatch ``t``) for
    ``t = 0..steps-1``; ``F t`` on rank ``k`` needs ``F t`` of rank ``k-1``, nothing else."""
    from parlearn.multi_device.pipeline import Op

    blocks, steps = check_int("blocks", blocks, lo=1), check_int("steps", steps, lo=1)
    return [[Op("F", t) for t in range(steps)] for _ in range(blocks)]


def block_costs(net: LocalNet, x: torch.Tensor, y: torch.Tensor, *, repeat: int = 5
                ) -> dict[str, float]:
    """Measured seconds (median of ``repeat``, one intra-op thread, the caller's count
    restored) of the slowest block's ``"forward"``, its ``"backward"`` (block gradients from
    the output gradient) and its local ``"head"`` (head forward and backward), on a minibatch
    ``(x, y)``: the costs to feed :func:`cost_model`."""
    from parlearn.core.timing import measure

    if not isinstance(net, LocalNet):
        raise TypeError(f"net must be a LocalNet, got {type(net).__name__}")
    check_tensor("x", x, ndim=2, floating=True)
    check_tensor("y", y, shape=(x.shape[0],), floating=False)
    repeat = check_int("repeat", repeat, lo=1)
    out = {"forward": 0.0, "backward": 0.0, "head": 0.0}
    h = x.detach()
    for block, head in zip(net.blocks, net.heads, strict=True):
        params = _trainable(block.parameters())
        out_h = block(h)
        g = torch.ones_like(out_h)
        o = out_h.detach().requires_grad_(True)

        def fwd(block=block, h=h):
            with torch.no_grad():
                block(h)

        def bwd(block=block, h=h, g=g, params=params):
            torch.autograd.grad(block(h), params, g)

        def hd(head=head, o=o):
            torch.autograd.grad(F.cross_entropy(head(o), y), [o, *head.parameters()])

        t_f = measure(fwd, repeat=repeat, threads=1).median
        # backward = forward-with-graph + backward, less the forward alone.
        t_b = max(measure(bwd, repeat=repeat, threads=1).median - t_f, 0.0)
        t_h = measure(hd, repeat=repeat, threads=1).median
        out = {"forward": max(out["forward"], t_f), "backward": max(out["backward"], t_b),
               "head": max(out["head"], t_h)}
        h = out_h.detach()
    return out


def cost_model(blocks: int, forward: float = 1.0, *, backward: float = 2.0,
               head: float = 0.3, micro_batches: int = 4, steps: int = 64,
               comm: float = 0.0) -> dict[str, dict[str, float]]:
    """Modeled time per minibatch and idle fraction of three ways to train ``K = blocks``
    equal blocks, each costing ``forward`` and ``backward`` per minibatch (a local head's
    forward + backward adds ``head``), messages taking ``comm``:

    - ``"backprop"``: one device runs everything, ``K (f + b)`` per minibatch, never idle;
    - ``"pipelined"``: 1F1B on ``K`` devices, ``M = micro_batches`` minibatches per update and
      a flush after each: ``(M + K - 1)(f + b) / M`` per minibatch, idle ``(K-1)/(M+K-1)``;
    - ``"local"``: the asynchronous local pipeline on ``K`` devices for ``T = steps``
      minibatches, filled once: ``(T + K - 1)(f + b + h) / T``, idle ``(K-1)/(T+K-1)``.

    The formulas hold for ``comm = 0``; the numbers come from
    :func:`parlearn.pipeline.simulate` of the schedules, so ``comm`` is counted too.
    ``speedup`` is the backprop time over each one's."""
    from parlearn.multi_device.pipeline import schedule, simulate

    blocks = check_int("blocks", blocks, lo=1)
    f = check_float("forward", forward, lo=0, lo_open=True)
    b = check_float("backward", backward, lo=0)
    h = check_float("head", head, lo=0)
    m = check_int("micro_batches", micro_batches, lo=1)
    steps = check_int("steps", steps, lo=1)
    comm = check_float("comm", comm, lo=0)
    out = {"backprop": {"step": blocks * (f + b), "idle": 0.0}}
    pipe = simulate(schedule("1f1b", blocks, m), f, b, comm=comm)
    out["pipelined"] = {"step": pipe.makespan / m, "idle": pipe.bubble}
    # Local: every op is one block's forward + local backward + update; nothing comes back.
    local = simulate(local_orders(blocks, steps), f + b + h, 0.0, comm=comm)
    out["local"] = {"step": local.makespan / steps, "idle": local.bubble}
    for v in out.values():
        v["speedup"] = out["backprop"]["step"] / v["step"]
    return out


# ---------------------------------------------------------------------------------------
# Bench: the asynchronous local pipeline vs pipelined backprop on the same ranks.

def bench(device: torch.device, quick: bool) -> list:
    """Rows for ``python -m parlearn.bench local``, on 2 real gloo ranks on the CPU
    (``device`` is not used: the ranks are CPU processes). One block per rank; the same
    blocks trained (1) by pipelined backprop, :func:`parlearn.pipeline.run_pipeline` 1F1B
    with ``M`` micro-batches per update (one launch, several steps; the first discarded)
    and (2) by :func:`run_local` over the same number of minibatches. Ratio = measured time
    per minibatch of pipelined backprop over local; the modeled ratio comes from
    :func:`cost_model` fed with the op costs measured in these runs (median F, B of the
    slowest rank; the head's cost is what the local op takes beyond them) and one message
    cost, fitted so that the simulated 1F1B step equals the measured one. The ratio is a
    ratio of medians, not of interleaved pairs: each local run is a launch of its own."""
    from parlearn.core.bench import Row
    from parlearn.core.timing import Timing
    from parlearn.multi_device.pipeline import run_pipeline, stage_op_costs

    del device
    repeat, m, width, batch = (3 if quick else 7), 4, 256, (64 if quick else 128)
    where = f"2 gloo ranks on CPU ({__import__('os').cpu_count()} cores)"
    net = make_net([width] * 5, 2, 10, seed=0)
    gen = torch.Generator().manual_seed(1)
    n = batch * m * repeat
    x = torch.randn(n, width, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (n,), generator=gen)
    onehot = F.one_hot(y[:batch * m], 10).to(torch.float64)
    seq = as_sequential(net)
    runs = run_pipeline("1f1b", seq, x[:batch * m], onehot, 2, [m] * (repeat + 1),
                        counts=[1, 1])[1:]
    spans = Timing(tuple((max(e[3] for e in r.events) - min(e[2] for e in r.events)) / m
                         for r in runs), where, threads=1)
    locals_ = [run_local(net, x, y, batch=batch, epochs=1, seed=s) for s in range(repeat + 1)][1:]
    local_t = Timing(tuple(r.makespan / (n // batch) for r in locals_), where, threads=1)
    local = sorted(locals_, key=lambda r: r.makespan)[len(locals_) // 2]
    t_local = local_t.median
    costs = stage_op_costs(runs[len(runs) // 2])
    f_, b_ = max(costs["F"]), max(costs["B"])
    # The local op (forward + head + backward + update) of the slowest rank, medians.
    local_op = max(sum(statistics.median(e[3] - e[2] for e in local.events
                                         if e[0] == f"rank {k}" and e[1][0] == kind)
                       for kind in "FB") for k in range(2))
    head = max(0.0, local_op - f_ - b_)
    # The model's free messages are not free here: fit one message cost so that the 1F1B
    # schedule, simulated with the measured op costs, takes the measured step (bisection).
    lo_c, hi_c = 0.0, spans.median * m
    for _ in range(40):
        comm = (lo_c + hi_c) / 2
        step = cost_model(2, f_, backward=b_, head=head, micro_batches=m, steps=1,
                          comm=comm)["pipelined"]["step"]
        lo_c, hi_c = (comm, hi_c) if step < spans.median else (lo_c, comm)
    model = cost_model(2, f_, backward=b_, head=head, micro_batches=m, steps=n // batch,
                       comm=comm)
    modeled = _ratio(model)
    free = _ratio(cost_model(2, f_, backward=b_, head=head, micro_batches=m, steps=n // batch))
    ratio = spans.median / t_local
    return [Row("local", f"pipelined backprop 1F1B (M={m}, flush per update)",
                "asynchronous local heads", ratio, where,
                target=f"modeled {modeled:.2f}x",
                detail=f"per minibatch of {batch}: pipelined {spans.median * 1e3:.2f} ms "
                       f"(spread {spans.spread:.2f}, "
                       f"{'reliable' if spans.reliable else 'UNRELIABLE (busy machine)'}), "
                       f"local {t_local * 1e3:.2f} ms (median of {repeat} launches of "
                       f"{n // batch} minibatches, spread {local_t.spread:.2f}, bubble "
                       f"{local.bubble:.2f}); ratio of medians, not interleaved (each local "
                       f"run is its own launch); modeled from measured op costs "
                       f"F {f_ * 1e3:.2f} ms, B {b_ * 1e3:.2f} ms, head {head * 1e3:.2f} ms "
                       f"and a message cost {comm * 1e3:.2f} ms fitted to the pipelined step "
                       f"(free messages would give {free:.2f}x); modeled local "
                       f"{model['local']['step'] * 1e3:.2f} ms vs measured {t_local * 1e3:.2f}"
                       f" ms per minibatch: the model overlaps every hand-over with compute, "
                       f"so a measured local step above it is hand-over latency (large on "
                       f"shared cores, under a millisecond on a quiet machine)")]


def _ratio(model: dict) -> float:
    return model["pipelined"]["step"] / model["local"]["step"]
