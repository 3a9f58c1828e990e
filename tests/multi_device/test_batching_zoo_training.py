"""Adaptive-batch training (SimiGrad's controller, AdaScale's gain) on the users' model zoo:
real ranks equal the one-process reference, batch for batch; frozen parameters never move."""

from __future__ import annotations

import copy

import pytest
import torch
import zoo

from parlearn import dist
from parlearn.multi_device.batching import training as bt


class ZooTask:
    """Fresh zoo batches each step (from the step, identically on every rank)."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.x_eval, self.y_eval = zoo.batch(64, dtype, seed=99)

    def draw(self, step, n):
        return zoo.batch(n, self.dtype, seed=1000 + step)

    def loss_fn(self, out, y):
        return torch.nn.functional.cross_entropy(out, y)

    def eval_loss(self, model):
        with torch.no_grad():
            return float(self.loss_fn(model(self.x_eval), self.y_eval))


KW = {"steps": 6, "lr": 0.3, "batch": 8, "base_batch": 4, "target": 0.6, "step": 0.3,
      "micro": 2}


@pytest.mark.parametrize("name", [n for n in zoo.ZOO if "batchnorm" not in zoo.FEATURES[n]])
@pytest.mark.parametrize("method", ["simigrad", "adascale"])
def test_on_ranks_equals_one_process_on_the_zoo(name, method):
    model = zoo.build(name, torch.float64)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    task, kw = ZooTask(torch.float64), {**KW, "method": method}
    ranks = dist.run(bt.worker_train, 2, args=(copy.deepcopy(model), task, kw), timeout=60)
    before = zoo.frozen(model)
    ref = bt.train(model, task, world_size=2, **kw)
    zoo.assert_frozen_unmoved(model, before)
    for h in ranks:
        assert h.batch == ref.batch
        for k in ref.params:
            torch.testing.assert_close(h.params[k], ref.params[k], rtol=1e-10, atol=1e-10)
    assert all(not torch.equal(ref.params[n], v) for n, v in start.items())   # it trained


@pytest.mark.parametrize("name", [n for n in zoo.ZOO if "batchnorm" not in zoo.FEATURES[n]])
def test_runs_in_one_launch_equal_one_process_each_on_the_zoo(name):
    """train_runs: both methods in one launch, each from its own copy of the model."""
    model = zoo.build(name, torch.float64)
    task = ZooTask(torch.float64)
    runs = [{**KW, "method": m} for m in ("simigrad", "adascale")]
    before = zoo.frozen(model)
    per_run = bt.train_runs(model, task, runs, world_size=2, timeout=60)
    for i, kw in enumerate(runs):
        ref = bt.train(copy.deepcopy(model), task, world_size=2, **kw)
        for h in per_run[i]:
            assert h.batch == ref.batch
            for k in ref.params:
                torch.testing.assert_close(h.params[k], ref.params[k], rtol=1e-10, atol=1e-10)
    zoo.assert_frozen_unmoved(model, before)
    a, b = per_run[0][0].params, per_run[1][0].params
    assert any(not torch.equal(a[k], b[k]) for k in a)          # two methods, two results


@pytest.mark.parametrize("name", [n for n in zoo.ZOO if "batchnorm" not in zoo.FEATURES[n]])
def test_noise_scale_and_sweep_run_on_the_zoo_and_leave_the_model_alone(name):
    from parlearn.multi_device.batching.noise_scale import measure_noise_scale
    from parlearn.multi_device.batching.tradeoff import batch_sweep

    model = zoo.build(name, torch.float64)
    task = ZooTask(torch.float64)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    with zoo.kept_state(model):
        res = measure_noise_scale(model, task, 8, 4, hessian_data=(task.x_eval, task.y_eval))
        sweep = batch_sweep(model, task, [4, 8], [0.1], target_loss=10.0, steps=3)
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    assert res["b_simple"] == res["b_simple"] and res["b_noise"] == res["b_noise"]   # not NaN
    assert -1.0 <= res["cos"] <= 1.0
    assert [r["batch"] for r in sweep["rows"]] == [4, 8]
