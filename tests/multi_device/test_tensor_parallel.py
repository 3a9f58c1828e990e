"""parlearn.tensor_parallel: Megatron layers (from scratch and DTensor) on real gloo ranks,
movement operators (halo exchange and transpose included) against their adjoints, in one
process and on real ranks, and a convolution split along its positions.

Each world size is one ``dist.run`` doing every check inside the worker (bounded by a group
timeout and a deadline), so a hang cannot stall the suite.
"""

from __future__ import annotations

import pytest
import torch
from ranks import assert_refused_on_every_rank

from parlearn.multi_device import tensor_parallel as tp

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


@pytest.mark.parametrize("act", [torch.nn.Tanh(), torch.nn.ReLU(),
                                 torch.nn.GELU(approximate="tanh"), torch.nn.LeakyReLU(0.3)],
                         ids=["tanh", "relu", "gelu-tanh", "leaky"])
def test_megatron_uses_the_blocks_own_activation(act):
    # A user's block with another activation than the default GELU: the sharded output and
    # every gradient must equal that block's, not a GELU block's.
    res = tp.megatron_check(2, batch=4, d_model=8, d_hidden=16, timeout=T, activation=act)
    assert res["scratch"] < 1e-12
    assert res["dtensor"] < 1e-12


def test_megatron_refuses_blocks_it_cannot_split_exactly():
    lin1, lin2 = torch.nn.Linear(4, 6), torch.nn.Linear(6, 4)
    # Not elementwise (mixes hidden features), or a parameter/random mask per rank.
    for act in (torch.nn.Softmax(dim=-1), torch.nn.LayerNorm(6), torch.nn.PReLU(),
                torch.nn.Dropout(0.1)):
        with pytest.raises(ValueError, match=r"full\[1\]"):
            tp.MegatronMLP(torch.nn.Sequential(lin1, act, lin2), 0, 2)
    with pytest.raises(TypeError, match="full"):
        tp.MegatronMLP(torch.nn.Sequential(lin1, torch.nn.ReLU()), 0, 2)
    with pytest.raises(TypeError, match=r"full\[2\]"):
        tp.MegatronMLP(torch.nn.Sequential(lin1, torch.nn.ReLU(), torch.nn.Tanh()), 0, 2)
    with pytest.raises(ValueError, match=r"full\[0\].out_features"):
        tp.MegatronMLP(torch.nn.Sequential(lin1, torch.nn.ReLU(), torch.nn.Linear(8, 4)), 0, 2)
    with pytest.raises(ValueError, match=r"full\[1\]"):   # before any rank starts
        tp.megatron_check(2, activation=torch.nn.Softmax(dim=-1))


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


@pytest.mark.parametrize("world_size", [2, 3])
def test_real_rank_movements_pass_the_dot_product_test(world_size):
    from parlearn import distributed as dist

    res = dist.run(tp.rank_dot_product_worker, world_size, args=(2, 4, 0), backend="gloo",
                   timeout=T, deadline=4 * T)
    names = set(res[0]) - {"values"}
    assert names == set(tp.RANK_MOVEMENTS)
    for name in names:
        lhs, rhs = res[0][name]
        assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), name
        assert abs(lhs) > 1e-3, name
        assert all(r[name] == res[0][name] for r in res)  # the sums over ranks agree
    # The forward values equal the one-process movements on the same pieces.
    serial = {"scatter": lambda x, p: tp.MOVEMENTS["scatter"][0](x[:1], p),
              "gather": lambda x, p: [*tp.MOVEMENTS["gather"][0](x, p),
                                      *[torch.zeros(p * 2, 4, dtype=torch.float64)] * (p - 1)],
              "all_gather": tp.MOVEMENTS["all_gather"][0],
              "reduce_scatter": tp.MOVEMENTS["reduce_scatter"][0],
              "rows_to_cols": tp.MOVEMENTS["rows_to_cols"][0],
              "cols_to_rows": tp.MOVEMENTS["cols_to_rows"][0],
              "halo_exchange": lambda x, p: tp._halo(x, p, halo=2)}
    for name, fwd in serial.items():
        xs = [r["values"][name][0] for r in res]
        want = fwd(xs, world_size)
        for r, w in zip(res, want, strict=True):  # sums may differ in order: round-off
            torch.testing.assert_close(r["values"][name][1], w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", sorted(tp.MOVEMENTS))
def test_the_backward_matrix_is_the_transpose_of_the_forward_matrix(name):
    for p in (1, 3):
        m, m_adj = tp.movement_matrix(name, p, rows=2, cols=2)
        assert m.abs().sum() > 0
        assert torch.equal(m_adj, m.T), (name, p)


@pytest.mark.parametrize("halo", [1, 2, 3])
def test_halo_pieces_are_windows_of_the_zero_padded_tensor(halo):
    g = torch.Generator().manual_seed(halo)
    x = torch.randn(2, 3, 12, generator=g, dtype=torch.float64)
    padded = torch.nn.functional.pad(x, (halo, halo))
    got = tp._halo(list(x.chunk(4, -1)), 4, halo)
    for r, t in enumerate(got):
        assert torch.equal(t, padded[..., 3 * r:3 * r + 3 + 2 * halo])
    # its adjoint, by the dot-product test with a halo wider than 1
    y = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in got]
    back = tp._halo_add(y, 4, halo)
    lhs = sum((a * b).sum() for a, b in zip(got, y, strict=True))
    rhs = sum((a * b).sum() for a, b in zip(x.chunk(4, -1), back, strict=True))
    assert abs(lhs - rhs) <= 1e-12 * abs(lhs)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_spatially_split_convolution_equals_the_unsharded_one(world_size):
    b, c_in, c_out, length, kernel = 2, 3, 4, 12, 5
    res = tp.halo_conv_check(world_size, batch=b, c_in=c_in, c_out=c_out, length=length,
                             kernel=kernel, timeout=T)
    # float64: output, input gradient, weight and bias gradients to round-off.
    for key in ("y", "dx", "dw", "db"):
        assert res[key] < 1e-12, key
    # What ran is what the planner's spatial cut charges: a halo of (k-1)/2 cells of every
    # channel and sample to each neighbour forward and back (the ledger counts what a rank
    # sends plus what it receives), and one all-reduce of the replicated weight (and bias).
    halo = tp.Conv(c_in, c_out, length, kernel).collectives(
        "spatial", (b, c_in, c_out, length // world_size), 8, True, world_size)
    sends = [n for ph, kind, n in halo if kind == "send"]
    interior = res["ledger"][1 if world_size > 2 else 0]
    assert interior["forward"]["batch_isend_irecv"][1] == 2 * sends[0]
    assert interior["backward"]["batch_isend_irecv"][1] == 2 * sends[1]
    assert interior["backward"]["all_reduce"][1] == (c_in * c_out * kernel + c_out) * 8


def test_serial_conv_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b = tp.serial_conv(3, 4, 5, seed=2), tp.serial_conv(3, 4, 5, seed=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("call, error, match", [
    (lambda: tp.SpatialConv1d(torch.nn.Conv1d(2, 2, 4, padding=1), 0, 2), ValueError, "odd"),
    (lambda: tp.SpatialConv1d(torch.nn.Conv1d(2, 2, 3, padding=1, stride=2), 0, 2),
     ValueError, "stride"),
    (lambda: tp.SpatialConv1d(torch.nn.Conv1d(2, 2, 3, padding=0), 0, 2), ValueError,
     "padding"),
    (lambda: tp.SpatialConv1d(torch.nn.Linear(2, 2), 0, 2), TypeError, "Conv1d"),
    (lambda: tp.SpatialConv1d(torch.nn.Conv1d(2, 2, 3, padding=1), 2, 2), ValueError, "rank"),
    (lambda: tp.serial_conv(2, 2, 4), ValueError, "kernel"),
    (lambda: tp.halo_conv_check(2, length=7), ValueError, "length"),
    (lambda: tp.halo_conv_check(4, length=4, kernel=5), ValueError, "length"),
    (lambda: tp.movement_matrix("teleport", 2), ValueError, "name"),
    (lambda: tp.RankHaloExchange.apply(torch.ones(2, 3), 4), ValueError, "halo"),
    (lambda: tp.RankHaloExchange.apply(torch.ones(2, 3), 0), ValueError, "halo"),
    (lambda: tp.movement_matrix("halo_exchange", 0), ValueError, "p"),
])
def test_bad_calls_fail_fast(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _bad_movement(rank: int, world_size: int, which: str) -> None:
    x = torch.zeros(4, 2, dtype=torch.float64)
    if which == "broadcast":     # one rank's block is longer
        tp.RankBroadcast.apply(x if rank == 0 else torch.zeros(5, 2, dtype=torch.float64))
    elif which == "sum_reduce":  # one rank passes no tensor
        tp.RankSumReduce.apply(x if rank == 0 else "x")
    elif which == "all_gather":  # one rank's block in another dtype
        tp.RankAllGather.apply(x if rank == 0 else x.float())
    elif which == "reduce_scatter":
        tp.RankReduceScatter.apply(torch.zeros(3, 2))
    elif which == "scatter":
        tp.RankScatter.apply(torch.zeros(3, 2))
    elif which == "gather":
        tp.RankGather.apply(x if rank else x[:, :1])
    elif which == "halo_exchange":   # neighbours that disagree on the halo width
        tp.RankHaloExchange.apply(x, 1 + rank)
    elif which == "repartition":
        tp.RankRepartition.apply(x, 0, 2)


@pytest.mark.parametrize("which, name", [
    ("broadcast", "x.shape"), ("sum_reduce", "x must be a torch.Tensor"),
    ("all_gather", "x.dtype"), ("reduce_scatter", "x.shape[0]"), ("scatter", "x.shape[0]"),
    ("gather", "x.shape"), ("halo_exchange", "halo"), ("repartition", "dst")])
def test_rank_movements_refuse_bad_blocks_on_every_rank(which, name):
    assert_refused_on_every_rank(_bad_movement, (which,), name=name)


def test_tp_roofline_is_the_scaling_books_condition():
    # H100 SXM: 989 TFLOP/s bf16 dense; NVLink 4 450 GB/s one way; NDR InfiniBand 50 GB/s
    nvlink = tp.tp_roofline(28672, 8, 989e12, 450e9)      # Llama 3 70B's d_ff, TP 8
    assert nvlink["intensity"] == pytest.approx(989e12 / 450e9)
    assert nvlink["width"] == 3584 and nvlink["compute_bound"]
    assert nvlink["ratio"] == pytest.approx(3584 / (989e12 / 450e9))
    assert nvlink["max_tp"] == 13
    ib = tp.tp_roofline(28672, 2, 989e12, 50e9)
    assert not ib["compute_bound"] and ib["max_tp"] == 1
    # the boundary is strict: F/Y equal to C/W is not compute-bound
    edge = tp.tp_roofline(4000, 2, 2000.0, 1.0)
    assert not edge["compute_bound"] and edge["max_tp"] == 1
    # no split communicates nothing: compute-bound, and the floor of max_tp
    one = tp.tp_roofline(10, 1, 1e6, 1.0)
    assert one["compute_bound"] and one["max_tp"] == 1 and one["ratio"] == float("inf")
    # max_tp is the largest degree that is compute-bound, for any widths
    for d_ff in (1, 7, 100, 4096, 28672):
        m = tp.tp_roofline(d_ff, 1, 989e12, 450e9)["max_tp"]
        assert tp.tp_roofline(d_ff, m, 989e12, 450e9)["compute_bound"]
        assert not tp.tp_roofline(d_ff, m + 1, 989e12, 450e9)["compute_bound"]
