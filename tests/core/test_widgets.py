import ipywidgets as W
import pytest

from parlearn.core.widgets import Dashboard, OptionalRun, control


def _compute(n, scale, kind):
    return {"values": [scale * i for i in range(n)], "kind": kind}


def _plot(result, ax):
    ax.plot(result["values"], label=result["kind"])


def _dash(**kw):
    return Dashboard(_compute, _plot, {"n": (1, 10, 1, 3), "scale": (0.5, 2.0, 0.5, 1.0),
                                       "kind": ["a", "b"]}, **kw)


def test_renders_once_with_defaults():
    d = _dash()
    assert d.result == {"values": [0.0, 1.0, 2.0], "kind": "a"}
    assert d.figure is not None and d.figure.axes[0].lines


def test_update_changes_result_and_controls():
    d = _dash()
    r = d.update(n=5, kind="b")
    assert r is d.result and len(r["values"]) == 5 and r["kind"] == "b"
    assert d.params == {"n": 5, "scale": 1.0, "kind": "b"}


def test_slider_release_recomputes_once():
    calls = []

    def compute(n):
        calls.append(n)
        return n

    d = Dashboard(compute, lambda r, ax: ax.plot([r]), {"n": (1, 10, 1, 2)})
    slider = d.controls["n"]
    assert slider.continuous_update is False  # no runs while dragging
    slider.value = 7  # what the browser sends on release
    assert calls == [2, 7] and d.result == 7


def test_run_button_defers_compute():
    calls = []

    def compute(n):
        calls.append(n)
        return n

    d = Dashboard(compute, lambda r, ax: ax.plot([r]), {"n": (1, 10, 1, 2)}, run_button=True)
    d.controls["n"].value = 5
    assert calls == [2] and "Run" in d.status.value
    d.run.click()
    assert calls == [2, 5]


def test_progress_callback_is_passed():
    seen = []

    def compute(n, progress):
        for i in range(n):
            progress((i + 1) / n, f"step {i}")
            seen.append(d_progress_value())
        return n

    holder = {}

    def d_progress_value():
        return holder["d"].progress.value if "d" in holder else None

    d = Dashboard(compute, lambda r, ax: None, {"n": (1, 5, 1, 2)})
    holder["d"] = d
    d.update(n=4)
    assert seen[-4:] == [0.25, 0.5, 0.75, 1.0]


def test_errors_raise_in_update_but_show_in_browser():
    def compute(n):
        if n > 5:
            raise ValueError("n too big")
        return n

    d = Dashboard(compute, lambda r, ax: None, {"n": (1, 10, 1, 2)})
    with pytest.raises(ValueError, match="too big"):
        d.update(n=6)
    d.controls["n"].value = 8  # browser path: shown, not raised
    assert "too big" in d.status.value


def test_bad_controls_and_params():
    with pytest.raises(TypeError, match="control 'x'"):
        control({"oops": 1}, "x")
    with pytest.raises(ValueError, match="outside"):
        control((0, 1, 1, 5), "x")
    d = _dash()
    with pytest.raises(ValueError, match="unknown parameter"):
        d.update(bogus=1)
    with pytest.raises(ValueError, match="outside"):
        d.update(kind="zzz")


def test_widget_box_and_explicit_widget():
    s = W.IntSlider(min=0, max=3, value=1, continuous_update=True)
    d = Dashboard(lambda k: k, lambda r, ax: None, {"k": s})
    assert s.continuous_update is False
    assert isinstance(d.widget(), W.VBox)


def test_float_slider_readout_shows_the_step():
    assert control((0.0, 1.0, 0.05, 0.25), "x").readout_format == ".2f"
    assert control((1e-5, 1e-3, 1e-5, 1e-4), "x").readout_format == ".5f"
    assert control((0.5, 2.0, 0.5, 1.0), "x").readout_format == ".1f"


@pytest.mark.parametrize("exc", [ZeroDivisionError, KeyError, IndexError, AssertionError,
                                 ValueError])
def test_every_compute_error_reaches_the_status_line(exc):
    def compute(n):
        if n > 2:
            raise exc("bad <n>")
        return n

    d = Dashboard(compute, lambda r, ax: ax.plot([r]), {"n": (1, 10, 1, 2)})
    d.controls["n"].value = 5          # the browser path: must not raise
    assert isinstance(d.error, exc)
    assert exc.__name__ in d.status.value and "&lt;n&gt;" in d.status.value
    assert d.progress.bar_style == "danger"
    d.controls["n"].value = 1          # a good value clears the error
    assert d.error is None and d.result == 1


def test_plot_errors_are_shown_too():
    def plot(r, ax):
        raise RuntimeError("cannot draw")

    calls = []
    d = Dashboard(lambda n: calls.append(n) or n, lambda r, ax: ax.plot([r]),
                  {"n": (1, 10, 1, 2)})
    d.plot_fn = plot
    d.controls["n"].value = 4
    assert isinstance(d.error, RuntimeError) and "cannot draw" in d.status.value


def test_ncols_is_checked():
    with pytest.raises(TypeError, match="ncols"):
        _dash(ncols=1.5)
    with pytest.raises(ValueError, match="ncols"):
        _dash(ncols=0)


def test_optional_run_waits_for_the_button_and_shows_errors():
    calls = []
    r = OptionalRun("go", lambda: calls.append(1) or f"ran {len(calls)}")
    assert calls == [] and r.text is None            # Run All skips it
    r.button.click()
    assert calls == [1] and r.text == "ran 1" and "ran 1" in r.status.value

    def broken() -> str:
        raise RuntimeError("no <package>")

    b = OptionalRun("go", broken)
    b.button.click()                                 # in the browser: shown, not raised
    assert isinstance(b.error, RuntimeError) and "&lt;package&gt;" in b.status.value


def test_optional_run_now_runs_at_once_and_raises():
    assert OptionalRun("go", lambda: "done", now=True).text == "done"
    with pytest.raises(RuntimeError, match="boom"):
        OptionalRun("go", lambda: (_ for _ in ()).throw(RuntimeError("boom")), now=True)
    with pytest.raises(TypeError, match="run"):
        OptionalRun("go", 3)


def test_optional_run_moves_its_progress_bar():
    seen = []

    def run(progress) -> str:
        progress(0.5, "half way")
        seen.append(r.progress.value)
        return "done"

    r = OptionalRun("go", run)
    assert r.progress.value == 0.0
    r.button.click()
    assert seen == [0.5] and r.progress.value == 1.0 and r.text == "done"


def test_predict_sets_the_guess_beside_measured_and_modeled(capsys):
    from parlearn.core.widgets import Predict

    p = Predict("the bubble at P=4, M=8", value=0.2)
    text = p.reveal(measured=(0.41, "on 2 ranks"), modeled=(0.273, "(P-1)/(M+P-1)"), why="alpha")
    assert "you guessed 0.2" in text and "2.0x too low" in text and "1.4x too low" in text
    assert "why: alpha" in text and text in capsys.readouterr().out
    p.box.value = "0.5"                    # typed in the box: read at reveal time
    assert p.value == 0.5 and "1.2x too high" in p.reveal(measured=0.41)
    p.box.value = "not a number"
    assert p.value is None and "you guessed nothing" in p.reveal(measured=0.41)
    c = Predict("equal to round-off?", choices=["yes", "no"], value="no")
    assert "(not this time)" in c.reveal(answer="yes")
    c.box.value = "yes"
    assert "(right)" in c.reveal(answer="yes")


def test_predict_refuses_what_it_cannot_show():
    import pytest

    from parlearn.core.widgets import Predict

    with pytest.raises(ValueError, match="question"):
        Predict("")
    with pytest.raises(TypeError, match="value"):
        Predict("q", value=True)
    with pytest.raises(ValueError, match="value"):
        Predict("q", choices=["a", "b"], value="c")
    with pytest.raises(ValueError, match="choices"):
        Predict("q", choices=["a"])
    with pytest.raises(ValueError, match="reveal needs"):
        Predict("q").reveal()
