"""The hang zoo: every classic hang ends in a RankError within its timeout whose diagnosis
names the ranks, the collective and its position; no process is left behind; the silent
mismatches are found on demand."""

from __future__ import annotations

import os
import time

import pytest
from ranks import assert_refused_on_every_rank

from parlearn import dist, hangs

T = 2.0  # the group timeout: hangs that wait for it cost this much each

# name -> fragments the diagnosis must hold, in this order.
EXPECTED = {
    "wrong_order": ["rank 2 waits in all_reduce #3", "while ranks 0 and 1 wait in all_gather #3",
                    "different collectives at #3"],
    "skipped_collective": ["ranks 0 and 2 wait in all_reduce #4 (128 B float64); rank 1 "
                           "skipped it and waits at the end of the run (its call #4)"],
    "size_mismatch": ["all_reduce #3 with 32 B on rank 1 but 64 B on ranks 0 and 2",
                      "different sizes"],
    "dtype_mismatch": ["all_reduce #3 with 128 B float64 on rank 1 but 64 B float32 on ranks "
                       "0 and 2", "dtypes"],
    "send_without_recv": ["rank 0 waits in send #2 to rank 1 (800 B float32); rank 1 never "
                          "posted a recv from rank 0: it waits at the end of the run "
                          "(its call #2)"],
    "dead_rank": ["rank 2 died (killed by signal 9) after its call #5; ranks 0 and 1 wait in "
                  "all_reduce #6 (16 B float32)"],
    "late_rank": ["rank 2 was still running when the run was stopped, before its first call",
                  "ranks 0 and 1 wait in monitored_barrier #1"],
}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:   # a zombie has exited, which is what we check
        return fh.read().split(")")[-1].split()[0] != "Z"


def test_the_zoo_is_what_the_tests_check():
    assert set(EXPECTED) == set(hangs.HANGS)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_hang_ends_in_a_diagnosed_rank_error(name):
    worker, what = hangs.HANGS[name]
    assert what and worker.__doc__
    pids: list[int] = []
    t0 = time.monotonic()
    with pytest.raises(dist.RankError) as info:
        dist.run(worker, 3, timeout=T, doctor=True, pids=pids)
    seconds = time.monotonic() - t0
    err = info.value
    assert str(err).splitlines()[0] == err.diagnosis
    at = 0
    for fragment in EXPECTED[name]:
        found = err.diagnosis.find(fragment, at)
        assert found >= 0, f"{fragment!r} not in {err.diagnosis!r}"
        at = found + len(fragment)
    # the group timeout, the failure grace and the stop of a stuck rank, on a loaded machine
    assert seconds < T + 8, seconds
    assert len(pids) == 3 and not any(_alive(p) for p in pids)


def test_late_rank_is_named_by_monitored_barrier():
    with pytest.raises(dist.RankError) as info:
        dist.run(hangs.late_rank, 3, args=(0.5,), timeout=T)
    assert "Ranks 2 failed to pass monitoredBarrier" in info.value.failures[0]


def test_silent_mismatches_return_wrong_values_and_the_doctor_names_them():
    values, diagnosis = hangs.doctor(hangs.silent_dtype, 3, timeout=T)
    assert any(v != 3.0 for row in values for v in row), values   # a sum of ones, garbled
    assert diagnosis.startswith("all_reduce #1 with bfloat16 on rank 1 but float16 on ranks "
                                "0 and 2") and "silently wrong" in diagnosis
    values, diagnosis = hangs.doctor(hangs.silent_broadcast, 3, timeout=T)
    assert values[1] == [1.0] * 16 + [2.0] * 16   # the tail kept rank 1's own values
    assert diagnosis.startswith("broadcast #1 with 64 B on rank 0 but 128 B on ranks 1 and 2")


def test_hang_zoo_rows_and_what_torch_says():
    rows = hangs.hang_zoo(["dead_rank", "silent_dtype"], world_size=3, timeout=T)
    assert [r["name"] for r in rows] == ["dead_rank", "silent_dtype"]
    dead, silent = rows
    assert dead["ended"] == "RankError" and dead["diagnosis"].startswith("rank 2 died")
    assert silent["ended"] == "returned" and "silently wrong" in silent["diagnosis"]
    # TORCH_DISTRIBUTED_DEBUG=DETAIL fingerprints every collective: the silent one is caught
    assert silent["torch_says"].startswith("Detected mismatch between collectives")
    assert "dtypes: BFloat16 vs Half" in silent["torch_says"] or \
        "dtypes: Half vs BFloat16" in silent["torch_says"]
    assert all(r["seconds"] < T + 8 and r["torch_seconds"] < T + 8 for r in rows)


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(names=[]), TypeError, "names"), (dict(names="dead_rank"), TypeError, "names"),
    (dict(names=["nope"]), ValueError, "names"), (dict(world_size=1), ValueError, "world_size"),
    (dict(timeout=True), TypeError, "timeout"), (dict(timeout=0.1), ValueError, "timeout"),
    (dict(torch_says=1), TypeError, "torch_says")])
def test_hang_zoo_refuses_bad_arguments(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        hangs.hang_zoo(**kwargs)


@pytest.mark.parametrize("worker", [w for w, _ in [*hangs.HANGS.values(),
                                                   *hangs.SILENT.values()]],
                         ids=lambda w: w.__name__)
def test_workers_refuse_bad_arguments_on_every_rank(worker):
    assert_refused_on_every_rank(worker, (), name="world_size", world_size=1, timeout=T)


def test_late_rank_refuses_a_bad_timeout_on_every_rank():
    for bad in (0.0, True, float("nan")):
        assert_refused_on_every_rank(hangs.late_rank, (bad,), name="seconds", timeout=T)


def test_hang_zoo_quiet_keeps_the_ranks_c_plus_plus_noise_out_of_stderr(capfd):
    rows = hangs.hang_zoo(["size_mismatch"], world_size=3, timeout=T, torch_says=False)
    assert "different sizes" in rows[0]["diagnosis"]
    assert "Received data size" not in capfd.readouterr().err
    hangs.hang_zoo(["size_mismatch"], world_size=3, timeout=T, torch_says=False, quiet=False)
    assert "Received data size" in capfd.readouterr().err   # gloo's abort, when not quiet
