"""Synchronous SGD with backup workers, on the users' model zoo: with no backup (b = 0) and no
straggler, every step equals one-process SGD on all the workers' batches together; a frozen
parameter never moves; BatchNorm (per-worker statistics) is refused up front."""

from __future__ import annotations

import pytest
import torch
import zoo

from parlearn import dist
from parlearn.multi_device.data_parallel.stragglers import DelayModel, worker_backup_sgd

WORKERS, STEPS, BATCH, LR = 2, 3, 5, 0.2


def _data(dtype):
    xs, ys = [], []
    for w in range(WORKERS):
        pairs = [zoo.batch(BATCH, dtype, seed=40 + 10 * w + t) for t in range(STEPS)]
        xs.append(torch.stack([x for x, _ in pairs]))
        ys.append(torch.stack([y for _, y in pairs]))
    return xs, ys


def _run(rank, world, name, dtype):
    xs, ys = _data(dtype)
    return worker_backup_sgd(rank, world, zoo.build(name, dtype), xs, ys, 0,
                             DelayModel(kind="none"), LR, STEPS)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("name, dtype", zoo.cases(dtypes=(torch.float64,))
                         + [("frozen", torch.float32)])
def test_equals_one_process_sgd_on_the_zoo(name, dtype):
    if "batchnorm" in zoo.FEATURES[name]:
        with pytest.raises(dist.RankError, match="BatchNorm1d"):
            dist.run(_run, WORKERS + 1, args=(name, dtype), timeout=30)
        return
    res = dist.run(_run, WORKERS + 1, args=(name, dtype), timeout=30)
    xs, ys = _data(dtype)
    model = zoo.build(name, dtype)
    before = zoo.frozen(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for t in range(STEPS):
        for w in range(1, WORKERS + 1):   # every worker computed at this step's parameters
            torch.testing.assert_close(res[w]["thetas"][t], _flat(model), rtol=tol, atol=tol)
        opt.zero_grad()
        x = torch.cat([xs[w][t] for w in range(WORKERS)])
        y = torch.cat([ys[w][t] for w in range(WORKERS)])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    zoo.assert_frozen_unmoved(model, before)
