"""A convolution split along its positions (lesson 14), and the package's bench rows.

:class:`SpatialConv1d` is rank ``r``'s share of an ``nn.Conv1d`` whose input is split
along its length: the halo exchange of
:class:`~parlearn.multi_device.tensor_parallel.movements.RankHaloExchange` in front, the
weight replicated behind Megatron's ``f``
(:class:`~parlearn.multi_device.tensor_parallel.megatron.CopyToRanks`).
:func:`halo_conv_check` compares it on real ranks with the unsharded convolution
:func:`serial_conv`. :func:`bench` counts what the Megatron block, this convolution and
the planner's chosen tilings send, against the planner's cost model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parlearn.core.checks import (
    check_bool,
    check_device,
    check_float,
    check_int,
    check_module,
    check_seed,
)
from parlearn.multi_device.tensor_parallel.megatron import CopyToRanks, _chunk, megatron_check
from parlearn.multi_device.tensor_parallel.movements import RankHaloExchange
from parlearn.multi_device.tensor_parallel.plan import Conv, Dense, best_one_cut, plan_collectives
from parlearn.multi_device.tensor_parallel.plan_hlo import bytes_by_kind, hlo_collectives

__all__ = ["SpatialConv1d", "serial_conv", "halo_conv_worker", "halo_conv_check", "bench"]


# ---------------------------------------------------------------------------------------
# A convolution split along its positions: halo exchange in front, weight replicated.

class SpatialConv1d(nn.Module):
    """Rank ``rank``'s share of ``full`` (an ``nn.Conv1d`` with stride 1, odd kernel and
    "same" zero padding) for an input split along its length over ``world_size`` ranks:
    ``forward(x_block)`` exchanges ``(kernel - 1) / 2`` halo cells with the neighbours
    (:class:`RankHaloExchange`) and convolves without padding, giving this rank's block of
    ``full(x)``. The weight and bias are replicated, passed through ``f``
    (:class:`CopyToRanks`) so their gradients are summed over ranks, as data parallelism
    would: the spatial cut's two collectives are the halo and that all-reduce."""

    def __init__(self, full: nn.Conv1d, rank: int, world_size: int):
        super().__init__()
        check_module("full", full)
        if not isinstance(full, nn.Conv1d):
            raise TypeError(f"full must be an nn.Conv1d, got {type(full).__name__}")
        k = full.kernel_size[0]
        if (full.stride, full.dilation, full.groups, full.padding_mode) != ((1,), (1,), 1,
                                                                              "zeros") \
                or k % 2 == 0 or full.padding != ((k - 1) // 2,):
            raise ValueError("full must have stride 1, dilation 1, groups 1, an odd kernel "
                             "and padding (kernel - 1) / 2 with zeros")
        world_size = check_int("world_size", world_size, lo=1)
        check_int("rank", rank, lo=0, hi=world_size - 1)
        self.halo = (k - 1) // 2
        self.weight = nn.Parameter(full.weight.detach().clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.halo:
            x = RankHaloExchange.apply(x, self.halo)
        bias = None if self.bias is None else CopyToRanks.apply(self.bias)
        return F.conv1d(x, CopyToRanks.apply(self.weight), bias)


def serial_conv(c_in: int, c_out: int, kernel: int, seed: int | torch.Generator = 0,
                dtype: torch.dtype = torch.float64) -> nn.Conv1d:
    """The unsharded ``nn.Conv1d(c_in, c_out, kernel, padding=(kernel - 1) // 2)``,
    initialised from ``seed`` (its own generator; the global RNG is untouched)."""
    c_in, c_out = check_int("c_in", c_in, lo=1), check_int("c_out", c_out, lo=1)
    kernel = check_int("kernel", kernel, lo=1)
    if kernel % 2 == 0:
        raise ValueError(f"kernel must be odd (same padding), got {kernel}")
    seed = check_seed("seed", seed)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        conv = nn.Conv1d(c_in, c_out, kernel, padding=(kernel - 1) // 2).to(dtype)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) / (c_in * kernel) ** 0.5)
    return conv


def _conv_inputs(batch: int, c_in: int, c_out: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed + 11)
    x = torch.randn(batch, c_in, length, generator=g, dtype=torch.float64)
    w = torch.randn(batch, c_out, length, generator=g, dtype=torch.float64)  # loss weights
    return x, w


def halo_conv_worker(rank: int, world_size: int, batch: int, c_in: int, c_out: int,
                     length: int, kernel: int, seed: int = 0) -> dict:
    """Worker: :class:`SpatialConv1d` on this rank's block of the input's positions, on the
    loss ``<conv(x), w>`` (this rank's block of it). Returns CPU tensors: this rank's block
    of the output and of ``dx``, the (all-reduced) weight and bias gradients, and the
    ledger of the forward and backward collectives."""
    from parlearn.distributed import ledger

    world_size = check_int("world_size", world_size, lo=1)
    rank = check_int("rank", rank, lo=0, hi=world_size - 1)
    batch, c_in, c_out = (check_int(n, v, lo=1) for n, v in
                          (("batch", batch), ("c_in", c_in), ("c_out", c_out)))
    kernel, seed = check_int("kernel", kernel, lo=1), check_int("seed", seed, lo=0)
    length = check_int("length", length, lo=1)
    if length % world_size or length // world_size < (kernel - 1) // 2:
        raise ValueError(f"length {length} must split evenly over world_size={world_size} "
                         f"into blocks at least (kernel - 1) / 2 = {(kernel - 1) // 2} long")
    full = serial_conv(c_in, c_out, kernel, seed)
    x, w = _conv_inputs(batch, c_in, c_out, length, seed)
    part = _chunk(length, rank, world_size)
    conv = SpatialConv1d(full, rank, world_size)
    xs = x[..., part].clone().requires_grad_(True)
    with ledger() as fwd:
        y = conv(xs)
    with ledger() as bwd:
        (y * w[..., part]).sum().backward()
    return dict(y=y.detach(), dx=xs.grad, dw=conv.weight.grad, db=conv.bias.grad,
                ledger=dict(forward=fwd.summary(), backward=bwd.summary()))


def halo_conv_check(world_size: int, batch: int = 2, c_in: int = 3, c_out: int = 4,
                    length: int = 12, kernel: int = 3, seed: int = 0,
                    timeout: float = 30) -> dict:
    """Run :func:`halo_conv_worker` on ``world_size`` real ranks and compare with the
    unsharded convolution in this process. Returns ``{"y", "dx", "dw", "db"}``: the largest
    absolute difference of each (blocks joined in rank order; the weight and bias
    gradients of every rank), and ``"ledger"``: every rank's ledger summaries."""
    from parlearn.distributed import run

    batch, c_in, c_out = (check_int(n, v, lo=1) for n, v in
                          (("batch", batch), ("c_in", c_in), ("c_out", c_out)))
    kernel = check_int("kernel", kernel, lo=1)
    seed = check_int("seed", seed, lo=0)   # the ranks rebuild the conv from it: an int
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    world_size = check_int("world_size", world_size, lo=1)
    length = check_int("length", length, lo=1)
    if length % world_size or length // world_size < (kernel - 1) // 2:
        raise ValueError(f"length {length} must split evenly over world_size={world_size} "
                         f"into blocks at least (kernel - 1) / 2 = {(kernel - 1) // 2} long")
    full = serial_conv(c_in, c_out, kernel, seed)
    x, w = _conv_inputs(batch, c_in, c_out, length, seed)
    x = x.requires_grad_(True)
    y = full(x)
    (y * w).sum().backward()
    res = run(halo_conv_worker, world_size, args=(batch, c_in, c_out, length, kernel, seed),
              backend="gloo", timeout=timeout, deadline=4 * timeout)
    err = {"y": (torch.cat([r["y"] for r in res], -1) - y.detach()).abs().max().item(),
           "dx": (torch.cat([r["dx"] for r in res], -1) - x.grad).abs().max().item(),
           "dw": max((r["dw"] - full.weight.grad).abs().max().item() for r in res),
           "db": max((r["db"] - full.bias.grad).abs().max().item() for r in res)}
    return {**err, "ledger": [r["ledger"] for r in res]}


def bench(device: torch.device, quick: bool) -> list:
    """Rows for ``python -m parlearn.bench tensor_parallel``: communication counted against
    the cost model (``ratio`` = counted bytes / modeled bytes; 1.0 is agreement). Bytes do
    not depend on the device, so every row runs on the CPU whatever ``device`` is (the
    rows name where they ran): the Megatron block on 2 gloo ranks (payloads from
    :func:`parlearn.distributed.ledger`, forward plus backward), the spatially split convolution
    on 3 gloo ranks against the planner's spatial cut (:class:`Conv`), and the plan
    :func:`best_one_cut` picks for two networks on a JAX mesh of 8 fake CPU devices
    (payloads from the compiled HLO). No times are claimed."""
    from parlearn.core.bench import Row

    check_device("device", device)   # checked, then unused: see the docstring
    check_bool("quick", quick)
    rows = []
    b, d, h = (8, 16, 32) if quick else (32, 64, 256)
    res = megatron_check(2, batch=b, d_model=d, d_hidden=h)
    counted = sum(n for phase in res["ledger"].values() for _, n, _ in phase.values())
    modeled = sum(n for *_, n in Dense.collectives("column", (b, d, h), 8, True, 2)
                  + Dense.collectives("row", (b, h, d), 8, True, 2))
    rows.append(Row("tensor_parallel", "cost model: all-reduce |Y| fwd + |X| bwd",
                    "Megatron MLP from scratch, ledger bytes", counted / modeled,
                    "cpu (gloo, 2 ranks)",
                    target="counted = modeled", met=counted == modeled,
                    detail=f"float64 batch {b}, d {d}, hidden {h}: counted {counted} B, "
                           f"modeled {modeled} B; max error vs unsharded "
                           f"{max(res['scratch'], res['dtensor']):.1e}"))
    # The spatial cut on 3 ranks: rank 1 has two neighbours. The ledger counts what a rank
    # sends plus what it receives point to point; the planner ignores biases, so the bias
    # all-reduce is added to its figure.
    b, ci, co, n, k = (2, 3, 4, 12, 5) if quick else (8, 16, 32, 96, 5)
    res = halo_conv_check(3, batch=b, c_in=ci, c_out=co, length=n, kernel=k)
    led = res["ledger"][1]
    counted = (led["forward"]["batch_isend_irecv"][1] + led["backward"]["batch_isend_irecv"][1]
               ) // 2 + led["backward"]["all_reduce"][1]
    modeled = sum(x for *_, x in Conv(ci, co, n, k).collectives(
        "spatial", (b, ci, co, n // 3), 8, True, 3)) + co * 8
    rows.append(Row("tensor_parallel", "planner's spatial cut: 2 halos each way + |W| (+|b|)",
                    "conv split along positions (halo exchange), ledger bytes",
                    counted / modeled, "cpu (gloo, 3 ranks)",
                    target="counted = modeled", met=counted == modeled,
                    detail=f"float64 batch {b}, channels {ci}->{co}, length {n}, kernel {k}, "
                           f"rank 1: counted {counted} B of payload (halo sends + "
                           f"all-reduce), modeled {modeled} B; max error vs unsharded "
                           f"{max(res[q] for q in ('y', 'dx', 'dw', 'db')):.1e}"))
    nets = {"wide layers, small batch": (8, [256, 1024, 256]),
            "narrow layers, large batch": (512, [32, 64, 32])}
    plans = {name: best_one_cut(bt, w, 8)[0] for name, (bt, w) in nets.items()}
    for name, (bt, w) in nets.items():
        ops = hlo_collectives([plans[name]], bt, w)[0]
        predicted = bytes_by_kind(plan_collectives(plans[name], bt, w, 8))
        got, want = sum(bytes_by_kind(ops).values()), sum(predicted.values())
        rows.append(Row("tensor_parallel", "planner's predicted payload bytes",
                        f"{name}: plan {'/'.join(plans[name])}, XLA HLO bytes",
                        got / want, "JAX, 8 fake CPU devices",
                        target="counted = modeled", met=got == want,
                        detail=f"batch {bt}, widths {w}: HLO {bytes_by_kind(ops)}, "
                               f"predicted {predicted}"))
    return rows
