"""The argument contract of the n-D mesh's runners and graders, the ZeRO bench row, and the
pipeline's Op (see harness.py). The JAX update lives in test_contract_jax_sharding.py."""

from __future__ import annotations

import torch
from harness import Case, contract_tests

P = "parlearn.multi_device."


def _cfg(**kw):
    from parlearn.multi_device.transformer import GPTConfig

    return GPTConfig(**{**dict(vocab_size=11, d_model=16, n_heads=2, n_layers=2, max_seq=8),
                        **kw})


def _mesh(dp: int = 2, tp: int = 1, pp: int = 1):
    from parlearn.multi_device.mesh import MeshShape

    return MeshShape(dp=dp, tp=tp, pp=pp)


def _card():
    from parlearn.card import Card

    from parlearn.distributed.cost import AlphaBeta

    links = {f"{k}@{n}": AlphaBeta(1e-5, 1e-9) for k in ("all_gather", "reduce_scatter", "p2p")
             for n in (2, 4, 8)}
    return Card(name="synthetic", measured=False, links=links,
                flops={"float64": 1e9, "bfloat16": 1e12}, mem_bw=1e10, memory=1e12, devices=8)


def _prediction():
    """The planner's best plan for the tiny GPT on 2 ranks (dp * micro_batch divides 4)."""
    from parlearn.multi_device.mesh.planner import Cluster, TinyGPT, rank_plans

    return rank_plans(TinyGPT(_cfg(), 4, 8), Cluster(_card(), gpus_per_node=2), 2)[0]


def _results():
    """The ranks' dicts of a dp=1, tp=2 mesh: each holds its half of a column-cut weight."""
    w = torch.arange(8.0).reshape(4, 2)
    return [{"params": {"blocks.0.attn.q.weight": w[:2]}},
            {"params": {"blocks.0.attn.q.weight": w[2:]}}]


def _assembled(result, kw):
    assert torch.equal(result["blocks.0.attn.q.weight"], torch.arange(8.0).reshape(4, 2))


def _fields_kept(result, kw):
    assert (result.kind, result.mb, result.chunk) == (kw["kind"], kw["mb"], kw["chunk"])


NOT_A_CFG = ["a config", 3]


def _axes3():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return list(plt.subplots(1, 3)[1])


def _best():
    from parlearn.multi_device.mesh.explore import best_meshes

    return best_meshes("llama3-8b", 8, 4096, 50.0, top=2)

CASES: list[Case] = [
    Case(P + "mesh.composed.assemble", lambda: dict(results=_results(), shape=_mesh(1, 2, 1)),
         bad={"results": [_results()[:1], "ranks", [{"params": {}}, "rank 1"], [{}, {}]],
              "shape": ["1x2x1", _mesh(2, 2, 1)]},
         check=_assembled),
    Case(P + "mesh.composed.mesh_check",
         lambda: dict(cfg=_cfg(), shape=_mesh(), steps=1, batch=4, seq=8, lr=0.01, seed=0),
         ranges={"steps": (1, None), "seed": (0, None)},
         bad={"cfg": NOT_A_CFG, "shape": ["2x1x1", _mesh(1, 1, 4)], "batch": [0, 3],
              "seq": [0, 9], "lr": [0.0, -1.0]},
         run_good=False),   # starts rank processes
    Case(P + "mesh.checks.mesh_checks",
         lambda: dict(cfg=_cfg(), shapes=[_mesh(), _mesh()], steps=1, batch=4, seq=8,
                      micro_batches=2, lr=0.01, seed=0, timeout=60.0),
         ranges={"steps": (1, None), "seed": (0, None)},
         bad={"cfg": NOT_A_CFG, "shapes": ["2x1x1", [], ["2x1x1"], [_mesh(), _mesh(1, 1, 4)]],
              "batch": [0, 3], "seq": [0, 9], "micro_batches": [0], "lr": [0.0, -1.0],
              "timeout": [0.0, -1.0]},
         run_good=False),   # starts rank processes
    Case(P + "mesh.grading.measure_plan",
         lambda: dict(cfg=_cfg(), pred=_prediction(), batch=4, seq=8, steps=2, timeout=60.0),
         ranges={"steps": (2, None)},
         bad={"cfg": NOT_A_CFG, "pred": ["plan", _prediction().plan], "batch": [0, 3],
              "seq": [0, 9], "timeout": [0.0, -1.0]},
         run_good=False),   # starts rank processes
    Case(P + "mesh.grading.plan_mesh", lambda: dict(pred=_prediction(), batch=4),
         bad={"pred": ["plan", _prediction().plan], "batch": [0, 3]},
         check=lambda r, kw: (r[0].world == kw["pred"].plan.gpus
                              and r[1] * kw["pred"].plan.dp * kw["pred"].plan.micro_batch
                              == kw["batch"])),
    Case(P + "mesh.grading.grade",
         lambda: dict(cfg=_cfg(), card=_card(), world=2, batch=4, seq=8, top=1, steps=2,
                      worst_steps=2, progress=False, timeout=60.0),
         ranges={"world": (1, None), "batch": (1, None), "seq": (1, None), "top": (1, None),
                 "steps": (2, None), "worst_steps": (2, None)},
         legal={"worst_steps": [None]},
         bad={"cfg": NOT_A_CFG, "card": ["h100", 3], "timeout": [0.0, -1.0]},
         run_good=False),   # starts rank processes
    Case(P + "mesh.explore.best_meshes",
         lambda: dict(model="llama3-8b", gpus=8, seq=4096, inter_gbs=50.0, efficiency=0.6,
                      top=2),
         ranges={"top": (1, None)}, legal={"efficiency": [None]},
         bad={"model": ["gpt", 3], "gpus": [0, -8], "seq": [0], "inter_gbs": [0.0, -1.0],
              "efficiency": [0.0, 1.5]},
         check=lambda r, kw: len(r["ranked"]) <= kw["top"]),
    Case(P + "mesh.explore.plot_best", lambda: dict(res=_best(), axes=_axes3()),
         bad={"res": ["plans", {}], "axes": [[None]]}, skip={"axes": "matplotlib axes"}),
    Case(P + "mesh.explore.explorer",
         lambda: dict(model="llama3-8b", gpus=8, seq=4096, inter_gbs=50.0, efficiency=0.6),
         ranges={"inter_gbs": (5.0, 100.0), "efficiency": (0.3, 1.0)},
         bad={"model": ["llama3-405b", 3], "gpus": [7, 0], "seq": [1000]},
         run_good=False),   # builds widgets
    # Bench rows run rank processes (run_good=False); device is checked, then unused.
    Case(P + "sharding.training.bench", lambda: dict(device=torch.device("cpu"), quick=True),
         run_good=False),
    Case(P + "pipeline.schedules.Op", lambda: dict(kind="F", mb=2, chunk=1),
         ranges={"mb": (0, None), "chunk": (0, None)}, bad={"kind": ["f", "FB", ""]},
         check=_fields_kept),
]

test_refuses, test_accepts, test_accepts_range = contract_tests(CASES)

MESH_TEST = "tests/multi_device/test_mesh.py::"
COVERED_ELSEWHERE: dict[str, str] = {
    P + "mesh.composed.mesh_train_worker":
        MESH_TEST + "test_mesh_worker_refuses_bad_arguments_on_every_rank",
    P + "mesh.torch_composed.torch_mesh_worker":
        MESH_TEST + "test_torch_mesh_worker_refuses_bad_arguments_on_every_rank",
}
EXEMPT: dict[str, str] = {
    P + "moe.router.Routing": "the record token_choice() and expert_choice() return; users "
    "only read it or hand it back to the layer that made it",
}
