"""The critical path across ranks: synthetic traces with known answers, then real gloo ranks
with one rank made slow on purpose."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parlearn.at_scale import critical as C
from parlearn.at_scale import traces as T


def _x(name, start_ms, end_ms, tid=1):
    return {"ph": "X", "name": name, "ts": start_ms * 1e3, "dur": (end_ms - start_ms) * 1e3,
            "pid": 0, "tid": tid}


def _rank(fwd_end, ar1, ar2, end=60, ar1_end=30):
    """A step: forward computes until ``fwd_end`` ms, backward calls all-reduce #1 at
    ``ar1`` (to ``ar1_end``) and all-gather #2 at ``ar2`` (to 45), the optimizer runs
    45..``end``."""
    return [_x("forward", 0, fwd_end), _x("aten::mm", 0, fwd_end),
            _x("backward", fwd_end, 45), _x("aten::mm", fwd_end, ar1),
            _x("gloo:all_reduce", ar1, ar1_end, 7), _x("gloo:allgather", ar2, 45, 7),
            _x("optimizer", 45, end), _x("aten::add_", 45, end)]


def _ms(x):
    return round(x * 1e3, 9)


def test_a_straggler_is_on_the_path_and_charged_with_the_waiting():
    # rank 1 computes until 25 ms and arrives last at the first call (rank 0 waits 15 ms
    # from 10), which ends on rank 1 at 31; both arrive at the second call at 35; rank 1's
    # optimizer ends last at 62.
    ranks = [_rank(5, 10, 35), _rank(5, 25, 35, end=62, ar1_end=31)]
    cp = C.critical_path(ranks)
    got = [(k, r, n, _ms(a), _ms(b)) for k, r, n, a, b in cp["segments"]]
    assert got == [("work", 1, "", 0, 25), ("comm", 1, "gloo:all_reduce", 25, 31),
                   ("work", 0, "", 31, 35), ("comm", 0, "gloo:allgather", 35, 45),
                   ("work", 1, "", 45, 62)]
    assert _ms(cp["step"]) == 62 == _ms(sum(b - a for *_, a, b in cp["segments"]))
    assert _ms(cp["comm"]) == 16
    assert {r: _ms(v) for r, v in cp["work"].items()} == {0: 4, 1: 42}
    assert {r: _ms(v) for r, v in cp["compute"].items()} == {0: 0, 1: 42}
    assert {r: _ms(v) for r, v in cp["waited"].items()} == {0: 0, 1: 15}
    assert [(n, r, _ms(s)) for n, r, s in cp["calls"]] == [("gloo:all_reduce", 1, 15),
                                                            ("gloo:allgather", 0, 0)]


def test_overlapping_waits_on_one_straggler_count_once():
    # rank 0 posts both calls early (5 and 6 ms) and waits for rank 1, which posts both at
    # 20: two waits that overlap in time, 15 ms of waiting, not 29.
    a = [_x("forward", 0, 1), _x("gloo:all_reduce", 5, 25, 7), _x("gloo:all_reduce", 6, 26, 8),
         _x("optimizer", 26, 27)]
    b = [_x("forward", 0, 1), _x("gloo:all_reduce", 20, 25, 7), _x("gloo:all_reduce", 20, 26, 8),
         _x("optimizer", 26, 27)]
    cp = C.critical_path([a, b])
    assert _ms(cp["waited"][1]) == 15 and _ms(cp["waited"][0]) == 0


def test_different_programs_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="different collectives"):
        C.critical_path([_rank(5, 10, 35), _rank(5, 10, 35)[:-3]
                         + [_x("optimizer", 45, 60)]])
    with pytest.raises(ValueError, match="step=1"):
        C.critical_path([_rank(5, 10, 35)], step=1)
    with pytest.raises(TypeError, match="traces"):
        C.critical_path("rank0.json")
    with pytest.raises(ValueError, match="step"):
        C.critical_path([_rank(5, 10, 35)], step=-1)
    with pytest.raises(TypeError, match="labels"):
        C.critical_path([_rank(5, 10, 35)], labels="step")


@pytest.mark.parametrize("kind", ["naive", "bucketed"])
def test_real_ranks_put_the_slow_rank_on_the_path(kind, tmp_path):
    """Rank 1 computes 100 ms more per step (far more than the whole step of this small
    MLP): the path's work is rank 1's, and rank 0 waited on rank 1, not the reverse. The
    segments tile the step."""
    res = T.profile_ranks(T.dp_step_worker, 2, out_dir=tmp_path,
                          args=(kind, 2, (64, 256, 10), 2**20, 0, 1, 0.1))
    cp = C.critical_path([path for _, path in res], step=1)
    assert sum(b - a for *_, a, b in cp["segments"]) == pytest.approx(cp["step"], abs=1e-9)
    assert cp["work"][1] > 0.1 > cp["work"][0]
    assert cp["compute"][1] > 0.05 > cp["compute"][0]   # the extra matmuls are compute
    # who waited on whom, not how long: under load rank 0's own step stretches too and eats
    # into its wait (18 ms of the 100 ms at load 8), so an absolute floor here is a timing test
    assert cp["waited"][1] > cp["waited"][0]


@given(st.lists(st.lists(st.tuples(st.floats(0, 20), st.floats(0.1, 10)), min_size=2,
                         max_size=2), min_size=1, max_size=5),
       st.floats(0, 30))
@settings(max_examples=200, deadline=None)
def test_the_path_tiles_the_step_and_waits_stay_within_it(calls, tail):
    """Two ranks with random call arrivals and lengths (in order on each rank): the
    segments are contiguous, add up to the step, and no rank is charged more waiting than
    the step lasted."""
    ranks = [[_x("forward", 0, 1)], [_x("forward", 0, 1)]]
    t = [1.0, 1.0]
    for k, pair in enumerate(calls):
        for r, (gap, length) in enumerate(pair):
            t[r] += gap
            ranks[r].append(_x("gloo:all_reduce", t[r], t[r] + length, 7 + k))
            t[r] += length
    for r in range(2):
        ranks[r].append(_x("optimizer", t[r], t[r] + tail))
    cp = C.critical_path(ranks)
    segs = cp["segments"]
    assert all(a < b for *_, a, b in segs)
    assert all(abs(segs[i][4] - segs[i + 1][3]) < 1e-12 for i in range(len(segs) - 1))
    assert sum(b - a for *_, a, b in segs) == pytest.approx(cp["step"], abs=1e-9)
    assert all(0 <= w <= cp["step"] + 1e-9 for w in cp["waited"].values())
    # From call k's last arrival to its last end every rank is inside it: the path calls
    # that time communication.
    comm = T._union([(a, b) for kind, *_, a, b in segs if kind == "comm"])
    for k in range(len(calls)):
        spans = [[e for e in rk if e["name"] == "gloo:all_reduce"][k] for rk in ranks]
        a_k = max(e["ts"] for e in spans) * 1e-6
        e_k = max(e["ts"] + e["dur"] for e in spans) * 1e-6
        assert T._length(T._intersect(comm, [(a_k, e_k)])) == pytest.approx(e_k - a_k,
                                                                           abs=1e-9)
