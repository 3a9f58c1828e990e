import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from parlearn.core import timing, viz  # noqa: E402


def test_measured_sweep_labels_device_threads_and_warns():
    s = {"values": [1, 2], "device": "cpu", "threads": 1, "reliable": False,
         "speedup": {"b": [2.0, 3.0]}, "speedup_lo": {"b": [1.5, 2.5]},
         "speedup_hi": {"b": [2.5, 3.5]}, "median_s": {"b": [1.0, 1.0]},
         "spread": {"b": [0.1, 0.1]}}
    fig, ax = plt.subplots()
    viz.plot_measured_sweep(ax, s, "b")
    labels = [t.get_text() for t in ax.texts]
    assert any(timing.UNRELIABLE.split(";")[0] in " ".join(t.split()) for t in labels)
    ax.legend()
    assert "measured on cpu, 1 thread(s)" in ax.get_legend().get_texts()[0].get_text()
    s["reliable"] = True
    fig2, ax2 = plt.subplots()
    viz.plot_measured_sweep(ax2, s, "b", key="median_s")
    assert not ax2.texts
    plt.close("all")


def _extent(artist, renderer):
    return artist.get_window_extent(renderer)


def test_reliability_warning_sits_above_the_axes_never_over_the_data():
    fig, axes = plt.subplots(1, 3, figsize=(10, 5))
    for i, ax in enumerate(axes):
        ax.plot([1, 2, 3], [3, 1, 2], marker="o", label="a curve")
        viz.mark_reliability(ax, False)
        viz.mark_reliability(ax, False)          # a second curve: still one warning
        ax.set_xlabel("layers N")                # set after the call, as lessons do
        if i == 0:
            ax.set_title("a title\non two lines")
        elif i == 1:
            ax.set_title("left", loc="left")
        else:                                    # a hidden title must not pull it aside
            ax.set_title("hidden")
            ax.title.set_visible(False)
        # Lessons put legends under the axes: the warning must not land there.
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2))
    viz.mark_reliability(axes[1], True)
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for i, ax in enumerate(axes):
        (warning,) = [t for t in ax.texts if "WARNING" in t.get_text()]
        assert timing.UNRELIABLE.split(";")[0] in " ".join(warning.get_text().split())
        box, data = _extent(warning, renderer), ax.get_window_extent(renderer)
        assert box.y0 >= data.y1                 # above the plotting area
        title = ax.title if i != 1 else ax._left_title
        if i < 2:
            assert box.y0 >= _extent(title, renderer).y1 - 1e-6   # and above the title
        legend = _extent(ax.get_legend(), renderer)
        assert box.y0 > legend.y1                # clear of the legend under the axes
        tight = fig.get_tightbbox(renderer)      # inside what the notebook shows
        assert box.y1 <= tight.y1 * fig.dpi + 1
        assert data.x0 - 1 <= (box.x0 + box.x1) / 2 <= data.x1 + 1   # centred on its axes
    plt.close("all")


def test_log_ticks_label_an_axis_spanning_less_than_a_decade():
    fig, ax = plt.subplots()
    ax.plot([64, 128, 256], [0.6, 1.1, 2.4])
    ax.set(xscale="log", yscale="log")
    ax.minorticks_off()                          # lesson 21 does this for its x axis
    fig.canvas.draw()

    def shown(axis):
        lo, hi = sorted(ax.get_ylim() if axis is ax.yaxis else ax.get_xlim())
        return [t.get_text() for t, v in zip(axis.get_ticklabels(), axis.get_majorticklocs(),
                                              strict=True) if lo <= v <= hi and t.get_text()]

    assert len(shown(ax.yaxis)) <= 1             # the problem: a lone "10^0"
    viz.log_ticks(ax, "both")
    fig.canvas.draw()
    labels = shown(ax.yaxis)
    assert len(labels) >= 3 and "1" in labels and "2" in labels
    assert len(shown(ax.xaxis)) >= 2
    # Several decades keep the powers of ten (already several labels).
    fig2, ax2 = plt.subplots()
    ax2.loglog([1, 1e6], [1, 1e6])
    loc = ax2.yaxis.get_major_locator()
    viz.log_ticks(ax2)
    assert ax2.yaxis.get_major_locator() is loc
    import pytest

    with pytest.raises(ValueError, match="axis"):
        viz.log_ticks(ax2, "z")
    fig3, ax3 = plt.subplots()
    with pytest.raises(ValueError, match="not log-scaled"):
        viz.log_ticks(ax3)
    plt.close("all")
