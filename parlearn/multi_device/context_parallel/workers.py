"""Workers the tests and lesson 17 run on real ranks, and the checks that compare them with
one process (full attention through autograd, float64).

:func:`attention_check` runs a scheme (``"ring"``, ``"ulysses"`` or ``"allgather"``) on
``world_size`` ranks on the loss ``<attention(q, k, v), w>`` and returns the largest error of
the output and of ``dq, dk, dv`` against :func:`full_attention`, with each rank's ledger, timeline
and causal work.
"""

from __future__ import annotations

import torch

from parlearn.core.checks import (
    check_bool,
    check_callable,
    check_choice,
    check_device,
    check_float,
    check_int,
)
from parlearn.multi_device.context_parallel.allgather import allgather_attention
from parlearn.multi_device.context_parallel.blocks import LAYOUTS, full_attention, shard_index
from parlearn.multi_device.context_parallel.ring import ring_attention
from parlearn.multi_device.context_parallel.ulysses import ulysses_attention

__all__ = ["SCHEMES", "saved_bytes", "attention_inputs", "attention_worker", "attention_check",
           "attention_checks", "layout_timing_worker",
           "layout_timing", "torch_cp_worker"]

SCHEMES = ("ring", "ulysses", "allgather")


def saved_bytes(fn, *args, **kwargs) -> tuple:
    """``(fn(*args, **kwargs), bytes)``: the bytes of the distinct storages autograd saved
    for backward during the call (what stays allocated until backward), parameters
    excluded."""
    check_callable("fn", fn)
    seen: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return out, sum(seen.values())


def attention_inputs(seq: int, batch: int = 1, heads: int = 2, head_dim: int = 4,
                     seed: int = 0, dtype: torch.dtype = torch.float64):
    """``q, k, v`` and the loss weight ``w``, each ``(batch, heads, seq, head_dim)``, from a
    private generator (the global RNG is not touched)."""
    seq, batch, heads, head_dim = (check_int(n, v, lo=1) for n, v in (
        ("seq", seq), ("batch", batch), ("heads", heads), ("head_dim", head_dim)))
    seed = check_int("seed", seed, lo=0)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, seq, head_dim, generator=gen, dtype=dtype)
                 for _ in range(4))


def attention_worker(rank: int, world_size: int, scheme: str, seq: int, batch: int,
                     heads: int, head_dim: int, causal: bool, layout: str, seed: int,
                     repeat: int = 1) -> dict:
    """Worker: this rank's shard through ``scheme``, forward and backward, ``repeat`` times
    (the last run's timeline is kept). Returns its output rows and gradient shards (CPU),
    ledger summaries of forward and backward, the timeline (ring only) and the bytes
    autograd saved for backward in forward (:func:`saved_bytes`)."""
    from parlearn.distributed import ledger

    check_choice("scheme", scheme, SCHEMES)
    world_size = check_int("world_size", world_size, lo=1)
    rank = check_int("rank", rank, lo=0, hi=world_size - 1)
    seq = check_int("seq", seq, lo=1)
    causal = check_bool("causal", causal)
    check_choice("layout", layout, LAYOUTS)
    repeat = check_int("repeat", repeat, lo=1)
    idx = shard_index(seq, world_size, rank, layout)   # checks seq against the layout
    q, k, v, w = (t[..., idx, :].clone() for t in
                  attention_inputs(seq, batch, heads, head_dim, seed))
    for _ in range(repeat):
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        timeline: list = []
        with ledger() as fwd:
            if scheme == "ring":
                o, saved = saved_bytes(ring_attention, qs, ks, vs, seq=seq, layout=layout,
                                       causal=causal, timeline=timeline)
            else:
                fn = ulysses_attention if scheme == "ulysses" else allgather_attention
                o, saved = saved_bytes(fn, qs, ks, vs, seq=seq, layout=layout, causal=causal)
        with ledger() as bwd:
            (o * w).sum().backward()
    return dict(idx=idx, o=o.detach(), dq=qs.grad, dk=ks.grad, dv=vs.grad,
                forward=fwd.summary(), backward=bwd.summary(), timeline=timeline,
                saved=saved)


def attention_check(scheme: str, world_size: int, seq: int, *, batch: int = 1, heads: int = 2,
                    head_dim: int = 4, causal: bool = False, layout: str = "contiguous",
                    seed: int = 0, repeat: int = 1, timeout: float = 30) -> dict:
    """Run :func:`attention_worker` on ``world_size`` real ranks; compare with full
    attention in this process. Returns ``{"o", "dq", "dk", "dv"}`` (largest absolute
    errors over all ranks), ``"ranks"`` (each rank's raw result) and ``"saved_full"``
    (bytes full attention saves for backward in one process)."""
    case = dict(scheme=scheme, seq=seq, batch=batch, heads=heads, head_dim=head_dim,
                causal=causal, layout=layout, seed=seed, repeat=repeat)
    return attention_checks(world_size, [case], timeout=timeout)[0]


_CASE_KEYS = ("scheme", "seq", "batch", "heads", "head_dim", "causal", "layout", "seed",
              "repeat")


def _check_case(case, world_size: int, i: int) -> dict:
    """Case ``i`` of :func:`attention_checks`: every argument checked (the error names
    ``cases[i]``), defaults filled in."""
    try:
        return _fill_case(case, world_size)
    except (TypeError, ValueError) as err:
        raise type(err)(f"cases[{i}]: {err}") from None


def _fill_case(case, world_size: int) -> dict:
    if not isinstance(case, dict):
        raise TypeError(f"cases must hold dicts, got {case!r}")
    unknown = set(case) - set(_CASE_KEYS)
    if unknown or "scheme" not in case or "seq" not in case:
        raise ValueError(f"each case needs 'scheme' and 'seq' and may set "
                         f"{_CASE_KEYS[2:]}, got keys {sorted(case)}")
    c = dict(batch=1, heads=2, head_dim=4, causal=False, layout="contiguous", seed=0,
             repeat=1) | case
    check_choice("scheme", c["scheme"], SCHEMES)
    check_int("seq", c["seq"], lo=1)
    check_bool("causal", c["causal"])
    check_choice("layout", c["layout"], LAYOUTS)
    check_int("repeat", c["repeat"], lo=1)
    attention_inputs(c["seq"], c["batch"], c["heads"], c["head_dim"], c["seed"])  # sizes
    for r in range(world_size):
        shard_index(c["seq"], world_size, r, c["layout"])   # seq against the layout
    return c


def _attention_case(rank: int, world_size: int, case: dict) -> dict:
    # run_many passes each case as one positional dict
    return attention_worker(rank, world_size, **case)


def attention_checks(world_size: int, cases: list, *, timeout: float = 60) -> list:
    """:func:`attention_check` for many cases on the same ranks, launched once: starting
    ``world_size`` processes costs seconds, a small case milliseconds. ``cases``: a
    non-empty list of dicts with ``scheme`` and ``seq`` and, optionally, attention_check's
    ``batch, heads, head_dim, causal, layout, seed, repeat``; every case is checked before
    the ranks start. Returns one attention_check result per case, in order."""
    from parlearn.distributed import run_many

    world_size = check_int("world_size", world_size, lo=1)
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    if not isinstance(cases, list) or not cases:
        raise TypeError(f"cases must be a non-empty list of dicts, got {cases!r}")
    cases = [_check_case(c, world_size, i) for i, c in enumerate(cases)]
    refs = []
    for c in cases:
        q, k, v, w = attention_inputs(c["seq"], c["batch"], c["heads"], c["head_dim"],
                                      c["seed"])
        q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
        ref, saved = saved_bytes(full_attention, q, k, v, c["causal"])
        (ref * w).sum().backward()
        refs.append((dict(o=ref.detach(), dq=q.grad, dk=k.grad, dv=v.grad), saved))
    per_case = run_many(_attention_case, world_size, [(c,) for c in cases], timeout=timeout)
    out = []
    for (want, saved), ranks in zip(refs, per_case, strict=True):
        errors = {name: max(float((r[name] - want[name][..., r["idx"], :]).abs().max())
                            for r in ranks) for name in want}
        out.append({**errors, "ranks": ranks, "saved_full": saved})
    return out


def layout_timing_worker(rank: int, world_size: int, seq: int, heads: int, head_dim: int,
                         repeat: int) -> dict:
    """Worker: causal ring attention's forward, ``repeat`` rounds, each round running every
    layout of :data:`LAYOUTS` once in turn (interleaved, so a slow spell of the machine
    falls on both layouts alike). Returns ``{layout: [forward compute seconds per
    round]}`` for this rank, from the ring's own timeline."""
    from parlearn.multi_device.context_parallel.cost import timeline_summary

    world_size = check_int("world_size", world_size, lo=2)
    rank = check_int("rank", rank, lo=0, hi=world_size - 1)
    repeat = check_int("repeat", repeat, lo=1)
    inputs = attention_inputs(seq, 1, heads, head_dim)       # checks the sizes
    shards = {lay: [t[..., shard_index(seq, world_size, rank, lay), :].contiguous()
                    for t in inputs[:3]] for lay in LAYOUTS}
    out: dict = {lay: [] for lay in LAYOUTS}
    with torch.no_grad():
        for _ in range(repeat):
            for lay in LAYOUTS:
                timeline: list = []
                ring_attention(*shards[lay], seq=seq, layout=lay, causal=True,
                               timeline=timeline)
                out[lay].append(timeline_summary(timeline)["fwd compute"])
    return out


def layout_timing(world_size: int, seq: int, *, heads: int = 4, head_dim: int = 16,
                  repeat: int = 5, timeout: float = 60) -> dict:
    """Run :func:`layout_timing_worker` on ``world_size`` ranks: ``{layout: [[seconds per
    round] per rank]}``, the contiguous and zig-zag forwards timed in one launch,
    interleaved round by round."""
    from parlearn.distributed import run

    world_size = check_int("world_size", world_size, lo=2)
    seq = check_int("seq", seq, lo=2 * world_size)
    check_int("heads", heads, lo=1)
    check_int("head_dim", head_dim, lo=1)
    repeat = check_int("repeat", repeat, lo=1)
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    ranks = run(layout_timing_worker, world_size, timeout=timeout,
                args=(seq, heads, head_dim, repeat))
    return {lay: [r[lay] for r in ranks] for lay in LAYOUTS}


def torch_cp_worker(rank: int, world_size: int, device: str = "cpu") -> float:
    """Worker: torch's own ``torch.distributed.tensor.experimental.context_parallel`` on
    causal SDPA (float32), against SDPA on the whole sequence in this rank. torch shards
    the buffers with its default load balancer, the zig-zag layout (rank ``r`` gets chunks
    ``r`` and ``2N-1-r``). Returns the largest error of this rank's output rows. In torch
    2.13 it runs only where SDPA has a CUDA kernel: on CPU the attention op raises
    "does not have a sharding strategy"."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    world_size = check_int("world_size", world_size, lo=1)
    rank = check_int("rank", rank, lo=0, hi=world_size - 1)
    device = check_device("device", device)
    mesh = init_device_mesh(device.type, (world_size,))
    q, k, v, _ = (t.to(device) for t in attention_inputs(8 * world_size, heads=2,
                                                          head_dim=8, dtype=torch.float32))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    bufs = [q.clone(), k.clone(), v.clone()]
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
        out = F.scaled_dot_product_attention(*bufs, is_causal=True)
    chunks = ref.chunk(2 * world_size, dim=2)
    want = torch.cat((chunks[rank], chunks[2 * world_size - 1 - rank]), dim=2)
    return float((out - want).abs().max())
