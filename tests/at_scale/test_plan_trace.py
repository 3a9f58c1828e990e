"""The planner's step beside the measured trace of the same plan, part by part."""

from __future__ import annotations

import pytest

from parlearn.at_scale import plan_trace as PT


def _x(name, a, b, tid=1):
    return {"ph": "X", "name": name, "ts": a * 1e3, "dur": (b - a) * 1e3, "pid": 0, "tid": tid}


def _trace():
    # ms: a step of 100 with compute 0-30 and 80-85, a TP all-reduce 20-50 (10 under compute),
    # a pipeline receive 50-70, and ZeRO's all-gather 85-95 inside the optimizer 80-100.
    return {"traceEvents": [
        _x("step", 0, 100), _x("forward", 0, 50), _x("aten::mm", 0, 30),
        _x("gloo:all_reduce", 20, 50, 7), _x("backward", 50, 80), _x("gloo:recv", 50, 70, 7),
        _x("optimizer", 80, 100), _x("aten::add_", 80, 85), _x("gloo:all_gather", 85, 95, 7)]}


def test_split_step_on_a_trace_with_known_parts():
    parts = PT.split_step(_trace(), (0.0, 0.1))
    want = {"compute": 0.035, "tp": 0.020, "dp": 0.010, "pipeline": 0.035, "step": 0.1}
    assert parts == pytest.approx(want, abs=1e-12)
    assert sum(parts[k] for k in PT.PARTS) == pytest.approx(parts["step"], abs=1e-15)


def test_split_step_credits_overlap_to_compute_and_p2p_to_the_pipeline():
    t = _trace()
    t["traceEvents"].append(_x("gloo:send", 30, 45, 8))     # under the all-reduce: no change
    t["traceEvents"].append(_x("aten::mm", 88, 92))          # dp hidden under compute
    parts = PT.split_step(t, (0.0, 0.1))
    assert parts["dp"] == pytest.approx(0.006, abs=1e-12)
    assert parts["compute"] == pytest.approx(0.039, abs=1e-12)
    assert parts["tp"] == pytest.approx(0.020, abs=1e-12)


def test_the_tied_embeddings_all_reduce_counts_as_pipeline_not_tp():
    t = _trace()
    t["traceEvents"] += [_x("embedding", 70, 80), _x("gloo:all_reduce", 71, 79, 7)]
    parts = PT.split_step(t, (0.0, 0.1))
    assert parts["tp"] == pytest.approx(0.020, abs=1e-12)         # unchanged
    assert parts["pipeline"] == pytest.approx(0.035, abs=1e-12)   # 71-79 was pipeline's


def test_split_step_refuses_a_bad_window():
    with pytest.raises(ValueError, match="window"):
        PT.split_step(_trace(), (0.1, 0.0))


def _card():
    from parlearn.card import Card

    from parlearn.distributed.cost import AlphaBeta

    links = {f"{k}@{n}": AlphaBeta(1e-5, 1e-9) for k in ("all_gather", "reduce_scatter", "p2p")
             for n in (2, 4, 8)}
    return Card(name="synthetic", measured=False, links=links,
                flops={"float64": 1e9, "bfloat16": 1e9}, mem_bw=1e10, memory=1e12, devices=8)


@pytest.mark.parametrize("dp, tp, pp", [(1, 2, 2), (2, 1, 1)])
def test_a_plan_on_real_ranks_splits_into_parts_that_add_up(dp, tp, pp, tmp_path):
    from parlearn.transformer import GPTConfig

    from parlearn.multi_device.mesh.planner import Cluster, Plan, TinyGPT, predict

    cfg = GPTConfig(d_model=16, n_heads=4, n_layers=2, max_seq=16)
    plan = Plan(dp=dp, tp=tp, pp=pp, micro_batch=8 // (2 * dp))
    pred = predict(TinyGPT(cfg, 8, 16), plan, Cluster(_card(), gpus_per_node=4))
    res = PT.plan_vs_trace(cfg, pred, batch=8, seq=16, steps=3, out_dir=str(tmp_path))
    assert len(res["ranks"]) == dp * tp * pp
    for parts in res["ranks"]:
        assert sum(parts[k] for k in PT.PARTS) == pytest.approx(parts["step"], rel=1e-9)
        assert parts["compute"] > 0 and parts["dp"] >= 0 and parts["tp"] >= 0
        assert (parts["tp"] > 0) == (tp > 1)     # no collective outside the update without TP
        if dp > 1:
            assert parts["dp"] > 0
    t = pred.time
    assert res["predicted"]["pipeline"] == t["pp"] + t["bubble"] + t["cp"]
    assert res["predicted"]["step"] == pytest.approx(t["total"], rel=1e-12)


def test_a_plan_with_context_parallelism_is_refused_not_run_without_it():
    from parlearn import card
    from parlearn.multi_device.mesh.grading import plan_mesh
    from parlearn.multi_device.mesh.planner import Cluster, LlamaWorkload, Plan, predict

    pred = predict(LlamaWorkload("llama3-8b", batch=64, seq=4096), Plan(dp=2, cp=2),
                   Cluster(card.preset("h100-8x-nvlink"), 8))
    with pytest.raises(ValueError, match="cp=2"):
        plan_mesh(pred, 64)
