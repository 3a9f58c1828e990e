"""The argument contract of parlearn.core and the bench registry (see harness.py)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch
from harness import NAN_TENSOR, Case, contract_tests

from parlearn.core import basics


def _amdahl_exact(result, kw):
    s, p = Fraction(kw["serial_fraction"]), Fraction(kw["workers"])
    assert math.isclose(float(result), float(1 / (s + (1 - s) / p)), rel_tol=1e-12)


def _brent(result, kw):
    w, d, p = kw["work"], kw["depth"], kw["workers"]
    lo, hi = result
    assert lo <= hi and math.isclose(hi, w / p + d) and lo >= d and lo >= w / p


def _pair():
    return basics.random_batch(3, 4, seed=1)


def _bmm_equals_loop(result, kw):
    torch.testing.assert_close(result, torch.stack([a @ b for a, b in zip(kw["a"], kw["b"],
                                                                           strict=True)]))


# Labels are free text: any string is legal, only a non-string is refused.
def _free(*args: str, formula: str = "n") -> dict[str, list[str]]:
    text = {"name": "ring", "device": "cpu", "formula": formula}
    return {a: ["no such " + text[a]] for a in args}


def _noop():
    return None


def _enter(cm):
    with cm:
        pass


def _ax(log: bool = False):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    plt.close(fig)
    if log:
        ax.plot([1, 10, 100], [1, 10, 100])
        ax.set_yscale("log")
    return ax


def _ab():
    from parlearn.distributed.cost import AlphaBeta

    return AlphaBeta(1e-5, 1e-9)


def _sweep():
    return {"values": [1, 2], "device": "cpu", "threads": 1, "reliable": True,
            "median_s": {"a": [1.0, 1.0], "b": [0.5, 0.4]}, "spread": {"a": [0.0, 0.0],
                                                                   "b": [0.1, 0.1]},
            "speedup": {"a": [1.0, 1.0], "b": [2.0, 2.5]},
            "speedup_lo": {"a": [1.0, 1.0], "b": [1.9, 2.4]},
            "speedup_hi": {"a": [1.0, 1.0], "b": [2.1, 2.6]}}


def _row():
    from parlearn.core.bench import Row

    return Row("b", "serial", "parallel", 2.0, "cpu")


def _card():
    from parlearn.distributed.card import preset

    return preset("h100-ib")


def _hello():
    from parlearn.distributed.collectives import hello

    return hello



def _call():
    from parlearn.distributed.diagnosis import Call

    return Call(1, "all_reduce", 8, "float32", (2,), None, 2, "", "ok")

CASES = [
    Case("parlearn.core.basics.amdahl", lambda: dict(serial_fraction=0.1, workers=8),
         ranges={"serial_fraction": (0.0, 1.0), "workers": (1, None)}, check=_amdahl_exact,
         bad={"workers": [np.array([2, True])]}),
    Case("parlearn.core.basics.gustafson", lambda: dict(serial_fraction=0.1, workers=8.0),
         ranges={"serial_fraction": (0.0, 1.0), "workers": (1, None)},
         check=lambda r, kw: math.isclose(
             float(r), kw["serial_fraction"] + (1 - kw["serial_fraction"]) * kw["workers"])),
    Case("parlearn.core.basics.sum_graph", lambda: dict(n=8, shape="tree"),
         ranges={"n": (2, None)}, bad={"shape": ["ring"]},
         check=lambda r, kw: len(r["ops"]) == kw["n"] - 1),
    Case("parlearn.core.basics.work_depth",
         lambda: dict(edges=[("x", "a"), ("a", "b")], ops=["a", "b"]),
         bad={"edges": [[("a",)], "ab", 3, [("a", "b"), ("b", "a")]], "ops": [[], 3, "ab"]},
         check=lambda r, kw: r == (2, 2)),
    Case("parlearn.core.basics.brent_bounds", lambda: dict(work=100.0, depth=10.0, workers=4),
         ranges={"workers": (1, None), "depth": (0.0, 100.0)},
         bad={"work": [-1.0, 5.0]}, check=_brent),
    Case("parlearn.core.basics.random_batch", lambda: dict(n=2, size=3, seed=0),
         ranges={"n": (1, None), "size": (1, None), "seed": (0, None)}),
    Case("parlearn.core.basics.looped_matmul", lambda: dict(zip("ab", _pair(), strict=True)),
         bad={"a": [torch.zeros(3, 4), torch.zeros(2, 4, 4)],
              "b": [torch.zeros(3, 5, 4), torch.zeros(3, 4, 4, dtype=torch.float64)]},
         legal={"a": [NAN_TENSOR], "b": [NAN_TENSOR]}, check=_bmm_equals_loop),
    Case("parlearn.core.basics.batched_matmul", lambda: dict(zip("ab", _pair(), strict=True)),
         bad={"a": [torch.zeros(3, 4), torch.zeros(0, 4, 4)],
              "b": [torch.zeros(3, 5, 4), torch.zeros(3, 4, 4, dtype=torch.float64)]},
         legal={"a": [NAN_TENSOR], "b": [NAN_TENSOR]}, check=_bmm_equals_loop),
    Case("parlearn.core.basics.batching_model",
         lambda: dict(n=8, size=4, alpha=1e-5, beta=1e-9), bad={"n": [np.array([2, 0])]},
         legal={"n": [8.5]},   # a smooth curve: lessons draw it on a dense grid
         ranges={"n": (1, None), "size": (1, None), "alpha": (0.0, None), "beta": (0.0, None)}),
    Case("parlearn.core.models.mlp", lambda: dict(widths=[4, 3, 2], seed=0),
         ranges={"seed": (0, None)}, bad={"widths": [[4], [4, 0, 2], [4, True], [4, 2.0]]}),
    Case("parlearn.core.models.mlp_param_bytes", lambda: dict(widths=[4, 3, 2], element_size=4),
         ranges={"element_size": (1, None)},
         bad={"widths": [[4], [4, 0, 2], [4, True], [4, 2.5], "42"]},
         check=lambda r, kw: r == [a * b * kw["element_size"] for a, b in
                                   zip(kw["widths"][:-1], kw["widths"][1:], strict=True)
                                   for a, b in ((a, b), (1, b))]),
    Case("parlearn.core.datasets.digits",
         lambda: dict(test_fraction=0.25, seed=0, n_train=40, dtype=torch.float64),
         ranges={"n_train": (1, 1347), "seed": (0, 2**32 - 1)},
         bad={"test_fraction": [0.0, 1.0, 0.001], "dtype": [torch.int64]},
         legal={"n_train": [None]}),
    Case("parlearn.core.device.pick_device", lambda: dict(prefer="cpu"),
         bad={"prefer": ["tpu", "cuda:x"]}, legal={"prefer": [None]}),
    Case("parlearn.core.device.describe", lambda: dict(device="cpu"), bad={"device": ["tpu"]},
         legal={"device": [None]}),
    Case("parlearn.core.device.describe_str", lambda: dict(device="cpu"),
         bad={"device": ["tpu"]}, legal={"device": [None]}),
    Case("parlearn.core.device.sync", lambda: dict(device="cpu"), bad={"device": ["tpu"]}),
    Case("parlearn.core.device.threads", lambda: dict(n=1), ranges={"n": (1, None)},
         check=lambda r, kw: _enter(r)),
    Case("parlearn.core.device.fake_jax_cpu_devices", lambda: dict(n=1),
         ranges={"n": (1, None)}, run_good=False),
    Case("parlearn.core.timing.measure",
         lambda: dict(fn=_noop, warmup=0, repeat=2, threads=1, device="cpu"),
         ranges={"warmup": (0, None), "repeat": (1, None), "threads": (1, None)},
         bad={"fn": [3], "device": ["tpu"]}, legal={"threads": [None]}),
    Case("parlearn.core.timing.compare",
         lambda: dict(candidates={"a": _noop, "b": _noop}, baseline="a", warmup=0, repeat=2),
         ranges={"warmup": (0, None), "repeat": (1, None)},
         bad={"candidates": [{}, {"a": 3}], "baseline": ["c"]}, legal={"baseline": [None]}),
    Case("parlearn.core.timing.sweep",
         lambda: dict(values=[1, 2], candidates=lambda v: {"a": _noop}, warmup=0, repeat=2),
         ranges={"warmup": (0, None), "repeat": (1, None)}, bad={"values": [[], 3],
                                                          "candidates": [3]}),
    Case("parlearn.core.basics.sweep_batching",
         lambda: dict(counts=[1, 2], size=2, repeat=2, seed=0, threads=1),
         ranges={"size": (1, None), "repeat": (1, None), "seed": (0, None),
                 "threads": (1, None)},
         bad={"counts": [[], [0], [True], "12"]}, legal={"threads": [None]}),
    Case("parlearn.core.basics.fit_batching_model",
         lambda: dict(result={"n": [1, 2, 4], "loop_s": [1e-3, 2e-3, 4e-3],
                              "bmm_s": [1e-3, 1.1e-3, 1.3e-3], "size": 8}),
         bad={"result": [{}, {"n": [1, 2], "loop_s": [1e-3, -1.0], "bmm_s": [1e-3, 1e-3],
                              "size": 8}]}),
    Case("parlearn.core.basics.roofline",
         lambda: dict(intensity=np.array([0.5, 50.0]), peak_flops=1e12, bandwidth=1e11),
         bad={"intensity": [0.0, -1.0, np.array([1.0, -2.0]), "1"],
              "peak_flops": [0.0, -1.0], "bandwidth": [0.0, -1.0]},
         check=lambda r, kw: np.allclose(r, [5e10, 1e12])),
    Case("parlearn.core.basics.matmul_intensity", lambda: dict(size=12, element_bytes=4),
         ranges={"element_bytes": (1, None)}, bad={"size": [0, 0.5, np.array([4, 0]), "4"]},
         check=lambda r, kw: math.isclose(float(r), 2 * 12 / (3 * kw["element_bytes"]))),
    Case("parlearn.core.basics.measure_roofline",
         lambda: dict(sizes=[4], working_set=4096, peak_size=8, repeat=1, device="cpu", threads=1,
                      seed=0),
         ranges={"working_set": (1024, None), "peak_size": (1, None), "repeat": (1, None),
                 "threads": (1, None), "seed": (0, None)},
         bad={"sizes": [[], [0], [True], "12"], "device": ["tpu"]}, legal={"threads": [None]}),
    Case("parlearn.core.basics.roofline_bound",
         lambda: dict(intensity=[0.5, 3.0, 40.0], ridge_range=(2.0, 4.0), margin=2.0),
         ranges={"margin": (1, None)},
         bad={"intensity": [0.0, [1.0, -1.0], "1", [True]],
              "ridge_range": [(0.0, 1.0), (3.0, 2.0), (1.0,), "ab", 3.0, (1.0, math.nan)]},
         check=lambda r, kw: r == [
             "memory" if x < 2.0 / kw["margin"] else "compute" if x > 4.0 * kw["margin"]
             else "near the ridge" for x in kw["intensity"]]),
    Case("parlearn.core.overhead.fit_batching",
         lambda: dict(ns=[1, 4, 16], seconds=[2e-5, 2.6e-5, 5e-5]),
         bad={"ns": [[1, True, 4], [1, 0, 4], [4, 4, 4], [4], [1, 4], np.array([True, False])],
              "seconds": [[2e-5, -1.0, 5e-5], [2e-5, 0.0, 5e-5], [2e-5, math.nan, 5e-5],
                          [2e-5, True, 5e-5], [2e-5, 3e-5]]},
         check=lambda r, kw: np.testing.assert_allclose(
             r.predict(np.array(kw["ns"])), 1.8e-5 + 2e-6 * np.array(kw["ns"]), rtol=0.1)),
    Case("parlearn.core.overhead.BatchingFit",
         lambda: dict(t0=1e-5, c=1e-7, ns=(1, 4), seconds=(1.01e-5, 1.04e-5)),
         ranges={"t0": (0.0, None), "c": (0.0, None)},
         bad={"ns": [(1, True), (1, 0), (1, 2, 3), "12"],
              "seconds": [(1e-5, -1.0), (1e-5,), (1e-5, math.nan)]},
         check=lambda r, kw: math.isclose(r.speedup(4), 4 * (kw["t0"] + kw["c"])
                                          / (kw["t0"] + 4 * kw["c"]))),
    Case("parlearn.core.viz.measured_label", lambda: dict(name="ring", device="cpu"),
         legal=_free("name", "device")),
    Case("parlearn.core.viz.modeled_label", lambda: dict(name="ring", formula="2(p-1)/p n"),
         legal=_free("name", "formula", formula="2(p-1)/p n")),
    Case("parlearn.core.viz.plot_measured",
         lambda: dict(ax=_ax(), x=[1, 2, 3], y=[1.0, 2.0, 3.0], name="ring", device="cpu"),
         bad={"x": [[1, 2]]}, legal={**_free("name", "device"), "y": [[1.0, math.nan, 2.0]]}),
    Case("parlearn.core.viz.plot_modeled",
         lambda: dict(ax=_ax(), x=[1, 2, 3], y=[1.0, 2.0, 3.0], name="ring", formula="n"),
         bad={"x": [[1, 2]]}, legal=_free("name", "formula")),
    Case("parlearn.core.viz.mark_reliability", lambda: dict(ax=_ax(), reliable=True)),
    Case("parlearn.core.viz.log_ticks", lambda: dict(ax=_ax(log=True), axis="y")),
    Case("parlearn.distributed.cost.ring_bytes",
         lambda: dict(kind="all_reduce", payload_bytes=1024.0, world_size=4),
         ranges={"payload_bytes": (0.0, None), "world_size": (1, None)},
         check=lambda r, kw: math.isclose(
             r, 2 * (kw["world_size"] - 1) / kw["world_size"] * kw["payload_bytes"])),
    Case("parlearn.distributed.cost.AlphaBeta", lambda: dict(alpha=1e-5, beta=1e-9),
         ranges={"alpha": (0.0, None), "beta": (0.0, None)}),
    Case("parlearn.distributed.cost.collective_time",
         lambda: dict(kind="all_reduce", nbytes=4096.0, world_size=4,
                      model=_ab(), algorithm="ring"),
         ranges={"nbytes": (0.0, None), "world_size": (1, None)},
         bad={"model": [{"send": 3}]}),
    Case("parlearn.distributed.cost.hierarchical_all_reduce_time",
         lambda: dict(nbytes=1e6, gpus_per_node=4, nodes=2, intra=_ab(), inter=_ab()),
         ranges={"nbytes": (0.0, None), "gpus_per_node": (1, None), "nodes": (1, None)},
         bad={"intra": [1e-9, None], "inter": [(1e-5, 1e-9)]},
         check=lambda r, kw: math.isclose(r["total"], r["reduce_scatter"] + r["all_reduce"]
                                          + r["all_gather"])),
    Case("parlearn.distributed.cost.fit_alpha_beta",
         lambda: dict(sizes=[1e3, 1e4, 1e5], times=[2e-5, 2e-5 + 9e-6, 2e-5 + 9.9e-5],
                      kind="send", world_size=2, algorithm="ring"),
         ranges={"world_size": (2, None)},
         bad={"sizes": [[1e3], [1e3, -1.0, 1e5], [1e3, 1e4]], "times": [[1.0, math.nan, 2.0]]}),
    Case("parlearn.distributed.card.bus_factor", lambda: dict(kind="all_reduce", world_size=8),
         ranges={"world_size": (1, None)}),
    Case("parlearn.distributed.card.preset", lambda: dict(name="h100-ib")),
    Case("parlearn.distributed.launch.default_backend", lambda: dict(world_size=2),
         ranges={"world_size": (1, None)}),
    Case("parlearn.distributed.launch.device_for", lambda: dict(rank=0),
         ranges={"rank": (0, None)}),
    Case("parlearn.distributed.collectives.rank_tensor",
         lambda: dict(rank=0, numel=5, seed=0, dtype=torch.float64),
         ranges={"rank": (0, None), "numel": (0, None), "seed": (0, None)},
         bad={"dtype": [torch.int64]}),
    Case("parlearn.distributed.launch.run",
         lambda: dict(fn=_hello(), world_size=2, timeout=20.0, backend="gloo", start="fork",
                      doctor=False, env=None, records=None),
         ranges={"world_size": (1, 64)}, run_good=False,
         bad={"fn": [3], "backend": ["mpi-x"], "start": ["teleport"], "timeout": [0.0, -1.0],
              "env": [{"A": 1}, "A=1", {"TORCH_DISTRIBUTED_DEBUG": "LOUD"}],
              "records": [3, {}]},   # {} without doctor=True
         legal={"env": [None], "records": [None]}),
    Case("parlearn.distributed.launch.run_many",
         lambda: dict(fn=_hello(), world_size=2, calls=[(), ()]),
         ranges={"world_size": (1, 64)}, run_good=False,
         bad={"fn": [3], "calls": [[], "ab", [3], [(), None]]}),
    Case("parlearn.distributed.flight.recording", lambda: dict(folder="/tmp", rank=0),
         ranges={"rank": (0, None)}, bad={"folder": [3, "/no/such/folder"]}),
    Case("parlearn.distributed.flight.read_records", lambda: dict(folder="/tmp"),
         bad={"folder": [3, "/no/such/folder"]}, check=lambda r, kw: isinstance(r, dict)),
    Case("parlearn.distributed.diagnosis.diagnose",
         lambda: dict(records_by_rank={0: [_call()], 1: [_call()]}, exits=None),
         bad={"records_by_rank": [{}, [], {0: [3]}, {-1: []}, {0: "calls"}],
              "exits": [{5: "returned"}, {0: 3}, "returned"]},
         legal={"exits": [None]},
         check=lambda r, kw: r == "the 2 ranks agree on all 1 calls, and every call returned"),
    Case("parlearn.core.viz.timeline",
         lambda: dict(ax=_ax(), events=[("rank 0", "chain 1", 0.0, 0.5),
                                        ("rank 1", "wgrad 1", 0.2, 0.4)], title="t"),
         bad={"events": [[("rank 0", "chain", 1.0, 0.5)], [("rank 0", "", 0.0, 1.0)],
                         [("rank 0", "chain", 0.0, math.nan)], [("r", "chain", 0.0)], "ab"]},
         legal={"title": ["no such t"]}),
    Case("parlearn.core.viz.dag", lambda: dict(ax=_ax(), graph=basics.sum_graph(4, "chain"),
                                               title="t"),
         bad={"graph": [{}, {"leaves": ["x"], "ops": ["a"], "edges": [], "pos": {}}, 3]},
         legal={"title": ["no such t"]}),
    Case("parlearn.core.viz.convergence",
         lambda: dict(ax=_ax(), histories={"a": [1.0, 0.1, 0.0]}, ylabel="r"),
         bad={"histories": [{}, {"a": [1.0, -1.0]}, {"a": [[1.0]]}, {"a": ["x"]}]},
         legal={"ylabel": ["no such r"], "histories": [{"a": [1.0, math.nan]}]}),
    Case("parlearn.core.viz.plot_measured_sweep",
         lambda: dict(ax=_ax(), sweep=_sweep(), name="b", key="speedup"),
         bad={"name": ["c"], "sweep": [{}]}),
    Case("parlearn.core.bench.format_table", lambda: dict(rows=[_row()]),
         bad={"rows": [[3], "row", [_row(), None]]}),
    Case("parlearn.core.bench.rows_in_fresh_process",
         lambda: dict(module="parlearn.core.basics", quick=True), run_good=False,
         legal={"module": ["no such parlearn.core.basics"]}),
    *[Case(f"parlearn.bench.{f}", lambda: dict(names=["basics"], device="cpu", quick=True),
           run_good=False, bad={"names": [["nope"], "basics", [3]], "device": ["tpu"]},
           legal={"names": [None], "device": [None]}) for f in ("run", "run_by_name")],
    Case("parlearn.distributed.traffic.replace_collective",
         lambda: dict(kind="all_reduce", old=_noop, new=_noop),
         bad={"kind": ["allreduce"], "old": [3], "new": [3]}),
    Case("parlearn.distributed.measure.sweep_collective",
         lambda: dict(kinds=("all_reduce",), sizes=(64, 128), world_size=2, repeat=1, warmup=0),
         ranges={"world_size": (2, 64)}, run_good=False,
         bad={"kinds": [("allreduce",), ()], "sizes": [(2,), (), "64"], "repeat": [0],
              "warmup": [-1]}),
    Case("parlearn.distributed.measure.measure_alpha_beta",
         lambda: dict(world_size=2, sizes=(64, 128), repeat=1), ranges={"world_size": (2, 64)},
         run_good=False, bad={"sizes": [(2,), (), "64"], "repeat": [0]}),
    Case("parlearn.distributed.measure.measure_links",
         lambda: dict(world_size=2, sizes=(64, 128), repeat=1, kinds=("all_reduce",)),
         ranges={"world_size": (2, 64)}, run_good=False,
         bad={"sizes": [(2,), (), "64"], "repeat": [0], "kinds": [(), ("allreduce",)]}),
    Case("parlearn.distributed.measure.other_load", lambda: dict(fn=_noop), bad={"fn": [3]}),
    Case("parlearn.distributed.card.describe", lambda: dict(card=_card(), nbytes=2.0**20),
         bad={"nbytes": [0.0, -1.0], "card": [3]}),
]

test_refuses, test_accepts, test_accepts_range = contract_tests(CASES)

# The checks name the label their caller gives them, not an argument of their own.
COVERED_ELSEWHERE: dict[str, str] = {
    f"parlearn.core.checks.{name}": "tests/core/test_checks.py::test_" + test
    for name, test in [("check_int", "int_range"), ("check_float", "float_refuses_non_finite"),
                       ("check_ints", "ints_refuses_and_names_the_argument"),
                       ("check_bool", "choice_bool_callable_module"),
                       ("check_choice", "choice_keeps_bools_and_floats_apart_from_ints"),
                       ("check_callable", "choice_bool_callable_module"),
                       ("check_tensor", "tensor_checks"), ("check_module",
                                                           "choice_bool_callable_module"),
                       ("check_seed", "seed"), ("check_device", "device_and_str"),
                       ("check_str", "device_and_str")]
}
_WORKERS = ("tests/distributed/test_worker_contract.py::"
            "test_workers_refuse_bad_arguments_on_every_rank")
COVERED_ELSEWHERE.update({
    **{f"parlearn.distributed.collectives.{w}": _WORKERS
       for w in ("ring_check", "ring_trace", "ring_ledger", "ring_vs_torch", "collectives_demo",
                 "time_collectives", "ring_vs_gloo_times")},
    **{f"parlearn.distributed.card.{f}": "tests/distributed/test_card.py::"
       "test_bad_input_names_the_argument" for f in ("Card", "calibrate", "fit_card")},
    **{f"parlearn.core.reference.{f}":
       "tests/core/test_reference.py::test_bad_arguments_are_refused_naming_them"
       for f in ("record", "table", "show")},
    "parlearn.core.reference.load":
        "tests/core/test_reference.py::test_a_file_that_is_not_a_reference_is_refused",
    "parlearn.core.reference.Reference":
        "tests/core/test_reference.py::test_recorded_rows_come_back_with_their_label",
    "parlearn.core.recipe.Recipe": [
        "tests/core/test_recipe.py::test_bad_recipes_are_refused_naming_the_argument",
        "tests/core/test_recipe.py::test_bad_uses_are_refused"],
    "parlearn.core.datasets.Split":
        "tests/core/test_datasets.py::test_split_refuses_labels_beyond_n_classes",
    "parlearn.core.widgets.control": "tests/core/test_widgets.py::test_bad_controls_and_params",
    "parlearn.core.widgets.Dashboard": ["tests/core/test_widgets.py::test_bad_controls_and_params",
                                        "tests/core/test_widgets.py::test_ncols_is_checked"],
    "parlearn.core.widgets.OptionalRun":
        "tests/core/test_widgets.py::test_optional_run_now_runs_at_once_and_raises",
    "parlearn.core.widgets.Predict": "tests/core/test_widgets.py::"
                                     "test_predict_refuses_what_it_cannot_show",
    "parlearn.distributed.collectives.plot_hierarchical":
        "tests/distributed/test_dist.py::"
        "test_plot_hierarchical_draws_three_phases_and_refuses_bad_shapes",
    "parlearn.distributed.collectives.plot_collectives":
        "tests/distributed/test_dist.py::test_plot_collectives_draws_every_collective",
    "parlearn.distributed.collectives.ring_all_reduce":
        "tests/distributed/test_worker_contract.py::test_ring_collectives_refuse_non_tensors",
    "parlearn.distributed.collectives.ring_reduce_scatter":
        "tests/distributed/test_worker_contract.py::test_ring_collectives_refuse_non_tensors",
    "parlearn.distributed.collectives.ring_all_gather":
        "tests/distributed/test_worker_contract.py::test_ring_collectives_refuse_non_tensors",
    "parlearn.bench.main": "tests/test_bench.py::test_unknown_benchmark_is_refused",
    "parlearn.distributed.agree.agree": "tests/multi_device/test_context_parallel.py::"
        "test_ring_attention_checks_dtypes_and_agreement_before_the_first_send",
    "parlearn.distributed.measure.ring_vs_gloo":
        "tests/distributed/test_measure.py::test_study_refuses_bad_arguments_naming_them",
})
EXEMPT: dict[str, str] = {
    "parlearn.core.settings.is_fast": "takes no arguments; reads PARLEARN_FAST, checked there",
    "parlearn.core.settings.banner": "takes no arguments, returns a line of text",
    "parlearn.core.settings.size": "returns one of its two arguments as given: any value",
    "parlearn.bench.registry": "takes no arguments, lists the bench entries",
    "parlearn.distributed.card.anchors": "takes no arguments, returns published figures",
    "parlearn.distributed.traffic.ledger": "takes no arguments: a context manager recording",
    "parlearn.distributed.traffic.Ledger": "takes no arguments; the ledger() block builds it",
    "parlearn.distributed.traffic.Record": "a record the ledger writes; users only read it",
    "parlearn.distributed.diagnosis.Call": "a record the flight recorder writes; users read it",
    "parlearn.distributed.flight.FlightRecorder": "built by recording(); users only call "
                                                  "note(text), checked there",
    "parlearn.core.timing.Timing": "a result record measure() builds; users only read it",
    "parlearn.core.timing.Comparison": "a result record compare() builds; users only read it",
    "parlearn.distributed.agree.describe": "takes any object and returns a summary of it",
    "parlearn.core.bench.Row": "a bench table row that bench functions build and print",
    "parlearn.distributed.launch.RankError": "an exception run() raises, not called by users",
    "parlearn.distributed.collectives.hello": "a worker of (rank, world_size) only, which run() "
                                              "checks before it starts a rank",
    "parlearn.distributed.measure.bench":
        "a bench entry that python -m parlearn.bench runs with its own checked device and quick",
}

# Public callables whose contract test is still to be written (test_completeness: only shrinks).
PENDING: list[str] = []
