"""The adaptive-batching probes on the users' model zoo: the two half-batch gradients average
to the whole batch's gradient (every model without batch statistics), on one process and on
real ranks, leaving .grad, the RNG and threads as they were."""

from __future__ import annotations

import pytest
import torch
import zoo

from parlearn import dist
from parlearn.multi_device.batching.halves import half_gradients, worker_half_gradients

NO_BATCH_STATS = [n for n in zoo.ZOO if "batchnorm" not in zoo.FEATURES[n]]


def _flat_full_grad(model, x, y):
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)
    return torch.cat([g.reshape(-1) for g in grads])


@pytest.mark.parametrize("name, dtype", zoo.cases(names=NO_BATCH_STATS))
@pytest.mark.parametrize("world, accum", [(2, 1), (4, 2)])
def test_halves_average_to_the_whole_batch(name, dtype, world, accum):
    model = zoo.build(name, dtype)
    x, y = zoo.batch(8 * world * accum // 2, dtype)
    before = zoo.frozen(model)
    with zoo.kept_state(model):
        a, b = half_gradients(model, torch.nn.functional.cross_entropy, x, y,
                              world_size=world, accum=accum)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close((a + b) / 2, _flat_full_grad(model, x, y), rtol=tol, atol=tol)
    assert not torch.allclose(a, b)   # the halves differ: each sees its own examples
    zoo.assert_frozen_unmoved(model, before)


def _ranks(rank, world, name):
    model = zoo.build(name, torch.float64)
    x, y = zoo.batch(8, torch.float64)
    return worker_half_gradients(rank, world, model, x, y)


@pytest.mark.parametrize("name", ["frozen", "tied", "no_bias", "layernorm_no_affine", "conv"])
def test_on_ranks_equal_to_one_process(name):
    model = zoo.build(name, torch.float64)
    x, y = zoo.batch(8, torch.float64)
    want = half_gradients(model, torch.nn.functional.cross_entropy, x, y, world_size=2)
    for got in dist.run(_ranks, 2, args=(name,), timeout=30):
        torch.testing.assert_close(got["a"], want[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["b"], want[1], rtol=1e-12, atol=1e-12)
