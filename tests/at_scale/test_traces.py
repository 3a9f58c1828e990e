"""Reading a step's time out of Chrome traces: synthetic traces with known answers, then real
gloo ranks whose parts add up to the step."""

from __future__ import annotations

import json

import pytest

from parlearn.at_scale import traces as T


def _x(name, start_ms, end_ms, tid=1):
    return {"ph": "X", "name": name, "ts": start_ms * 1e3, "dur": (end_ms - start_ms) * 1e3,
            "pid": 0, "tid": tid}


STEP = [_x("forward", 0, 10), _x("aten::mm", 0, 8), _x("aten::view", 2, 3),   # nested op
        _x("backward", 10, 30), _x("aten::mm", 10, 25),
        _x("gloo:all_reduce", 20, 35, tid=7),            # overlaps backward's last 5 ms
        _x("optimizer", 35, 40), _x("aten::add_", 36, 39),
        {"ph": "i", "name": "marker", "ts": 5e3, "pid": 0, "tid": 1}]


def _ms(d):
    return {k: round(v * 1e3, 9) for k, v in d.items()}


def test_a_synthetic_step_with_known_answers():
    got = _ms(T.breakdown({"traceEvents": STEP}))
    assert got == {"step": 40, "compute": 26, "comm": 15, "hidden": 5, "exposed": 10, "idle": 4}


def test_parts_add_up_and_a_second_step_is_cut_apart(tmp_path):
    second = [{**e, "ts": e["ts"] + 50e3} for e in STEP if e["ph"] == "X"]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": STEP + second}))
    windows = T.step_windows(str(path))
    assert [(round(a * 1e3, 9), round(b * 1e3, 9)) for a, b in windows] == [(0, 40), (50, 90)]
    for w in windows:
        assert _ms(T.breakdown(str(path), window=w))["exposed"] == 10
    whole = T.breakdown(str(path))
    assert whole["compute"] + whole["exposed"] + whole["idle"] == pytest.approx(whole["step"])
    assert round(whole["idle"] * 1e3, 9) == 4 + 4 + 10   # the 10 ms between the steps


def test_fully_hidden_and_fully_exposed():
    hidden = [_x("backward", 0, 10), _x("aten::mm", 0, 10), _x("gloo:all_reduce", 2, 6, 7)]
    assert _ms(T.breakdown(hidden))["hidden"] == 4 and _ms(T.breakdown(hidden))["exposed"] == 0
    exposed = [_x("backward", 0, 10), _x("aten::mm", 0, 5), _x("nccl:all_reduce", 5, 10, 7)]
    got = _ms(T.breakdown(exposed))
    assert got["hidden"] == 0 and got["exposed"] == 5 and got["idle"] == 0


def test_bad_traces_are_refused():
    with pytest.raises(TypeError, match="trace"):
        T.breakdown(3)
    with pytest.raises(ValueError, match="window"):
        T.breakdown(STEP, window=(5.0, 1.0))
    with pytest.raises(ValueError, match="no"):
        T.breakdown([])
    with pytest.raises(ValueError, match="optimizer"):
        T.step_windows([_x("forward", 0, 1)])


@pytest.mark.parametrize("kind", ["naive", "bucketed", "zero3"])
def test_real_ranks_traces_add_up(kind, tmp_path):
    res = T.profile_ranks(T.dp_step_worker, 2, args=(kind, 2, (32, 64, 10), 512),
                          out_dir=str(tmp_path))
    for rank, (steps, path) in enumerate(res):
        assert steps == 2 and path.endswith(f"rank{rank}.json")
        windows = T.step_windows(path)
        assert len(windows) == 2
        for w in windows:
            b = T.breakdown(path, window=w)
            assert b["comm"] > 0 and b["compute"] > 0
            assert b["compute"] + b["exposed"] + b["idle"] == pytest.approx(b["step"])
            assert 0 <= b["hidden"] <= min(b["comm"], b["compute"]) and b["idle"] >= -1e-12


def test_worker_refuses_on_every_rank():
    from ranks import assert_refused_on_every_rank

    assert_refused_on_every_rank(T.dp_step_worker, ("zero",), name="kind")
    assert_refused_on_every_rank(T.dp_step_worker, ("naive", 0), name="steps")
    assert_refused_on_every_rank(T.dp_step_worker, ("naive", 1, (4, 2), 2**20, 0, 2, 0.1),
                                 name="slow_rank")
    assert_refused_on_every_rank(T.dp_step_worker, ("naive", 1, (4, 2), 2**20, 0, 1, -1.0),
                                 name="extra_s")


def test_timed_worker_times_each_step_and_refuses_bad_calls():
    from ranks import assert_refused_on_every_rank

    from parlearn import dist

    for profiled in (False, True):
        times = dist.run(T.dp_timed_worker, 2, args=("naive", 3, profiled, (8, 8, 2)))
        assert all(len(t) == 3 and min(t) > 0 for t in times)
    assert_refused_on_every_rank(T.dp_timed_worker, ("naive", 2, 1), name="profiled")
    assert_refused_on_every_rank(T.dp_timed_worker, ("naive", 0, False), name="steps")
