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


CASES = [
    Case("parlearn.core.basics.amdahl", lambda: dict(serial_fraction=0.1, workers=8),
         ranges={"serial_fraction": (0.0, 1.0), "workers": (1, None)}, check=_amdahl_exact,
         bad={"workers": [np.array([2, True])]}),
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
         ranges={"n": (1, None), "size": (1, None), "alpha": (0.0, None), "beta": (0.0, None)}),
    Case("parlearn.core.models.mlp", lambda: dict(widths=[4, 3, 2], seed=0),
         ranges={"seed": (0, None)}, bad={"widths": [[4], [4, 0, 2], [4, True], [4, 2.0]]}),
    Case("parlearn.core.models.mlp_param_bytes", lambda: dict(widths=[4, 3, 2], element_size=4),
         ranges={"element_size": (1, None)},
         bad={"widths": [[4], [4, 0, 2], [4, True], [4, 2.5], "42"]},
         check=lambda r, kw: r == [a * b * kw["element_size"] for a, b in
                                   zip(kw["widths"][:-1], kw["widths"][1:], strict=True)
                                   for a, b in ((a, b), (1, b))]),
]

test_refuses, test_accepts, test_accepts_range = contract_tests(CASES)

# The checks name the label their caller gives them, not an argument of their own.
COVERED_ELSEWHERE: dict[str, str] = {
    f"parlearn.core.checks.{name}": "tests/core/test_checks.py::test_" + test
    for name, test in [("check_int", "int_range"), ("check_float", "float_refuses_non_finite"),
                       ("check_bool", "choice_bool_callable_module"),
                       ("check_choice", "choice_keeps_bools_and_floats_apart_from_ints"),
                       ("check_callable", "choice_bool_callable_module"),
                       ("check_tensor", "tensor_checks"), ("check_module",
                                                           "choice_bool_callable_module"),
                       ("check_seed", "seed")]
}
EXEMPT: dict[str, str] = {}

# Public callables whose contract test is still to be written (test_completeness: only shrinks).
PENDING = [
    "parlearn.bench.main",
    "parlearn.bench.registry",
    "parlearn.bench.run",
    "parlearn.core.basics.fit_batching_model",
    "parlearn.core.basics.sweep_batching",
    "parlearn.core.bench.Row",
    "parlearn.core.bench.format_table",
    "parlearn.core.bench.rows_in_fresh_process",
    "parlearn.core.datasets.Split",
    "parlearn.core.datasets.digits",
    "parlearn.core.device.describe",
    "parlearn.core.device.describe_str",
    "parlearn.core.device.fake_jax_cpu_devices",
    "parlearn.core.device.pick_device",
    "parlearn.core.device.sync",
    "parlearn.core.device.threads",
    "parlearn.core.settings.banner",
    "parlearn.core.settings.is_fast",
    "parlearn.core.settings.size",
    "parlearn.core.timing.Comparison",
    "parlearn.core.timing.Timing",
    "parlearn.core.timing.compare",
    "parlearn.core.timing.measure",
    "parlearn.core.timing.sweep",
    "parlearn.core.viz.convergence",
    "parlearn.core.viz.log_ticks",
    "parlearn.core.viz.mark_reliability",
    "parlearn.core.viz.measured_label",
    "parlearn.core.viz.modeled_label",
    "parlearn.core.viz.plot_measured",
    "parlearn.core.viz.plot_measured_sweep",
    "parlearn.core.viz.plot_modeled",
    "parlearn.core.viz.timeline",
    "parlearn.core.widgets.Dashboard",
    "parlearn.core.widgets.OptionalRun",
    "parlearn.core.widgets.control",
    "parlearn.distributed.card.Card",
    "parlearn.distributed.card.anchors",
    "parlearn.distributed.card.bus_factor",
    "parlearn.distributed.card.calibrate",
    "parlearn.distributed.card.describe",
    "parlearn.distributed.card.fit_card",
    "parlearn.distributed.card.preset",
    "parlearn.distributed.collectives.collectives_demo",
    "parlearn.distributed.collectives.hello",
    "parlearn.distributed.collectives.plot_collectives",
    "parlearn.distributed.collectives.rank_tensor",
    "parlearn.distributed.collectives.ring_all_gather",
    "parlearn.distributed.collectives.ring_all_reduce",
    "parlearn.distributed.collectives.ring_check",
    "parlearn.distributed.collectives.ring_ledger",
    "parlearn.distributed.collectives.ring_reduce_scatter",
    "parlearn.distributed.collectives.ring_trace",
    "parlearn.distributed.collectives.ring_vs_gloo_times",
    "parlearn.distributed.collectives.ring_vs_torch",
    "parlearn.distributed.collectives.time_collectives",
    "parlearn.distributed.cost.AlphaBeta",
    "parlearn.distributed.cost.collective_time",
    "parlearn.distributed.cost.fit_alpha_beta",
    "parlearn.distributed.cost.ring_bytes",
    "parlearn.distributed.launch.RankError",
    "parlearn.distributed.launch.default_backend",
    "parlearn.distributed.launch.device_for",
    "parlearn.distributed.launch.run",
    "parlearn.distributed.measure.bench",
    "parlearn.distributed.measure.measure_alpha_beta",
    "parlearn.distributed.measure.measure_links",
    "parlearn.distributed.measure.other_load",
    "parlearn.distributed.measure.ring_vs_gloo",
    "parlearn.distributed.measure.sweep_collective",
    "parlearn.distributed.traffic.Ledger",
    "parlearn.distributed.traffic.Record",
    "parlearn.distributed.traffic.ledger",
    "parlearn.distributed.traffic.replace_collective",
]
