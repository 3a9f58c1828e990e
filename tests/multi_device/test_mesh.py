"""The GPT on an n-D mesh equals one process; the mesh's layout and bad input."""

from __future__ import annotations

import pytest
from parlearn.transformer import GPTConfig

from parlearn.multi_device.mesh import MeshShape, check_plan, mesh_check

CFG = GPTConfig(d_model=16, n_heads=4, n_layers=4, max_seq=16)
TOL = 1e-12


@pytest.mark.parametrize("dims", [(2, 2, 2), (4, 2, 1), (2, 1, 4), (1, 2, 4)],
                         ids=lambda d: "dp{}-tp{}-pp{}".format(*d))
def test_composed_equals_one_process(dims):
    shape = MeshShape(*dims)
    res = mesh_check(CFG, shape, steps=3, batch=8, seq=16, micro_batches=2)
    assert res["loss"] < TOL and res["params"] < TOL
    assert res["replicas"] == 0.0  # dp replicas hold bit-identical shards


@pytest.mark.parametrize("variant", [
    dict(sp=False), dict(zero=0, schedule_kind="gpipe"), dict(recompute="full"),
    dict(cfg=GPTConfig(d_model=16, n_heads=2, n_layers=2, max_seq=16, mlp="swiglu",
                       pos="learned"))], ids=["no-sp", "zero0-gpipe", "recompute", "swiglu"])
def test_variants_equal_one_process(variant):
    cfg = variant.pop("cfg", CFG)
    res = mesh_check(cfg, MeshShape(1, 2, 2), steps=2, batch=4, seq=8, micro_batches=2,
                     **variant)
    assert res["loss"] < TOL and res["params"] < TOL


def test_collectives_per_axis_match_the_plan():
    """One step's messages on rank 0 of (2,2,2), counted by the ledger, against the model."""
    res = mesh_check(CFG, MeshShape(2, 2, 2), steps=1, batch=8, seq=16, micro_batches=2)
    col = res["results"][0]["collectives"]
    mb, s_local, h = 2, 16 // 2, 16
    # first stage: sends one activation per micro-batch, receives one gradient per micro-batch
    assert col["pp"] == {"isend": (2, 2 * mb * s_local * h * 8),
                         "recv": (2, 2 * mb * s_local * h * 8)}
    # SP: 2 blocks x (2 gathers + 2 scatters) forward, the same backward, per micro-batch
    assert col["tp"]["all_gather"][0] == col["tp"]["reduce_scatter"][0] == 2 * 2 * 2 * 2
    assert col["embedding"] == {"all_reduce": (1, CFG.vocab_size * h * 8)}
    assert set(col["dp"]) == {"reduce_scatter_single", "all_gather_single"}


def test_layout():
    shape = MeshShape(dp=2, tp=2, pp=2)
    assert [shape.coords(r) for r in (0, 1, 2, 7)] == [
        {"pp": 0, "dp": 0, "tp": 0}, {"pp": 0, "dp": 0, "tp": 1},
        {"pp": 0, "dp": 1, "tp": 0}, {"pp": 1, "dp": 1, "tp": 1}]
    assert shape.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.groups("embedding") == shape.groups("pp")
    for axis in ("tp", "dp", "pp"):
        assert sorted(r for g in shape.groups(axis) for r in g) == list(range(8))
    assert all(shape.rank(**shape.coords(r)) == r for r in range(8))


@pytest.mark.parametrize("kwargs, match", [
    (dict(shape=MeshShape(1, 1, 3)), "pp=3"),
    (dict(shape=MeshShape(1, 8, 1)), "tp=8"),
    (dict(batch=6), "batch=6"),
    (dict(seq=15), "seq=15"),
    (dict(seq=32), "seq=32"),
])
def test_bad_plans_refused(kwargs, match):
    args = dict(cfg=CFG, shape=MeshShape(2, 2, 2), batch=8, seq=16, micro_batches=2, sp=True)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        check_plan(**args)
    with pytest.raises(ValueError, match="dp"):
        MeshShape(dp=0)


@pytest.mark.parametrize("dp, tp", [(2, 2), (1, 2), (2, 1)])
def test_torch_composable_equals_one_process(dp, tp):
    """parallelize_module (TP) then fully_shard (FSDP2), torchtitan's order, on gloo."""
    from parlearn.context_parallel.gpt import serial_train
    from parlearn.multi_device.mesh.torch_composed import torch_mesh_train

    res = torch_mesh_train(CFG, dp, tp, steps=2, batch=4, seq=8)
    ref = serial_train(CFG, steps=2, batch=4, seq=8, optimizer="adam")
    for r in res:
        assert max(abs(a - b) for a, b in zip(r["loss"], ref["loss"], strict=True)) < TOL
        assert max((r["params"][n] - ref["params"][n]).abs().max().item()
                   for n in ref["params"]) < TOL


@pytest.mark.parametrize("dims, recompute, mlp", [((2, 2, 2), "none", "gelu"),
                                                  ((1, 2, 4), "none", "swiglu"),
                                                  ((2, 1, 2), "full", "gelu")])
def test_planner_memory_equals_what_the_ranks_hold(dims, recompute, mlp):
    """The planner's exact count of the tiny GPT equals, on every rank, the bytes
    ShardedAdam holds and the peak of saved activations the hooks measured."""
    from parlearn.multi_device.mesh import mesh_train
    from parlearn.multi_device.mesh.planner import Plan, TinyGPT

    cfg = GPTConfig(d_model=16, n_heads=4, n_layers=4, max_seq=16, mlp=mlp)
    shape = MeshShape(*dims)
    res = mesh_train(cfg, shape, steps=1, batch=8, seq=16, micro_batches=2,
                     recompute=recompute)
    work = TinyGPT(cfg, 8, 16)
    plan = Plan(shape.dp, shape.tp, shape.pp, recompute=recompute, micro_batch=8 // (2 * shape.dp))
    for r in res:
        stage = r["coords"]["pp"]
        assert r["act_per_mb"] == work.activations(plan, stage)
        assert r["act_peak"] == work.in_flight(plan, stage) * work.activations(plan, stage)
        held = {k: r["held"][k] for k in ("params", "grads", "optimizer")}
        assert held == work.states(plan, stage)
