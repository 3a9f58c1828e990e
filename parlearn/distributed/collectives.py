"""Collectives written from send/recv, and the workers lesson 10 runs on real ranks.

Ring all-reduce (Patarasuk & Yuan 2009; the schedule NCCL and gloo use for large
messages) on ``N`` ranks cuts the tensor into ``N`` chunks and passes chunks around the
ring ``rank -> rank + 1`` for ``2(N-1)`` steps:

- reduce-scatter phase, ``N-1`` steps: at step ``s`` rank ``r`` sends chunk
  ``(r-s-1) mod N`` to its right and adds the chunk ``(r-s-2) mod N`` arriving from its
  left into its own copy. Each chunk travels once round the ring collecting a term from
  every rank, so after ``N-1`` steps rank ``r`` holds the full sum of chunk ``r``;
- all-gather phase, ``N-1`` steps: at step ``s`` rank ``r`` sends chunk ``(r-s) mod N``
  (complete) and overwrites chunk ``(r-s-1) mod N`` with the one arriving.

Every step each rank sends one chunk (``n/N`` bytes), so each sends ``2(N-1)/N n`` bytes
in all, whatever ``N`` is: this is why the ring is bandwidth-optimal, and why all-reduce
is a reduce-scatter followed by an all-gather. Sizes not divisible by ``N`` use
``torch.tensor_split`` chunks (the first ``numel % N`` chunks one element longer).

Every function here is a worker-side call (inside :func:`parlearn.distributed.run` or under
``torchrun``) on the default process group; the serial reference of an all-reduce is the
sum of the ranks' tensors, which the tests and the lesson compute in the caller.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as tdist

from parlearn.core.checks import check_choice, check_int, check_tensor
from parlearn.distributed.launch import device_for
from parlearn.distributed.traffic import ledger

__all__ = ["ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "hello", "rank_tensor",
           "ring_vs_torch", "ring_check", "ring_trace", "ring_ledger", "collectives_demo",
           "plot_collectives", "plot_hierarchical", "time_collectives", "ring_vs_gloo_times",
           "TIMED_KINDS", "REDUCING"]


def _sequence(name: str, value) -> list:
    """A non-empty list of ``value``'s items; a string or a lone number is refused."""
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a sequence, got {value!r}")
    value = list(value)
    if not value:
        raise ValueError(f"{name} must not be empty")
    return value


def _exchange(send: torch.Tensor, to: int, recv: torch.Tensor, frm: int) -> None:
    """Send ``send`` to rank ``to`` while receiving ``recv`` from rank ``frm``.
    The send is posted first and asynchronously: with blocking sends every rank would
    wait for its right neighbour to receive, and the ring would deadlock."""
    req = tdist.isend(send, to)
    tdist.recv(recv, frm)
    req.wait()


_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(like: torch.Tensor) -> torch.Tensor:
    """A receive buffer of ``like``'s size, dtype and device, kept between calls (one per
    dtype and device in this process, grown to the largest chunk seen). A fresh buffer
    per call cost as much as the transfer at 64 MiB: the OS hands new pages over one
    fault at a time (lesson 10, section 6, measures it), which gloo avoids the same way.
    Shared, so one ring at a time per process (as the workers here run them)."""
    key = (like.dtype, like.device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < like.numel():
        buf = _SCRATCH[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
    return buf[:like.numel()]


def _reduce_scatter_phase(chunks: list[torch.Tensor], rank: int, n: int,
                          log: list | None) -> None:
    right, left = (rank + 1) % n, (rank - 1) % n
    buf = _scratch(chunks[0])  # chunk 0 is the longest
    for step in range(n - 1):
        out, into = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = buf[:chunks[into].numel()]
        _exchange(chunks[out], right, incoming, left)
        chunks[into] += incoming
        if log is not None:
            log.append(("reduce-scatter", step, out, right, into, left))


def _all_gather_phase(chunks: list[torch.Tensor], rank: int, n: int,
                      log: list | None) -> None:
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        out, into = (rank - step) % n, (rank - step - 1) % n
        _exchange(chunks[out], right, chunks[into], left)
        if log is not None:
            log.append(("all-gather", step, out, right, into, left))


def _flat_chunks(tensor: torch.Tensor, n: int) -> list[torch.Tensor]:
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous (the chunks are views of it)")
    return list(tensor.view(-1).tensor_split(n))


def ring_all_reduce(tensor: torch.Tensor, *, log: list | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place by the ring (module docstring): the
    reduce-scatter phase, then the all-gather phase, ``2(N-1)`` steps of send/recv.
    Returns ``tensor``. ``log``, when a list, receives one tuple per step:
    ``(phase, step, chunk sent, to rank, chunk received, from rank)``."""
    check_tensor("tensor", tensor)
    n, rank = tdist.get_world_size(), tdist.get_rank()
    chunks = _flat_chunks(tensor, n)
    _reduce_scatter_phase(chunks, rank, n, log)
    _all_gather_phase(chunks, rank, n, log)
    return tensor


def ring_reduce_scatter(tensor: torch.Tensor, *, log: list | None = None) -> torch.Tensor:
    """Chunk ``rank`` (of ``tensor.view(-1).tensor_split(N)``) of the sum over ranks, by the
    ring's first phase; ``tensor`` is left unchanged. Equals ``reduce_scatter`` of the
    same chunks."""
    check_tensor("tensor", tensor)
    n, rank = tdist.get_world_size(), tdist.get_rank()
    chunks = _flat_chunks(tensor.clone(), n)
    _reduce_scatter_phase(chunks, rank, n, log)
    return chunks[rank]


def ring_all_gather(tensor: torch.Tensor, *, log: list | None = None) -> torch.Tensor:
    """The ranks' ``tensor`` (same shape on every rank) concatenated along a new first
    dimension in rank order, by the ring's second phase. Equals ``all_gather_into_tensor``."""
    check_tensor("tensor", tensor)
    n, rank = tdist.get_world_size(), tdist.get_rank()
    out = torch.empty((n, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    out[rank] = tensor
    _all_gather_phase(list(out.view(n, -1)), rank, n, log)
    return out


# ---------------------------------------------------------------------------------------
# Workers: called as fn(rank, world_size, *args) by parlearn.distributed.run or torchrun.

def hello(rank: int, world_size: int) -> tuple[int, int, str]:
    """Worker: ``(rank, world_size, backend)`` as the process group sees them."""
    return tdist.get_rank(), tdist.get_world_size(), tdist.get_backend()


def rank_tensor(rank: int, numel: int, seed: int = 0,
                dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The test input of ``rank``: standard normals from its own generator, so the caller
    can rebuild every rank's input and compute the serial reference."""
    rank = check_int("rank", rank, lo=0)
    numel = check_int("numel", numel, lo=0)
    seed = check_int("seed", seed, lo=0)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    g = torch.Generator().manual_seed(seed * 100_003 + rank)
    return torch.randn(numel, generator=g, dtype=dtype)


def ring_vs_torch(rank: int, world_size: int, numel: int, seed: int = 0) -> dict:
    """Worker: ring all-reduce, reduce-scatter and all-gather from send/recv beside
    ``torch.distributed``'s own, on this rank's :func:`rank_tensor`. Returns CPU tensors."""
    numel = check_int("numel", numel, lo=1)
    seed = check_int("seed", seed, lo=0)
    dev = device_for(rank)
    x = rank_tensor(rank, numel, seed).to(dev)
    ring = ring_all_reduce(x.clone())
    ref = x.clone()
    tdist.all_reduce(ref)
    chunks = list(x.tensor_split(world_size))
    ring_rs = ring_reduce_scatter(x)
    ref_rs = torch.empty_like(chunks[rank])
    # reduce_scatter (list form) accepts the uneven chunks that tensor_split makes.
    tdist.reduce_scatter(ref_rs, [c.clone() for c in chunks])
    piece = x[: numel // world_size].clone()
    ring_ag = ring_all_gather(piece)
    ref_ag = torch.empty_like(ring_ag)
    tdist.all_gather(list(ref_ag), piece)
    return {k: v.cpu() for k, v in dict(ring=ring, ref=ref, ring_rs=ring_rs, ref_rs=ref_rs,
                                          ring_ag=ring_ag, ref_ag=ref_ag).items()}


def ring_check(rank: int, world_size: int, numel: int = 1000) -> dict:
    """Worker (the ``torchrun`` demo): ring all-reduce vs ``all_reduce`` of ``numel``
    float64 values; returns the largest difference and the bytes this rank sent."""

    numel = check_int("numel", numel, lo=1)
    with ledger() as led:
        out = ring_vs_torch(rank, world_size, numel)
    return {"max_abs_diff": float((out["ring"] - out["ref"]).abs().max()),
            "ring_bytes_sent": led.bytes("isend"), "all_reduce_payload": led.bytes("all_reduce")}


def ring_trace(rank: int, world_size: int, numel: int) -> list[tuple]:
    """Worker: the step log of :func:`ring_all_reduce` of ``numel`` values on this rank."""
    log: list = []
    ring_all_reduce(torch.zeros(check_int("numel", numel, lo=1)), log=log)
    return log


def ring_ledger(rank: int, world_size: int, numel: int) -> dict[str, int]:
    """Worker: bytes this rank sends and receives in :func:`ring_all_reduce` of ``numel``
    float32 values, as the ledger counts them, beside the payload ``all_reduce`` would see."""

    x = torch.ones(check_int("numel", numel, lo=1))
    with ledger() as led:
        ring_all_reduce(x)
    return {"sent": led.bytes("isend"), "received": led.bytes("recv"),
            "payload": x.numel() * x.element_size()}


def collectives_demo(rank: int, world_size: int, per_rank: int = 2) -> dict:
    """Worker: each collective applied to small integer tensors whose entries say where
    they started (rank ``r`` holds ``10 r + 1, 10 r + 2, ...``). Returns
    ``{collective: (before, after)}`` of this rank, CPU int64 tensors."""
    n, k = world_size, check_int("per_rank", per_rank, lo=1)
    if n * k > 9:
        raise ValueError(f"per_rank * world_size must be <= 9 so a value's tens digit names "
                         f"its rank, got {k} * {n}")

    def mine() -> torch.Tensor:
        return torch.arange(1, n * k + 1, dtype=torch.int64) + 10 * rank

    out = {}
    x = mine()
    before = x.clone()
    tdist.broadcast(x, src=0)
    out["broadcast"] = (before, x)
    x = mine()
    before = x.clone()
    tdist.reduce(x, dst=0)
    if rank != 0:
        # Only the destination's result is defined; the others keep unspecified partials.
        x = torch.zeros_like(x)
    out["reduce"] = (before, x)
    x = mine()
    before = x.clone()
    tdist.all_reduce(x)
    out["all_reduce"] = (before, x)
    x = mine()
    y = torch.empty(k, dtype=torch.int64)
    tdist.reduce_scatter(y, list(x.clone().chunk(n)))
    out["reduce_scatter"] = (x, y)
    x = mine()[:k]
    y = torch.empty(n * k, dtype=torch.int64)
    tdist.all_gather(list(y.chunk(n)), x)
    out["all_gather"] = (x, y)
    x = mine()
    y = torch.empty_like(x)
    tdist.all_to_all_single(y, x)
    out["all_to_all"] = (x, y)
    return out


# Collectives whose outputs are sums (drawn in one colour) rather than moved data.
REDUCING = ("reduce", "all_reduce", "reduce_scatter")


def plot_collectives(demo: list[dict], axes, kinds: tuple[str, ...] | None = None) -> None:
    """Draw :func:`collectives_demo`'s results: for each collective (a row of ``axes``) the
    data on every rank before (left) and after (right). A cell's colour is the rank its
    value came from; sums are grey; blank cells hold nothing."""
    import matplotlib.pyplot as plt
    import numpy as np

    kinds = tuple(demo[0]) if kinds is None else kinds
    n = len(demo)
    colours = plt.get_cmap("tab10")
    width = max(max(t.numel() for t in demo[r][k]) for r in range(n) for k in kinds)
    for row, kind in enumerate(kinds):
        for col, when in enumerate(("before", "after")):
            ax = axes[row][col]
            img = np.ones((n, width, 3))
            for r in range(n):
                values = demo[r][kind][col]
                for j, v in enumerate(values.tolist()):
                    summed = when == "after" and kind in REDUCING
                    if summed and kind == "reduce" and r != 0:
                        continue  # only the destination holds the result
                    img[r, j] = (0.75,) * 3 if summed else colours((v - 1) // 10)[:3]
                    ax.text(j, r, str(v), ha="center", va="center", fontsize=7)
            ax.imshow(img, aspect="auto")
            ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=7)
            ax.set_xticks([])
            ax.set_title(f"{kind}: {when}", fontsize=8)


def plot_hierarchical(axes, nodes: int = 2, gpus_per_node: int = 4) -> None:
    """Draw the three phases of a hierarchical all-reduce (``cost.hierarchical_all_reduce_time``)
    on three ``axes``: a ring reduce-scatter inside each node (blue arrows, fast links), the
    all-reduce of each GPU's ``1/G`` share across nodes between GPUs of the same local index
    (one colour per index, the network), and a ring all-gather inside each node. A diagram,
    nothing is measured."""
    import matplotlib.pyplot as plt

    m = check_int("nodes", nodes, lo=2, hi=8)
    g = check_int("gpus_per_node", gpus_per_node, lo=2, hi=8)
    if len(axes) != 3:
        raise ValueError(f"axes must hold 3 axes (one per phase), got {len(axes)}")
    colours = plt.get_cmap("tab10")
    titles = (f"1. reduce-scatter inside each node\n(each GPU keeps 1/{g} of its node's sum)",
              f"2. all-reduce across nodes, per local index\n({g} rings of n/{g} bytes, "
              "one per NIC)", "3. all-gather inside each node\n(every GPU gets all n bytes)")
    for phase, (ax, title) in enumerate(zip(axes, titles, strict=True), start=1):
        for node in range(m):
            y = m - 1 - node
            ax.add_patch(plt.Rectangle((-0.45, y - 0.3), g - 0.1, 0.6, fill=False, lw=0.8,
                                       ec="gray"))
            ax.text(-0.55, y, f"node {node}", ha="right", va="center", fontsize=7)
            for j in range(g):
                ax.plot(j, y, "o", ms=11, color=colours(j), zorder=3)
                ax.text(j, y, str(node * g + j), ha="center", va="center", fontsize=6,
                        color="white", zorder=4)
                if phase != 2:      # ring inside the node: j -> j+1, the last one back to 0
                    nxt = (j + 1) % g
                    ax.annotate("", (nxt, y + (0.18 if nxt == 0 else 0)),
                                (j, y + (0.18 if nxt == 0 else 0)),
                                arrowprops=dict(arrowstyle="->", color="C0", lw=1,
                                                connectionstyle="arc3,rad=0.35" if nxt == 0
                                                else "arc3"))
                elif node < m - 1:  # across nodes, same local index
                    ax.annotate("", (j, y - 1 + 0.15), (j, y - 0.15),
                                arrowprops=dict(arrowstyle="<->", color=colours(j), lw=1.2))
        ax.set_xlim(-1.6, g)
        ax.set_ylim(-0.6, m - 0.4)
        ax.set_title(title, fontsize=8)
        ax.axis("off")


TIMED_KINDS = ("all_reduce", "ring_all_reduce", "send", "all_gather", "reduce_scatter",
               "all_to_all")
# The kinds whose payload is cut into world_size equal chunks: sizes must divide evenly.
_CHUNKED = ("all_gather", "reduce_scatter", "all_to_all")


def _timed_once(kind: str, x: torch.Tensor, rank: int, out: torch.Tensor) -> float:
    tdist.barrier()
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    t0 = time.perf_counter()
    if kind == "all_reduce":
        tdist.all_reduce(x)
    elif kind == "all_gather":  # payload = the gathered output, as the ledger counts it
        tdist.all_gather_single(out, x[: x.numel() // tdist.get_world_size()])
    elif kind == "reduce_scatter":  # payload = the input
        tdist.reduce_scatter_single(out[: x.numel() // tdist.get_world_size()], x)
    elif kind == "all_to_all":
        tdist.all_to_all_single(out, x)
    elif kind == "ring_all_reduce":
        ring_all_reduce(x)
    elif rank == 0:  # send: a round trip 0 -> 1 -> 0, halved; other ranks idle
        tdist.send(x, 1)
        tdist.recv(x, 1)
    elif rank == 1:
        tdist.recv(x, 0)
        tdist.send(x, 0)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    elapsed = time.perf_counter() - t0
    x.fill_(1.0)  # repeated sums would grow to inf, which can change the speed
    return elapsed / 2 if kind == "send" else elapsed


def time_collectives(rank: int, world_size: int, kinds: tuple[str, ...], sizes: tuple[int, ...],
                     repeat: int = 5, warmup: int = 1) -> dict[str, dict[int, list[float]]]:
    """Worker: seconds of each of ``kinds`` at each payload size in bytes (float32, rounded
    down to whole elements), ``warmup`` untimed then ``repeat`` timed rounds, the kinds
    interleaved within a round; every call starts after a barrier. ``"send"`` is a round
    trip rank 0 -> 1 -> 0, halved. The payload of ``all_gather`` is its gathered output, of
    ``reduce_scatter`` and ``all_to_all`` their input (as :func:`parlearn.distributed.ledger` counts
    them); for these three the elements must divide by ``world_size``.
    Returns ``{kind: {bytes: [seconds]}}`` of this rank."""
    kinds, sizes = _sequence("kinds", kinds), _sequence("sizes", sizes)
    sizes = [check_int("sizes", nbytes, lo=4) for nbytes in sizes]
    repeat, warmup = check_int("repeat", repeat, lo=1), check_int("warmup", warmup, lo=0)
    for kind in kinds:
        check_choice("kinds", kind, TIMED_KINDS)
    if any(k in _CHUNKED for k in kinds):
        for nbytes in sizes:
            if (nbytes // 4) % world_size:
                raise ValueError(f"sizes: {nbytes} bytes is not a whole number of float32 "
                                 f"chunks per rank for {world_size} ranks (all_gather, "
                                 f"reduce_scatter, all_to_all); use multiples of "
                                 f"{4 * world_size}")
    dev = device_for(rank)
    out: dict[str, dict[int, list[float]]] = {k: {} for k in kinds}
    for nbytes in sizes:
        x = torch.ones(max(nbytes // 4, 1), device=dev)
        # A separate output buffer, allocated once per size so no repeat times an allocation.
        y = torch.empty_like(x)
        for i in range(warmup + repeat):
            for kind in kinds:
                t = _timed_once(kind, x, rank, y)
                if i >= warmup:
                    out[kind].setdefault(x.numel() * 4, []).append(t)
    return out


def ring_vs_gloo_times(rank: int, world_size: int, sizes: tuple[int, ...], repeat: int,
                       warmup: int = 1, seed: int = 0) -> dict:
    """Worker: ``torch.distributed.all_reduce`` and :func:`ring_all_reduce` of the same
    float32 tensor at each payload size in bytes, alternated within every repeat (which one
    goes first swaps from repeat to repeat, so neither always follows the other), a barrier
    before each call; ``warmup`` untimed rounds first.

    Before timing, both all-reduce this rank's :func:`rank_tensor` (float32) and the largest
    difference of the two results is kept, beside the largest absolute value of the sum.
    Returns ``{"all_reduce": {bytes: [s]}, "ring_all_reduce": {bytes: [s]},
    "max_diff": {bytes: float}, "max_abs": {bytes: float}, "torch_threads": int,
    "os_threads": int}``: ``torch_threads`` is this rank's intra-op thread count, and
    ``os_threads`` the threads of the whole process (gloo's included) once both ran."""
    sizes = [check_int("sizes", nbytes, lo=4) for nbytes in _sequence("sizes", sizes)]
    repeat, warmup = check_int("repeat", repeat, lo=1), check_int("warmup", warmup, lo=0)
    seed = check_int("seed", seed, lo=0)
    dev = device_for(rank)
    out: dict = {"all_reduce": {}, "ring_all_reduce": {}, "max_diff": {}, "max_abs": {}}
    for nbytes in sizes:
        numel = nbytes // 4
        x = rank_tensor(rank, numel, seed, torch.float32).to(dev)
        theirs, ours = x.clone(), x.clone()
        tdist.all_reduce(theirs)
        ring_all_reduce(ours)
        out["max_diff"][numel * 4] = float((theirs - ours).abs().max())
        out["max_abs"][numel * 4] = float(theirs.abs().max())
        x = torch.ones(numel, device=dev)
        for i in range(warmup + repeat):
            order = ("all_reduce", "ring_all_reduce")[:: 1 if i % 2 == 0 else -1]
            for kind in order:
                t = _timed_once(kind, x, rank, x)
                if i >= warmup:
                    out[kind].setdefault(numel * 4, []).append(t)
    out["torch_threads"] = torch.get_num_threads()
    # /proc lists one entry per thread of this process (Linux); elsewhere count none.
    task = f"/proc/{os.getpid()}/task"
    out["os_threads"] = len(os.listdir(task)) if os.path.isdir(task) else 0
    return out
