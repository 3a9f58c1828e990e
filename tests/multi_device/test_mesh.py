"""The GPT on an n-D mesh equals one process; the mesh's layout and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from parlearn.transformer import GPTConfig

from parlearn.core.recipe import Recipe
from parlearn.multi_device.mesh import MeshShape, check_plan, mesh_check

CFG = GPTConfig(d_model=16, n_heads=4, n_layers=4, max_seq=16)
TOL = 1e-12
# A clip far below the gradients' norms (0.7-1.4 on this model), so it acts on every step.
RECIPE = Recipe(weight_decay=0.1, clip=0.05, warmup=2)


@pytest.mark.parametrize("dims", [(2, 2, 2), (4, 2, 1), (2, 1, 4), (1, 2, 4)],
                         ids=lambda d: "dp{}-tp{}-pp{}".format(*d))
def test_composed_equals_one_process(dims):
    shape = MeshShape(*dims)
    res = mesh_check(CFG, shape, steps=3, batch=8, seq=16, micro_batches=2)
    assert res["loss"] < TOL and res["params"] < TOL
    assert res["replicas"] == 0.0  # dp replicas hold bit-identical shards


def test_mesh_checks_is_mesh_check_per_shape_in_one_launch(monkeypatch):
    # Lesson 19's meshes in one launch of the ranks: each result equals mesh_check's.
    import parlearn.distributed.launch as pdist
    from parlearn.multi_device.mesh import mesh_checks

    launches, real_run = [], pdist.run

    def counting_run(*args, **kwargs):
        launches.append(args[0])
        return real_run(*args, **kwargs)

    shapes = [MeshShape(2, 1, 2), MeshShape(1, 2, 2)]
    monkeypatch.setattr(pdist, "run", counting_run)
    got = mesh_checks(CFG, shapes, steps=2, batch=8, seq=16, micro_batches=2)
    assert len(launches) == 1
    monkeypatch.setattr(pdist, "run", real_run)
    for shape, res in zip(shapes, got, strict=True):
        alone = mesh_check(CFG, shape, steps=2, batch=8, seq=16, micro_batches=2)
        assert res["loss"] < TOL and res["params"] < TOL and res["replicas"] == 0.0
        for a, b in zip(res["results"], alone["results"], strict=True):
            assert a["loss"] == b["loss"]
            for name, p in a["params"].items():
                assert torch.equal(p, b["params"][name]), name
    with pytest.raises(ValueError, match=r"shapes\[1\]"):
        mesh_checks(CFG, [MeshShape(2, 1, 2), MeshShape(2, 2, 2)], steps=1, batch=8, seq=16)


@pytest.mark.parametrize("variant", [
    dict(sp=False), dict(zero=0, schedule_kind="gpipe"), dict(recompute="full"),
    dict(cfg=GPTConfig(d_model=16, n_heads=2, n_layers=2, max_seq=16, mlp="swiglu",
                       pos="learned"))], ids=["no-sp", "zero0-gpipe", "recompute", "swiglu"])
def test_variants_equal_one_process(variant):
    cfg = variant.pop("cfg", CFG)
    res = mesh_check(cfg, MeshShape(1, 2, 2), steps=2, batch=4, seq=8, micro_batches=2,
                     **variant)
    assert res["loss"] < TOL and res["params"] < TOL


@pytest.mark.parametrize("dims, zero, sp", [((2, 2, 2), 1, True), ((2, 1, 2), 2, True),
                                            ((2, 2, 1), 0, False), ((1, 2, 4), 2, True)],
                         ids=["dp2-tp2-pp2-zero1", "dp2-pp2-zero2", "dp2-tp2-zero0-nosp",
                              "tp2-pp4-zero2"])
def test_the_whole_recipe_on_the_mesh_equals_one_process(dims, zero, sp):
    """AdamW with decay on matrices only, the global-norm clip across tp, pp and dp shards,
    warm-up + cosine, two micro-batches per replica: every step's loss and global norm,
    and the final parameters, equal one process on the whole batch."""
    res = mesh_check(CFG, MeshShape(*dims), steps=4, batch=8, seq=16, micro_batches=2,
                     recipe=RECIPE, zero=zero, sp=sp)
    assert res["loss"] < TOL and res["params"] < TOL and res["grad_norm"] < TOL
    assert res["replicas"] == 0.0
    for r in res["results"]:   # every rank computed the same norm, and the clip acted
        assert len(r["grad_norm"]) == 4 and min(r["grad_norm"]) > RECIPE.clip
        assert max(abs(a - b) for a, b in zip(r["grad_norm"], res["results"][0]["grad_norm"],
                                               strict=True)) < TOL


def test_zero2_on_the_mesh_keeps_only_owned_gradients():
    """With the recipe, ZeRO-2 over dp drops the gradients a replica does not own: each
    rank of a dp pair holds fewer gradient bytes than under ZeRO-1, and together
    exactly one copy."""
    from parlearn.multi_device.mesh import mesh_train

    held = {z: [r["held"] for r in mesh_train(CFG, MeshShape(2, 1, 1), steps=1, batch=8,
                                               seq=16, recipe=RECIPE, zero=z)] for z in (1, 2)}
    assert all(h2["grads"] < h1["grads"] for h1, h2 in zip(held[1], held[2], strict=True))
    assert sum(h["grads"] for h in held[2]) == held[1][0]["grads"]
    assert sum(h["optimizer"] for h in held[2]) == sum(h["optimizer"] for h in held[1])


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


def _fake_card(alpha=1e-4, beta=1e-9, rate=1e9, memory=1e12):
    from parlearn.card import Card

    from parlearn.distributed.cost import AlphaBeta

    links = {f"{k}@{n}": AlphaBeta(alpha, beta) for k in ("all_gather", "reduce_scatter", "p2p")
             for n in (2, 4, 8)}
    return Card(name="synthetic", measured=False, links=links,
                flops={"float64": rate, "bfloat16": rate}, mem_bw=1e10, memory=memory,
                devices=8)


def test_planner_space_and_ranking_equal_brute_force():
    """Every factorisation that the shapes allow is enumerated, and the ranking's best is
    the brute-force minimum of the predicted step time over them."""
    import itertools

    from parlearn.multi_device.mesh.planner import (
        Cluster,
        Plan,
        TinyGPT,
        plans,
        predict,
        rank_plans,
    )

    work, cluster = TinyGPT(CFG, 8, 16), Cluster(_fake_card(), gpus_per_node=8)
    brute = []
    for dp, tp, pp, mb in itertools.product((1, 2, 4, 8), repeat=4):
        if dp * tp * pp == 8:
            for z, r in itertools.product((0, 1), ("none", "full")):
                plan = Plan(dp, tp, pp, 1, z, r, mb)
                if work.check(plan) is None:
                    brute.append(plan)
    got = plans(work, 8, zero=(0, 1), recompute=("none", "full"))
    assert set(got) == set(brute) and len(got) == len(brute)
    ranked = rank_plans(work, cluster, 8, zero=(0, 1), recompute=("none", "full"))
    best = min(predict(work, p, cluster).step_s for p in brute)
    assert ranked[0].step_s == best
    fit = [p.step_s for p in ranked if p.fits]
    assert fit == sorted(fit)


def test_planner_terms_move_the_right_way():
    from parlearn.multi_device.mesh.planner import Cluster, Plan, TinyGPT, predict

    work = TinyGPT(CFG, 8, 16)
    slow = Cluster(_fake_card(alpha=1e-3), gpus_per_node=8)
    fast = Cluster(_fake_card(alpha=1e-6), gpus_per_node=8)
    p = Plan(2, 2, 2, micro_batch=1)
    assert predict(work, p, slow).time["tp"] > predict(work, p, fast).time["tp"] > 0
    # more micro-batches, smaller bubble fraction
    b1 = predict(work, Plan(1, 1, 4, micro_batch=8), fast).time
    b8 = predict(work, Plan(1, 1, 4, micro_batch=1), fast).time
    assert b1["bubble"] / b1["compute"] > b8["bubble"] / b8["compute"]
    full = predict(work, Plan(2, 2, 2, recompute="full"), fast)
    none = predict(work, Plan(2, 2, 2), fast)
    assert full.time["compute"] > none.time["compute"]
    assert full.memory["activations"] < none.memory["activations"]
    tiny_memory = Cluster(_fake_card(memory=1e3), gpus_per_node=8)
    assert not predict(work, p, tiny_memory).fits


def test_planner_charges_compute_at_the_sustained_fraction_and_mfu_against_the_card():
    """Compute is charged at ``efficiency`` times the card's rate (default 0.6 of a preset
    card's, all of a measured card's); MFU stays against the card's rate, so a plan with
    no communication (one GPU, one micro-batch) reaches MFU = efficiency exactly."""
    import dataclasses

    from parlearn.multi_device.mesh.planner import PEAK_EFFICIENCY, Cluster, Plan, TinyGPT, predict

    work, one = TinyGPT(CFG, 8, 16), Plan(1, 1, 1, micro_batch=8)
    card = _fake_card()
    full = predict(work, one, Cluster(card, efficiency=1.0))
    assert full.time["compute"] == full.step_s and math.isclose(full.mfu, 1.0, rel_tol=1e-12)
    half = predict(work, one, Cluster(card, efficiency=0.5))
    assert math.isclose(half.time["compute"], 2 * full.time["compute"], rel_tol=1e-12)
    assert math.isclose(half.mfu, 0.5, rel_tol=1e-12)
    preset = predict(work, one, Cluster(card))
    assert PEAK_EFFICIENCY == 0.6 and math.isclose(preset.mfu, 0.6, rel_tol=1e-12)
    measured = predict(work, one, Cluster(dataclasses.replace(card, measured=True)))
    assert math.isclose(measured.mfu, 1.0, rel_tol=1e-12)
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="efficiency"):
            Cluster(card, efficiency=bad)


def test_explorer_keeps_the_fastest_plan_of_each_mesh_and_prices_the_measured_anchor():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from parlearn.card import preset
    from parlearn.memory import PRESETS
    from parlearn.mesh import explore

    from parlearn.multi_device.mesh.planner import MEASURED_MFU

    res = explore.best_meshes("llama3-8b", 8, 4096, 50.0, top=3)
    meshes = [(p.plan.dp, p.plan.tp, p.plan.pp, p.plan.cp) for p in res["ranked"]]
    assert len(meshes) == len(set(meshes)) == 3
    assert all(p.fits for p in res["ranked"])
    steps = [p.step_s for p in res["ranked"]]
    assert steps == sorted(steps) and res["efficiency"] == 0.6
    # the band: the step time at the measured MFU is 3F / (MFU x peak x GPUs)
    m = PRESETS["llama3-8b"]  # 64 sequences of 4096 tokens; 2N + 4 L s h per token
    flops = 3 * 64 * 4096 * (2 * m.matmul_params() + 4 * m.layers * 4096 * m.hidden)
    lo, hi = MEASURED_MFU[0]["mfu"]
    peak = preset("h100-8x-nvlink").flops["bfloat16"] * 8
    assert math.isclose(res["anchor_s"][0], flops / (lo * peak), rel_tol=1e-12)
    assert math.isclose(res["anchor_s"][1], flops / (hi * peak), rel_tol=1e-12)
    faster = explore.best_meshes("llama3-8b", 8, 4096, 50.0, efficiency=1.0, top=3)
    assert faster["ranked"][0].mfu > res["ranked"][0].mfu
    fig, axes = plt.subplots(1, 3)
    explore.plot_best(res, axes)
    assert len(axes[0].patches) >= 3 * 6 and len(axes[1].patches) >= 3
    plt.close(fig)
    with pytest.raises(ValueError, match="axes"):
        explore.plot_best(res, [None])


def test_planner_refuses_impossible_plans():
    from parlearn.multi_device.mesh.planner import Cluster, LlamaWorkload, Plan, TinyGPT, predict

    cluster = Cluster(_fake_card())
    with pytest.raises(ValueError, match="pp=3"):
        predict(TinyGPT(CFG, 8, 16), Plan(1, 1, 3), cluster)
    with pytest.raises(ValueError, match="tp=3"):
        predict(LlamaWorkload("llama3-8b", 8, 4096), Plan(1, 3, 1), cluster)
    with pytest.raises(ValueError, match="cp"):
        predict(TinyGPT(CFG, 8, 16), Plan(1, 1, 1, cp=2), cluster)
    with pytest.raises(ValueError, match="zero"):
        Plan(zero=4)
    with pytest.raises(ValueError, match="recompute"):
        Plan(recompute="some")


def test_kendall_tau():
    from parlearn.multi_device.mesh.grading import kendall_tau

    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="length"):
        kendall_tau([1], [1])


def test_grading_report_is_complete(monkeypatch):
    """FAST grading on a tiny space: every field present and finite (no timing claims), all
    picks run in one launch of the ranks, each with the memory measure_plan measures."""
    import math

    import parlearn.distributed.launch as pdist
    from parlearn.multi_device.mesh.grading import grade, measure_plan

    launches, real_run = [], pdist.run

    def counting_run(*args, **kwargs):
        launches.append(args[0])
        return real_run(*args, **kwargs)

    monkeypatch.setattr(pdist, "run", counting_run)
    rep = grade(CFG, _fake_card(), world=2, batch=4, seq=8, top=2, steps=3, worst_steps=2,
                progress=False)
    assert len(launches) == 1
    assert rep["rows"][-1]["spread"] == 0.0   # the worst plan: one timed step
    monkeypatch.setattr(pdist, "run", real_run)
    alone = measure_plan(CFG, rep["rows"][0]["prediction"], 4, 8, steps=2)
    assert alone["memory"] == rep["rows"][0]["measured_bytes"]
    assert len(rep["rows"]) == 3 and rep["rows"][-1]["pick"] == "worst"
    meshes = [r["plan"].split(" cp")[0] for r in rep["rows"][:-1]]
    assert len(set(meshes)) == len(meshes)  # the top picks are distinct meshes
    assert -1.0 <= rep["tau"] <= 1.0
    assert rep["memory_error"] == 0.0  # the tiny GPT's memory count is exact
    for row in rep["rows"]:
        assert row["measured_s"] > 0 and math.isfinite(row["predicted_s"])
        # the step times' range, so a figure can show the spread the table prints
        assert row["min_s"] <= row["measured_s"] <= row["max_s"]


def test_planner_prices_a_ring_or_chain_that_spans_nodes_on_the_inter_node_link():
    """Regression: a CP ring (or PP chain) over 2 nodes was priced on the intra-node link,
    because one hop's two ranks sit side by side; the hops that cross nodes set the pace."""
    from parlearn.multi_device.mesh.planner import Cluster, LlamaWorkload, Plan, predict

    node, inter = _fake_card(alpha=1e-6, beta=1e-11), _fake_card(alpha=1e-3, beta=1e-8)
    cluster = Cluster(node, gpus_per_node=8, inter=inter)
    work = LlamaWorkload("llama3-8b", batch=16, seq=4096)
    layers, act = work.layers, 4096 * work.hidden * work.elem
    cp = predict(work, Plan(dp=1, cp=16), cluster)
    hop = inter.comm_time("p2p", work.kv_bytes(Plan(dp=1, cp=16)), 2)
    assert cp.time["cp"] == pytest.approx(3 * 15 * hop * 16 * layers)
    pp = predict(work, Plan(dp=4, pp=4), cluster)  # stages 4 ranks apart: a chain over 2 nodes
    assert pp.time["pp"] == pytest.approx(2 * 4 * inter.comm_time("p2p", act, 2))
    # Inside one node the same hops take the node's link; with no pipeline, no PP hop at all.
    one = Cluster(node, gpus_per_node=16, inter=inter)
    assert predict(work, Plan(dp=1, cp=16), one).time["cp"] == pytest.approx(
        3 * 15 * node.comm_time("p2p", work.kv_bytes(Plan(dp=1, cp=16)), 2) * 16 * layers)
    assert predict(work, Plan(dp=16), cluster).time["pp"] == 0.0


def test_planner_refuses_bad_clusters_and_workloads_naming_the_argument():
    """Regression: Cluster(share=-1) gave a negative step time; a TinyGPT longer than its
    max_seq was ranked."""
    from parlearn.multi_device.mesh.planner import Cluster, Plan, TinyGPT, predict, rank_plans

    for share in (-1.0, 0.0, 1.5, True):
        with pytest.raises((ValueError, TypeError), match="share"):
            Cluster(_fake_card(), share=share)
    with pytest.raises(ValueError, match="seq"):
        TinyGPT(CFG, 8, CFG.max_seq + 1)
    with pytest.raises(ValueError, match="gpus_per_node"):
        predict(TinyGPT(CFG, 8, 16), Plan(dp=8), Cluster(_fake_card(), gpus_per_node=4))
    with pytest.raises(TypeError, match="cluster"):
        rank_plans(TinyGPT(CFG, 8, 16), "a cluster", 4)
    with pytest.raises((ValueError, TypeError), match="zero"):
        rank_plans(TinyGPT(CFG, 8, 16), Cluster(_fake_card()), 4, zero=(True,))


@pytest.mark.parametrize("which, name", [("seq", "seq"), ("world", "world_size"),
                                         ("zero", "zero"), ("zero2", "zero"),
                                         ("recipe", "recipe")])
def test_mesh_worker_refuses_bad_arguments_on_every_rank(which, name):
    """Called straight through dist.run (as a user may), the worker refuses on every rank
    before the mesh's first collective: no hang, no rank left waiting."""
    from ranks import assert_refused_on_every_rank

    from parlearn.multi_device.mesh.composed import mesh_train_worker

    cfg = GPTConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=2, max_seq=8)
    shape = MeshShape(dp=2, tp=1, pp=1) if which != "world" else MeshShape(dp=1, tp=2, pp=2)
    args = dict(cfg=cfg, shape=shape, steps=1, batch=4, seq=8, micro_batches=1, lr=1e-2,
                seed=0, sp=False, zero=1, recompute="none", kind="1f1b")
    args.update({"seq": {"seq": 9}, "zero": {"zero": True},
                 "zero2": {"zero": 2},  # ZeRO-2 needs the recipe's ShardedOptimizer
                 "recipe": {"recipe": "adamw"}}.get(which, {}))
    assert_refused_on_every_rank(mesh_train_worker, tuple(args.values()), name=name)


@pytest.mark.parametrize("which, name", [("lr", "lr"), ("world", "world_size")])
def test_torch_mesh_worker_refuses_bad_arguments_on_every_rank(which, name):
    from ranks import assert_refused_on_every_rank

    from parlearn.multi_device.mesh.torch_composed import torch_mesh_worker

    cfg = GPTConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=2, max_seq=8)
    dp = 1 if which == "world" else 2   # dp * tp = 1 on 2 ranks
    lr = 0.0 if which == "lr" else 1e-2
    assert_refused_on_every_rank(torch_mesh_worker, (cfg, dp, 1, 1, 4, 8, lr, 0), name=name)


def test_assemble_and_measure_plan_refuse_what_is_not_theirs():
    from parlearn.multi_device.mesh.composed import assemble
    from parlearn.multi_device.mesh.grading import measure_plan
    from parlearn.multi_device.mesh.planner import Cluster, TinyGPT, rank_plans

    shape = MeshShape(dp=2, tp=1, pp=1)
    with pytest.raises(ValueError, match="results"):
        assemble([{"params": {}}], shape)          # one rank's dict for a world of 2
    with pytest.raises(TypeError, match=r"results\[1\]"):
        assemble([{"params": {}}, "rank 1"], shape)
    with pytest.raises(TypeError, match="shape"):
        assemble([{"params": {}}], "1x1x1")
    cfg = GPTConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=2, max_seq=8)
    pred = rank_plans(TinyGPT(cfg, 4, 8), Cluster(_fake_card(), gpus_per_node=2), 2)[0]
    with pytest.raises(TypeError, match="pred"):
        measure_plan(cfg, pred.plan, 4, 8)
    with pytest.raises(ValueError, match="steps"):
        measure_plan(cfg, pred, 4, 8, steps=1)
    with pytest.raises(ValueError, match="batch"):
        measure_plan(cfg, pred, 3, 8)
