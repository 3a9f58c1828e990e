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
    assert any(timing.UNRELIABLE.split(";")[0] in t for t in labels)
    ax.legend()
    assert "measured on cpu, 1 thread(s)" in ax.get_legend().get_texts()[0].get_text()
    s["reliable"] = True
    fig2, ax2 = plt.subplots()
    viz.plot_measured_sweep(ax2, s, "b", key="median_s")
    assert not ax2.texts
    plt.close("all")
