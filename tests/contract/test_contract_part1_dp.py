"""The argument contract of data_parallel's workers, compression hook and slow link, and of
batching's closed forms, halves, noise-scale estimates, tasks and sweep (from part1_training)."""

from __future__ import annotations

import math
import statistics

import torch
from harness import Case, contract_tests

P = "parlearn.multi_device."


def _ab():
    from parlearn.distributed.cost import AlphaBeta

    return AlphaBeta(1e-5, 1e-9)


def _problem():
    from parlearn.multi_device.batching.tasks import LinearRegressionProblem

    return LinearRegressionProblem(4, seed=0)


def _task():
    from parlearn.multi_device.batching.tasks import RegressionTask

    return RegressionTask(_problem())


def _delays():
    from parlearn.multi_device.data_parallel.stragglers import DelayModel

    return DelayModel()


def _split():
    """A tiny digits-like split: 5 features, 3 classes."""
    from parlearn.core.datasets import Split

    g = torch.Generator().manual_seed(0)
    return Split(x_train=torch.randn(12, 5, generator=g), y_train=torch.arange(12) % 3,
                 x_test=torch.randn(6, 5, generator=g), y_test=torch.arange(6) % 3, n_classes=3)


def _rand(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _labels(*shape, k=3):
    return torch.randint(0, k, shape, generator=torch.Generator().manual_seed(1))


def _linear(d_in=3, d_out=2):
    return torch.nn.Linear(d_in, d_out).double()


def _holds(cond: bool) -> None:
    assert cond


def _mse(out, y):
    return (out - y).square().mean()


def _halves_average_to_the_full_gradient(result, kw):
    """Equal halves of a mean loss: (a + b) / 2 is the full batch's gradient; .grad untouched."""
    a, b = result
    model = kw["model"]
    grads = torch.autograd.grad(kw["loss_fn"](model(kw["x"]), kw["y"]), list(model.parameters()))
    full = torch.cat([g.reshape(-1) for g in grads])
    torch.testing.assert_close((a + b) / 2, full, rtol=1e-12, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())


def _noise_estimates(r, kw):
    assert r["trace"] >= 0 and -1 - 1e-12 <= r["cos"] <= 1 + 1e-12
    assert r["b_simple"] == (r["trace"] / r["g2"] if r["g2"] > 0 else math.inf)
    assert ("b_noise" in r) == (kw["hessian_data"] is not None)


def _fake_check(**over):
    """A slow_link_check result: the fields plot_check draws."""
    side = {"measured": 1.5, "q1": 1.2, "q3": 1.8, "modeled": 1.7,
            "steps": {"local": {"median": 0.01}},
            "charged": {"bucketed": (400.0, 0.1), "compressed": (108.0, 0.03)}}
    return {"crossover": 1e8, "alpha": 1e-4, "numel": 100, "coding": (5e-9, 1e-9),
            "below": {**side, "bandwidth": 2.5e7}, "above": {**side, "bandwidth": 4e8},
            **over}


def _steps(times0, times1, kinds=("local", "naive")):
    return [{k: {"times": list(t), "bytes": {"all_reduce": 8}} for k in kinds}
            for t in (times0, times1)]


def _slowest_rank_median(r, kw):
    res, skip = kw["results"], kw["skip"]
    for k in res[0]:
        per_step = [max(x[k]["times"][i] for x in res) for i in range(len(res[0][k]["times"]))]
        assert r[k]["median"] == statistics.median(per_step[skip:])
        assert r[k]["q1"] <= r[k]["median"] <= r[k]["q3"]


def _sweep_rows(r, kw):
    assert [row["batch"] for row in r["rows"]] == kw["batches"]
    assert all(row["lr"] in kw["lrs"] for row in r["rows"] if row["lr"] is not None)
    assert r["fit"]["s_min"] > 0


BAD_SPLIT = ["digits", 3]
RANK_OF_2 = {"rank": [2, -1], "world_size": [0]}

CASES: list[Case] = [
    # --- batching: closed forms -------------------------------------------------------------
    Case(P + "batching.noise_scale.expected_cosine", lambda: dict(b_simple=10.0, batch=32.0),
         ranges={"b_simple": (0.0, None)}, bad={"batch": [0.0, -1.0]}),
    Case(P + "batching.noise_scale.controller_fixed_point",
         lambda: dict(b_simple=10.0, target=0.5),
         ranges={"b_simple": (0.0, None)}, bad={"target": [0.0, 1.0, 1.5]}),
    Case(P + "batching.noise_scale.adascale_gain", lambda: dict(sigma2=1.0, g2=0.5, scale=4.0),
         ranges={"sigma2": (0.0, None), "g2": (0.0, None), "scale": (1.0, None)}),
    Case(P + "batching.noise_scale.adascale_gain_from_b_simple",
         lambda: dict(b_simple=10.0, base_batch=8.0, batch=32.0),
         ranges={"b_simple": (0.0, None), "batch": (8.0, None)},
         bad={"base_batch": [0.0, -1.0]}),
    Case(P + "batching.noise_scale.steps_samples_model",
         lambda: dict(batch=[8.0, 32.0], b_noise=16.0, s_min=100.0),
                  bad={"batch": [[0.0], [-1.0], [True], "8", [math.nan]], "b_noise": [0.0],
              "s_min": [0.0]}),
    Case(P + "batching.noise_scale.critical_batch_fit",
         lambda: dict(batches=[8.0, 16.0, 64.0], steps=[300.0, 200.0, 125.0]),
         bad={"batches": [[8.0], [8.0, 8.0, 8.0], [0.0, 16.0, 64.0], "abc"],
              "steps": [[300.0, 200.0], [300.0, -1.0, 125.0], [300.0, math.nan, 125.0]]}),
    Case(P + "batching.tradeoff.tradeoff_model",
         lambda: dict(b_noise=[8.0, 16.0], batch=None, factor=2.0, power=1.0),
         legal={"batch": [None]},
         bad={"b_noise": [[], [0.0], [True], "8"], "factor": [0.0], "power": [0.0]}),
    Case(P + "batching.tradeoff.frontier_samples",
         lambda: dict(rows=[{"steps": 100, "samples": 800}, {"steps": 50, "samples": 1600}],
                      steps=70.0),
         bad={"rows": ["rows", [{"steps": 1}], [3]], "steps": [0.0, -1.0]}),
    Case(P + "batching.halves.probe_bytes", lambda: dict(n_params=100, world_size=4,
                                                         element_size=4),
         ranges={"n_params": (1, None), "element_size": (1, None)},
         bad={"world_size": [0, 1, 3]}),
    # --- batching: the two halves -----------------------------------------------------------
    Case(P + "batching.halves.half_gradients",
         lambda: dict(model=_linear(), loss_fn=_mse, x=_rand(8, 3), y=_rand(8, 2, seed=1),
                      world_size=2, accum=2),
         bad={"loss_fn": ["mse", 3], "world_size": [0, 1, 3, 16], "accum": [0, -1, 3],
              "x": [_rand(7, 3), torch.tensor(1.0)], "y": [_rand(6, 2), torch.tensor(1.0)]},
         check=_halves_average_to_the_full_gradient),
    # Inside a worker: the group is built after the checks, so the legal call is not run here.
    Case(P + "batching.halves.half_groups", lambda: dict(world_size=2),
         bad={"world_size": [0, 1, 3, -2]}, run_good=False),
    Case(P + "batching.halves.worker_half_gradients",
         lambda: dict(rank=0, world_size=2, model=_linear(), x=_rand(8, 3), y=_labels(8, k=2),
                      accum=1),
         bad={"rank": [2, -1], "world_size": [0, 1, 3], "accum": [0, 3],
              "x": [_rand(7, 3), torch.tensor(1.0)], "y": [_labels(6, k=2)]}, run_good=False),
    # --- batching: estimates, tasks, the sweep ----------------------------------------------
    Case(P + "batching.noise_scale.monte_carlo_halves",
         lambda: dict(problem=_problem(), w=torch.zeros(4, dtype=torch.float64), batch=8, reps=3,
                      seed=0, chunk=2),
         ranges={"reps": (1, None), "seed": (0, None), "chunk": (1, None)},
         bad={"problem": ["p", 3], "w": [torch.zeros(3), torch.zeros(4, dtype=torch.int64)],
              "batch": [0, 1, 3]},
         check=lambda r, kw: _holds(len(r) == kw["reps"]
                                   and all(s.batch == kw["batch"] for s in r))),
    Case(P + "batching.noise_scale.measure_noise_scale",
         lambda: dict(model=_problem().model(), task=_task(), batch=8, reps=2, first_draw=0,
                      hessian_data=_problem().sample(16, torch.Generator().manual_seed(5))),
         ranges={"reps": (1, None), "first_draw": (0, None)}, legal={"hessian_data": [None]},
         bad={"task": ["task", 3], "batch": [0, 1, 3],
              "hessian_data": ["xy", 3, (_rand(4, 4),), (_rand(4, 4), _rand(3)),
                               (_rand(4, 4), "y")]},
         check=_noise_estimates),
    Case(P + "batching.tasks.DigitsTask", lambda: dict(split=_split(), seed=0),
         ranges={"seed": (0, None)}, bad={"split": BAD_SPLIT},
         check=lambda r, kw: _holds([t.shape for t in r.draw(0, 4)] == [(4, 5), (4,)])),
    Case(P + "batching.tradeoff.batch_sweep",
         lambda: dict(model=_problem().model(), task=_task(), batches=[2, 8], lrs=[0.5],
                      target_loss=0.1, steps=200, progress=None),
         legal={"progress": [None]},
         bad={"task": ["task", 3], "batches": [[], "28", 3, [1], [2.5], [True]],
              "lrs": [[], "0.5", 0.5, [0.0], [math.nan]], "steps": [0, -1],
              "target_loss": [None],
              "progress": ["p", 3]},
         check=_sweep_rows),
    # Bench rows: they train and run rank processes (run_good=False); device checked, unused.
    Case(P + "batching.tradeoff.bench", lambda: dict(device=torch.device("cpu"), quick=True),
         run_good=False),
    Case(P + "data_parallel.workers.bench", lambda: dict(device=torch.device("cpu"), quick=True),
         run_good=False),
    # --- data parallel: the 8-bit hook's state, the slow link -------------------------------
    Case(P + "data_parallel.compression.Dettmers8HookState",
         lambda: dict(group=None, error_feedback=True),
         legal={"group": [None]}, bad={"group": ["world", 3]},
         check=lambda r, kw: _holds((r.error_feedback is not None) == kw["error_feedback"])),
    Case(P + "data_parallel.slow_link.emulated_link",
         lambda: dict(alpha=1e-4, bandwidth=1e9, sleep=lambda s: None),
         ranges={"alpha": (0.0, None)}, bad={"bandwidth": [0.0, -1.0], "sleep": ["sleep", 3]},
         check=lambda r, kw: _holds(hasattr(r, "__enter__") and hasattr(r, "__exit__"))),
    Case(P + "data_parallel.slow_link.plot_check",
         lambda: dict(ax=None, check=_fake_check(), real=_ab()), run_good=False,
         skip={"ax": "matplotlib axes, drawn on"},
         bad={"check": ["check", 3, {}, _fake_check(coding=(1e-9,)), _fake_check(below=3),
                       _fake_check(numel=0), _fake_check(crossover=math.nan),
                       _fake_check(above={"bandwidth": 4e8})],
              "real": ["ib", (1e-4, 1e-9)]}),
    # --- data parallel: workers. Every argument is checked before the first message
    # (dist.run gives every rank the same ones); the legal calls need a group: not run here.
    Case(P + "data_parallel.stragglers.worker_backup_sgd",
         lambda: dict(rank=1, world_size=3, model=torch.nn.Linear(4, 3),
                      xs=[_rand(2, 2, 4, dtype=torch.float32)] * 2, ys=[_labels(2, 2)] * 2,
                      b=1, delays=_delays(), lr=0.1, steps=2,
                      eval_data=(_rand(5, 4, dtype=torch.float32), _labels(5))),
         run_good=False, legal={"eval_data": [None]},
         bad={"rank": [3, -1], "world_size": [1, 0],
              "xs": ["xs", [_rand(2, 2, 4)], [_rand(1, 2, 4)] * 2, [_rand(2, 4)] * 2,
                    [_rand(2, 2, 4), "x"]],
              "ys": [[_labels(2, 3)] * 2, [torch.zeros(2, 2)] * 2, [_labels(2)] * 2],
              "b": [2, -1], "delays": ["exp", 3], "lr": [0.0, -1.0], "steps": [0, 3],
              "eval_data": ["xy", (_rand(5, 4),), (_rand(5, 4), _labels(4)),
                            (_rand(5, 4), torch.zeros(5))]}),
    Case(P + "data_parallel.workers.worker_step_time",
         lambda: dict(rank=0, world_size=2, kinds=("local", "naive"), widths=[4, 8, 2], batch=4,
                      steps=1, bucket_bytes=1024, seed=0, link=(1e-4, 1e9)),
         run_good=False, legal={"link": [None]},
         ranges={"batch": (1, None), "steps": (1, None), "bucket_bytes": (1, None),
                 "seed": (0, None)},
         bad={**RANK_OF_2, "kinds": ["local", (), ("lcoal",), ("local", "local"), 3],
              "widths": ["48", [4], [4, 0]],
              "link": [(1e-4,), (1e-4, 0.0), (-1.0, 1e9), (math.nan, 1e9), "ab"]}),
    Case(P + "data_parallel.workers.worker_digits",
         lambda: dict(rank=0, world_size=2, method="fp32", data=_split(), steps=1, batch=4,
                      lr=0.1, hidden=8, seed=0, eval_every=1),
         run_good=False,
         ranges={"steps": (1, None), "batch": (1, None), "hidden": (1, None), "seed": (0, None),
                 "eval_every": (1, None)},
         bad={**RANK_OF_2, "data": BAD_SPLIT, "lr": [0.0, -1.0]}),
    Case(P + "data_parallel.workers.summarize_steps",
         lambda: dict(results=_steps([0.3, 0.1, 0.2, 0.4], [0.2, 0.3, 0.1, 0.5]), skip=1),
         ranges={"skip": (0, 3)},
         bad={"results": ["r", [], [3], {"local": {}}, [{"local": {}}],
                          _steps([0.1, 0.2], [0.1, 0.2, 0.3]),
                          _steps([0.1, 0.2], [0.1, math.nan]),
                          [_steps([0.1], [0.1])[0], _steps([0.1], [0.1], kinds=("naive",))[0]]],
              "skip": [4]},
         check=_slowest_rank_median),
    Case(P + "data_parallel.workers.rank_coding_seconds",
         lambda: dict(numel=64, repeat=1, seed=0), run_good=False,
         ranges={"numel": (1, None), "repeat": (1, None), "seed": (0, None)}),
    Case(P + "data_parallel.workers.worker_rank_coding",
         lambda: dict(rank=0, world_size=2, numel=64, repeat=1), run_good=False,
         ranges={"numel": (1, None), "repeat": (1, None)}, bad=RANK_OF_2),
    Case(P + "data_parallel.workers.worker_slow_link",
         # coding None: measured and broadcast, so every other check must come before that
         lambda: dict(rank=0, world_size=2, widths=[8, 64, 4], batch=8, steps=3,
                      real=(1e-4, 1e-9), alpha=0.0, factor=4.0, coding=None),
         run_good=False,
         ranges={"batch": (1, None), "steps": (1, None), "alpha": (0.0, None)},
         bad={**RANK_OF_2, "widths": ["8", [8], 3], "real": ["ab", (1e-4,), (-1.0, 1e-9)],
              "factor": [1.0, 0.5], "coding": [(1e-8,), (math.nan, 0.0), "qd"]}),
    # Launches 2 ranks: every argument is checked before they start.
    Case(P + "data_parallel.workers.slow_link_check",
         lambda: dict(widths=[8, 64, 4], real=_ab(), coding=(5e-8, 1e-8), alpha=0.0, factor=4.0,
                      batch=32, steps=3),
         run_good=False, legal={"coding": [None]},
         ranges={"batch": (1, None), "steps": (3, None), "alpha": (0.0, None)},
         bad={"widths": ["8", [8], [8, 0], 3], "real": ["ib", (1e-4, 1e-9)],
              "factor": [1.0, 0.5], "coding": [(1e-8,), (-1.0, 1e-8), "ab"]}),
]

test_refuses, test_accepts, test_accepts_range = contract_tests(CASES)

R_TEST = "tests/multi_device/test_dp_refusals.py::"
COVERED_ELSEWHERE: dict[str, str] = {
    # NaN in x is found from the chunk scales, which need the world size: on ranks only.
    P + "data_parallel.compression.compressed_all_reduce":
        R_TEST + "test_compressed_all_reduce_refuses_on_every_rank",
    # its bucket is a GradBucket, which only DDP builds
    P + "data_parallel.compression.dettmers8_hook": R_TEST + "test_dettmers8_hook_refuses",
    # launch ranks or draw on axes: refusals and a run in their own test file
    P + "data_parallel.explorer.explorer_step":
        "tests/multi_device/test_dp_explorer.py::test_explorer_step_refuses_before_launching",
    P + "data_parallel.explorer.plot_explorer":
        "tests/multi_device/test_dp_explorer.py::test_plot_explorer_refuses_other_results",
    P + "data_parallel.explorer.cluster_timeline":
        "tests/multi_device/test_dp_explorer.py::"
        "test_cluster_timeline_draws_the_model_and_its_exposed_tail",
}
EXEMPT: dict[str, str] = {}
