"""parlearn.distributed: run() on real gloo ranks, the ledger, the ring collectives, the cost model.

Every test that starts ranks passes a small group ``timeout`` (and a ``deadline`` where a
rank may hang outside a collective), so a failure cannot hang the suite.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist

from parlearn import distributed as dist
from parlearn.distributed import collectives
from parlearn.distributed.cost import AlphaBeta, collective_time, fit_alpha_beta, ring_bytes

ROOT = Path(__file__).resolve().parents[2]
T = 20  # group timeout (s) for tests that should succeed; generous for a loaded machine


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited, which is what we check.
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[-1].split()[0] != "Z"


def _all_gone(pids: list[int]) -> bool:
    return not any(_alive(p) for p in pids)


# ---- workers defined here (fork start: they need not be importable) -------------------

def _sum_ranks(rank, world_size, scale=1.0):
    t = torch.tensor([float(rank + 1)])
    tdist.all_reduce(t)
    return rank, world_size, tdist.get_rank(), t.item() * scale, torch.get_num_threads()


def _raise_in_rank_1(rank, world_size):
    if rank == 1:
        raise KeyError("boom from rank one")
    tdist.barrier()
    return rank


def _hang_in_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(120)
    tdist.all_reduce(torch.ones(3))
    return rank


def _sleep_everywhere(rank, world_size):
    time.sleep(120)


def _exit_in_rank_0(rank, world_size):
    if rank == 0:
        os._exit(3)
    tdist.barrier()


def _unpicklable(rank, world_size):
    return lambda: rank


# ---- run -------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_run_returns_each_ranks_value_in_rank_order(world_size):
    pids: list[int] = []
    out = dist.run(_sum_ranks, world_size, args=(2.0,), timeout=T, pids=pids)
    total = world_size * (world_size + 1) / 2
    assert out == [(r, world_size, r, 2.0 * total, 1) for r in range(world_size)]
    assert len(pids) == world_size and _all_gone(pids)


def test_two_runs_back_to_back_and_caller_threads_untouched():
    before = torch.get_num_threads()
    torch.randn(300, 300) @ torch.randn(300, 300)  # the parent has used its thread pool
    assert dist.run(_sum_ranks, 2, timeout=T)[1][3] == 3.0
    assert dist.run(_sum_ranks, 2, timeout=T)[0][3] == 3.0
    assert torch.get_num_threads() == before


def test_exception_names_the_rank_and_carries_its_traceback():
    pids: list[int] = []
    t0 = time.monotonic()
    with pytest.raises(dist.RankError) as info:
        dist.run(_raise_in_rank_1, 2, timeout=10, pids=pids)
    err = info.value
    assert err.rank == 1
    assert "KeyError: 'boom from rank one'" in err.traceback and "_raise_in_rank_1" in err.traceback
    assert "rank 1 failed" in str(err)
    assert time.monotonic() - t0 < 10 + 5
    assert _all_gone(pids)


def test_hung_rank_surfaces_within_the_group_timeout():
    pids: list[int] = []
    t0 = time.monotonic()
    with pytest.raises(dist.RankError) as info:
        dist.run(_hang_in_rank_1, 2, timeout=2, pids=pids)
    # rank 0's all_reduce times out; rank 1 (asleep) is stopped.
    assert info.value.rank == 0 and info.value.unfinished == [1]
    assert time.monotonic() - t0 < 2 + 10
    assert _all_gone(pids)


def test_deadline_bounds_ranks_that_hang_outside_collectives():
    pids: list[int] = []
    t0 = time.monotonic()
    with pytest.raises(dist.RankError, match="deadline"):
        dist.run(_sleep_everywhere, 2, timeout=T, deadline=1.0, pids=pids)
    assert time.monotonic() - t0 < 1 + 8
    assert _all_gone(pids)


def test_rank_that_exits_without_returning():
    pids: list[int] = []
    with pytest.raises(dist.RankError) as info:
        dist.run(_exit_in_rank_0, 2, timeout=5, pids=pids)
    assert info.value.rank == 0 and "exited with code 3" in info.value.traceback
    assert _all_gone(pids)


def test_unpicklable_return_value_is_an_error_in_that_rank():
    with pytest.raises(dist.RankError, match="cannot be pickled"):
        dist.run(_unpicklable, 2, timeout=T)


def test_spawn_refuses_a_worker_it_could_not_import_before_starting():
    def local(rank, world_size):
        return rank
    with pytest.raises(ValueError, match="import"):
        dist.run(local, 2, start="spawn")
    with pytest.raises(ValueError, match="import"):
        dist.run(lambda r, w: r, 2, start="spawn")


def test_spawn_runs_a_library_worker():
    out = dist.run(collectives.ring_check, 2, args=(37,), timeout=T, start="spawn", deadline=60)
    assert all(o["max_abs_diff"] < 1e-12 for o in out)



def _grow(rank, world_size, box, by):
    # mutates its argument: a second call must not see the first call's change
    box.append(by)
    t = torch.tensor([float(sum(box) * (rank + 1))])
    tdist.all_reduce(t)
    return list(box), t.item()


def test_run_many_equals_one_launch_per_call_each_with_its_own_arguments():
    box = [1.0]
    calls = [(box, 2.0), (box, 10.0), (box, -3.0)]
    together = dist.run_many(_grow, 2, calls, timeout=T)
    alone = [dist.run(_grow, 2, args=c, timeout=T) for c in calls]
    assert together == alone and box == [1.0]          # the caller's list untouched
    assert together[1] == [([1.0, 10.0], 33.0)] * 2    # not [1, 2, 10]: a fresh copy per call
    assert len(dist.run_many(_sum_ranks, 3, [(), (2.0,)], timeout=T)[1]) == 3


@pytest.mark.parametrize("calls, kwargs, match", [
    ([], {}, "calls"), ("ab", {}, "calls"), ([(1.0,), 3], {}, r"calls\[1\]"),
    ([()], {"args": (1,)}, "args"), ([()], {"start": "bogus"}, "start"),
])
def test_run_many_refuses_bad_calls_before_starting_anything(calls, kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        dist.run_many(_sum_ranks, 2, calls, **kwargs)
    with pytest.raises(ValueError, match="import"):   # fn travels to spawned children too
        dist.run_many(lambda r, w: r, 2, [()], start="spawn")


@pytest.mark.parametrize("kwargs, exc", [
    (dict(world_size=0), ValueError), (dict(world_size=2.0), TypeError),
    (dict(timeout=0), ValueError), (dict(backend="mpi"), ValueError),
    (dict(start="bogus"), ValueError), (dict(args=5), TypeError),
    (dict(deadline=-1), ValueError),
])
def test_run_rejects_bad_arguments(kwargs, exc):
    kwargs = {"world_size": 2, **kwargs}
    with pytest.raises(exc):
        dist.run(_sum_ranks, **kwargs)
    with pytest.raises(TypeError, match="fn"):
        dist.run("not callable")


def test_device_for_outside_a_group_is_cpu():
    assert dist.device_for(0) == torch.device("cpu")


# ---- ring collectives from send/recv ---------------------------------------------------

@pytest.mark.parametrize("world_size, numel", [(2, 1), (2, 7), (2, 64), (4, 3), (4, 13),
                                               (4, 1001)])
def test_ring_collectives_equal_torch_and_the_serial_sum(world_size, numel):
    out = dist.run(collectives.ring_vs_torch, world_size, args=(numel, 5), timeout=T)
    inputs = [collectives.rank_tensor(r, numel, 5) for r in range(world_size)]
    serial = torch.stack(inputs).sum(0)  # the serial reference
    chunks = serial.tensor_split(world_size)
    pieces = torch.stack([x[: numel // world_size] for x in inputs])
    for rank, o in enumerate(out):
        torch.testing.assert_close(o["ring"], o["ref"], rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(o["ring"], serial, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(o["ring_rs"], o["ref_rs"], rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(o["ring_rs"], chunks[rank], rtol=1e-13, atol=1e-13)
        assert torch.equal(o["ring_ag"], o["ref_ag"]) and torch.equal(o["ring_ag"], pieces)


def _ring_log(rank, world_size):
    log: list = []
    collectives.ring_all_reduce(torch.arange(8.0), log=log)
    return log


def test_ring_takes_2_n_minus_1_steps_each_sending_one_chunk():
    logs = dist.run(_ring_log, 4, timeout=T)
    for rank, log in enumerate(logs):
        assert len(log) == 2 * (4 - 1)
        assert [e[0] for e in log] == ["reduce-scatter"] * 3 + ["all-gather"] * 3
        assert all(e[3] == (rank + 1) % 4 and e[5] == (rank - 1) % 4 for e in log)
    # What rank r sends at step s is what rank r+1 receives at step s.
    for rank in range(4):
        right = (rank + 1) % 4
        assert [e[2] for e in logs[rank]] == [e[4] for e in logs[right]]


# ---- the ledger ------------------------------------------------------------------------

def _dp_step_ledger(rank, world_size, sizes):
    """One data-parallel step: all_reduce each gradient; then the same with the ring."""
    grads = [torch.full((n,), float(rank)) for n in sizes]
    with dist.ledger() as led:
        for g in grads:
            tdist.all_reduce(g)
    with dist.ledger() as ring:
        for g in grads:
            collectives.ring_all_reduce(g)
    with dist.ledger() as other:
        x = torch.zeros(6)
        tdist.broadcast(x, src=0)
        out = torch.empty(6 * world_size)
        tdist.all_gather_into_tensor(out, x)
        tdist.reduce_scatter_tensor(torch.empty(6), torch.ones(6 * world_size))
        tdist.all_to_all_single(torch.empty(4 * world_size), torch.ones(4 * world_size))
        tdist.barrier()
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        ops = [tdist.P2POp(tdist.isend, torch.ones(5), right),
               tdist.P2POp(tdist.irecv, torch.empty(5), left)]
        for req in tdist.batch_isend_irecv(ops):
            req.wait()
    return (led.count("all_reduce"), led.bytes("all_reduce"), ring.bytes("isend"),
            ring.bytes("recv"), ring.count("all_reduce"), other.summary(), led.records[0].ranks)


@pytest.mark.filterwarnings("ignore:.*(all_gather_into_tensor|reduce_scatter_tensor)")
@pytest.mark.parametrize("world_size", [2, 4])
def test_ledger_bytes_equal_the_formulas(world_size):
    sizes = [12, 40, 100]  # divisible by 2 and 4, so every ring chunk is the same size
    grad_bytes = 4 * sum(sizes)
    out = dist.run(_dp_step_ledger, world_size, args=(sizes,), timeout=T)
    for count, payload, sent, received, nested, other, ranks in out:
        assert (count, payload, ranks) == (len(sizes), grad_bytes, world_size)
        # Our ring sends exactly what the formula says: 2(N-1)/N |grad| per rank per step.
        assert sent == received == ring_bytes("all_reduce", grad_bytes, world_size)
        assert sent == 2 * (world_size - 1) * grad_bytes // world_size
        assert nested == 0
        assert other["broadcast"][:2] == (1, 24)
        assert other["all_gather_into_tensor"][:2] == (1, 24 * world_size)
        assert other["reduce_scatter_tensor"][:2] == (1, 24 * world_size)
        assert other["all_to_all_single"][:2] == (1, 16 * world_size)
        assert other["barrier"][:2] == (1, 0)
        # The isend/irecv that batch_isend_irecv issues are not counted a second time.
        assert other["batch_isend_irecv"][:2] == (1, 40)
        assert "isend" not in other and "irecv" not in other


def test_ledger_restores_torch_functions():
    original = tdist.all_reduce
    with dist.ledger(), dist.ledger():
        assert tdist.all_reduce is not original
    assert tdist.all_reduce is original and tdist.distributed_c10d.all_reduce is original


# ---- the cost model --------------------------------------------------------------------

M = AlphaBeta(alpha=1e-5, beta=1e-9)


@pytest.mark.parametrize("kind, algorithm, n, N, expected", [
    ("send", "ring", 1000, 2, 1e-5 + 1000e-9),
    ("all_reduce", "ring", 4000, 4, 6 * 1e-5 + 1.5 * 4000e-9),
    ("all_reduce", "ring", 4000, 1, 0.0),
    ("all_reduce", "tree", 4000, 8, 6 * (1e-5 + 4000e-9)),
    ("all_reduce", "tree", 4000, 5, 6 * (1e-5 + 4000e-9)),   # ceil(log2 5) = 3
    ("reduce_scatter_tensor", "ring", 800, 8, 7e-5 + 700e-9),
    ("all_gather_into_tensor", "ring", 800, 8, 7e-5 + 700e-9),
    ("all_gather", "tree", 800, 8, 3e-5 + 700e-9),
    ("broadcast", "ring", 800, 8, 7e-5 + 800e-9),
    ("broadcast", "tree", 800, 8, 3 * (1e-5 + 800e-9)),
    ("all_to_all_single", "ring", 800, 4, 3 * (1e-5 + 200e-9)),
    ("all_to_all", "tree", 800, 4, 2 * 1e-5 + 800e-9),
    ("all_reduce", "double_tree", 4000, 8, 6e-5 + 2 * 4000e-9),   # 2 log2 N a + 2 n b
    ("all_reduce", "double_tree", 4000, 5, 6e-5 + 2 * 4000e-9),
    ("all_reduce", "double_tree", 4000, 1, 0.0),
    ("broadcast", "double_tree", 800, 8, 3e-5 + 800e-9),
    ("reduce", "double_tree", 800, 4, 2e-5 + 800e-9),
])
def test_collective_time_hand_computed(kind, algorithm, n, N, expected):
    assert math.isclose(collective_time(kind, n, N, M, algorithm), expected, rel_tol=1e-12)


def test_collective_time_prices_each_collective_by_its_own_link():
    fast, slow = AlphaBeta(2e-5, 5e-10), AlphaBeta(3e-5, 4e-9)
    links = {"all_reduce": fast, "all_gather_single": slow, "all_to_all": M}
    for kind, link in (("all_reduce", fast), ("all_gather_into_tensor", slow),
                       ("all_gather", slow), ("all_to_all_single", M)):
        assert collective_time(kind, 1e6, 4, links) == collective_time(kind, 1e6, 4, link)
    with pytest.raises(ValueError, match="no link for 'reduce_scatter'"):
        collective_time("reduce_scatter_tensor", 1e6, 4, links)
    with pytest.raises(ValueError, match="model's keys"):
        collective_time("all_reduce", 1e6, 4, {"allreduce": fast})
    with pytest.raises(ValueError, match="same collective"):
        collective_time("all_gather", 1e6, 4, {"all_gather": fast, "all_gather_single": slow})
    with pytest.raises(TypeError, match=r"model\['all_reduce'\]"):
        collective_time("all_reduce", 1e6, 4, {"all_reduce": (1e-5, 1e-9)})
    with pytest.raises(TypeError, match="model must be"):
        collective_time("all_reduce", 1e6, 4, (1e-5, 1e-9))


def test_ring_all_reduce_is_reduce_scatter_plus_all_gather():
    for N in (2, 3, 8):
        rs_ag = (collective_time("reduce_scatter", 1e6, N, M)
                 + collective_time("all_gather", 1e6, N, M))
        assert math.isclose(collective_time("all_reduce", 1e6, N, M), rs_ag, rel_tol=1e-12)
    assert ring_bytes("all_reduce", 1000, 4) == 1500
    assert ring_bytes("all_gather_into_tensor", 1000, 4) == 750


def test_double_tree_has_a_trees_latency_and_a_rings_bytes():
    # Large messages: the pipelined tree's time per byte is the ring's limit 2 n b, far
    # below the binomial tree's 2 log2 N n b; small ones: its latency is the tree's.
    big, small = 14e9, 8.0
    for N in (8, 64, 1024):
        ring = collective_time("all_reduce", big, N, M)
        dbt = collective_time("all_reduce", big, N, M, "double_tree")
        binomial = collective_time("all_reduce", big, N, M, "tree")
        assert 1 < dbt / ring < N / (N - 1) * 1.001 and binomial / dbt > math.log2(N) * 0.99
        assert math.isclose(collective_time("all_reduce", small, N, M, "double_tree"),
                            collective_time("all_reduce", small, N, M, "tree"), rel_tol=1e-3)
    with pytest.raises(ValueError, match="double_tree"):
        collective_time("all_gather", 1e6, 4, M, "double_tree")


def test_cost_model_rejects_bad_input():
    with pytest.raises(ValueError, match="kind"):
        collective_time("allreduce", 1, 2, M)
    with pytest.raises(ValueError, match="algorithm"):
        collective_time("all_reduce", 1, 2, M, "butterfly")
    with pytest.raises(ValueError, match="nbytes"):
        collective_time("all_reduce", -1, 2, M)
    with pytest.raises(ValueError, match="world_size"):
        collective_time("send", 1, 1, M)
    with pytest.raises(TypeError, match="model"):
        collective_time("send", 1, 2, (1e-5, 1e-9))
    with pytest.raises(ValueError, match="alpha"):
        AlphaBeta(-1.0, 1.0)


@pytest.mark.parametrize("kind, N, algorithm", [("send", 2, "ring"), ("all_reduce", 4, "ring"),
                                                ("all_reduce", 8, "tree")])
def test_fit_recovers_alpha_beta_from_synthetic_timings(kind, N, algorithm):
    truth = AlphaBeta(alpha=37e-6, beta=1 / 2.5e9)
    sizes = [2.0 ** k for k in range(4, 26)]
    g = torch.Generator().manual_seed(1)
    noise = 1 + 0.02 * torch.randn(len(sizes), generator=g, dtype=torch.float64)
    times = [collective_time(kind, n, N, truth, algorithm) * float(e)
             for n, e in zip(sizes, noise, strict=True)]
    exact = fit_alpha_beta(sizes, [collective_time(kind, n, N, truth, algorithm) for n in sizes],
                           kind=kind, world_size=N, algorithm=algorithm)
    assert math.isclose(exact.alpha, truth.alpha, rel_tol=1e-9)
    assert math.isclose(exact.beta, truth.beta, rel_tol=1e-9)
    noisy = fit_alpha_beta(sizes, times, kind=kind, world_size=N, algorithm=algorithm)
    assert math.isclose(noisy.alpha, truth.alpha, rel_tol=0.05)
    assert math.isclose(noisy.beta, truth.beta, rel_tol=0.05)


def test_fit_pins_a_negative_coefficient_to_zero():
    # Pure bandwidth data (no latency at all) with noise that pulls alpha below 0.
    sizes = [1e3, 1e4, 1e5, 1e6]
    times = [n * 1e-9 * f for n, f in zip(sizes, [0.9, 1.0, 1.0, 1.0], strict=True)]
    fit = fit_alpha_beta(sizes, times)
    assert fit.alpha == 0.0 and fit.beta > 0
    with pytest.raises(ValueError, match="same length"):
        fit_alpha_beta([1, 2], [1.0])
    with pytest.raises(ValueError, match="times"):
        fit_alpha_beta([1, 2], [1.0, 0.0])


# ---- torchrun --------------------------------------------------------------------------

def test_torchrun_runs_a_library_worker_on_two_cpu_ranks():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "parlearn.distributed", "parlearn.distributed.collectives:ring_check", "101"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("rank ")]
    assert sorted(ln.split(":")[0] for ln in lines) == ["rank 0", "rank 1"]
    for ln in lines:
        value = eval(ln.split(": ", 1)[1])  # the dict the worker returned, printed by repr
        assert value["max_abs_diff"] < 1e-12
        assert value["all_reduce_payload"] == 8 * 101


# ---- measuring on real ranks -----------------------------------------------------------

def test_sweep_collective_measures_every_kind_at_every_size():
    sizes = [64, 4096, 65536]
    sw = dist.sweep_collective(collectives.TIMED_KINDS, sizes, 2, repeat=3, timeout=T)
    assert sw["sizes"] == sizes and sw["world_size"] == 2 and "gloo" in sw["device"]
    for kind in collectives.TIMED_KINDS:
        med, q1, q3 = sw["median_s"][kind], sw["q1_s"][kind], sw["q3_s"][kind]
        assert len(med) == len(sizes)
        assert all(0 < lo <= m <= hi for lo, m, hi in zip(q1, med, q3, strict=True))
    assert isinstance(sw["reliable"], bool)
    with pytest.raises(ValueError, match="kinds"):
        dist.sweep_collective(("allreduce",), sizes)
    with pytest.raises(ValueError, match="world_size"):
        dist.sweep_collective(("all_reduce",), sizes, 1)
    with pytest.raises(ValueError, match="sizes"):  # 68 B = 17 floats: no equal halves
        dist.sweep_collective(("all_gather",), [68], 2)


def test_measure_alpha_beta_on_real_ranks_gives_a_usable_model():
    model = dist.measure_alpha_beta(2, sizes=[64, 1024, 16384, 262144], repeat=3, timeout=T)
    # Any machine has some latency or some per-byte cost; the fit says which, >= 0.
    assert model.alpha >= 0 and model.beta >= 0 and (model.alpha > 0 or model.beta > 0)
    assert collective_time("all_reduce", 262144, 2, model) > 0


def test_measure_links_fits_each_collective_on_real_ranks():
    links = dist.measure_links(2, sizes=[64, 1024, 16384, 262144], repeat=3, timeout=T,
                               kinds=("all_reduce", "all_gather"))
    assert set(links) == {"all_reduce", "all_gather"}
    for link in links.values():
        assert link.alpha >= 0 and link.beta >= 0 and (link.alpha > 0 or link.beta > 0)
    assert collective_time("all_gather_single", 262144, 2, links) == \
        collective_time("all_gather", 262144, 2, links["all_gather"])
    with pytest.raises(ValueError, match="kinds"):
        dist.measure_links(2, kinds="all_reduce")


# ---- the lesson's workers --------------------------------------------------------------

def test_collectives_demo_equals_the_serial_semantics():
    n, k = 3, 2
    demo = dist.run(collectives.collectives_demo, n, args=(k,), timeout=T)
    mine = [torch.arange(1, n * k + 1) + 10 * r for r in range(n)]
    total = torch.stack(mine).sum(0)
    for r, d in enumerate(demo):
        assert all(torch.equal(d[c][0], mine[r] if c != "all_gather" else mine[r][:k])
                   for c in d)
        assert torch.equal(d["broadcast"][1], mine[0])
        assert torch.equal(d["all_reduce"][1], total)
        assert torch.equal(d["reduce_scatter"][1], total.chunk(n)[r])
        assert torch.equal(d["all_gather"][1], torch.cat([m[:k] for m in mine]))
        assert torch.equal(d["all_to_all"][1], torch.cat([m.chunk(n)[r] for m in mine]))
    assert torch.equal(demo[0]["reduce"][1], total)
    with pytest.raises(ValueError, match="per_rank"):
        collectives.collectives_demo(0, 4, 3)


@pytest.mark.parametrize("world_size, numel", [(4, 1001), (3, 10), (2, 5)])
def test_ring_ledger_with_uneven_chunks(world_size, numel):
    out = dist.run(collectives.ring_ledger, world_size, args=(numel,), timeout=T)
    sizes = [len(c) for c in torch.arange(numel).tensor_split(world_size)]
    for rank, o in enumerate(out):
        # The reduce-scatter phase sends every chunk but the rank's own and receives every
        # chunk but its left neighbour's; the all-gather phase sends every chunk but its
        # right neighbour's and receives every chunk but its own.
        left, right = sizes[(rank - 1) % world_size], sizes[(rank + 1) % world_size]
        assert o["sent"] == 4 * (2 * numel - sizes[rank] - right)
        assert o["received"] == 4 * (2 * numel - left - sizes[rank])
        assert o["payload"] == 4 * numel


def test_plot_collectives_draws_every_collective():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    demo = dist.run(collectives.collectives_demo, 2, timeout=T)
    fig, axes = plt.subplots(6, 2)
    collectives.plot_collectives(demo, axes)
    assert [ax.get_title() for ax in axes[:, 1]] == [f"{c}: after" for c in demo[0]]
    assert sum(len(ax.texts) for ax in axes[:, 0]) == sum(
        v[0].numel() for d in demo for v in d.values())
    plt.close(fig)


def test_plot_hierarchical_draws_three_phases_and_refuses_bad_shapes():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3)
    collectives.plot_hierarchical(axes, nodes=3, gpus_per_node=4)
    assert [ax.get_title().split(".")[0] for ax in axes] == ["1", "2", "3"]
    # ring arrows in phases 1 and 3 (G per node), G arrows between each pair of nodes in 2
    arrows = [sum(1 for t in ax.texts if getattr(t, "arrow_patch", None) is not None)
              for ax in axes]
    assert arrows == [3 * 4, 2 * 4, 3 * 4]
    for bad, err in (({"nodes": 1}, ValueError), ({"gpus_per_node": 2.0}, TypeError),
                     ({"nodes": True}, TypeError)):
        with pytest.raises(err, match=next(iter(bad))):
            collectives.plot_hierarchical(axes, **bad)
    with pytest.raises(ValueError, match="axes"):
        collectives.plot_hierarchical(axes[:2])
    plt.close(fig)


def test_hierarchical_all_reduce_is_three_ring_phases():
    from parlearn.distributed.cost import AlphaBeta, hierarchical_all_reduce_time
    fast, slow = AlphaBeta(1e-6, 1 / 400e9), AlphaBeta(1e-5, 1 / 50e9)
    n, g, m = 1e9, 8, 4
    t = hierarchical_all_reduce_time(n, g, m, fast, slow)
    assert t["reduce_scatter"] == pytest.approx(7 * 1e-6 + 7 / 8 * n / 400e9)
    assert t["all_reduce"] == pytest.approx(2 * 3 * 1e-5 + 2 * 3 / 4 * (n / 8) / 50e9)
    assert t["all_gather"] == pytest.approx(t["reduce_scatter"])
    assert t["total"] == pytest.approx(sum(t[k] for k in ("reduce_scatter", "all_reduce",
                                                           "all_gather")))
    # one node: no network phase; one GPU per node: a flat ring over the network
    assert hierarchical_all_reduce_time(n, g, 1, fast, slow)["all_reduce"] == 0
    assert hierarchical_all_reduce_time(n, 1, m, fast, slow)["total"] == pytest.approx(
        dist.collective_time("all_reduce", n, m, slow))


def test_ring_receive_buffer_is_kept_between_calls_and_grows():
    from parlearn.distributed.collectives import _scratch

    a = _scratch(torch.empty(1000))
    b = _scratch(torch.empty(10))  # a smaller chunk reuses the kept buffer
    assert b.numel() == 10 and b.data_ptr() == a.data_ptr()
    c = _scratch(torch.empty(5000))  # a larger one replaces it
    assert c.numel() == 5000 and _scratch(torch.empty(3000)).data_ptr() == c.data_ptr()
    d = _scratch(torch.empty(7, dtype=torch.float64))  # one per dtype
    assert d.dtype == torch.float64 and d.numel() == 7
