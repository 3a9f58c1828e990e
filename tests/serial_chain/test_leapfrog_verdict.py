"""leapfrog.shortfall reads the reason for a short speedup off the two timelines."""

import pytest

from parlearn.serial_chain import leapfrog


def _serial(chain=1.0, wgrad=1.0, n=4):
    t, ev = 0.0, []
    for i in range(n, 0, -1):
        ev.append(("worker 0 (chain)", f"wgrad {i}", t, t + wgrad))
        t += wgrad
        ev.append(("worker 0 (chain)", f"chain {i}", t, t + chain))
        t += chain
    return ev


def _leapfrog(chain=1.0, helper_share=1.0, n=4):
    ev, t = [], 0.0
    for i in range(n, 0, -1):
        lane = "worker 1" if i <= round(helper_share * n) else "worker 0 (chain)"
        ev.append((lane, f"wgrad {i}", t, t + 1.0))
        ev.append(("worker 0 (chain)", f"chain {i}", t, t + chain))
        t += chain
    return ev


def test_close_to_the_model_needs_no_excuse():
    r = leapfrog.shortfall(_serial(), _leapfrog(), measured=1.9, modeled=2.0, workers=2, cores=4,
                           load=0.1)
    assert not r["short"] and r["verdict"].startswith("measured 1.90x, modeled 2.00x: close")
    assert r["verdict"].endswith(r["why"]) and r["why"].startswith("close")


def test_stretched_chain_means_no_idle_core():
    r = leapfrog.shortfall(_serial(), _leapfrog(chain=4.0), measured=0.85, modeled=1.94,
                           workers=2, cores=2, load=3.5)
    assert r["short"] and r["chain_stretch"] == pytest.approx(4.0)
    assert "no idle core on this machine (2 cores, 2 workers, load average 3.5)" in r["verdict"]


def test_a_slowed_serial_run_is_not_called_per_task_overhead():
    # the serial run's chain steps 2.5x longer than leapfrog's: the serial recording was
    # disturbed, and "the chain kept its speed" would be false
    r = leapfrog.shortfall(_serial(chain=2.5), _leapfrog(), measured=1.2, modeled=1.94,
                           workers=2, cores=2, load=4.8)
    assert r["chain_stretch"] == pytest.approx(0.4)
    assert "kept its speed" not in r["why"]
    assert "the serial run's chain steps took 2.5x as long as under leapfrog" in r["why"]


def test_chain_worker_doing_the_work_means_a_starved_helper():
    r = leapfrog.shortfall(_serial(), _leapfrog(helper_share=0.25), measured=1.0, modeled=1.9,
                           workers=2, cores=2, load=0.0)
    assert r["chain_worker_share"] == pytest.approx(0.75)
    assert "computed 75% of the weight gradients itself" in r["verdict"]


def test_tiny_tasks_mean_per_task_overhead():
    r = leapfrog.shortfall(_serial(1e-5, 1e-5), _leapfrog(1e-5), measured=0.2, modeled=1.9,
                           workers=2, cores=8, load=0.0)
    assert "a task of the serial schedule takes a median 10 us" in r["verdict"]


def test_otherwise_the_verdict_says_it_cannot_explain():
    # chain at full speed, work shared, tasks far above a hand-off: nothing in the timelines
    # explains the shortfall, and the verdict must not invent per-task overhead
    r = leapfrog.shortfall(_serial(), _leapfrog(), measured=1.0, modeled=1.9, workers=2, cores=8,
                           load=0.0)
    assert r["chain_stretch"] == pytest.approx(1.0) and r["lanes"] == 2
    assert r["timeline_speedup"] == pytest.approx(2.0)
    assert r["why"].startswith("not explained by these timelines")
    assert "overhead" not in r["why"]
    # a ratio of times, said as one: "kept its speed (0.7x)" read as slower
    assert "the chain's steps took 1.0x as long as in the serial run" in r["why"]


def test_a_stretched_tail_counts_although_the_median_step_kept_its_speed():
    # 5 of 8 chain steps at serial speed, 3 stretched 6x: the median step is 1.0x, but the
    # chain took 2.9x as long in all, which is what slowed the backward
    serial = _serial(n=8)
    lf = _leapfrog(n=8)
    t, stretched = 0.0, []
    for lane, task, a, b in lf:
        if task.startswith("chain"):
            d = 6.0 if task in ("chain 3", "chain 2", "chain 1") else 1.0
            stretched.append((lane, task, t, t + d))
            t += d
        else:
            stretched.append((lane, task, a, b))
    r = leapfrog.shortfall(serial, stretched, measured=0.7, modeled=1.94, workers=2, cores=2,
                           load=4.0)
    assert r["chain_stretch"] == pytest.approx(23 / 8)
    assert "no idle core" in r["why"] and "2.9x as long in all" in r["why"]


def test_timelines_that_disagree_with_the_timed_repeats_cannot_say():
    # the timelines show the chain 4x slower (a 0.5x speedup), the timed repeats 1.5x: the
    # machine moved between the recordings, and "4x as long" would be read off the wrong run
    r = leapfrog.shortfall(_serial(), _leapfrog(chain=4.0), measured=1.5, modeled=1.94,
                           workers=2, cores=2, load=5.0)
    assert r["timeline_speedup"] == pytest.approx(0.5)
    assert "these timelines cannot say" in r["why"] and "no idle core" not in r["why"]
    assert "0.50x speedup against 1.50x in the timed repeats" in r["why"]


def test_real_timelines_are_read():
    net = leapfrog.deep_mlp(3, 8)
    import torch
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    mse = lambda o, t: ((o - t) ** 2).mean()  # noqa: E731
    ev = {m: leapfrog.timeline(net, mse, x, y, workers=2, mode=m, threads_per_worker=1)
          for m in ("serial", "leapfrog")}
    r = leapfrog.shortfall(ev["serial"], ev["leapfrog"], measured=1.0, modeled=1.5,
                           workers=2)
    assert r["chain_stretch"] > 0 and 0 <= r["chain_worker_share"] <= 1 and r["lanes"] >= 1


@pytest.mark.parametrize("bad", [[], [("a", "wgrad 1", 0.0, 1.0)], [("a", "chain 1", 1.0, 0.0)],
                                 "events"])
def test_refuses_events_that_are_not_timelines(bad):
    with pytest.raises(ValueError, match="serial_events"):
        leapfrog.shortfall(bad, _leapfrog(), measured=1.0, modeled=2.0, workers=2)
