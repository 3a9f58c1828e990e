"""multigrid.speed_sweep times MGRIT against the serial ResNet beside its models; plot_speed
draws it."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from parlearn import multigrid as mg  # noqa: E402


def test_speed_sweep_measures_each_depth_beside_its_models_and_plots():
    told = []
    r = mg.speed_sweep(8, 2, 4, 2, 1, depths=[16, 32], repeat=1, device="cpu",
                       progress=lambda f, text="": told.append(f))
    assert r["Ns"] == [16, 32] and len(r["err"]) == 2 and told == sorted(told)
    assert r["model_f"] == [mg.cost_model(n, 4, 2, 1)["speedup"] for n in (16, 32)]
    assert all(c > 0 for c in r["model_cal"]) and r["setting"].startswith("w=8, B=2, m=4")
    assert set(r["fwd"]["speedup"]) == {"serial", "MGRIT"} and r["fwd"]["threads"] == 1
    fig, ax = plt.subplots()
    mg.plot_speed(r, ax)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("measured on cpu" in t for t in labels)
    equal = r["model_f"] == pytest.approx(r["model_fb"], rel=0.01)
    assert sum("modeled" in t for t in labels) == (2 if equal else 3)
    plt.close(fig)


def test_equal_forward_and_fwd_bwd_limits_are_one_line_and_the_legend_sits_below():
    # two identical lines hide one another: draw one, labelled as both
    r = mg.speed_sweep(8, 2, 4, 2, 1, depths=[16], repeat=1, device="cpu")
    r["above"], r["cal_over_limit"], r["over_cal"] = [], [], []
    for fb, lines in ((list(r["model_f"]), 1), ([v * 0.7 for v in r["model_f"]], 2)):
        r["model_fb"] = fb
        fig, ax = plt.subplots()
        mg.plot_speed(r, ax)
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert sum("limit (modeled" in t or "limits (equal here)" in t for t in labels) == lines
        assert (lines == 1) == any("equal here" in t for t in labels)
        fig.canvas.draw()
        assert ax.get_legend().get_window_extent().y1 < ax.get_window_extent().y0
        plt.close(fig)


def test_a_forward_above_its_calibrated_limit_is_flagged_at_every_depth():
    r = mg.speed_sweep(8, 2, 4, 2, 1, depths=[16, 32], repeat=1, device="cpu")
    assert r["over_cal"] == [(n, s, c) for n, s, c in zip(r["Ns"], r["fwd"]["speedup"]["MGRIT"],
                                                           r["model_cal"], strict=True)
                              if s > 1.25 * c]
    r["above"], r["cal_over_limit"] = [], []
    r["over_cal"] = [(16, 0.95, 0.25)]   # the first depth, not only the last
    fig, ax = plt.subplots()
    mg.plot_speed(r, ax)
    text = " ".join(t.get_text() for t in ax.texts)
    assert "MEASURED ABOVE THE CALIBRATED LIMIT (N=16: 0.95x > 0.25x)" in text
    plt.close(fig)


def test_speed_sweep_checks_every_depth_before_building_any():
    with pytest.raises(ValueError, match="divisible"):
        mg.speed_sweep(8, 2, 4, 3, 1, depths=[16, 24], repeat=1, device="cpu")


def test_plot_speed_refuses_what_speed_sweep_did_not_return():
    with pytest.raises(ValueError, match="result"):
        mg.plot_speed({"Ns": [16]}, None)


def test_plot_speed_calls_a_median_above_its_limit_unreadable_when_the_repeats_spread():
    r = mg.speed_sweep(8, 2, 4, 2, 1, depths=[16], repeat=1, device="cpu")
    lim = r["model_f"][0]
    r["above"] = [("forward", 16, lim + 1.0, lim)]
    for reliable, lo, expect in ((False, lim + 0.5, "too spread"), (True, lim - 0.5, "too spread"),
                                 (True, lim + 0.5, "a bug to explain")):
        r["fwd"]["reliable"], r["fwd"]["speedup_lo"]["MGRIT"][0] = reliable, lo
        fig, ax = plt.subplots()
        mg.plot_speed(r, ax)
        text = " ".join(t.get_text() for t in ax.texts)
        assert "ABOVE THE MODELED LIMIT" in text and expect in text, (reliable, lo, text)
        if expect == "too spread":
            assert "a bug to explain" not in text
        plt.close(fig)


def test_a_calibrated_limit_above_n_over_depth_is_flagged_not_drawn_silently():
    # the calibrated calls can never add up to less than depth serial layers: when they do,
    # the serial loop and the calls were timed at different speeds of the machine
    r = mg.speed_sweep(8, 2, 4, 2, 1, depths=[16], repeat=1, device="cpu")
    assert r["cal_over_limit"] == [(16, c, lim) for c, lim in zip(r["model_cal"], r["model_f"],
                                                                    strict=True) if c > 1.25 * lim]
    r["above"], r["model_cal"] = [], [r["model_f"][0] * 8]
    r["cal_over_limit"] = [(16, r["model_cal"][0], r["model_f"][0])]
    fig, ax = plt.subplots()
    mg.plot_speed(r, ax)
    text = " ".join(t.get_text() for t in ax.texts)
    assert "CALIBRATED LIMIT ABOVE THE MODELED ONE (N=16" in text
    # the note sits under the axes, not over the data
    fig.canvas.draw()
    note = next(t for t in ax.texts if "CALIBRATED" in t.get_text())
    assert note.get_window_extent().y1 < ax.get_window_extent().y0
    plt.close(fig)


def _one_depth(measured, cal, limit=8.0, lo=None, reliable=True):
    sw = {"speedup": {"MGRIT": [measured]},
          "speedup_lo": {"MGRIT": [measured if lo is None else lo]},
          "speedup_hi": {"MGRIT": [measured + 0.1]}, "reliable": reliable}
    r = {"Ns": [64], "fwd": sw, "fb": sw, "model_f": [limit], "model_fb": [limit],
         "model_cal": [cal], "err": [0.0], "setting": "w=4"}
    r["above"] = [(w, 64, measured, limit) for w in ("forward", "fwd+bwd") if measured > limit]
    r["cal_over_limit"] = [(64, cal, limit)] if cal > 1.25 * limit else []
    r["over_cal"] = [(64, measured, cal)] if measured > mg.speed.ABOVE_CAL * cal else []
    return r


def test_cal_reading_names_where_the_forward_stands_to_its_calibrated_limit():
    # lessons 21 and 29 print their verdicts from this one reading
    assert mg.cal_reading(_one_depth(1.0, 1.05), 64) == "near"
    assert mg.cal_reading(_one_depth(0.7, 1.0), 64) == "under_cal"
    assert mg.cal_reading(_one_depth(0.81, 1.0), 64) == "near"
    assert mg.cal_reading(_one_depth(1.3, 1.0), 64) == "over_cal"
    assert mg.cal_reading(_one_depth(1.2, 1.0), 64) == "near"
    # a calibrated limit 1.25x above N / depth is not a result, whatever the forward did
    assert mg.cal_reading(_one_depth(1.0, 11.0), 64) == "cal_over_limit"
    assert mg.cal_reading(_one_depth(1.0, 9.0), 64) == "under_cal"   # within 1.25x of N / depth
    with pytest.raises(ValueError, match="n must be one of the swept depths"):
        mg.cal_reading(_one_depth(1.0, 1.0), 128)


def test_read_above_calls_a_median_above_its_limit_steady_only_when_the_whole_iqr_is():
    assert mg.read_above(_one_depth(1.0, 1.0)) == []
    read = mg.read_above(_one_depth(9.0, 1.0, lo=8.5))
    assert [(a["what"], a["N"], a["steady"]) for a in read] == [("forward", 64, True),
                                                                 ("fwd+bwd", 64, True)]
    assert read[0]["lo"] == 8.5 and read[0]["hi"] == pytest.approx(9.1) and read[0]["limit"] == 8.0
    assert not any(a["steady"] for a in mg.read_above(_one_depth(9.0, 1.0, lo=7.9)))
    assert not any(a["steady"] for a in mg.read_above(_one_depth(9.0, 1.0, lo=8.5,
                                                                 reliable=False)))


def test_the_calibrated_limit_reads_the_serial_run_timed_right_after_the_calls(monkeypatch):
    # a sweep long after the calibration reads the machine's load between the two timings;
    # the calibrated limit's serial time is taken right after each depth's calibration
    from parlearn.serial_chain.multigrid import speed

    seen, real_cal, real_cmp = [], speed.calibrate, speed.compare

    def spy_cal(*args, **kwargs):
        seen.append(real_cal(*args, **kwargs))
        return seen[-1]

    def spy_cmp(*args, **kwargs):
        cmp = real_cmp(*args, **kwargs)
        seen.append(cmp.timings["serial"].median)
        return cmp

    monkeypatch.setattr(speed, "calibrate", spy_cal)
    monkeypatch.setattr(speed, "compare", spy_cmp)
    r = mg.speed_sweep(8, 2, 4, 2, 1, depths=[16, 32], repeat=1, device="cpu")
    assert r["cal_serial_s"] == seen[1::2]
    for n, cal, times, serial in zip(r["Ns"], r["model_cal"], seen[::2], seen[1::2], strict=True):
        mgrit = mg.cost_model(n, 4, 2, 1, call_time=times.__getitem__)["mgrit_seconds"]
        assert cal == pytest.approx(serial / mgrit, rel=1e-12)


def test_the_calibrated_line_leaves_out_the_depths_flagged_as_not_a_result():
    # a flagged calibrated value is not a measurement: it must not be drawn as one
    r = mg.speed_sweep(8, 2, 4, 2, 1, depths=[16, 32], repeat=1, device="cpu")
    r["above"], r["model_cal"] = [], [r["model_f"][0] * 8, 1.0]
    r["cal_over_limit"], r["over_cal"] = [(16, r["model_cal"][0], r["model_f"][0])], []
    fig, ax = plt.subplots()
    mg.plot_speed(r, ax)
    line = next(ln for ln in ax.lines if "calibrated" in ln.get_label())
    y = list(line.get_ydata())
    assert y[0] != y[0] and y[1] == 1.0   # NaN at the flagged N=16, drawn at N=32
    plt.close(fig)


def test_a_calibrated_limit_left_with_one_depth_is_still_visible():
    # with every other depth flagged, a dashed line without markers would draw nothing
    r = mg.speed_sweep(8, 2, 4, 2, 1, depths=[16, 32], repeat=1, device="cpu")
    r["above"], r["over_cal"] = [], []
    r["cal_over_limit"] = [(16, r["model_cal"][0], r["model_f"][0])]
    fig, ax = plt.subplots()
    mg.plot_speed(r, ax)
    line = next(ln for ln in ax.get_lines() if "calibrated" in ln.get_label())
    assert line.get_marker() not in (None, "None", "", " ")
    plt.close(fig)
