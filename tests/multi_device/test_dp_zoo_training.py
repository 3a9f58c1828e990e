"""The lesson's DP training (worker_train under our two wrappers and torch's DDP, with and
without accumulation) on the users' model zoo equals train_reference, one process on the
whole batch; BatchNorm is refused up front by all three, naming it."""

from __future__ import annotations

import pytest
import torch
import zoo

from parlearn import dist
from parlearn.multi_device.data_parallel import ddp as D

STEPS = 2


def _data(n, dtype):
    pairs = [zoo.batch(n, dtype, seed=20 + t) for t in range(STEPS)]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _worker(rank, world, name, dtype, accum):
    xs, ys = _data(14 * accum, dtype)   # 7 rows per micro-batch and rank: a prime
    out = {}
    for kind in ("naive", "bucketed", "ddp"):
        model = zoo.build(name, dtype)
        try:
            out[kind] = D.worker_train(rank, world, kind, model, xs, ys, 0.1, "adam", accum,
                                       256)["snapshots"]
        except ValueError as e:
            out[kind] = str(e)
    return out


@pytest.mark.parametrize("name, dtype", zoo.cases(dtypes=(torch.float64,))
                         + [("frozen", torch.float32), ("conv", torch.float32)])
@pytest.mark.parametrize("accum", [1, 2])
def test_worker_train_on_the_zoo_equals_train_reference(name, dtype, accum):
    ranks = dist.run(_worker, 2, args=(name, dtype, accum), timeout=60)
    xs, ys = _data(14 * accum, dtype)
    model = zoo.build(name, dtype)
    before = zoo.frozen(model)
    if "batchnorm" in zoo.FEATURES[name]:
        for r in ranks:
            assert all(isinstance(v, str) and "BatchNorm1d" in v for v in r.values()), r
        return
    ref = D.train_reference(model, xs, ys, lr=0.1, optimizer="adam")
    zoo.assert_frozen_unmoved(model, before)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    for r in ranks:
        for kind, snaps in r.items():
            assert not isinstance(snaps, str), (kind, snaps)
            for t, (got, want) in enumerate(zip(snaps, ref, strict=True)):
                for n in want:
                    torch.testing.assert_close(got[n], want[n], rtol=tol, atol=tol,
                                               msg=f"{kind} step {t} {n}")
