"""Megatron's layer API (parlearn.multi_device.tensor_parallel.layers) on 2 real gloo ranks.

Every layer's output and gradients equal the full nn.Linear / nn.Embedding /
F.cross_entropy built from the same seed, in float64 to 1e-12, and the column / row
layers equal DTensor's ColwiseParallel / RowwiseParallel through ``parallelize_module``.
One ``dist.run`` does every equality check; bad arguments fail on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ranks import assert_refused_on_every_rank

from parlearn import dist
from parlearn.multi_device import tensor_parallel as tp

T = 30
F64 = torch.float64
IN, OUT, BATCH, VOCAB, DIM = 6, 4, 3, 10, 3


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _full_linear(data_seed: int, seed: int) -> tuple:
    """``(x, w, full, xf)``: an input ``x``, weights ``w`` of the loss ``<full(x), w>``, the
    full layer from ``seed`` and the leaf ``xf``, both holding that loss's gradients."""
    g = torch.Generator().manual_seed(data_seed)
    x, w = torch.randn(BATCH, IN, generator=g, dtype=F64), torch.randn(BATCH, OUT, generator=g,
                                                                        dtype=F64)
    full = tp.serial_linear(IN, OUT, seed=seed, dtype=F64)
    xf = x.clone().requires_grad_(True)
    (full(xf) * w).sum().backward()
    return x, w, full, xf


def _dtensor(world: int, module: torch.nn.Module, style) -> torch.nn.Module:
    """``module`` split over a 1-D mesh of ``world`` CPU ranks by DTensor's ``style``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    return parallelize_module(module, init_device_mesh("cpu", (world,)), style)


def _column(rank: int, world: int, gather: bool) -> dict:
    x, w, full, xf = _full_linear(1, seed=3)
    part = slice(rank * OUT // world, (rank + 1) * OUT // world)

    layer = tp.MegatronColumnParallelLinear(IN, OUT, gather_output=gather, seed=3, dtype=F64)
    xs = x.clone().requires_grad_(True)
    y = layer(xs)
    # The loss is <full(x), w>: with gather_output every rank computes it whole; without,
    # each rank its columns' share (the sum over ranks is the loss).
    (y * (w if gather else w[:, part])).sum().backward()
    want_y = full(x) if gather else full(x)[:, part]
    out = {"y": _err(y, want_y), "dx": _err(xs.grad, xf.grad),
           "dw": _err(layer.weight.grad, full.weight.grad[part]),
           "db": _err(layer.bias.grad, full.bias.grad[part]),
           "init": _err(layer.weight, full.weight[part])}

    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel
    style = ColwiseParallel(output_layouts=Replicate()) if gather else ColwiseParallel()
    ref = _dtensor(world, tp.serial_linear(IN, OUT, seed=3, dtype=F64), style)
    xd = x.clone().requires_grad_(True)
    yd = ref(xd)
    (yd * (w if gather else w[:, part])).sum().backward()
    out.update(dt_y=_err(y, yd), dt_dx=_err(xs.grad, xd.grad),
               dt_dw=_err(layer.weight.grad, ref.weight.grad.to_local()),
               dt_db=_err(layer.bias.grad, ref.bias.grad.to_local()))
    return out


def _row(rank: int, world: int, parallel_in: bool) -> dict:
    x, w, full, xf = _full_linear(2, seed=4)
    part = slice(rank * IN // world, (rank + 1) * IN // world)

    layer = tp.MegatronRowParallelLinear(IN, OUT, input_is_parallel=parallel_in, seed=4,
                                         dtype=F64)
    xs = (x[:, part] if parallel_in else x).clone().requires_grad_(True)
    y = layer(xs)
    (y * w).sum().backward()
    out = {"y": _err(y, full(x)), "dx": _err(xs.grad, xf.grad[:, part] if parallel_in
                                                else xf.grad),
           "dw": _err(layer.weight.grad, full.weight.grad[:, part]),
           "db": _err(layer.bias.grad, full.bias.grad),
           "init": _err(layer.weight, full.weight[:, part])}

    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel
    style = RowwiseParallel() if parallel_in else RowwiseParallel(input_layouts=Replicate())
    ref = _dtensor(world, tp.serial_linear(IN, OUT, seed=4, dtype=F64), style)
    xd = (x[:, part] if parallel_in else x).clone().requires_grad_(True)
    yd = ref(xd)
    (yd * w).sum().backward()
    out.update(dt_y=_err(y, yd), dt_dx=_err(xs.grad, xd.grad),
               dt_dw=_err(layer.weight.grad, ref.weight.grad.to_local()),
               dt_db=_err(layer.bias.grad, ref.bias.grad.full_tensor()))
    return out


def _embedding(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (4, 5), generator=g)
    w = torch.randn(4, 5, DIM, generator=g, dtype=F64)
    full = tp.serial_embedding(VOCAB, DIM, seed=6, dtype=F64)
    (full(ids) * w).sum().backward()
    layer = tp.VocabParallelEmbedding(VOCAB, DIM, seed=6, dtype=F64)
    y = layer(ids)
    (y * w).sum().backward()
    rows = slice(rank * VOCAB // world, (rank + 1) * VOCAB // world)
    out = {"y": _err(y, full(ids)), "dw": _err(layer.weight.grad, full.weight.grad[rows]),
           "init": _err(layer.weight, full.weight[rows]),
           "both_halves_used": float(bool((ids < VOCAB // world).any()
                                          and (ids >= VOCAB // world).any()))}

    # DTensor's row-wise split of an nn.Embedding is the vocabulary-parallel embedding.
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel
    ref = _dtensor(world, tp.serial_embedding(VOCAB, DIM, seed=6, dtype=F64),
                   RowwiseParallel(input_layouts=Replicate()))
    yd = ref(ids)
    (yd * w).sum().backward()
    out.update(dt_y=_err(y, yd),
               dt_dw=_err(layer.weight.grad, ref.weight.grad.full_tensor()[rows]))
    return out


def _cross_entropy(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(7)
    out = {}
    for reduction, shape in (("mean", (6,)), ("sum", (6,)), ("none", (2, 3))):
        # Large logits: without the max shift exp() would overflow in float64.
        logits = 300 * torch.randn(*shape, VOCAB, generator=g, dtype=F64)
        target = torch.randint(0, VOCAB, shape, generator=g)
        w = torch.randn(shape, generator=g, dtype=F64) if reduction == "none" else 1.0
        cols = slice(rank * VOCAB // world, (rank + 1) * VOCAB // world)
        lf = logits.clone().requires_grad_(True)
        ref = F.cross_entropy(lf.flatten(0, -2), target.flatten(), reduction=reduction)
        ref = ref.reshape(shape) if reduction == "none" else ref
        (ref * w).sum().backward()
        ls = logits[..., cols].clone().requires_grad_(True)
        got = tp.vocab_parallel_cross_entropy(ls, target, reduction=reduction)
        (got * w).sum().backward()
        out[f"{reduction}_loss"] = _err(got, ref)
        out[f"{reduction}_grad"] = _err(ls.grad, lf.grad[..., cols])
        if reduction != "none":   # DTensor's loss_parallel on the same shards
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor, Shard
            from torch.distributed.tensor.parallel import loss_parallel
            mesh = init_device_mesh("cpu", (world,))
            ld = logits[..., cols].clone().requires_grad_(True)
            with loss_parallel():
                dl = F.cross_entropy(DTensor.from_local(ld, mesh, [Shard(-1)]), target,
                                     reduction=reduction)
                dl.backward()
            out[f"dt_{reduction}_loss"] = _err(got, dl.full_tensor())
            out[f"dt_{reduction}_grad"] = _err(ls.grad, ld.grad)
    return out


def _init_method(rank: int, world: int) -> dict:
    # Megatron's init_method acts on the full ("master") weight, drawn from the seed.
    init = torch.nn.init.xavier_normal_
    full = tp.serial_linear(IN, OUT, seed=9, dtype=F64, init_method=init)
    layers = (tp.MegatronColumnParallelLinear(IN, OUT, seed=9, dtype=F64, init_method=init),
              tp.MegatronRowParallelLinear(IN, OUT, seed=9, dtype=F64, init_method=init))
    cols = slice(rank * OUT // world, (rank + 1) * OUT // world)
    rows = slice(rank * IN // world, (rank + 1) * IN // world)
    default = tp.serial_linear(IN, OUT, seed=9, dtype=F64).weight
    return {"column": _err(layers[0].weight, full.weight[cols]),
            "row": _err(layers[1].weight, full.weight[:, rows]),
            "applied": float(_err(full.weight, default) < 1e-3)}   # must be 0: it changed


def _all_equalities(rank: int, world: int) -> dict:
    return {"init_method": _init_method(rank, world),
            "column": _column(rank, world, False), "column_gather": _column(rank, world, True),
            "row_parallel_in": _row(rank, world, True), "row_full_in": _row(rank, world, False),
            "embedding": _embedding(rank, world), "cross_entropy": _cross_entropy(rank, world)}


def test_megatron_layers_equal_the_full_layers_and_dtensor():
    res = dist.run(_all_equalities, 2, backend="gloo", timeout=T, deadline=4 * T)
    for rank, r in enumerate(res):
        for layer, errs in r.items():
            for key, err in errs.items():
                if key == "both_halves_used":
                    assert err == 1.0   # the ids fall on both ranks' rows
                elif key == "applied":
                    assert err == 0.0   # init_method changed the weight
                else:
                    assert err < 1e-12, (rank, layer, key, err)


def test_gather_from_ranks_backward_splits_and_split_to_ranks_forward_slices():
    # The weight gradient under gather_output=True is the full layer's, not N times it:
    # covered above; here the pair's own backward, on the loss sum(y * w).
    res = dist.run(_pair, 2, backend="gloo", timeout=T, deadline=4 * T)
    for r in res:
        assert r["gather_grad"] < 1e-12 and r["split_fwd"] == 0 and r["split_grad"] < 1e-12


def _pair(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(8)
    full = torch.randn(3, 4, generator=g, dtype=F64)
    w = torch.randn(3, 4, generator=g, dtype=F64)
    cols = slice(rank * 2, rank * 2 + 2)
    x = full[:, cols].clone().requires_grad_(True)
    (tp.GatherFromRanks.apply(x, None) * w).sum().backward()
    xf = full.clone().requires_grad_(True)
    s = tp.SplitToRanks.apply(xf, None)
    (s * w[:, cols]).sum().backward()
    return {"gather_grad": _err(x.grad, w[:, cols]), "split_fwd": _err(s, full[:, cols]),
            "split_grad": _err(xf.grad, w)}


# ---- refusals: on every rank, naming the argument, before the first message --------------

def _bad(rank: int, world: int, which: str) -> None:
    x = torch.zeros(2, IN, dtype=F64)
    if which == "out_features":
        tp.MegatronColumnParallelLinear(IN, 5, dtype=F64)
    elif which == "in_features":
        tp.MegatronRowParallelLinear(5, OUT, dtype=F64)
    elif which == "num_embeddings":
        tp.VocabParallelEmbedding(9, DIM, dtype=F64)
    elif which == "seed":   # ranks that would hold shards of different layers
        tp.MegatronColumnParallelLinear(IN, OUT, seed=rank, dtype=F64)
    elif which == "gather_output":
        tp.MegatronColumnParallelLinear(IN, OUT, gather_output=1, dtype=F64)
    elif which == "x":      # one rank's input is narrower
        layer = tp.MegatronColumnParallelLinear(IN, OUT, dtype=F64)
        layer(x if rank == 0 else x[:, :-1])
    elif which == "x.shape":
        layer = tp.MegatronRowParallelLinear(IN, OUT, input_is_parallel=False, dtype=F64)
        layer(x if rank == 0 else torch.zeros(3, IN, dtype=F64))
    elif which == "ids":    # one rank holds an id outside the vocabulary
        tp.VocabParallelEmbedding(VOCAB, DIM, dtype=F64)(torch.tensor([1, VOCAB * rank]))
    elif which == "target":
        tp.vocab_parallel_cross_entropy(torch.zeros(2, 5, dtype=F64),
                                        torch.tensor([0, 9 + rank]))
    elif which == "reduction":
        tp.vocab_parallel_cross_entropy(torch.zeros(2, 5, dtype=F64), torch.tensor([0, 1]),
                                        reduction="avg" if rank else "mean")
    elif which == "x.shape[-1]":
        tp.SplitToRanks.apply(torch.zeros(2, 3, dtype=F64), None)


@pytest.mark.parametrize("which", ["out_features", "in_features", "num_embeddings", "seed",
                                   "gather_output", "x", "x.shape", "ids", "target",
                                   "reduction", "x.shape[-1]"])
def test_bad_arguments_fail_on_every_rank_naming_them(which):
    assert_refused_on_every_rank(_bad, (which,), name=which)


def test_serial_references_leave_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b = tp.serial_linear(4, 6, seed=3), tp.serial_linear(4, 6, seed=3)
    e = tp.serial_embedding(5, 2, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    torch.manual_seed(3)   # "the same seed" means the torch default init after manual_seed
    assert torch.equal(torch.nn.Linear(4, 6).weight, a.weight)
    torch.manual_seed(1)
    assert torch.equal(torch.nn.Embedding(5, 2).weight, e.weight)


def test_layers_need_a_process_group():
    with pytest.raises(RuntimeError, match="process|group|distributed"):
        tp.MegatronColumnParallelLinear(IN, OUT)
    with pytest.raises(ValueError, match="in_features"):   # the argument first, even so
        tp.MegatronRowParallelLinear(0, OUT)


@pytest.mark.parametrize("world", [2, 4])
def test_lesson_check_equals_full_layers_and_shows_the_summing_gather(world):
    """megatron_layers_check (lesson 14): every layer, and causal attention split by heads,
    equal to the full one; SP's summing gather in place of Megatron's splitting one makes the
    weight gradient N times too large."""
    res = tp.megatron_layers_check(world)
    assert "attention, heads split" in res
    for layer, err in res.items():
        if layer != "wrong_ratio":
            assert err < 1e-12, (layer, err)
    assert res["wrong_ratio"] == pytest.approx([float(world)] * world, rel=1e-12)


def test_lesson_check_refuses_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        tp.megatron_layers_check(3)
    with pytest.raises(ValueError, match="seed"):
        tp.megatron_layers_check(2, seed=-1)
    assert_refused_on_every_rank(tp.megatron_layers_worker, (True,), name="seed")
