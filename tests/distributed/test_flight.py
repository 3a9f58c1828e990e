"""The flight recorder and the doctor: records written by real ranks, and diagnose() on
hand-built records (exact wording, and properties over random programs)."""

from __future__ import annotations

import glob
import os
import tempfile

import pytest
import torch
import torch.distributed as tdist
from hypothesis import given, settings
from hypothesis import strategies as st

from parlearn import dist
from parlearn.distributed import diagnosis, flight, traffic
from parlearn.distributed.diagnosis import END_OF_RUN, Call, diagnose

T = 20  # group timeout (s) for runs that should succeed


def _c(seq, kind="all_reduce", nbytes=64, dtype="float32", outcome="ok", **kw):
    shape = kw.pop("shape", (nbytes // 4,) if kind not in ("barrier",) else ())
    return Call(seq, kind, nbytes, dtype, shape, outcome=outcome, **kw)


def _end(seq, outcome=""):
    return Call(seq, "barrier", 0, "", (), None, 3, END_OF_RUN, outcome)


def test_the_doctor_is_reexported_where_it_was():
    """diagnose, Call and END_OF_RUN live in diagnosis; flight and dist still hand them out."""
    for name in ("diagnose", "Call", "END_OF_RUN"):
        assert getattr(flight, name) is getattr(diagnosis, name), name
    assert dist.diagnose is diagnose and dist.Call is Call


def _prefix(n, **kw):
    return [_c(i + 1, group=3, **kw) for i in range(n)]


# ---- diagnose on hand-built records: the wording ------------------------------------------

def test_different_collectives_at_the_same_position():
    recs = {r: _prefix(16) for r in range(3)}
    recs[0].append(_c(17, "all_gather", 16384, outcome="", group=3))
    recs[1].append(_c(17, "all_gather", 16384, outcome="", group=3))
    recs[2].append(_c(17, "all_reduce", 4096, outcome="", group=3))
    assert diagnose(recs) == (
        "rank 2 waits in all_reduce #17 (4,096 B float32) while ranks 0 and 1 wait in "
        "all_gather #17 (16,384 B float32): the ranks issued different collectives at #17")


def test_a_skipped_collective_leaves_the_rank_at_the_end_of_the_run():
    recs = {r: _prefix(3, nbytes=64, dtype="float64") for r in range(3)}
    recs[0].append(_c(4, nbytes=64, dtype="float64", outcome="", group=3))
    recs[2].append(_c(4, nbytes=64, dtype="float64", outcome="", group=3))
    recs[1].append(_end(4))
    assert diagnose(recs) == ("ranks 0 and 2 wait in all_reduce #4 (64 B float64); rank 1 "
                              "skipped it and waits at the end of the run (its call #4)")


def test_mismatched_sizes_and_dtypes_name_the_odd_rank():
    recs = {r: _prefix(2) + [_c(3, nbytes=64, outcome="", group=3)] for r in range(3)}
    recs[1][-1] = _c(3, nbytes=32, outcome="", group=3)
    assert diagnose(recs).startswith("all_reduce #3 with 32 B on rank 1 but 64 B on ranks 0 "
                                     "and 2: the ranks passed different sizes")
    recs[1][-1] = _c(3, nbytes=64, dtype="int32", outcome="", group=3)
    assert diagnose(recs).startswith("all_reduce #3 with int32 on rank 1 but float32 on ranks "
                                     "0 and 2: the ranks passed different dtypes")


def test_a_mismatch_that_returned_is_called_silent():
    recs = {r: [_c(1, dtype="float16")] for r in range(3)}
    recs[1] = [_c(1, dtype="bfloat16")]
    assert "silently wrong" in diagnose(recs)
    assert "silently" not in diagnose({r: [_c(1)] for r in range(3)})


def test_a_send_with_no_matching_recv():
    recs = {r: [_c(1)] for r in range(3)}
    recs[0].append(Call(2, "send", 800, "float32", (200,), 1, 3, "", ""))
    recs[1].append(_end(2))
    recs[2].append(_end(2))
    assert diagnose(recs) == ("rank 0 waits in send #2 to rank 1 (800 B float32); rank 1 "
                              "never posted a recv from rank 0: it waits at the end of the "
                              "run (its call #2)")
    recs[1].insert(1, Call(2, "recv", 800, "float32", (200,), 0, 3, "", "ok"))
    assert "never posted" not in diagnose(recs)


def test_a_dead_rank():
    recs = {r: _prefix(5, nbytes=16) for r in range(3)}
    recs[0].append(_c(6, nbytes=16, outcome="RuntimeError: Connection closed by peer"))
    recs[1].append(_c(6, nbytes=16, outcome="RuntimeError: Connection closed by peer"))
    exits = {0: "raised RuntimeError: Connection closed by peer",
             1: "raised RuntimeError: Connection closed by peer", 2: "killed by signal 9"}
    assert diagnose(recs, exits) == ("rank 2 died (killed by signal 9) after its call #5; "
                                     "ranks 0 and 1 wait in all_reduce #6 (16 B float32)")


def test_agreeing_records():
    assert diagnose({r: _prefix(4) for r in range(2)}) == (
        "the 2 ranks agree on all 4 calls, and every call returned")
    stuck = {r: _prefix(2) + [_c(3, outcome="")] for r in range(2)}
    assert diagnose(stuck).startswith("ranks 0 and 1 wait in all_reduce #3")


def test_long_rank_lists_are_ranges():
    recs = {r: [_c(1, outcome="")] for r in range(8)}
    recs[5] = [_c(1, nbytes=32, outcome="")]
    assert "64 B on ranks 0-4, 6 and 7" in diagnose(recs)


@pytest.mark.parametrize("records, exits, exc", [
    ({}, None, TypeError), ([], None, TypeError), ({0: [3]}, None, TypeError),
    ({-1: []}, None, ValueError), ({0: []}, {1: "returned"}, ValueError),
    ({0: []}, {0: 3}, TypeError), ({0: []}, "returned", TypeError)])
def test_diagnose_refuses_bad_input_naming_it(records, exits, exc):
    with pytest.raises(exc, match="records_by_rank|exits"):
        diagnose(records, exits)


# ---- diagnose: properties over random programs ---------------------------------------------

KINDS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier")
_call = st.tuples(st.sampled_from(KINDS), st.sampled_from([4, 64, 4096]),
                  st.sampled_from(["float32", "float64", "bfloat16"])).map(
    lambda c: ("barrier", 0, "") if c[0] == "barrier" else c)   # a barrier has no payload


def _program(spec, start=1, outcome="ok"):
    return [Call(start + i, k, n, d, outcome=outcome) for i, (k, n, d) in enumerate(spec)]


@settings(max_examples=60, deadline=None)
@given(prefix=st.lists(_call, max_size=12), world=st.integers(2, 6), data=st.data())
def test_one_rank_diverging_after_a_common_prefix_is_named(prefix, world, data):
    odd = data.draw(st.integers(0, world - 1), label="odd")
    mine = data.draw(_call, label="mine")
    theirs = data.draw(_call.filter(lambda c: c != mine), label="theirs")
    how = data.draw(st.sampled_from(["differs", "skips", "dies"]), label="how")
    k = len(prefix) + 1
    recs = {r: _program(prefix) + _program([theirs], k, "") for r in range(world)}
    exits = None
    if how == "differs":
        recs[odd] = _program(prefix) + _program([mine], k, "")
    elif how == "skips":
        recs[odd] = _program(prefix) + [Call(k, "barrier", note=END_OF_RUN)]
    else:
        recs[odd] = _program(prefix)
        exits = {odd: "killed by signal 9"}
    text = diagnose(recs, exits)
    assert f"#{k}" in text and "agree" not in text, text
    others = [r for r in range(world) if r != odd]
    if world > 2:   # with two ranks there is no majority: both are named, either first
        assert text.startswith(f"rank {odd} ") or f" rank {odd} " in text or \
            f"on rank {odd}" in text, text
        assert diagnosis._ranks(others) in text, text
    if how == "skips":
        assert f"{'rank' if world == 2 else 'ranks'}" in text and "end of the run" in text
    if how == "dies":
        assert text.startswith(f"rank {odd} died (killed by signal 9)"), text


@settings(max_examples=30, deadline=None)
@given(prefix=st.lists(_call, max_size=10), world=st.integers(1, 5))
def test_ranks_that_agree_are_never_blamed(prefix, world):
    recs = {r: _program(prefix) for r in range(world)}
    assert diagnose(recs).startswith(f"the {world} ranks agree")


# ---- the recorder on real ranks --------------------------------------------------------------

def _program_on_ranks(rank: int, world_size: int):
    t = torch.ones(6, dtype=torch.float64)
    tdist.all_reduce(t)
    if rank == 0:
        tdist.send(torch.ones(3), 1)
    elif rank == 1:
        tdist.recv(torch.empty(3), 0)
    parts = [torch.empty(6, dtype=torch.float64) for _ in range(world_size)]
    tdist.all_gather(parts, t)
    return len(traffic._watchers)


def _flight_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "parlearn-flight-*")))


def test_records_of_a_successful_run_count_from_one_and_end_with_the_run():
    before = _flight_dirs()
    records: dict = {}
    watchers = dist.run(_program_on_ranks, 2, timeout=T, doctor=True, records=records)
    assert watchers == [1, 1]   # the recorder watched fn, and nothing else did
    assert _flight_dirs() == before   # the temporary folder is gone
    r0, r1 = records[0], records[1]
    assert [c.seq for c in r0] == [1, 2, 3, 4] and [c.seq for c in r1] == [1, 2, 3, 4]
    assert [c.kind for c in r0] == ["all_reduce", "send", "all_gather", "barrier"]
    assert [c.kind for c in r1] == ["all_reduce", "recv", "all_gather", "barrier"]
    assert r0[0] == Call(1, "all_reduce", 48, "float64", (6,), None, 2, "", "ok")
    assert (r0[1].peer, r1[1].peer, r0[1].nbytes) == (1, 0, 12)
    assert r0[2].shape == (2, 6) and r0[2].nbytes == 96
    assert r0[3].note == END_OF_RUN and r1[3].note == END_OF_RUN
    assert all(c.outcome == "ok" for c in r0 + r1)
    assert diagnose(records) == "the 2 ranks agree on all 4 calls, and every call returned"


def _count_watchers(rank: int, world_size: int):
    return len(traffic._watchers), tdist.get_debug_level() == tdist.DebugLevel.DETAIL, \
        os.environ.get("PARLEARN_FLIGHT_TEST")


def test_doctor_off_records_nothing_and_env_reaches_the_children():
    before = _flight_dirs()
    out = dist.run(_count_watchers, 2, timeout=T)
    assert out == [(0, False, None)] * 2 and _flight_dirs() == before
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "PARLEARN_FLIGHT_TEST": "yes"}
    assert dist.run(_count_watchers, 2, timeout=T, env=env) == [(0, True, "yes")] * 2
    assert "PARLEARN_FLIGHT_TEST" not in os.environ


def _raise_on_rank_1(rank: int, world_size: int):
    tdist.all_reduce(torch.ones(2))
    if rank == 1:
        raise KeyError("boom")
    tdist.all_reduce(torch.ones(2))


def test_a_failure_without_the_doctor_has_no_diagnosis_and_with_it_one_first():
    with pytest.raises(dist.RankError) as info:
        dist.run(_raise_on_rank_1, 2, timeout=5)
    assert info.value.diagnosis is None and info.value.records is None
    with pytest.raises(dist.RankError) as info:
        dist.run(_raise_on_rank_1, 2, timeout=5, doctor=True)
    err = info.value
    assert err.diagnosis.startswith("rank 1 raised KeyError: 'boom', after its call #1; "
                                    "rank 0 waits in all_reduce #2"), err.diagnosis
    assert str(err).splitlines()[0] == err.diagnosis


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(doctor=1), TypeError, "doctor"), (dict(doctor="yes"), TypeError, "doctor"),
    (dict(env={"A": 1}), TypeError, "env"), (dict(env="A=1"), TypeError, "env"),
    (dict(env={"TORCH_DISTRIBUTED_DEBUG": "LOUD"}), ValueError, "env"),
    (dict(records=[]), TypeError, "records"), (dict(records={}), ValueError, "records")])
def test_run_checks_its_new_arguments(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        dist.run(_count_watchers, 2, timeout=T, **kwargs)


def test_recording_and_read_records_check_their_arguments(tmp_path):
    with pytest.raises(ValueError, match="folder"):
        flight.recording(tmp_path / "missing", 0)
    with pytest.raises(TypeError, match="rank"):
        flight.recording(tmp_path, True)
    with pytest.raises(ValueError, match="folder"):
        flight.read_records(tmp_path / "missing")


def test_a_line_cut_short_is_skipped(tmp_path):
    (tmp_path / "rank0.jsonl").write_text(
        '{"seq": 1, "kind": "all_reduce", "bytes": 8, "dtype": "float32", "shape": [2], '
        '"peer": null, "group": 2, "note": ""}\n{"seq": 1, "end": "ok", "seconds": 0.1}\n'
        '{"seq": 2, "kind": "all_re')
    assert flight.read_records(tmp_path) == {
        0: [Call(1, "all_reduce", 8, "float32", (2,), None, 2, "", "ok")]}
