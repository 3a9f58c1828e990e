"""parlearn.tensor_parallel's planner (plan, plan_levels, plan_hlo): the tiling DP against
brute force, its bytes against the collectives XLA inserts, the 2^k recursion against the
joint optimum, SplitBrain's hybrid with conv layers, the two-level plan against brute force."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from parlearn.multi_device import tensor_parallel as tp
from parlearn.multi_device.tensor_parallel import plan, plan_hlo, plan_levels

# ---- the tiling search ---------------------------------------------------------------

def test_plan_collectives_of_the_textbook_plans():
    b, d, h = 16, 32, 64
    # Data parallel: one gradient all-reduce per weight, nothing else.
    assert plan.plan_collectives(["batch", "batch"], b, [d, h, d], 2) == [
        (0, "backward", "all_reduce", d * h * 4), (1, "backward", "all_reduce", h * d * 4)]
    # Megatron (column then row): one all-reduce of Y forward (no dX: the input is data).
    assert plan.plan_collectives(["column", "row"], b, [d, h, d], 2) == [
        (1, "forward", "all_reduce", b * d * 4)]


@pytest.mark.parametrize("groups", [2, 8])
def test_one_cut_dp_is_optimal_against_brute_force(groups):
    g = torch.Generator().manual_seed(groups)
    for _ in range(40):
        layers = int(torch.randint(1, 5, (1,), generator=g))
        widths = [8 * int(w) for w in torch.randint(1, 65, (layers + 1,), generator=g)]
        batch = 8 * int(torch.randint(1, 65, (1,), generator=g))
        cuts, cost = plan.best_one_cut(batch, widths, groups)
        _, best = plan.brute_force_cut(batch, widths, groups)
        assert cost == best
        assert plan.plan_cost(cuts, batch, widths, groups) == cost  # the DP's plan costs that


def test_recursive_plan_one_level_is_the_one_cut_and_levels_add_up():
    widths, batch = [64, 256, 64, 128], 32
    (cuts,), cost = plan_levels.recursive_plan(batch, widths, 1)
    assert (cuts, cost) == tuple(plan.best_one_cut(batch, widths, 2))
    per_level, total = plan_levels.recursive_plan(batch, widths, 3)
    assert len(per_level) == 3 and total > cost
    assert plan_levels.plan_levels_cost(per_level, batch, widths) == total
    # Each level is the one-cut optimum on the shapes the levels before it left.
    for k in (1, 2):
        chosen = plan_levels.plan_levels_cost(per_level[:k + 1], batch, widths)
        for alt in itertools.product(plan.CUTS, repeat=3):
            assert plan_levels.plan_levels_cost([*per_level[:k], alt], batch, widths) >= chosen
    with pytest.raises(ValueError, match="even"):
        plan_levels.recursive_plan(2, [3, 5], 3)


def test_planner_validates_arguments():
    with pytest.raises(ValueError, match="cuts"):
        plan.plan_collectives(["batch"], 4, [4, 4, 4])
    with pytest.raises(ValueError, match="cuts"):
        plan.plan_collectives(["diagonal"], 4, [4, 4])
    with pytest.raises(ValueError, match="groups"):
        plan.best_one_cut(4, [4, 4], groups=1)


def test_predicted_bytes_equal_the_collectives_xla_inserts_on_8_devices():
    batch, widths = 16, [32, 64, 16, 32]
    plans = [("batch", "batch", "batch"),      # data parallel
             ("column", "column", "column"),   # column-sharded throughout
             ("row", "row", "row"),            # row-sharded throughout
             ("column", "row", "batch"),       # Megatron block, then data parallel
             ("batch", "row", "column")]       # with an all-to-all re-tiling
    hlo = plan_hlo.hlo_collectives(plans, batch, widths, devices=8, timeout=240)
    for cuts, ops in zip(plans, hlo, strict=True):
        predicted = plan_hlo.bytes_by_kind(plan.plan_collectives(cuts, batch, widths, 8))
        assert plan_hlo.bytes_by_kind(ops) == predicted, cuts
        assert predicted  # every one of these plans communicates


# ---- the two-level plan --------------------------------------------------------------

def _brute_two_level(batch, net, devices, m, flops, bw):
    net = plan.network(net)
    layers, mb, best = len(net), batch // m, math.inf
    for stages in range(1, min(layers, devices) + 1):
        group = devices // stages
        if devices % stages or (group > 1 and mb % group):
            continue
        for cut_points in itertools.combinations(range(1, layers), stages - 1):
            bounds = [0, *cut_points, layers]
            slowest = max(plan_levels._stage_time(mb, net, i, j, group, j == layers, flops, bw,
                                                  4)[0]
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
        res = plan_levels.two_level_plan(64, widths, devices, m, 1e14, bw)
        assert res["step_s"] == pytest.approx(_brute_two_level(64, widths, devices, m, 1e14, bw),
                                               rel=1e-12)
        assert [s for s, _ in res["stages"]][0] == 0 and res["stages"][-1][1] == layers
        m_stages = len(res["stages"])
        assert res["step_s"] == pytest.approx((m + m_stages - 1) * max(res["stage_s"]))


def test_two_level_plan_corners():
    widths = [256, 256, 256, 256]
    one = plan_levels.two_level_plan(32, widths, 1, 1, 1e12, 1e9)
    assert one["step_s"] == pytest.approx(6 * 32 * 3 * 256 * 256 / 1e12)  # serial compute
    # Slow network, tiny layers, big batch: data parallelism on every device.
    dp = plan_levels.two_level_plan(4096, [16, 16, 16], 4, 1, 1e12, 1e9)
    assert dp["group"] == 4 and dp["cuts"] == [["batch", "batch"]]
    with pytest.raises(ValueError, match="microbatches"):
        plan_levels.two_level_plan(30, widths, 2, 4, 1e12, 1e9)


# ---- conv layers and SplitBrain's hybrid ----------------------------------------------

def test_conv_cuts_charge_what_each_needs():
    conv, b = plan.Conv(4, 8, 32, kernel=5), 16
    w, x, y = 4 * 8 * 5 * 4, b * 4 * 32 * 4, b * 8 * 32 * 4
    assert conv.collectives("batch", conv.dims(b), 4, True, 2) == [("backward", "all_reduce", w)]
    assert conv.collectives("column", conv.dims(b), 4, True, 2) == [("backward", "all_reduce", x)]
    assert conv.collectives("row", conv.dims(b), 4, True, 2) == [("forward", "all_reduce", y)]
    # spatial: a halo of 2 cells x 4 channels x 16 samples to each neighbour, both ways,
    # and the replicated weight's gradient all-reduce
    halo = 2 * 4 * b * 4
    assert conv.collectives("spatial", conv.dims(b), 4, True, 8) == [
        ("forward", "send", 2 * halo), ("backward", "send", 2 * halo),
        ("backward", "all_reduce", w)]
    assert conv.collectives("spatial", conv.dims(b), 4, False, 2) == [
        ("forward", "send", halo), ("backward", "all_reduce", w)]
    # A position split, flattened, feeds a row-cut dense layer with no conversion.
    net = [conv, plan.Dense(8 * 32, 10)]
    assert plan.plan_collectives(["spatial", "row"], b, net, 2) == [
        (0, "forward", "send", halo), (0, "backward", "all_reduce", w),
        (1, "forward", "all_reduce", b * 10 * 4)]


CNN = [plan.Conv(4, 32, 64), plan.Conv(32, 32, 64), plan.Conv(32, 16, 64),
       plan.Dense(16 * 64, 1024), plan.Dense(1024, 16)]


@pytest.mark.parametrize("groups", [2, 8])
def test_planner_finds_splitbrain_hybrid_exactly_when_it_is_cheapest(groups):
    def brute(batch):
        states = [plan._feasible(x, x.dims(batch), groups) for x in CNN]
        return {p: plan.plan_cost(p, batch, CNN, groups) for p in itertools.product(*states)}

    hybrid = [["batch"]] * 3 + [["column", "row"]] * 2
    # Small batch: the FC weights dwarf the activations: the hybrid is the optimum.
    costs = brute(32)
    cuts, cost = plan.best_one_cut(32, CNN, groups)
    assert cost == min(costs.values())
    assert plan.is_splitbrain(cuts, CNN)
    assert min(c for p, c in costs.items() if not plan.is_splitbrain(p, CNN)) > cost
    assert plan.best_one_cut(32, CNN, groups, allowed=[["batch"]] * 5)[1] > 10 * cost
    # Large batch: the activations dwarf the weights: pure data parallelism wins and the
    # best hybrid costs more.
    costs = brute(4096)
    cuts, cost = plan.best_one_cut(4096, CNN, groups)
    assert cost == min(costs.values())
    assert cuts == ["batch"] * 5 and not plan.is_splitbrain(cuts, CNN)
    assert min(c for p, c in costs.items() if plan.is_splitbrain(p, CNN)) > cost
    assert plan.best_one_cut(4096, CNN, groups, allowed=hybrid)[1] > cost


def test_long_inputs_one_sample_cut_along_positions_else_along_the_batch():
    # A spatial cut pays halos plus the weight all-reduce that a batch cut pays alone, so
    # it wins only where the batch cannot be split: here, one long sample.
    net = [plan.Conv(4, 8, 4096), plan.Conv(8, 8, 4096), plan.Conv(8, 8, 4096)]
    for batch, want in ((1, ["spatial"] * 3), (2, ["batch"] * 3)):
        cuts, cost = plan.best_one_cut(batch, net, 2)
        assert cuts == want and plan.brute_force_cut(batch, net, 2)[1] == cost


def test_two_level_plan_takes_conv_layers():
    for bw in (1e9, 1e11, 1e13):
        res = plan_levels.two_level_plan(64, CNN, 8, 2, 1e14, bw)
        assert res["step_s"] == pytest.approx(_brute_two_level(64, CNN, 8, 2, 1e14, bw),
                                              rel=1e-12)
        assert res["step_s"] == pytest.approx((2 + len(res["stages"]) - 1) * max(res["stage_s"]))


# ---- 2^k devices: SoyBean's recursion against the joint optimum -----------------------

def _random_chain(g, conv=False):
    layers = int(torch.randint(1, 4, (1,), generator=g))
    widths = [8 * int(w) for w in torch.randint(1, 33, (layers + 1,), generator=g)]
    if conv:  # a convolution, flattened into a dense layer
        c = widths[0] // 8 * 4
        return [plan.Conv(4, c, 16), plan.Dense(c * 16, widths[-1])]
    return widths


@pytest.mark.parametrize("levels", [2, 3])
def test_joint_dp_equals_brute_force_over_all_k_level_tilings(levels):
    g = torch.Generator().manual_seed(levels)
    for i in range(12 if levels == 2 else 5):
        net = _random_chain(g, conv=i % 3 == 0)
        batch = 8 * int(torch.randint(1, 33, (1,), generator=g))
        if levels == 3 and len(plan.network(net)) > 2:
            net = plan.network(net)[:2]
        per_level, cost = plan_levels.joint_plan(batch, net, levels)
        assert cost == pytest.approx(plan_levels.brute_force_joint(batch, net, levels)[1],
                                     rel=1e-12)
        assert plan_levels.plan_levels_cost(per_level, batch, net) == pytest.approx(cost, rel=1e-12)


def test_greedy_recursion_is_never_better_than_the_joint_optimum():
    g = torch.Generator().manual_seed(5)
    for _ in range(40):
        widths = _random_chain(g)
        batch = 8 * int(torch.randint(1, 33, (1,), generator=g))
        for levels in (1, 2, 3):
            greedy, g_cost = plan_levels.recursive_plan(batch, widths, levels)
            _, j_cost = plan_levels.joint_plan(batch, widths, levels)
            assert plan_levels.plan_levels_cost(greedy, batch, widths) == g_cost
            assert g_cost >= j_cost * (1 - 1e-12)
            if levels == 1 or len(widths) == 2:  # one level, or one layer: equal
                assert g_cost == pytest.approx(j_cost, rel=1e-12)


@pytest.mark.parametrize("batch, widths, levels", [(16, [256, 16, 32, 128], 2),
                                                   (1024, [512, 16, 1024], 3)])
def test_greedy_recursion_can_be_worse_than_the_joint_optimum(batch, widths, levels):
    greedy, g_cost = plan_levels.recursive_plan(batch, widths, levels)
    joint, j_cost = plan_levels.brute_force_joint(batch, widths, levels)
    assert plan_levels.joint_plan(batch, widths, levels)[1] == j_cost
    assert g_cost > 1.03 * j_cost
    assert greedy[0] != joint[0]  # the best first cut is not the first cut of the best plan
    # Greedy's first level is no worse on its own (strictly better in the first case): the
    # loss comes from the shapes it leaves to the later levels.
    first = [plan_levels.plan_levels_cost([p[0]], batch, widths) for p in (greedy, joint)]
    assert first[0] < first[1] if batch == 16 else first[0] <= first[1]


@pytest.mark.parametrize("call, match", [
    (lambda: plan.network([plan.Dense(4, 8), plan.Dense(6, 2)]), "chain"),
    (lambda: plan.network([plan.Conv(2, 4, 8, kernel=4)]), "kernel"),
    (lambda: plan.network([plan.Conv(0, 4, 8)]), "c_in"),
    (lambda: plan.network([5]), "widths"),
    (lambda: plan.best_one_cut(4, [4, 4], allowed=[["batch"], ["row"]]), "allowed"),
    (lambda: plan.best_one_cut(4, [4, 4], allowed=[["spatial"]]), "allowed"),
    (lambda: plan.best_one_cut(3, [3, 3], groups=2), "divisible"),
    (lambda: plan_levels.recursive_plan(4, [4, 4], 0), "levels"),
    (lambda: plan_levels.joint_plan(2, [3, 3], 2), "halved"),
    (lambda: plan_levels.plan_levels_cost([["batch"]], 3, [4, 4]), "even"),
    (lambda: plan.is_splitbrain(["batch"], [4, 4, 4]), "cuts"),
])
def test_planner_bad_calls_fail_fast(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_tensor_parallel_re_exports_the_planner():
    for module in (plan, plan_levels, plan_hlo):
        for name in module.__all__:
            assert getattr(tp, name) is getattr(module, name)
