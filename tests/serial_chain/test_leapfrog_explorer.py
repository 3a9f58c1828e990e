"""leapfrog.explore measures one setting beside the cost model; plot_explore draws it."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from parlearn.serial_chain import leapfrog  # noqa: E402


def test_explore_measures_every_schedule_beside_the_model_and_plots():
    r = leapfrog.explore(3, 8, 4, 2, threads_per_worker=1, device="cpu", repeat=1)
    assert set(r["cmp"].timings) == {"serial", "leapfrog", "segments", "autograd"}
    # the model's seconds are its flops at the serial schedule's measured rate
    assert r["modeled"]["serial"] == pytest.approx(r["cmp"].timings["serial"].median)
    assert r["limit"] == pytest.approx(2 - 1 / 3)
    assert list(r["ks"]) == list(range(1, 9)) and r["model_speedup"][0] == pytest.approx(1.0)
    assert r["why"]["verdict"].startswith("measured") and r["threads"] == "1 per worker"
    fig, axes = plt.subplots(1, 2)
    leapfrog.plot_explore(r, axes)
    labels = [t.get_text() for t in axes[0].get_legend().get_texts()]
    assert any("measured on cpu" in t for t in labels) and any("modeled" in t for t in labels)
    # the verdict is printed under the figure at a readable size, not inside the axes at 7 pt
    note = next(t for t in axes[1].texts if t.get_text().startswith("measured"))
    assert note.get_fontsize() >= 9
    fig.canvas.draw()
    assert note.get_window_extent().y1 < axes[1].get_window_extent().y0
    plt.close(fig)


def test_explore_skips_a_schedule_modeled_far_slower():
    r = leapfrog.explore(4, 128, 4, 2, threads_per_worker=None, device="cpu", repeat=1)
    assert "segments" not in r["cmp"].timings and r["threads"] == "n // k per worker"


def test_plot_explore_refuses_what_explore_did_not_return():
    with pytest.raises(ValueError, match="result"):
        leapfrog.plot_explore({"cmp": None}, [None, None])
