"""parlearn.tensor_parallel: Megatron layers (from scratch and DTensor) on real gloo ranks,
movement operators against their adjoints.

Each world size is one ``dist.run`` doing every check inside the worker (bounded by a group
timeout and a deadline), so a hang cannot stall the suite.
"""

from __future__ import annotations

import math

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


# ---- the tiling search ---------------------------------------------------------------

def test_plan_collectives_of_the_textbook_plans():
    b, d, h = 16, 32, 64
    # Data parallel: one gradient all-reduce per weight, nothing else.
    assert tp.plan_collectives(["batch", "batch"], b, [d, h, d], 2) == [
        (0, "backward", "all_reduce", d * h * 4), (1, "backward", "all_reduce", h * d * 4)]
    # Megatron (column then row): one all-reduce of Y forward (no dX: the input is data).
    assert tp.plan_collectives(["column", "row"], b, [d, h, d], 2) == [
        (1, "forward", "all_reduce", b * d * 4)]


@pytest.mark.parametrize("groups", [2, 8])
def test_one_cut_dp_is_optimal_against_brute_force(groups):
    g = torch.Generator().manual_seed(groups)
    for _ in range(40):
        layers = int(torch.randint(1, 5, (1,), generator=g))
        widths = [8 * int(w) for w in torch.randint(1, 65, (layers + 1,), generator=g)]
        batch = 8 * int(torch.randint(1, 65, (1,), generator=g))
        cuts, cost = tp.best_one_cut(batch, widths, groups)
        _, best = tp.brute_force_cut(batch, widths, groups)
        assert cost == best
        assert tp.plan_cost(cuts, batch, widths, groups) == cost  # the DP's plan costs that


def test_recursive_plan_one_level_is_the_one_cut_and_levels_add_up():
    widths, batch = [64, 256, 64, 128], 32
    (cuts,), cost = tp.recursive_plan(batch, widths, 1)
    assert (cuts, cost) == tuple(tp.best_one_cut(batch, widths, 2))
    per_level, total = tp.recursive_plan(batch, widths, 3)
    assert len(per_level) == 3 and total > cost
    # Level 2's cost is the one-cut optimum on the shapes level 1 left.
    shapes = [[batch, widths[i], widths[i + 1]] for i in range(3)]
    for s, c in zip(shapes, per_level[0], strict=True):
        s[{"batch": 0, "row": 1, "column": 2}[c]] //= 2
    assert per_level[1] == tp._best_local(shapes, 4, 2)[0]
    with pytest.raises(ValueError, match="even"):
        tp.recursive_plan(2, [3, 5], 3)


def test_planner_validates_arguments():
    with pytest.raises(ValueError, match="cuts"):
        tp.plan_collectives(["batch"], 4, [4, 4, 4])
    with pytest.raises(ValueError, match="cuts"):
        tp.plan_collectives(["diagonal"], 4, [4, 4])
    with pytest.raises(ValueError, match="groups"):
        tp.best_one_cut(4, [4, 4], groups=1)


def test_predicted_bytes_equal_the_collectives_xla_inserts_on_8_devices():
    batch, widths = 16, [32, 64, 16, 32]
    plans = [("batch", "batch", "batch"),      # data parallel
             ("column", "column", "column"),   # column-sharded throughout
             ("row", "row", "row"),            # row-sharded throughout
             ("column", "row", "batch"),       # Megatron block, then data parallel
             ("batch", "row", "column")]       # with an all-to-all re-tiling
    hlo = tp.hlo_collectives(plans, batch, widths, devices=8, timeout=240)
    for plan, ops in zip(plans, hlo, strict=True):
        predicted = tp.bytes_by_kind(tp.plan_collectives(plan, batch, widths, 8))
        assert tp.bytes_by_kind(ops) == predicted, plan
        assert predicted  # every one of these plans communicates


@pytest.mark.parametrize("world_size", [3])
def test_real_rank_movements_pass_the_dot_product_test(world_size):
    from parlearn import dist

    res = dist.run(tp.rank_dot_product_worker, world_size, args=(2, 3, 0), backend="gloo",
                   timeout=T, deadline=4 * T)
    assert set(res[0]) == set(tp.RANK_MOVEMENTS)
    for name, (lhs, rhs) in res[0].items():
        assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), name
        assert abs(lhs) > 1e-3, name
    assert all(r == res[0] for r in res)  # the sums over ranks agree everywhere


# ---- the two-level plan --------------------------------------------------------------

def _brute_two_level(batch, widths, devices, m, flops, bw):
    import itertools

    layers, mb, best = len(widths) - 1, batch // m, math.inf
    for stages in range(1, min(layers, devices) + 1):
        group = devices // stages
        if devices % stages or (group > 1 and mb % group):
            continue
        for cut_points in itertools.combinations(range(1, layers), stages - 1):
            bounds = [0, *cut_points, layers]
            slowest = max(tp._stage_time(mb, widths, i, j, group, j == layers, flops, bw, 4)[0]
                          for i, j in itertools.pairwise(bounds))
            best = min(best, (m + stages - 1) * slowest)
    return best


def test_two_level_plan_is_optimal_against_brute_force():
    g = torch.Generator().manual_seed(11)
    for _ in range(25):
        layers = int(torch.randint(1, 6, (1,), generator=g))
        widths = [64 * int(w) for w in torch.randint(1, 17, (layers + 1,), generator=g)]
        devices = [1, 2, 4, 8][int(torch.randint(0, 4, (1,), generator=g))]
        m = [1, 2, 4][int(torch.randint(0, 3, (1,), generator=g))]
        bw = [1e9, 5e10, 5e11][int(torch.randint(0, 3, (1,), generator=g))]
        plan = tp.two_level_plan(64, widths, devices, m, 1e14, bw)
        assert plan["step_s"] == pytest.approx(_brute_two_level(64, widths, devices, m, 1e14, bw),
                                               rel=1e-12)
        assert [s for s, _ in plan["stages"]][0] == 0 and plan["stages"][-1][1] == layers
        m_stages = len(plan["stages"])
        assert plan["step_s"] == pytest.approx((m + m_stages - 1) * max(plan["stage_s"]))


def test_two_level_plan_corners():
    widths = [256, 256, 256, 256]
    one = tp.two_level_plan(32, widths, 1, 1, 1e12, 1e9)
    assert one["step_s"] == pytest.approx(6 * 32 * 3 * 256 * 256 / 1e12)  # serial compute
    # Slow network, tiny layers, big batch: data parallelism on every device.
    dp = tp.two_level_plan(4096, [16, 16, 16], 4, 1, 1e12, 1e9)
    assert dp["group"] == 4 and dp["cuts"] == [["batch", "batch"]]
    with pytest.raises(ValueError, match="microbatches"):
        tp.two_level_plan(30, widths, 2, 4, 1e12, 1e9)
