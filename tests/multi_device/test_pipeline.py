"""Tests of parlearn.pipeline. Every multi-rank test is bounded by the group timeout
(30 s per collective) and a whole-run deadline of 4x that (dist.run(deadline=...)).
"""

import itertools
import random

import pytest
import torch

from parlearn.multi_device import pipeline as pl

WIDTHS = [4, 6, 5, 6, 3]   # 4 layers: P = 2 and 3 stages both cut it
N = 840                    # divisible by 1..8, so torch's micro-batches are equal too


@pytest.fixture(scope="module")
def problem():
    model = pl.make_model(WIDTHS, seed=1)
    x, y = pl.make_data(model, N, seed=2)
    return model, x, y, pl.reference_grads(model, x, y)


def _max_err(a, b):
    assert len(a) == len(b)
    return max((u - v).abs().max().item() for u, v in zip(a, b, strict=True))


# --- schedules and the simulator (modeled) -------------------------------------------------

@pytest.mark.parametrize("kind", pl.SCHEDULES)
@pytest.mark.parametrize("stages,m", list(itertools.product([1, 2, 3, 4], [1, 2, 3, 5, 8])))
def test_every_op_once_in_dependency_order(kind, stages, m):
    orders = pl.schedule(kind, stages, m)
    kinds = "FBW" if kind == "zb" else "FB"
    for ops in orders:
        for k in kinds:
            assert [op.mb for op in ops if op.kind == k] == list(range(m))
        for i in range(m):
            assert ops.index(pl.Op("F", i)) < ops.index(pl.Op("B", i))
            if kind == "zb":
                assert ops.index(pl.Op("B", i)) < ops.index(pl.Op("W", i))
    pl.simulate(orders, 1, 1, 1) if kind == "zb" else pl.simulate(orders)   # no deadlock


def test_1f1b_phases():
    orders = pl.schedule("1f1b", 4, 6)
    assert [str(o) for o in orders[0]] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5".split()
    assert [str(o) for o in orders[3]] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5".split()


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_bubble_equals_formula_for_equal_stages(kind):
    for stages, m in itertools.product(range(1, 6), range(1, 9)):
        sim = pl.simulate(pl.schedule(kind, stages, m), cost_f=1.0, cost_b=2.0)
        assert sim.bubble == pytest.approx(pl.bubble_formula(stages, m), abs=1e-12)
        assert sim.makespan == pytest.approx(3.0 * (m + stages - 1))


def test_bubble_grows_with_an_unbalanced_stage():
    orders = pl.schedule("1f1b", 3, 8)
    assert pl.simulate(orders, [1, 2, 1], [2, 4, 2]).bubble > pl.bubble_formula(3, 8) + 0.1


def test_peak_activation_memory():
    for stages, m in itertools.product(range(1, 5), range(1, 9)):
        g = pl.simulate(pl.schedule("gpipe", stages, m)).peak_in_flight
        o = pl.simulate(pl.schedule("1f1b", stages, m)).peak_in_flight
        assert g == [m] * stages
        assert o == [min(stages - s, m) for s in range(stages)]


def test_zero_bubble_reaches_zb_h1_makespan():
    for stages, m in itertools.product(range(2, 5), range(1, 9)):
        orders = pl.schedule("zb", stages, m)
        zb = pl.simulate(orders, 1, 1, 1)
        one = pl.simulate(pl.schedule("1f1b", stages, m), 1, 2)
        assert zb.bubble < one.bubble
        if m >= stages:
            assert zb.makespan == 3 * m + stages - 1
            assert zb.bubble == pytest.approx((stages - 1) / (3 * m + stages - 1))
            # a third of 1F1B's idle *time* per stage, more than a third of its fraction
            idle_zb = [zb.makespan - b for b in zb.busy]
            idle_one = [one.makespan - b for b in one.busy]
            assert idle_zb == pytest.approx([i / 3 for i in idle_one])
            assert zb.bubble > one.bubble / 3
        # the paper's ZB-H1: P-s awaiting B plus s awaiting W, 1F1B's first-stage peak
        assert zb.peak_in_flight == [min(stages, m)] * stages


def test_zero_bubble_matches_zb_h1_formula_at_unequal_costs():
    # Qi et al. 2024, Table 1: ZB-H1's bubble (each stage's idle time in its span) is
    # (P-1)(T_F + T_B - T_W), here for M >= P and T_W <= T_F.
    for stages, m in itertools.product(range(2, 6), range(2, 13)):
        if m < stages:
            continue
        for t_f, t_b, t_w in itertools.product((0.5, 1, 2), (0.5, 1, 1.5), (0.25, 0.5, 1, 2)):
            if t_w <= t_f:
                idle = max(pl.simulate(pl.schedule("zb", stages, m), t_f, t_b, t_w).idle_in_span)
                assert idle == pytest.approx((stages - 1) * (t_f + t_b - t_w))


def test_simulate_detects_deadlock_and_bad_costs():
    bad = [[pl.Op("F", 0), pl.Op("B", 0)], [pl.Op("B", 0), pl.Op("F", 0)]]
    with pytest.raises(ValueError, match="deadlock"):
        pl.simulate(bad)
    with pytest.raises(ValueError, match="cost_w"):
        pl.simulate(pl.schedule("1f1b", 2, 2), 1, 1, 1)
    with pytest.raises(ValueError, match="cost_f"):
        pl.simulate(pl.schedule("1f1b", 2, 2), [1, 1, 1])
    with pytest.raises(ValueError, match="kind"):
        pl.schedule("pipedream", 2, 2)
    with pytest.raises(ValueError, match="micro_batches"):
        pl.schedule("gpipe", 2, 0)


def test_measured_bubble_of_a_known_timeline():
    events = [("a", "F 0", 0.0, 1.0), ("b", "F 0", 1.0, 2.0)]
    assert pl.measured_bubble(events) == pytest.approx(0.5)


# --- the real ranks: from scratch and torch's engine ------------------------------------

@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("kind", pl.SCHEDULES)
def test_from_scratch_equals_single_process(problem, kind, stages):
    model, x, y, ref = problem
    ms = list(range(1, 9))
    runs = pl.run_pipeline(kind, model, x, y, stages, ms, timeout=30)
    for m, run in zip(ms, runs, strict=True):
        assert _max_err(run.grads, ref) < 1e-12, (kind, stages, m)
        assert run.ops == [[str(op) for op in ops] for ops in pl.schedule(kind, stages, m)]
        assert {e[0] for e in run.events} == {f"rank {s}" for s in range(stages)}
        assert 0.0 <= run.bubble < 1.0
        costs = pl.stage_op_costs(run)
        assert sorted(costs) == (["B", "F", "W"] if kind == "zb" else ["B", "F"])
        assert all(len(c) == stages and min(c) > 0 for c in costs.values())


def test_uneven_micro_batches_and_counts(problem):
    model, x, y, _ = problem
    x, y = x[:11], y[:11]    # 11 rows into 4 micro-batches of 3, 3, 3, 2
    run = pl.run_pipeline("1f1b", model, x, y, 2, 4, counts=[1, 3])
    assert _max_err(run.grads, pl.reference_grads(model, x, y)) < 1e-12


def test_verbose_prints_every_send_and_recv(problem, capsys):
    model, x, y, _ = problem
    pl.run_pipeline("1f1b", model, x, y, 2, 3, verbose=True)
    text = capsys.readouterr().out
    for mb in range(3):
        assert f"rank 0: send activation mb {mb} -> rank 1" in text
        assert f"rank 1: recv activation mb {mb} <- rank 0 (done)" in text
        assert f"rank 1: send gradient mb {mb} -> rank 0" in text
    assert "rank 0: send gradient" not in text


def test_run_pipeline_rejects_bad_arguments(problem):
    model, x, y, _ = problem
    with pytest.raises(ValueError, match="stages"):
        pl.run_pipeline("1f1b", model, x, y, 5)
    with pytest.raises(ValueError, match="counts"):
        pl.run_pipeline("1f1b", model, x, y, 2, counts=[1, 2])
    with pytest.raises(ValueError, match="micro_batches"):
        pl.run_pipeline("1f1b", model, x[:3], y[:3], 2, 4)
    with pytest.raises(TypeError, match="nn.Sequential"):
        pl.run_pipeline("1f1b", torch.nn.Linear(2, 2), x, y, 2)


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("kind", pl.SCHEDULES)
def test_torch_pipelining_equals_single_process(problem, kind, stages):
    model, x, y, ref = problem
    # torch refuses M < P for 1F1B, and zero-bubble wants M a multiple of P.
    ms = {"gpipe": range(1, 9), "1f1b": range(stages, 9), "zb": range(stages, 9, stages)}[kind]
    for grads in pl.run_torch_pipeline(kind, model, x, y, stages, list(ms), timeout=30):
        assert _max_err(grads, ref) < 1e-12


# --- partitioning -----------------------------------------------------------------------

def _brute_force(costs, stages):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_balanced_partition_is_optimal():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        stages = rng.randint(1, n)
        costs = [rng.choice([0.5, 1.0, 2.0, 3.0, 7.0]) * rng.random() for _ in range(n)]
        counts = pl.partition_balanced(costs, stages)
        assert len(counts) == stages and all(c >= 1 for c in counts) and sum(counts) == n
        assert max(pl.stage_costs(costs, counts)) == pytest.approx(_brute_force(costs, stages))


def test_balanced_beats_equal_on_a_skewed_model():
    costs = [1, 1, 1, 1, 1, 5]
    assert pl.partition_equal(6, 2) == [3, 3]
    assert pl.partition_balanced(costs, 2) == [5, 1]
    assert pl.partition_equal(7, 3) == [3, 2, 2]


def test_layer_costs_are_measured_per_layer():
    model = pl.make_model([8, 64, 8], seed=0)
    costs = pl.layer_costs(model, torch.randn(16, 8, dtype=torch.float64), repeat=2)
    assert len(costs) == 2 and all(c > 0 for c in costs)


# --- Hydra ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["1f1b", "zb"])
def test_hydra_models_train_as_if_alone(kind):
    models = [pl.make_model(w, seed=s) for s, w in enumerate([[4, 6, 5, 3], [4, 3, 7, 2]])]
    data = [pl.make_data(m, 12, seed=10 + i) for i, m in enumerate(models)]
    before = [[p.detach().clone() for p in m.parameters()] for m in models]
    trained = pl.hydra_train(models, data, 3, 3, steps=3, lr=0.2, kind=kind)
    alone = pl.hydra_reference(models, data, steps=3, lr=0.2)
    for t, a, m, b in zip(trained, alone, models, before, strict=True):
        assert _max_err(list(t.parameters()), list(a.parameters())) < 1e-12
        assert _max_err(list(t.parameters()), b) > 1e-3          # it did train
        assert _max_err(list(m.parameters()), b) == 0.0          # inputs untouched


def test_hydra_schedule_interleaves_models():
    orders = pl.hydra_schedule("1f1b", 2, 3, 2)
    assert len([op for op in orders[0] if op.kind == "F"]) == 6
    one = pl.simulate(pl.schedule("1f1b", 3, 4)).bubble
    assert pl.simulate(pl.hydra_schedule("1f1b", 3, 4, 3)).bubble < one


# --- bidirectional pipelines (modeled) -------------------------------------------------------

def test_bidirectional_does_all_the_work_and_shrinks_the_bubble():
    for stages, m in itertools.product(range(2, 6), range(2, 13, 2)):
        sim = pl.simulate_bidirectional(stages, m)
        assert sim.busy == [pytest.approx(3.0 * m)] * stages      # each device: M (F + B)
        assert len(sim.events) == 2 * m * stages
        assert sim.bubble <= pl.simulate(pl.schedule("1f1b", stages, m)).bubble + 1e-12
    assert pl.simulate_bidirectional(4, 4).bubble < pl.bubble_formula(4, 4) - 0.05
    with pytest.raises(ValueError, match="even"):
        pl.simulate_bidirectional(2, 3)


def test_make_model_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    a = pl.make_model([3, 5, 2], seed=1)
    assert torch.equal(state, torch.random.get_rng_state())
    b = pl.make_model([3, 5, 2], seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_measured_beside_simulated_shares_one_time_axis():
    measured = [("rank 0", "F 0", 10.0, 11.0), ("rank 1", "F 0", 11.5, 12.5),
                ("rank 0", "B 0", 13.0, 15.0)]
    sim = pl.simulate(pl.schedule("gpipe", 2, 1), 1.0, 2.0)
    out = pl.measured_beside_simulated(measured, sim.events)
    lanes = list(dict.fromkeys(e[0] for e in out))
    assert lanes == ["rank 0 measured", "rank 0 simulated", "rank 1 measured",
                     "rank 1 simulated"]
    assert [e[2:] for e in out if e[0] == "rank 0 measured"] == [(0.0, 1.0), (3.0, 5.0)]
    assert sorted(e[1:] for e in out if e[0].endswith("simulated")) == sorted(
        e[1:] for e in sim.events)
    with pytest.raises(ValueError, match="measured"):
        pl.measured_beside_simulated([("rank 0", "F 0", 2.0, 1.0)], sim.events)
    with pytest.raises(TypeError, match="simulated"):
        pl.measured_beside_simulated(measured, [])


def test_interleaved_rounds_depth_first_and_breadth_first():
    from parlearn.multi_device.pipeline import zoo
    P, M, v = 4, 8, 2
    default = zoo.zoo_schedule("interleaved", P, M, v)
    assert zoo.zoo_schedule("interleaved", P, M, v, group=P) == default      # Megatron's
    bf = zoo.zoo_schedule("interleaved", P, M, v, group=M)
    zoo.validate(bf)
    # breadth-first: all M micro-batches through chunk 0, then chunk 1, on every rank
    assert [op.chunk for op in bf[0] if op.kind == "F"] == [0] * M + [1] * M
    assert all(1 + sum(a.chunk != b.chunk for a, b in zip(o, o[1:], strict=False)) == 2 * v - 1
               for o in bf)
    sims = [pl.simulate(s, 1, 2) for s in (default, bf)]
    assert sims[0].bubble == pytest.approx(sims[1].bubble)
    assert sims[1].peak_in_flight[0] > sims[0].peak_in_flight[0]
    for kw, err in (({"group": 3}, ValueError), ({"group": 6}, ValueError),
                    ({"group": 4.0}, TypeError)):
        with pytest.raises(err, match="group"):
            zoo.zoo_schedule("interleaved", P, M, v, **kw)
    with pytest.raises(ValueError, match="group"):
        zoo.zoo_schedule("zb-v", P, M, group=P)
