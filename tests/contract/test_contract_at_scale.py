"""The argument contract of Part 5's modules (see harness.py)."""

from __future__ import annotations

import math

from harness import Case, contract_tests

A = "parlearn.at_scale."


def _count():
    from parlearn.at_scale.mfu import flop_count

    return flop_count("llama3-8b", 4096)


def _tiny():
    from parlearn.multi_device.memory.calculator import LlamaShape

    return LlamaShape(hidden=16, layers=2, heads=4, kv_heads=2, ffn=24, vocab=40)


def _is_dense_h100(result, kw):
    assert result == {"bfloat16": 989e12, "float32": 67e12}.get(kw["dtype"], result)


def _trusted(result, kw):
    assert result == []   # the right numerator and the dense peak: nothing to report


def _trace():
    def x(name, a, b, tid=1):
        return {"ph": "X", "name": name, "ts": a * 1e3, "dur": (b - a) * 1e3, "pid": 0,
                "tid": tid}
    return {"traceEvents": [x("forward", 0, 10), x("aten::mm", 0, 8), x("backward", 10, 30),
                            x("aten::mm", 10, 25), x("gloo:all_reduce", 20, 35, 7),
                            x("optimizer", 35, 40), x("aten::add_", 36, 39)]}


def _adds_up(result, kw):
    assert abs(result["compute"] + result["exposed"] + result["idle"] - result["step"]) < 1e-12


CASES: list[Case] = [
    Case(A + "mfu.peak_flops", lambda: dict(device="H100 SXM", dtype="bfloat16"),
         bad={"device": ["h100", "B200", 3], "dtype": ["bf16", "int8", 3]},
         check=_is_dense_h100),
    Case(A + "mfu.matmul_params", lambda: dict(shape=_tiny()),
         bad={"shape": ["llama3-1b", 3]},
         check=lambda r, kw: r == 2 * (2 * 16 * 16 + 2 * 16 * 8 + 3 * 16 * 24) + 40 * 16),
    Case(A + "mfu.flop_count",
         lambda: dict(shape=_tiny(), seq=8, attention="causal", window=None, recompute="none"),
         ranges={"seq": (1, None)},
         bad={"shape": ["llama3-1b", 3], "attention": ["flash", True],
              "window": [0, -1, 2.5], "recompute": ["some", None]},
         legal={"window": [None]},
         check=lambda r, kw: r.model >= 6 * r.matmul_params and r.hardware >= r.model),
    Case(A + "mfu.utilisation",
         lambda: dict(tokens_per_second=1e6, count=_count(), device="H100 SXM",
                      dtype="bfloat16", n_devices=512),
         ranges={"tokens_per_second": (0.0, None), "n_devices": (1, None)},
         bad={"count": [3.0, "count"], "device": ["B200"], "dtype": ["bf16"]},
         check=lambda r, kw: math.isclose(
             r, kw["tokens_per_second"] * kw["count"].model / (kw["n_devices"] * 989e12))),
    Case(A + "mfu.audit",
         lambda: dict(flops_per_token=_count().model, peak_per_device=989e12,
                      shape="llama3-8b", seq=4096, device="H100 SXM", dtype="bfloat16",
                      attention="causal", window=None, recompute="none", devices_per_node=8),
         ranges={"devices_per_node": (1, None)},
         bad={"flops_per_token": [0.0, -1.0], "peak_per_device": [0.0, -1.0],
              "shape": ["llama3-1b"], "seq": [0, -1], "attention": ["flash"],
              "recompute": ["some"], "window": [0], "device": [3, ""],
              "dtype": ["bf16", 3]},
         # an unknown device is reported (a Finding), not refused
         legal={"window": [None], "device": ["no such H100 SXM"]}, check=_trusted),
]

CASES += [
    Case(A + "traces.spans", lambda: dict(trace=_trace(), names=("forward",), prefixes=()),
         bad={"trace": [3, "no such file.json", {"events": []}]},
         skip={"names": "any names: unknown ones match nothing",
               "prefixes": "any prefixes: unknown ones match nothing"},
         check=lambda r, kw: r == [(0.0, 0.01)]),
    Case(A + "traces.breakdown",
         lambda: dict(trace=_trace(), compute_prefixes=("aten::",), comm_prefixes=("gloo:",),
                      phases=("forward", "backward", "optimizer"), window=None),
         bad={"trace": [3, {"traceEvents": []}], "window": [(0.04, 0.0), "all", (1.0,)]},
         legal={"window": [None]},
         skip={"compute_prefixes": "any prefixes: unknown ones match nothing",
               "comm_prefixes": "any prefixes: unknown ones match nothing",
               "phases": "any names: unknown ones fall back to every span"},
         check=_adds_up),
    Case(A + "traces.step_windows", lambda: dict(trace=_trace(), first="forward",
                                                 last="optimizer"),
         bad={"trace": [3], "first": ["no such label"], "last": ["no such label"]},
         check=lambda r, kw: len(r) == 1),
    Case(A + "traces.median_breakdown", lambda: dict(trace=_trace(), skip=0),
         ranges={"skip": (0, 0)}, bad={"trace": [3, {"traceEvents": []}]},
         check=lambda r, kw: r["steps"] == 1 and abs(r["exposed"] - 0.010) < 1e-12),
    Case(A + "traces.timeline_events", lambda: dict(trace=_trace(), rank=0, window=(0.0, 0.04)),
         ranges={"rank": (0, None)}, bad={"trace": [3]},
         skip={"window": "a pair of seconds; any order of the trace's own times"},
         check=lambda r, kw: {e[1] for e in r} == {"compute", "comm"}),
    Case(A + "overlap.overlap_study",
         lambda: dict(out_dir="/tmp/parlearn-x", kinds=["naive"], widths=(8, 8, 2), steps=2,
                      bucket_bytes=64, world_size=2, link=None, progress=None),
         ranges={"steps": (2, None), "bucket_bytes": (1, None), "world_size": (2, None)},
         bad={"out_dir": [3, None], "kinds": [[], "naive", ["zero"]], "link": [3.0, "ab"],
              "progress": [3], "widths": [(8,), (8, 0, 2), "8"]},
         legal={"link": [None], "progress": [None], "out_dir": ["no such /tmp/parlearn-x"]},
         run_good=False),   # starts rank processes
    Case(A + "traces.profile_ranks",
         lambda: dict(worker=lambda r, w: r, world_size=1, args=(), out_dir="/tmp/parlearn-x",
                      timeout=30.0),
         ranges={"world_size": (1, None)},
         bad={"worker": [3, "worker"], "out_dir": [3, None], "timeout": [0.0, -1.0]},
         skip={"args": "any sequence of arguments for the worker"},
         legal={"out_dir": ["no such /tmp/parlearn-x"]},   # made when missing
         run_good=False),   # starts rank processes
]


def _shape(**kw):
    from parlearn.mesh import MeshShape

    return MeshShape(**kw)


def _spec(**kw):
    from parlearn.at_scale.train import TrainSpec

    return TrainSpec(steps=1, batch=4, seq=8, d_model=16, n_layers=2, log=False, **kw)


CASES += [
    Case(A + "checkpoint.step_dir", lambda: dict(root="/tmp/run", step=4),
         ranges={"step": (0, None)}, bad={"root": [3, "", None]},
         legal={"root": ["no such /tmp/run"]},   # a folder still to be made
         check=lambda r, kw: r == f"/tmp/run/step_{kw['step']:06d}"),
    Case(A + "checkpoint.latest", lambda: dict(root="/tmp/parlearn-no-such-run"),
         bad={"root": [3, "", None]},
         legal={"root": ["no such /tmp/parlearn-no-such-run"]},   # None found: None
         check=lambda r, kw: r is None),
    Case(A + "checkpoint.load_full", lambda: dict(directory="/tmp/parlearn-no-such-ckpt"),
         bad={"directory": [3, "", None]}, run_good=False),   # needs a saved checkpoint
    Case(A + "train.TrainSpec",
         lambda: dict(dp=1, tp=2, pp=1, steps=3, batch=4, seq=8, micro_batches=2, lr=1e-2,
                      seed=0, sp=True, zero=1, d_model=16, n_layers=2, n_heads=4, ckpt=None,
                      every=0, fail_at=1, fail_rank=0, peak_tflops=None, log=False),
         ranges={"dp": (1, 2), "pp": (1, 2), "steps": (2, None), "micro_batches": (1, 2),
                 "seed": (0, None), "every": (0, 0), "fail_rank": (0, 1),
                 "n_layers": (1, None), "fail_at": (0, 2)},
         bad={"tp": [0, 3, True], "lr": [0.0, -1.0], "dp": [3], "pp": [3], "batch": [0, 3],
              "seq": [0, 7], "zero": [2, True],
              "d_model": [0, 18], "n_heads": [0, 3], "ckpt": ["", 3], "sp": [1, "yes"],
              "peak_tflops": [0.0, -1.0], "log": [1, "no"]},
         legal={"ckpt": [None], "fail_at": [None], "peak_tflops": [None]},
         check=lambda r, kw: r.world == kw["dp"] * kw["tp"] * kw["pp"]),
    Case(A + "train.train", lambda: dict(spec=_spec(dp=2), timeout=60.0),
         bad={"spec": [3, {"dp": 2}], "timeout": [0.0, -1.0]},
         check=lambda r, kw: len(r) == 2 and list(r[0]["loss"]) == [0]),
    Case(A + "train.reshard_check",
         lambda: dict(before=_shape(dp=2), after=_shape(), steps=2, at=1, directory=None,
                      timeout=60.0),
         ranges={"steps": (2, None), "timeout": (0.0, None)},
         bad={"before": [(2, 1, 1), "dp=2"], "after": [None, 3], "at": [0, 2, True],
              "directory": [3]},
         legal={"directory": [None]}, run_good=False),   # starts rank processes twice
    Case(A + "goodput.young_daly", lambda: dict(cost=30.0, mtbf=3600.0),
         bad={"cost": [0.0, -1.0], "mtbf": [0.0, -1.0]},   # open at 0: no range
         check=lambda r, kw: math.isclose(r, math.sqrt(2 * kw["cost"] * kw["mtbf"]))),
    Case(A + "goodput.modeled_goodput",
         lambda: dict(interval=600.0, cost=30.0, mtbf=3600.0, restart=120.0),
         ranges={"cost": (0.0, None), "restart": (0.0, None)},
         bad={"interval": [0.0, -1.0], "mtbf": [0.0, -1.0]},
         check=lambda r, kw: 0 < r <= 1),
    Case(A + "goodput.simulated_goodput",
         lambda: dict(interval=60.0, cost=5.0, mtbf=3600.0, restart=60.0, work=7200.0,
                      setup=0.0, seed=0),
         ranges={"cost": (0.0, None), "restart": (0.0, None), "seed": (0, None),
                 "setup": (0.0, None)},
         bad={"interval": [0.0, -1.0], "mtbf": [0.0, -1.0], "work": [0.0, -1.0]},
         check=lambda r, kw: 0 < r <= 1),
    Case(A + "goodput.measured_goodput",
         lambda: dict(every=2, mtbf_steps=10.0, steps=8, seed=0, max_restarts=5),
         ranges={"every": (1, None), "steps": (1, None), "seed": (0, None),
                 "max_restarts": (0, None)},
         bad={"mtbf_steps": [0.0, -1.0]},
         run_good=False),   # starts rank processes, many times
]


CASES += [
    Case(A + "hangs.hang_zoo",
         lambda: dict(names=["dead_rank"], world_size=3, timeout=2.0, torch_says=False,
                      quiet=True),
         ranges={"world_size": (2, 16), "timeout": (0.5, 60.0)},
         bad={"names": [[], "dead_rank", ["nope"], [3]]}, legal={"names": [None]},
         run_good=False),   # starts rank processes
    Case(A + "hangs.doctor",
         lambda: dict(fn=lambda r, w: r, world_size=1, args=(), timeout=30.0),
         ranges={"world_size": (1, 64)}, bad={"fn": [3], "timeout": [0.0, -1.0]},
         skip={"args": "any sequence of arguments for the worker"},
         run_good=False),   # starts rank processes
]

def _pred(**kw):
    from parlearn.card import Card
    from parlearn.transformer import GPTConfig

    from parlearn.distributed.cost import AlphaBeta
    from parlearn.multi_device.mesh.planner import Cluster, Plan, TinyGPT, predict

    links = {f"{k}@{n}": AlphaBeta(1e-5, 1e-9) for k in ("all_gather", "reduce_scatter", "p2p")
             for n in (2, 4)}
    card = Card(name="synthetic", measured=False, links=links,
                flops={"float64": 1e9, "bfloat16": 1e9}, mem_bw=1e10, memory=1e12, devices=4)
    cfg = GPTConfig(d_model=16, n_heads=4, n_layers=2, max_seq=16)
    return predict(TinyGPT(cfg, 8, 16), Plan(**kw), Cluster(card, gpus_per_node=4))


def _cfg16():
    from parlearn.transformer import GPTConfig

    return GPTConfig(d_model=16, n_heads=4, n_layers=2, max_seq=16)


CASES += [
    Case(A + "plan_trace.split_step", lambda: dict(trace=_trace(), window=(0.0, 0.04)),
         bad={"trace": [3, {"traceEvents": 3}], "window": [(0.04, 0.0), "all", (1.0,)]},
         check=lambda r, kw: abs(sum(r[k] for k in ("compute", "tp", "dp", "pipeline"))
                                 - r["step"]) < 1e-12),
    Case(A + "plan_trace.plan_vs_trace",
         lambda: dict(cfg=_cfg16(), pred=_pred(dp=2, micro_batch=2), batch=8, seq=16, steps=2,
                      out_dir="/tmp/parlearn-x", timeout=60.0),
         ranges={"steps": (2, None)},
         bad={"pred": [3, "dp2"], "batch": [0, 3], "out_dir": [3, None], "seq": [0, 17],
              "timeout": [0.0, -1.0], "cfg": [3, "gpt"]},
         legal={"out_dir": ["no such /tmp/parlearn-x"]},   # made when missing
         run_good=False),   # starts rank processes
]


test_refuses, test_accepts, test_accepts_range = contract_tests(CASES)

_HANG_WORKERS = "tests/at_scale/test_hangs.py::test_workers_refuse_bad_arguments_on_every_rank"
COVERED_ELSEWHERE: dict[str, str | list[str]] = {
    A + "checkpoint.state": "tests/at_scale/test_checkpoint.py::"
                            "test_the_rank_functions_refuse_what_is_not_a_mesh_rank",
    A + "checkpoint.modeled_bytes": "tests/at_scale/test_checkpoint.py::"
                                    "test_the_rank_functions_refuse_what_is_not_a_mesh_rank",
    A + "checkpoint.save": "tests/at_scale/test_checkpoint.py::"
                           "test_mesh_rank_and_save_refuse_bad_calls_on_every_rank",
    A + "checkpoint.load": "tests/at_scale/test_checkpoint.py::"
                           "test_load_refuses_a_checkpoint_of_another_model_on_every_rank",
    A + "critical.critical_path": "tests/at_scale/test_critical.py::"
                                  "test_different_programs_and_bad_arguments_are_refused",
    A + "train.train_worker": "tests/at_scale/test_train.py::test_a_spec_is_checked_when_built",
    A + "train.main":
        "tests/at_scale/test_train.py::test_the_command_line_refuses_nccl_and_bad_flags",
    "parlearn.multi_device.mesh.composed.MeshRank": "tests/at_scale/test_checkpoint.py::"
        "test_mesh_rank_and_save_refuse_bad_calls_on_every_rank",
    **{A + f"hangs.{w}": _HANG_WORKERS
       for w in ("wrong_order", "skipped_collective", "size_mismatch", "dtype_mismatch",
                 "send_without_recv", "dead_rank", "silent_dtype", "silent_broadcast")},
    A + "hangs.late_rank": [_HANG_WORKERS, "tests/at_scale/test_hangs.py::"
                            "test_late_rank_refuses_a_bad_timeout_on_every_rank"],
    A + "traces.dp_step_worker": "tests/at_scale/test_traces.py::test_worker_refuses_on_every_rank",
    A + "traces.dp_timed_worker":
        "tests/at_scale/test_traces.py::test_timed_worker_times_each_step_and_refuses_bad_calls",
}
EXEMPT: dict[str, str] = {
    A + "mfu.FlopCount": "the record flop_count() returns; users only read its fields",
    A + "mfu.Finding": "the record audit() returns; users only read its fields",
}
