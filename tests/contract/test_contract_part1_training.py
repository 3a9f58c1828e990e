"""The argument contract of data_parallel, sharding, batching, transformer, memory, mesh (the
rest of data_parallel and batching: test_contract_part1_dp.py)."""

from __future__ import annotations

import math

import torch
from harness import NAN_TENSOR, Case, contract_tests

P = "parlearn.multi_device."


def _card(memory: float = 1e12):
    from parlearn.card import Card

    from parlearn.distributed.cost import AlphaBeta

    links = {f"{k}@{n}": AlphaBeta(1e-5, 1e-9) for k in ("all_gather", "reduce_scatter", "p2p")
             for n in (2, 4, 8)}
    return Card(name="synthetic", measured=False, links=links,
                flops={"float64": 1e9, "bfloat16": 1e12}, mem_bw=1e10, memory=memory,
                devices=8)


def _cfg(**kw):
    from parlearn.multi_device.transformer import GPTConfig

    return GPTConfig(**{**dict(vocab_size=11, d_model=16, n_heads=2, n_layers=2, max_seq=8),
                        **kw})


def _tiny():
    from parlearn.multi_device.mesh.planner import TinyGPT

    return TinyGPT(_cfg(n_layers=4, max_seq=16), 8, 16)


def _plan(**kw):
    from parlearn.multi_device.mesh.planner import Plan

    return Plan(**kw)


def _mesh(dp: int = 2, tp: int = 2, pp: int = 1):
    from parlearn.multi_device.mesh import MeshShape

    return MeshShape(dp=dp, tp=tp, pp=pp)


def _ab():
    from parlearn.distributed.cost import AlphaBeta

    return AlphaBeta(1e-5, 1e-9)


def _x():
    return torch.tensor([0.5, -3.0, 1e-3, 0.0, 7.0, -0.25])


_BAD_X = [torch.arange(6), torch.zeros(6, dtype=torch.bool),
          torch.ones(6).to(torch.float8_e4m3fn)]
_BAD_SCALE = [0.0, -1.0, torch.tensor([1.0, 2.0]), torch.tensor(2), torch.tensor(-1.0)]


def _problem():
    from parlearn.multi_device.batching.tasks import LinearRegressionProblem

    return LinearRegressionProblem(4, seed=0)


def _history():
    from parlearn.multi_device.batching.training import History

    return History("sgd", samples=[8, 16], loss=[1.0, 0.6, 0.4])


def _cluster():
    from parlearn.multi_device.mesh.planner import Cluster

    return Cluster(_card(), gpus_per_node=8)


def _gpt():
    from parlearn.multi_device.transformer import GPT

    return GPT(_cfg())


def _ids(b: int = 2, s: int = 8) -> torch.Tensor:
    return torch.randint(0, 11, (b, s), generator=torch.Generator().manual_seed(0))


def _spec():
    from parlearn.multi_device.sharding import Spec

    return Spec(sizes=(4, 3, 2), steps=1, batch=2)


def _delays():
    from parlearn.multi_device.data_parallel.stragglers import DelayModel

    return DelayModel()


def _total_is_sum(result, kw):
    assert result["total"] == sum(v for k, v in result.items() if k != "total")


NOT_A_CFG = ["a config", 3]

CASES: list[Case] = [
    # --- sharding: the ZeRO cost models ---------------------------------------------------
    Case(P + "sharding.cost.memory_model",
         lambda: dict(n_params=1000, world_size=4, stage=2, precision="fp32"),
         ranges={"n_params": (0, None), "world_size": (1, None)}, bad={"stage": [4, -1]},
         check=_total_is_sum),
    Case(P + "sharding.cost.comm_model",
         lambda: dict(n_params=1000, world_size=4, stage=3, bytes_per_element=2),
         ranges={"n_params": (0, None), "world_size": (1, None), "bytes_per_element": (1, None)},
         bad={"stage": [4]}, check=_total_is_sum),
    Case(P + "sharding.cost.gpus_needed",
         lambda: dict(n_params=10**6, gpu_bytes=1e7, stage=3, precision="fp32", max_gpus=64),
         ranges={"n_params": (0, None), "max_gpus": (1, None)},
         bad={"gpu_bytes": [0.0, -1.0], "stage": [4]}),
    Case(P + "sharding.cost.ledger_wire_bytes",
         lambda: dict(records=[("all_reduce", 100), ("all_gather", 8)], world_size=2),
         ranges={"world_size": (1, None)},
         bad={"records": ["all_reduce", [("no such kind", 1)], [("all_reduce", -1)],
                          [("all_reduce", True)], [("all_reduce",)]]}),
    Case(P + "sharding.cost.draw_stages", lambda: dict(axes=None, world_size=4),
         ranges={"world_size": (1, None)}, skip={"axes": "matplotlib axes, drawn on"},
         run_good=False),
    Case(P + "sharding.zero.FlatShard",
         lambda: dict(shapes=[torch.Size([3]), torch.Size([2, 5])], world_size=4, rank=1),
         ranges={"rank": (0, 3)},
         bad={"world_size": [0, -1], "shapes": ["3", [(-1, 2)], [(2.5,)], []], "rank": [4]}),
    Case(P + "sharding.zero.adam_update",
         lambda: dict(param=torch.zeros(4), grad=torch.ones(4), exp_avg=torch.zeros(4),
                      exp_avg_sq=torch.zeros(4), step=1, lr=0.1, betas=(0.9, 0.99), eps=1e-8),
         ranges={"step": (1, None), "lr": (0.0, None), "eps": (0.0, None)},
         legal={t: [NAN_TENSOR] for t in ("param", "grad", "exp_avg", "exp_avg_sq")},
         bad={"grad": [torch.ones(3)], "exp_avg": [torch.zeros(5)],
              "exp_avg_sq": [torch.zeros(4, dtype=torch.float64)],
              "betas": [(0.9,), (1.0, 0.9), (0.9, -0.1), "ab"]}),
    Case(P + "sharding.training.mlp", lambda: dict(sizes=(4, 3, 2), seed=0,
                                                   dtype=torch.float64),
         ranges={"seed": (0, None)}, bad={"sizes": [(4,), (4, 0), (4, True)],
                                          "dtype": [torch.int64]}),
    Case(P + "sharding.training.regression_data",
         lambda: dict(n=4, n_in=3, n_out=2, seed=0, dtype=torch.float64),
         ranges={"n": (1, None), "n_in": (1, None), "n_out": (1, None), "seed": (0, None)},
         bad={"dtype": [torch.int64]}),
    Case(P + "sharding.training.Spec",
         lambda: dict(sizes=(4, 3, 2), steps=2, batch=2, lr=0.1, seed=0, dtype=torch.float64),
         ranges={"steps": (1, None), "batch": (1, None), "seed": (0, None)},
         bad={"sizes": [(4,), (4, 0)], "lr": [0.0], "dtype": [torch.int64]}),
    Case(P + "sharding.training.train_serial",
         lambda: dict(spec=_spec(), world_size=2),
         ranges={"world_size": (1, None)}, bad={"spec": ["a spec", 3]}),
    # Launchers of real ranks: every argument is checked before the first rank starts.
    Case(P + "sharding.training.train_sharded",
         lambda: dict(spec=_spec(), stage=1, world_size=2, timeout=30.0), run_good=False,
         ranges={"world_size": (1, None)},
         bad={"spec": ["spec", 3], "stage": [4], "timeout": [0.0, -1.0]}),
    Case(P + "sharding.training.measure_memory",
         lambda: dict(spec=_spec(), world_size=2, timeout=30.0), run_good=False,
         ranges={"world_size": (1, None)}, bad={"spec": ["spec"], "timeout": [0.0, -1.0]}),
    Case(P + "sharding.training.step_times",
         lambda: dict(spec=_spec(), world_size=2, repeat=1, timeout=30.0), run_good=False,
         ranges={"world_size": (1, None), "repeat": (1, None)},
         bad={"spec": ["spec"], "timeout": [0.0, -1.0]}),
    Case(P + "sharding.engines.train_engine",
         lambda: dict(spec=_spec(), engine="zero", world_size=2, timeout=30.0), run_good=False,
         ranges={"world_size": (1, None)}, bad={"spec": ["spec"], "timeout": [0.0, -1.0]}),
    # --- memory ---------------------------------------------------------------------------
    Case(P + "memory.activations.activation_terms",
         lambda: dict(cfg=_cfg(), batch=2, seq=8, precision="fp32", recompute="none"),
         ranges={"batch": (1, None), "seq": (1, None)}, bad={"cfg": NOT_A_CFG}),
    Case(P + "memory.activations.activation_bytes",
         lambda: dict(cfg=_cfg(), batch=2, seq=8, precision="bf16", recompute="full",
                      weight_copies=True),
         ranges={"batch": (1, None), "seq": (1, None)}, bad={"cfg": NOT_A_CFG}),
    Case(P + "memory.activations.korthikanti_bytes", lambda: dict(s=16, b=2, h=32, a=4),
         ranges={"s": (1, None), "b": (1, None)}, bad={"h": [0, -1], "a": [0, 3]}),
    Case(P + "memory.activations.korthikanti_terms", lambda: dict(s=16, b=2, h=32, a=4),
         ranges={"s": (1, None), "b": (1, None)}, bad={"h": [0, -1], "a": [0, 3]}),
    Case(P + "memory.calculator.LlamaShape",
         lambda: dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=100, tied=False),
         ranges={"layers": (1, None), "ffn": (1, None), "vocab": (1, None)},
         bad={"hidden": [0, 30], "heads": [0, 3], "kv_heads": [0, 3]}),
    Case(P + "memory.calculator.estimate",
         lambda: dict(model="llama3-8b", batch=1, seq=4096, precision="bf16-mixed",
                      zero_stage=1, dp=8, tp=2, pp=2, cp=2, recompute="selective",
                      schedule="1f1b", micro_batches=4),
         ranges={"batch": (1, None), "dp": (1, None), "micro_batches": (1, None)},
         bad={"zero_stage": [4], "tp": [0, 3], "pp": [0, 5], "cp": [0, 3], "seq": [0, 4095]},
         check=lambda r, kw: r["total"] == sum(r[k] for k in ("params", "grads", "optimizer",
                                                              "activations", "logits"))),
    Case(P + "memory.measured.autocast_for", lambda: dict(device="cpu", dtype=torch.bfloat16),
         legal={"dtype": [None]}, bad={"dtype": [torch.int64]}),
    Case(P + "memory.measured.peak_memory", lambda: dict(step=lambda: None, device="cpu"),
         bad={"step": ["step", 3]}, check=lambda r, kw: r is None),
    Case(P + "memory.measured.Saved",
         lambda: dict(shape=(2, 3), dtype=torch.float32, nbytes=24, kind="activation", uses=1),
         ranges={"nbytes": (0, None), "uses": (1, None)}, bad={"shape": [(-1,), "2x3"]}),
    Case(P + "memory.steps.fp16_underflow", lambda: dict(scale=2.0 ** 16, seed=0),
         bad={"scale": [0.0, -1.0], "seed": [-1]}),
    Case(P + "memory.steps.recompute_cost",
         lambda: dict(model=_gpt(), idx=_ids(), targets=_ids(), repeat=1, autocast=None,
                      threads=1),
         ranges={"repeat": (1, None), "threads": (1, None)}, legal={"threads": [None]},
         bad={"idx": [_ids().float(), _ids()[0], _ids(2, 9)], "targets": [_ids(2, 4)],
              "autocast": [torch.int64, "bf16"]},
         run_good=False),
    # --- memory: FP8 -------------------------------------------------------------------------
    Case(P + "memory.fp8.format_info", lambda: dict(dtype=torch.float8_e4m3fn),
         bad={"dtype": [torch.int8, "e4m3"]}, check=lambda r, kw: r["max"] == 448.0),
    Case(P + "memory.fp8.amax_scale", lambda: dict(x=_x(), fmt="e5m2", margin=1),
         ranges={"margin": (0, None)}, bad={"x": _BAD_X},
         check=lambda r, kw: r * kw["x"].abs().max().item() <= 57344 / 2 ** kw["margin"] * 1.001),
    Case(P + "memory.fp8.quantize", lambda: dict(x=_x(), fmt="e4m3", scale=2.0),
         bad={"x": _BAD_X, "scale": _BAD_SCALE},
         check=lambda r, kw: r.dtype == torch.float8_e4m3fn),
    Case(P + "memory.fp8.dequantize",
         lambda: dict(q=_x().to(torch.float8_e4m3fn), scale=2.0, dtype=torch.float64),
         bad={"q": [_x()], "scale": _BAD_SCALE, "dtype": [torch.int64]}),
    Case(P + "memory.fp8.round_trip", lambda: dict(x=_x(), fmt="e5m2", scale=0.5),
         bad={"x": _BAD_X, "scale": _BAD_SCALE}),
    Case(P + "memory.fp8.cast_stats", lambda: dict(x=_x(), fmt="e4m3", scale=4.0),
         bad={"x": _BAD_X, "scale": _BAD_SCALE}),
    Case(P + "memory.fp8.scaled_matmul",
         lambda: dict(a=_x().view(2, 3), b=_x().view(3, 2), fmt="e4m3", scaling="amax"),
         bad={"a": _BAD_X + [_x()], "b": [_x().view(2, 3), _x().long().view(3, 2)]}),
    Case(P + "memory.fp8.state_bytes_per_param", lambda: dict(recipe="fp8"),
         check=lambda r, kw: r["total"] == sum(v for k, v in r.items() if k != "total")),
    Case(P + "memory.fp8.fp8_activation_terms",
         lambda: dict(cfg=_cfg(), batch=2, seq=8, recompute="selective"),
         ranges={"batch": (1, None), "seq": (1, None)}, bad={"cfg": NOT_A_CFG},
         check=lambda r, kw: all(f <= b for _, b, f in r)),
    # --- transformer ------------------------------------------------------------------------
    Case(P + "transformer.model.GPTConfig",
         lambda: dict(vocab_size=11, d_model=16, n_heads=2, n_layers=2, max_seq=8, mlp="gelu",
                      pos="rope", d_ff=24, seed=0),
         ranges={"vocab_size": (1, None), "n_layers": (1, None), "max_seq": (1, None),
                 "d_ff": (1, None), "seed": (0, None)},
         legal={"d_ff": [None]}, bad={"d_model": [0, 15], "n_heads": [0, 3]}),
    Case(P + "transformer.model.GPT", lambda: dict(cfg=_cfg(), dtype=torch.float64,
                                                   device="cpu"),
         legal={"device": [None]}, bad={"cfg": NOT_A_CFG, "dtype": [torch.int64]}),
    Case(P + "transformer.model.count_params", lambda: dict(cfg=_cfg()), bad={"cfg": NOT_A_CFG},
         check=lambda r, kw: r["total"] == sum(p.numel() for p in _gpt().parameters())),
    Case(P + "transformer.model.attention_core",
         lambda: dict(q=torch.zeros(1, 2, 4, 3), k=torch.zeros(1, 2, 4, 3),
                      v=torch.zeros(1, 2, 4, 3), mask=torch.ones(4, 4, dtype=torch.bool).triu(1)),
         legal={"q": [NAN_TENSOR], "k": [NAN_TENSOR], "v": [NAN_TENSOR]},
         bad={"q": [torch.zeros(2, 4, 3), torch.zeros(1, 2, 4, 3, dtype=torch.int64)],
              "k": [torch.zeros(1, 2, 5, 3)], "v": [torch.zeros(1, 2, 3, 3)],
              "mask": [torch.zeros(4, 4), torch.ones(3, 3, dtype=torch.bool)]}),
    Case(P + "transformer.train.flops_per_token", lambda: dict(cfg=_cfg(), seq=8, backward=True),
         ranges={"seq": (1, 8)}, bad={"cfg": NOT_A_CFG}),
    Case(P + "transformer.train.measured_flops",
         lambda: dict(model=_gpt(), idx=_ids(), targets=_ids(), backward=False),
         bad={"model": [torch.nn.Linear(2, 2)], "idx": [_ids().float(), _ids()[0], _ids(2, 9)],
              "targets": [_ids(2, 4), _ids().float()]}),
    Case(P + "transformer.train.evaluate",
         lambda: dict(model=_gpt(), ids=torch.arange(40) % 11, batch=2, seq=8, batches=1,
                      seed=1),
         ranges={"batch": (1, None), "seq": (1, 8), "seed": (0, None)},
         legal={"seq": [None]}, bad={"batches": [0, -1], "model": [torch.nn.Linear(2, 2)],
                                     "ids": [torch.zeros(40), torch.arange(5), torch.arange(40)
                                             .view(4, 10)]}),
    Case(P + "transformer.corpus.get_batch",
         lambda: dict(ids=torch.arange(40), batch=2, seq=8,
                      generator=torch.Generator().manual_seed(0)),
         ranges={"batch": (1, None), "seq": (1, 39)},
         bad={"ids": [torch.zeros(40), torch.arange(40).view(4, 10)], "seq": [40],
              "generator": [0, "g"]}),
    Case(P + "transformer.corpus.pydoc_corpus", lambda: dict(val_fraction=0.1),
         bad={"val_fraction": [0.0, 1.0, -0.1, 1.5]}),
    Case(P + "transformer.train.train",
         lambda: dict(cfg=_cfg(vocab_size=103), steps=1, batch=2, seq=8, lr=1e-3, device="cpu",
                      dtype=torch.float32, eval_every=1, seed=0, autocast=None, progress=False,
                      threads=1),
         run_good=False, legal={"seq": [None], "threads": [None]},
         bad={"cfg": NOT_A_CFG, "seq": [0, 9], "lr": [0.0], "dtype": [torch.int64],
              "autocast": ["bf16", torch.int64], "steps": [0], "batch": [0], "eval_every": [0],
              "threads": [0], "seed": [-1]}),
    # --- mesh: the planner ------------------------------------------------------------------
    Case(P + "mesh.planner.Plan",
         lambda: dict(dp=2, tp=2, pp=1, cp=1, zero=1, recompute="none", micro_batch=1),
         ranges={k: (1, None) for k in ("dp", "tp", "pp", "cp", "micro_batch")},
         bad={"zero": [4, -1]}),
    Case(P + "mesh.planner.Cluster",
         lambda: dict(card=_card(), gpus_per_node=8, inter=_card(), share=0.5,
                      efficiency=0.6),
         ranges={"gpus_per_node": (1, None)},
         legal={"inter": [None], "efficiency": [None]},
         bad={"card": ["h100", 3], "inter": ["ib"], "share": [0.0, -0.5, 1.5],
              "efficiency": [0.0, -0.5, 1.5]}),
    Case(P + "mesh.planner.LlamaWorkload",
         lambda: dict(model="llama3-8b", batch=8, seq=4096, dtype="bfloat16", elem=2),
         ranges={"batch": (1, None), "seq": (1, None), "elem": (1, None)},
         skip={"dtype": "any name; the card says which rates it has, checked by predict"}),
    Case(P + "mesh.planner.TinyGPT", lambda: dict(cfg=_cfg(max_seq=16), batch=8, seq=16,
                                                  dtype="float64", elem=8),
         ranges={"batch": (1, None), "seq": (1, 16)}, bad={"cfg": NOT_A_CFG, "elem": [4, 2]}),
    Case(P + "mesh.planner.plans",
         lambda: dict(workload=_tiny(), gpus=4, zero=(0, 1), recompute=("none", "full"),
                      cp=False, micro_batches=[1, 2]),
         ranges={"gpus": (1, None)}, legal={"micro_batches": [None]},
         bad={"workload": ["tiny", 3], "zero": [(True,), (5,), (), "0"],
              "recompute": [("some",), ()], "micro_batches": [[0], [True], []]}),
    Case(P + "mesh.planner.predict",
         lambda: dict(workload=_tiny(), plan=_plan(dp=2, tp=2), cluster=_cluster()),
         bad={"workload": ["tiny"], "plan": ["dp2", _plan(pp=3)], "cluster": ["c"]},
         check=lambda r, kw: r.step_s == sum(v for k, v in r.time.items() if k != "total")),
    Case(P + "mesh.planner.rank_plans",
         lambda: dict(workload=_tiny(), cluster=_cluster(), gpus=4),
         bad={"workload": ["tiny"], "cluster": ["c"], "gpus": [0, -1, 9]}),
    Case(P + "mesh.layout.MeshShape", lambda: dict(dp=2, tp=2, pp=1),
         ranges={"dp": (1, None), "tp": (1, None), "pp": (1, None)}),
    Case(P + "mesh.grading.kendall_tau", lambda: dict(xs=[1.0, 2.0, 3.0], ys=[1.0, 3.0, 2.0]),
         bad={"xs": [[1.0, 2.0], [1.0], "abc", [1.0, math.nan, 2.0], [1.0, True, 2.0]],
              "ys": [[1.0, 2.0, 3.0, 4.0], [1.0, "x", 2.0]]}),
    Case(P + "mesh.layout.draw_mesh", lambda: dict(shape=_mesh(), axes=[None] * 3),
         bad={"shape": ["2x2", 3], "axes": [[None], []]}, run_good=False),
    Case(P + "mesh.stage.StageGPT",
         lambda: dict(full=_gpt(), shape=_mesh(1, 2, 2), stage=1, shard=1, sp=True,
                      recompute="full"),
         ranges={"stage": (0, 1), "shard": (0, 1)},
         bad={"full": [torch.nn.Linear(2, 2)], "shape": ["1x2x2", _mesh(1, 3, 2)]}),
    # --- data parallel: the 8-bit type and its cost models ----------------------------------
    Case(P + "data_parallel.dynamic_tree.quantize", lambda: dict(x=torch.linspace(-1, 1, 7),
                                                             scale=None),
         legal={"scale": [None]}),
    Case(P + "data_parallel.dynamic_tree.quantize_reference",
         lambda: dict(x=torch.linspace(-1, 1, 7), scale=2.0),
         ranges={"scale": (1.0, None)}, bad={"scale": [0.0, -1.0, 0.5]}),
    Case(P + "data_parallel.dynamic_tree.dequantize",
         lambda: dict(codes=torch.arange(7, dtype=torch.uint8), scale=2.0, dtype=torch.float32),
         bad={"codes": [torch.arange(7), torch.zeros(3)], "scale": [[1.0, 2.0]],
              "dtype": [torch.int64]}),
    Case(P + "data_parallel.dynamic_tree.dequantize_reference",
         lambda: dict(codes=torch.arange(7, dtype=torch.uint8), scale=2.0, dtype=torch.float64),
         bad={"codes": [torch.arange(7), torch.zeros(3)], "dtype": [torch.int64]}),
    Case(P + "data_parallel.dynamic_tree.quantize_linear_int8",
         lambda: dict(x=torch.linspace(-1, 1, 7)), bad={"x": [torch.arange(3)]}),
    Case(P + "data_parallel.dynamic_tree.dequantize_linear_int8",
         lambda: dict(q=torch.arange(7, dtype=torch.int8), scale=2.0, dtype=torch.float32),
         bad={"q": [torch.arange(7), torch.zeros(3)], "dtype": [torch.int64]}),
    Case(P + "data_parallel.dynamic_tree.relative_error",
         lambda: dict(magnitudes=torch.tensor([0.1, 0.5, 1.0]), kind="linear_int8"),
         bad={"magnitudes": [torch.tensor([0.0, 0.5]), torch.tensor([1.5]), torch.arange(3)]}),
    Case(P + "data_parallel.dynamic_tree.coding_seconds",
         lambda: dict(numel=64, repeat=1, seed=0, threads=1), run_good=False,
         ranges={"numel": (1, None), "repeat": (1, None), "seed": (0, None)},
         legal={"threads": [None]}, bad={"threads": [0, -1]}),
    Case(P + "data_parallel.compression.compressed_all_reduce_time",
         lambda: dict(numel=1000, world_size=4, model=_ab(), quantize_s=1e-9, dequantize_s=1e-9,
                      error_feedback=True),
         ranges={"numel": (1, None), "world_size": (1, None), "quantize_s": (0.0, None),
                 "dequantize_s": (0.0, None)}, bad={"model": ["ib", 3]}),
    Case(P + "data_parallel.compression.crossover_bandwidth",
         lambda: dict(numel=10**6, world_size=4, alpha=1e-5, quantize_s=1e-9,
                      dequantize_s=1e-9),
         ranges={"numel": (1, None), "world_size": (2, None), "alpha": (0.0, None),
                 "quantize_s": (0.0, None), "dequantize_s": (0.0, None)}),
    Case(P + "data_parallel.compression.modeled_step_ratio",
         lambda: dict(numel=10**6, world_size=4, link=_ab(), compute_s=0.01, quantize_s=1e-9,
                      dequantize_s=1e-9),
         ranges={"numel": (1, None), "world_size": (2, None), "compute_s": (0.0, None),
                 "quantize_s": (0.0, None), "dequantize_s": (0.0, None)},
         bad={"link": ["ib", 3]}),
    Case(P + "data_parallel.compression.path_coding_seconds",
         lambda: dict(numel=64, world_size=2, repeat=1, seed=0, threads=1), run_good=False,
         ranges={"numel": (1, None), "world_size": (1, None), "repeat": (1, None),
                 "seed": (0, None)}, legal={"threads": [None]}, bad={"threads": [0]}),
    Case(P + "data_parallel.step_model.dp_step_model",
         lambda: dict(param_bytes=[400, 4000], world_size=4, model=_ab(), compute_seconds=0.01,
                      strategy="bucketed", bucket_bytes=1000, backward_fraction=0.5),
         ranges={"world_size": (1, None), "compute_seconds": (0.0, None),
                 "bucket_bytes": (1, None), "backward_fraction": (0.0, 1.0)},
         bad={"param_bytes": [[], [0], [True], "400", [4.5]], "model": ["ab"]}),
    Case(P + "data_parallel.slow_link.EmulatedLink",
         lambda: dict(alpha=1e-4, bandwidth=1e9, sleep=lambda s: None),
         ranges={"alpha": (0.0, None)}, bad={"bandwidth": [0.0, -1.0], "sleep": ["sleep", 3]}),
    Case(P + "data_parallel.slow_link.emulated_bandwidths",
         lambda: dict(numel=10**6, world_size=4, real=_ab(), alpha=1e-4, quantize_s=1e-9,
                      dequantize_s=1e-9, factor=4.0),
         ranges={"numel": (1, None), "world_size": (2, None), "alpha": (0.0, None),
                 "quantize_s": (0.0, None), "dequantize_s": (0.0, None)},
         bad={"real": ["ib", 3], "factor": [0.0, -1.0, 0.5]}),
    Case(P + "data_parallel.spans.step_spans",
         lambda: dict(events=[("forward", "", 0.0), ("backward", "", 1.0), ("end", "", 2.0)],
                      lane="compute"),
         bad={"events": ["events", [("forward", "", math.nan)], [("forward",)], [3]],
              "lane": [3, None]}, skip={"lane": "any str is a lane's label"}),
    Case(P + "sharding.zero.storage_bytes", lambda: dict(tensors=[torch.zeros(3), None]),
         bad={"tensors": ["abc", [3], torch.zeros(3)]},
         check=lambda r, kw: r == 12),
    Case(P + "batching.noise_scale.HalfStats",
         lambda: dict(cos=0.5, g2=1.0, trace=2.0, batch=8),
         ranges={"trace": (0.0, None)}, bad={"batch": [1, 0, 3]}),
    Case(P + "batching.noise_scale.two_half_stats",
         lambda: dict(a=torch.ones(4, dtype=torch.float64), b=torch.ones(4, dtype=torch.float64)
                      * 2, batch=8),
         bad={"a": [torch.ones(3, dtype=torch.float64), torch.ones(2, 2)],
              "b": [torch.ones(5, dtype=torch.float64)], "batch": [3, 1]}),
    Case(P + "batching.noise_scale.NoiseScale", lambda: dict(decay=0.9),
         bad={"decay": [1.0, -0.1, 1.5]}),
    Case(P + "batching.training.SimiGradController",
         lambda: dict(target=0.5, step=0.1, start=32, min_batch=2, max_batch=1024, quantum=2),
         bad={"target": [0.0, 1.0], "step": [0.0, -0.1], "start": [0, 1, 4096],
              "min_batch": [0, 1], "max_batch": [1], "quantum": [0, 1, 3]}),
    Case(P + "batching.tasks.LinearRegressionProblem",
         lambda: dict(d=8, h=None, noise=0.1, seed=0),
         ranges={"d": (1, None), "noise": (0.0, None), "seed": (0, None)},
         legal={"h": [None]}),
    Case(P + "mesh.composed.mesh_train",
         lambda: dict(cfg=_cfg(n_layers=4, max_seq=16), shape=_mesh(), steps=1, batch=8, seq=16,
                      micro_batches=2, lr=0.01, seed=0, sp=True, zero=1, recompute="none",
                      schedule_kind="1f1b", timeout=30.0), run_good=False,
         ranges={"steps": (1, None), "micro_batches": (1, None), "seed": (0, None)},
         bad={"cfg": NOT_A_CFG, "shape": ["2x2", _mesh(1, 3, 1)], "batch": [0, 7],
              "seq": [0, 17], "lr": [0.0], "zero": [2, True], "timeout": [0.0]}),
    Case(P + "mesh.torch_composed.torch_mesh_train",
         lambda: dict(cfg=_cfg(n_layers=4, max_seq=16), dp=2, tp=2, steps=1, batch=8, seq=16,
                      lr=0.01, seed=0, timeout=30.0), run_good=False,
         ranges={"steps": (1, None), "seed": (0, None)},
         bad={"cfg": NOT_A_CFG, "dp": [0, 3], "tp": [0, 3], "batch": [0, 7], "seq": [0, 17],
              "lr": [0.0], "timeout": [0.0]}),
    Case(P + "data_parallel.compression.compressed_all_reduce_reference",
         lambda: dict(xs=[torch.linspace(-1, 1, 6), torch.linspace(1, -1, 6)], average=True,
                      error_feedback=None, key=0),
         legal={"error_feedback": [None]}, skip={"key": "any hashable names the state"},
         bad={"xs": [[], [torch.zeros(6), torch.zeros(5)], "xs", [torch.arange(6)]]}),
    Case(P + "data_parallel.ddp.train_reference",
         lambda: dict(model=torch.nn.Linear(4, 3).double(), xs=[torch.ones(2, 4,
                                                                          dtype=torch.float64)],
                      ys=[torch.tensor([0, 2])], lr=0.1, optimizer="adam"),
         bad={"lr": [0.0, -1.0], "xs": ["xs"]}),
    Case(P + "memory.steps.state_bytes",
         lambda: dict(model=torch.nn.Linear(2, 2), optimizer=torch.optim.SGD(
             torch.nn.Linear(2, 2).parameters(), lr=0.1)),
         bad={"optimizer": ["adam", 3]}),
    Case(P + "transformer.corpus.CharCorpus",
         lambda: dict(chars="abc", train=torch.tensor([0, 1, 2, 1]), val=torch.tensor([2, 0])),
         bad={"chars": ["", "aab", 3], "train": [torch.tensor([0, 3]), torch.tensor([-1]),
                                                   torch.zeros(2), torch.zeros(2, 2).long()],
              "val": [torch.tensor([5])]}),
    Case(P + "batching.tasks.RegressionTask", lambda: dict(problem=_problem(), seed=0),
         ranges={"seed": (0, None)}, bad={"problem": ["p", 3]}),
    Case(P + "batching.training.samples_to_target",
         lambda: dict(hist=_history(), target_loss=0.5),
         bad={"hist": ["h", {"loss": [1.0]}]}),
    Case(P + "memory.measured.saved_tensors", lambda: dict(autocast=torch.bfloat16),
         args=lambda: (torch.nn.Linear(3, 2), torch.ones(4, 3)), bad={"autocast": [torch.int64]}),
    # --- data parallel: cost models -------------------------------------------------------
    Case(P + "data_parallel.stragglers.DelayModel",
         lambda: dict(kind="pareto", mean=0.01, shape=2.5, seed=0, slow=((1, 0.1),)),
         ranges={"mean": (0.0, None), "seed": (0, None)},
         bad={"shape": [1.0], "slow": [((-1, 0.1),), ((1, -0.1),), "slow", ((1,),),
                                       ((True, 0.1),)]}),
    Case(P + "data_parallel.stragglers.expected_order_statistic",
         lambda: dict(k=2, n=4, delays=_delays()),
         ranges={"k": (1, 4)}, bad={"n": [0, -1], "k": [0, 5], "delays": ["exp", 3]}),
    Case(P + "data_parallel.stragglers.order_statistic_quantile",
         lambda: dict(k=2, n=4, delays=_delays(), q=0.5),
         ranges={"k": (1, 4)},
         bad={"n": [0, -1], "k": [0, 5], "delays": ["exp", 3], "q": [0.0, 1.0, -0.1, 1.5]}),
    Case(P + "data_parallel.stragglers.backup_tradeoff",
         lambda: dict(n=4, b=1, delays=_delays(), compute_seconds=0.1, sigma2=1.0, batch=2),
         ranges={"b": (0, 3), "compute_seconds": (0.0, None),
                 "sigma2": (0.0, None), "batch": (1, None)},
         bad={"n": [0, -1], "b": [4], "delays": ["exp"]}),
    Case(P + "data_parallel.ddp.shard", lambda: dict(x=torch.arange(6.0), rank=1, world_size=3),
         ranges={"rank": (0, 2)}, legal={"x": [NAN_TENSOR]},
         bad={"world_size": [0, 4, 5], "rank": [3]}),
    Case(P + "data_parallel.ddp.TiedMLP",
         lambda: dict(d_in=4, d_hidden=3, d_out=2, seed=0, dtype=torch.float64),
         ranges={"d_in": (1, None), "d_hidden": (1, None), "d_out": (1, None),
                 "seed": (0, None)}, bad={"dtype": [torch.int64]}),
]

test_refuses, test_accepts, test_accepts_range = contract_tests(CASES)

D_TEST = "tests/multi_device/test_data_parallel.py::"
S_TEST = "tests/multi_device/test_sharding.py::"
COVERED_ELSEWHERE: dict[str, str] = {
    **{P + "data_parallel.ddp." + n: D_TEST + "test_dp_wrappers_refuse_bad_arguments_naming_"
       "them_before_any_rank_work"
       for n in ("NaiveDP", "BucketedDP", "CompressedDP", "make_ddp", "worker_train")},
    P + "sharding.zero.ShardedAdam": S_TEST + "test_sharded_adam_refuses_bad_arguments_naming_"
    "them_before_looking_for_ranks",
    P + "mesh.stage.check_plan": "tests/multi_device/test_mesh.py::test_bad_plans_refused",
    P + "batching.training.train": "tests/multi_device/test_batching.py::"
    "test_bad_train_arguments_fail_before_any_step",
    P + "batching.training.worker_train": "tests/multi_device/test_batching.py::"
    "test_bad_calls_fail_fast",
    P + "batching.training.train_runs": "tests/multi_device/test_batching.py::"
    "test_train_runs_equals_one_launch_per_run_and_checks_every_run_first",
}
EXEMPT: dict[str, str] = {
    P + "mesh.planner.Prediction": "the result record predict() returns; no user builds one",
    P + "data_parallel.step_model.DPStepModel": "the result record dp_step_model() returns",
    P + "data_parallel.slow_link.Charge": "the record EmulatedLink appends per collective",
    P + "memory.measured.SavedLedger": "the ledger saved_tensors() returns (its Saved records "
    "are checked: see the Saved case)",
    P + "batching.training.History": "the record train() returns and appends to",
    P + "data_parallel.dynamic_tree.code_table": "takes no arguments at all: the fixed table",
    P + "data_parallel.dynamic_tree.sorted_codes": "takes no arguments at all: the fixed table",
    P + "data_parallel.compression.ErrorFeedback": "takes no arguments; state filled per key",
}

# Public callables whose contract test is still to be written (test_completeness: only shrinks).
PENDING: list[str] = []
