"""Tests of the schedule zoo (interleaved 1F1B, ZB-H2, ZB-V): validated, simulated against
each paper's formula, and executed on real gloo ranks against the single-process float64
gradients. Multi-rank tests are bounded by the group timeout and dist.run's deadline."""

import itertools
import math

import pytest

from parlearn.multi_device import pipeline as pl
from parlearn.multi_device.pipeline.torch_pipeline import TORCH_ZOO, run_torch_zoo
from parlearn.multi_device.pipeline.virtual import run_schedule
from parlearn.multi_device.pipeline.zoo import (
    ZOO,
    in_flight_formula,
    paper_bubble,
    validate,
    zoo_schedule,
)

WIDTHS = [4, 6, 5, 6, 5, 6, 5, 6, 3]   # 8 layers: 2P virtual stages for P = 4
N = 48


def _sim(sched, t_f=1.0, t_b=1.0, t_w=1.0):
    # Whole-stage costs; a schedule without W folds it into B.
    if sched.split:
        return pl.simulate(sched, t_f, t_b, t_w)
    return pl.simulate(sched, t_f, t_b + t_w)


def _cases(stages):
    for kind in ZOO:
        for m in (stages, 2 * stages):
            for v in ((1, 2) if kind == "interleaved" else (2,)):
                yield kind, m, v


# --- validated ----------------------------------------------------------------------------

@pytest.mark.parametrize("stages,m", list(itertools.product([1, 2, 3, 4, 8], [1, 2, 4, 8, 16])))
@pytest.mark.parametrize("kind", ZOO)
def test_every_schedule_validates(kind, stages, m):
    if kind == "interleaved" and m % stages:
        with pytest.raises(ValueError, match="multiple of stages"):
            zoo_schedule(kind, stages, m, v=2)
        return
    sched = zoo_schedule(kind, stages, m, v=2)
    peaks = validate(sched)
    assert len(peaks) == stages and sched.micro_batches == m
    assert sum(len(ops) for ops in sched) == stages * sched.chunks * m * (3 if sched.split else 2)


def test_validate_names_the_fault():
    sched = zoo_schedule("zb-v", 2, 2)
    broken = pl.Schedule([ops[:-1] for ops in sched], "x", 2, 2, chunks=2, placement="v")
    with pytest.raises(ValueError, match="want each"):
        validate(broken)
    swapped = pl.Schedule([list(ops) for ops in sched], "x", 2, 2, chunks=2, placement="v")
    i = next(i for i, op in enumerate(swapped[1]) if op.kind == "B")
    j = next(j for j, op in enumerate(swapped[1]) if op == pl.Op("F", swapped[1][i].mb,
                                                                 swapped[1][i].chunk))
    swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]
    with pytest.raises(ValueError, match="before its F"):
        validate(swapped)
    f0, b0, f1, b1 = pl.Op("F", 0), pl.Op("B", 0), pl.Op("F", 1), pl.Op("B", 1)
    dead = pl.Schedule([[f0, b0, f1, b1], [f1, b1, f0, b0]], "x", 2, 2)   # a cycle
    with pytest.raises(ValueError, match="deadlock"):
        validate(dead)


def test_refusals_name_the_argument():
    with pytest.raises(ValueError, match="kind"):
        zoo_schedule("dualpipe", 2, 2)
    with pytest.raises(ValueError, match="multiple of stages"):
        zoo_schedule("interleaved", 4, 6, v=2)
    with pytest.raises(ValueError, match="v"):
        zoo_schedule("interleaved", 2, 2, v=0)
    with pytest.raises(ValueError, match="chunks must be 2"):
        pl.Schedule([[]], "x", 1, 1, chunks=3, placement="v")
    model = pl.make_model([3, 4, 2], seed=0)
    x, y = pl.make_data(model, 8, seed=0)
    with pytest.raises(ValueError, match="virtual stages"):
        run_schedule(zoo_schedule("zb-v", 2, 2), model, x, y)


# --- simulated: each paper's formula ------------------------------------------------------

@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_interleaved_bubble_is_one_vth(stages):
    for v, k in itertools.product([1, 2, 3, 4], [1, 2, 3]):
        m = k * stages
        for t_f, t_b in ((1.0, 2.0), (1.0, 1.0), (2.0, 3.0)):
            sim = _sim(zoo_schedule("interleaved", stages, m, v), t_f, t_b, 0.0)
            ideal = m * (t_f + t_b)
            assert max(sim.idle_in_span) == pytest.approx((stages - 1) * (t_f + t_b) / v)
            assert sim.makespan == pytest.approx(ideal * (1 + (stages - 1) / (v * m)))
            assert max(sim.idle_in_span) == pytest.approx(
                paper_bubble("interleaved", stages, v, t_f, t_b, 0.0))


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_zero_bubble_rates_at_equal_costs(stages):
    for m in (2 * stages, 3 * stages, 4 * stages):
        one = max(_sim(zoo_schedule("1f1b", stages, m)).idle_in_span)
        h1 = max(_sim(zoo_schedule("zb-h1", stages, m)).idle_in_span)
        h2 = max(_sim(zoo_schedule("zb-h2", stages, m)).idle_in_span)
        zbv = max(_sim(zoo_schedule("zb-v", stages, m)).idle_in_span)
        assert one == pytest.approx(paper_bubble("1f1b", stages)) == 3 * (stages - 1)
        assert h1 == pytest.approx(paper_bubble("zb-h1", stages)) == stages - 1
        assert h2 == pytest.approx(paper_bubble("zb-h2", stages)) == 0
        assert zbv == pytest.approx(paper_bubble("zb-v", stages)) == 0


def test_zb_v_bubble_and_ramp():
    # The paper's ZB-V at T_F = T_B = T_W = T: no idle inside any rank's span once
    # M >= 2P-1; rank r starts r chunk slots (T/2 each) late, so the synchronous step is
    # 3MT + (P-1)T/2 long. With fewer micro-batches rank 0 idles (2P-1-M)T, the most.
    for stages, m, t in itertools.product([1, 2, 3, 4, 5, 8], range(1, 34), (1.0, 2.0)):
        sim = pl.simulate(zoo_schedule("zb-v", stages, m), t, t, t)
        assert max(sim.idle_in_span) == sim.idle_in_span[0] == max(0, 2 * stages - 1 - m) * t
        if m >= 2 * stages - 1:
            assert sim.makespan == 3 * m * t + (stages - 1) * t / 2
            assert sim.bubble == pytest.approx((stages - 1) / (6 * m + stages - 1))


def _torch_order(cls, stages, m):
    # torch's order of the same paper's schedule as our Ops (a private torch 2.13 method).
    from types import SimpleNamespace

    fake = SimpleNamespace(pp_group_size=stages, _n_microbatches=m, num_stages=2 * stages)
    kinds = {"F": "F", "I": "B", "W": "W"}
    return [[pl.Op(kinds[a.computation_type.value], a.microbatch_index, int(a.stage_index != r))
             for a in cls._calculate_single_rank_operations(fake, r) if a is not None]
            for r in range(stages)]


def test_zb_v_is_the_papers_order_as_torch_builds_it():
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    for stages, m in itertools.product([2, 3, 4, 5, 8], range(1, 25)):
        ours = [list(ops) for ops in zoo_schedule("zb-v", stages, m)]
        assert ours == _torch_order(ScheduleZBVZeroBubble, stages, m), (stages, m)


def test_p2p_messages():
    for stages, m in itertools.product([2, 3, 4], [4, 8]):
        for v in (1, 2, 4):
            # each micro-batch crosses vP-1 rank boundaries each way: ~v times 1F1B's
            sim = _sim(zoo_schedule("interleaved", stages, m * stages, v))
            assert sim.messages == 2 * m * stages * (v * stages - 1)
        # V: the turn stays on a rank and the loss on rank 0: 2M(2P-2) messages.
        assert _sim(zoo_schedule("zb-v", stages, m)).messages == 2 * m * (2 * stages - 2)
        assert _sim(zoo_schedule("1f1b", stages, m)).messages == 2 * m * (stages - 1)


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("kind", ZOO)
def test_peak_in_flight_equals_formula(kind, stages):
    for m in (stages, 2 * stages, 4 * stages):
        for v in (2, 3):
            sched = zoo_schedule(kind, stages, m, v)
            sim = _sim(sched)
            assert sim.peak_in_flight[0] == pytest.approx(in_flight_formula(kind, stages, m, v))
            if kind == "zb-v":   # below M = 2P-1 rank 0 holds less than the others
                assert sim.peak_in_flight == [min(stages, m, (m + 1 + r) / 2)
                                              for r in range(stages)]
                assert max(sim.peak_in_flight) == min(stages, m)     # 1F1B's (rank 0)
            else:
                assert max(sim.peak_in_flight) == pytest.approx(sim.peak_in_flight[0])
            assert [p * sched.chunks for p in sim.peak_in_flight] == validate(sched)
    if kind == "1f1b":
        assert _sim(zoo_schedule(kind, stages, 8)).peak_in_flight[0] == min(stages, 8)


# --- executed on real ranks ---------------------------------------------------------------

@pytest.mark.parametrize("stages", [2, 4])
def test_every_schedule_equals_single_process(stages):
    model = pl.make_model(WIDTHS, seed=1)
    x, y = pl.make_data(model, N, seed=2)
    ref = pl.reference_grads(model, x, y)
    cases = list(_cases(stages))
    scheds = [zoo_schedule(kind, stages, m, v) for kind, m, v in cases]
    runs = run_schedule(scheds, model, x, y, timeout=30)
    for case, sched, run in zip(cases, scheds, runs, strict=True):
        assert len(run.grads) == len(ref)
        err = max((a - b).abs().max().item() for a, b in zip(run.grads, ref, strict=True))
        assert err < 1e-12, case
        assert run.ops == [[str(op) for op in ops] for ops in sched], case
        assert 0.0 <= run.bubble < 1.0


# --- torch's multi-stage schedules beside ours (torch 2.13 runs them on gloo, CPU) -------

@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", sorted(TORCH_ZOO))
def test_torch_schedules_equal_ours(name, stages):
    model = pl.make_model(WIDTHS, seed=1)
    x, y = pl.make_data(model, N, seed=2)
    ref = pl.reference_grads(model, x, y)
    ours = {"interleaved": zoo_schedule("interleaved", stages, 2 * stages, 2),
            "interleaved-zb": zoo_schedule("interleaved", stages, 2 * stages, 2),
            "zb-v": zoo_schedule("zb-v", stages, 2 * stages),
            "dualpipe-v": zoo_schedule("zb-v", stages, 2 * stages)}[name]
    mine = run_schedule(ours, model, x, y, timeout=30).grads
    # torch's DualPipeV wants M >= 2P (its stage count); the others M a multiple of P.
    ms = [2 * stages] if name == "dualpipe-v" else [stages, 2 * stages]
    for grads in run_torch_zoo(name, model, x, y, stages, ms, timeout=30):
        assert len(grads) == len(ref)
        for a, b, c in zip(grads, mine, ref, strict=True):
            assert (a - b).abs().max().item() < 1e-12
            assert (a - c).abs().max().item() < 1e-12


# --- torch's DualPipe-V order as our schedule: validated, simulated, executed ---------------

def test_torch_dualpipe_v_order_runs_in_our_simulator_and_ranks():
    for stages, m in itertools.product([2, 4, 8], [2, 4]):
        sched = pl.dualpipe_v_order(stages, m * stages)
        validate(sched)
        plain = pl.simulate(sched, 1, 1, 1)
        fused = pl.simulate(sched, 1, 1, 1, cost_fb=2.25)     # an F&B group: 3/4 of F+B+W
        assert sched.overlap and fused.makespan < plain.makespan
        assert max(plain.peak_in_flight) <= stages + 0.5
    with pytest.raises(ValueError, match="micro_batches"):
        pl.dualpipe_v_order(4, 7)
    model = pl.make_model(WIDTHS, seed=1)
    x, y = pl.make_data(model, N, seed=2)
    ref = pl.reference_grads(model, x, y)
    for stages in (2, 4):
        # torch's order, and our reconstruction at M = 2P and 3P
        scheds = [pl.dualpipe_v_order(stages, 2 * stages), pl.dualpipe_v(stages, 2 * stages),
                  pl.dualpipe_v(stages, 3 * stages)]
        for sched, run in zip(scheds, run_schedule(scheds, model, x, y, timeout=30),
                              strict=True):
            err = max((a - b).abs().max().item() for a, b in zip(run.grads, ref, strict=True))
            assert err < 1e-12
            assert run.ops == [[str(op) for op in ops] for ops in sched]


# --- DualPipe-V reconstructed: DeepSeek's phases, DeepSeek's bubble ------------------------

def test_dualpipe_v_is_deepseeks_order_as_torch_builds_it():
    for stages in range(1, 9):
        for m in range(2 * stages, 4 * stages + 2):
            ours, torch_ = pl.dualpipe_v(stages, m), pl.dualpipe_v_order(stages, m)
            assert [list(ops) for ops in ours] == [list(ops) for ops in torch_], (stages, m)
            assert ours.overlap == torch_.overlap and ours.overlap


def test_dualpipe_v_bubble_is_deepseeks_at_equal_costs():
    # DeepSeek: (PP/2-1)(F&B + B - 3W), PP = 2P stages, B a whole backward, counted as the
    # most idle rank's idle time in a synchronous step; F&B from no overlap (3T) to full (2T).
    assert pl.dualpipe_v_bubble(4) == 3 * (3 + 1 - 2) / 2
    assert pl.dualpipe_v_bubble(4, t_fb=2.0) == 3 * (2 + 1 - 2) / 2
    for stages, t in itertools.product(range(1, 9), (1.0, 2.0)):
        for m in (2 * stages, 2 * stages + 1, 3 * stages, 4 * stages):
            sched = pl.dualpipe_v(stages, m)
            assert validate(sched) == [2 * stages + 1] * stages
            for t_fb in (3 * t, 2.5 * t, 2 * t):
                sim = pl.simulate(sched, t, t, t, cost_fb=t_fb)
                step_idle = max(sim.makespan - busy for busy in sim.busy)
                assert step_idle == pl.dualpipe_v_bubble(stages, t, t, t, t_fb), (stages, m, t_fb)
                assert sim.peak_in_flight == [stages + 0.5] * stages    # DeepSeek's PP + 1
                assert sim.messages == 2 * m * (2 * stages - 2)
    with pytest.raises(ValueError, match="micro_batches"):
        pl.dualpipe_v(4, 7)
    with pytest.raises(ValueError, match="stages"):
        pl.dualpipe_v(0, 4)


# --- the contract at the edges ------------------------------------------------------------

def test_run_schedule_refuses_a_schedule_validate_rejects():
    """A user's 1F1B that never runs micro-batch 5 on any rank: the step would finish with
    gradients of 5 of the 6 micro-batches. It must be refused before the ranks start."""
    good = zoo_schedule("1f1b", 2, 6)
    short = pl.Schedule([[op for op in ops if op.mb != 5] for ops in good], "mine", 2, 6)
    with pytest.raises(ValueError, match="want each"):
        validate(short)
    model = pl.make_model([3, 4, 2], seed=0)
    x, y = pl.make_data(model, 12, seed=0)
    with pytest.raises(ValueError, match="scheds.*want each of 0..5"):
        run_schedule(short, model, x, y, timeout=10)
    with pytest.raises(ValueError, match="scheds"):
        run_schedule([good, short], model, x, y, timeout=10)


def test_validate_refuses_ops_it_would_ignore():
    good = zoo_schedule("1f1b", 2, 2)
    extra = pl.Schedule([list(ops) for ops in good], "mine", 2, 2)
    extra[0].append(pl.Op("F", 0, 3))   # a chunk the schedule does not have
    with pytest.raises(ValueError, match="sched.*chunk"):
        validate(extra)
    odd = pl.Schedule([list(ops) for ops in good], "mine", 2, 2)
    odd[1].append(("X", 0, 0))   # a plain tuple: an Op itself refuses kind "X" when made
    with pytest.raises(ValueError, match="sched"):
        validate(odd)
    with pytest.raises(ValueError, match="kind"):
        pl.Op("X", 0)
    with pytest.raises(ValueError, match="orders must hold one op list per rank"):
        pl.Schedule([list(good[0])], "mine", 2, 2)
    lost = pl.Schedule([list(ops) for ops in good], "mine", 2, 2)
    lost.pop()   # a rank's list removed after construction
    with pytest.raises(ValueError, match="sched must hold one op list per rank"):
        validate(lost)


@pytest.mark.parametrize("arg,value", [("t_f", -1.0), ("t_b", math.nan), ("t_w", -1),
                                       ("t_w", True), ("v", 0), ("v", True)])
def test_paper_bubble_refuses_bad_costs(arg, value):
    with pytest.raises((ValueError, TypeError), match=arg):
        paper_bubble("1f1b", 4, **{arg: value})


@pytest.mark.parametrize("v", [0, -1, True, 2.0])
def test_in_flight_formula_refuses_bad_v_for_every_kind(v):
    for kind in ZOO:
        with pytest.raises((ValueError, TypeError), match="v"):
            in_flight_formula(kind, 4, 8, v=v)
