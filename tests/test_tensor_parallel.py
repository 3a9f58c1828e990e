"""parlearn.tensor_parallel: Megatron layers (from scratch and DTensor) on real gloo ranks,
movement operators against their adjoints.

Each world size is one ``dist.run`` doing every check inside the worker (bounded by a group
timeout and a deadline), so a hang cannot stall the suite.
"""

from __future__ import annotations

import pytest
import torch

from parlearn import tensor_parallel as tp

T = 30  # group timeout (s): generous for a loaded machine


@pytest.mark.parametrize("world_size", [2, 4])
def test_megatron_scratch_and_dtensor_equal_unsharded_block(world_size):
    res = tp.megatron_check(world_size, batch=4, d_model=8, d_hidden=16, timeout=T)
    # float64: output and every gradient (x, both weights, both biases) to round-off.
    assert res["scratch"] < 1e-12
    assert res["dtensor"] < 1e-12
    # One all-reduce of |Y| = batch * d_model float64 forward, one of |X| backward.
    nbytes = 4 * 8 * 8
    for phase in ("forward", "backward"):
        assert set(res["ledger"][phase]) == {"all_reduce"}
        count, got, _ = res["ledger"][phase]["all_reduce"]
        assert (count, got) == (1, nbytes)


def test_split_layers_refuse_widths_the_ranks_cannot_share():
    full = torch.nn.Linear(6, 5)
    with pytest.raises(ValueError, match="divisible"):
        tp.ColumnParallelLinear(full, 0, 2)
    with pytest.raises(ValueError, match="divisible"):
        tp.RowParallelLinear(full, 0, 4)
    with pytest.raises(ValueError, match="rank"):
        tp.RowParallelLinear(full, 2, 2)


def test_serial_mlp_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b = tp.serial_mlp(4, 6, seed=3), tp.serial_mlp(4, 6, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("name", sorted(tp.MOVEMENTS))
@pytest.mark.parametrize("p", [1, 2, 4])
def test_every_movement_passes_the_dot_product_test(name, p):
    lhs, rhs = tp.dot_product_test(name, p, rows=3, cols=2, seed=p)
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs))
    assert abs(lhs) > 1e-3  # a vacuous 0 = 0 would prove nothing


def test_dot_product_test_catches_a_wrong_adjoint(monkeypatch):
    fwd, _, shapes = tp.MOVEMENTS["broadcast"]
    # Taking rank 0's gradient only (instead of the sum over ranks) is not the adjoint.
    monkeypatch.setitem(tp.MOVEMENTS, "broadcast", (fwd, lambda y, p: [y[0]], shapes))
    lhs, rhs = tp.dot_product_test("broadcast", 3)
    assert abs(lhs - rhs) > 1e-6


def test_movement_backward_equals_autograd_through_the_plain_forward():
    # The plain forward is built from torch ops, so torch's own autograd gives the true
    # adjoint independently of the hand-written one.
    g = torch.Generator().manual_seed(0)
    for name, (fwd, _, shapes) in tp.MOVEMENTS.items():
        x = [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
             for s in shapes(3, 2, 2)]
        y = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in fwd(x, 3)]
        ours = torch.autograd.grad(tp.movement(name, x, 3), x, grad_outputs=y)
        ref = torch.autograd.grad(fwd(x, 3), x, grad_outputs=y)
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_movement_validates_its_arguments():
    with pytest.raises(ValueError, match="name"):
        tp.movement("teleport", [torch.ones(2)], 2)
    with pytest.raises(ValueError, match="p"):
        tp.dot_product_test("broadcast", 0)
