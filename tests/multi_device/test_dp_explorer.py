"""Lesson 11's explorer and modeled cluster timeline (data_parallel.explorer)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from parlearn.distributed import AlphaBeta  # noqa: E402
from parlearn.multi_device.data_parallel import explorer as dpx  # noqa: E402
from parlearn.multi_device.data_parallel.step_model import dp_step_model  # noqa: E402

LINKS = {"all_reduce": AlphaBeta(1e-5, 1e-9), "all_to_all": AlphaBeta(1e-5, 1e-9),
         "all_gather": AlphaBeta(1e-5, 1e-9)}


def test_explorer_step_measures_and_models_then_plots():
    seen = []
    r = dpx.explorer_step(2, 16, 16, False, links=LINKS, quantize_s=1e-9, dequantize_s=1e-9,
                          steps=2, progress=lambda f, t="": seen.append(f))
    assert seen and r["kind"] == "bucketed" and r["ranks"] == 2
    assert r["wire"] == pytest.approx(r["wire_model"])        # the ledger equals the formula
    assert r["modeled"] >= r["local"]["median"] > 0
    fig, axes = plt.subplots(1, 3)
    dpx.plot_explorer(r, axes)
    assert "communication beyond compute" in axes[0].get_title()
    plt.close(fig)


@pytest.mark.parametrize("bad, err", [
    ({"ranks": 1}, ValueError), ({"ranks": 2.0}, TypeError), ({"hidden": 0}, ValueError),
    ({"bucket_kb": True}, TypeError), ({"compression_on": 1}, TypeError),
    ({"links": {"all_reduce": 3}}, TypeError), ({"links": None}, TypeError),
    ({"quantize_s": -1.0}, ValueError), ({"dequantize_s": float("nan")}, ValueError),
    ({"steps": 0}, ValueError), ({"progress": 3}, TypeError)])
def test_explorer_step_refuses_before_launching(bad, err):
    kw = dict(ranks=2, hidden=16, bucket_kb=16, compression_on=False, links=LINKS,
              quantize_s=0.0, dequantize_s=0.0, steps=1)
    kw.update(bad)
    with pytest.raises(err, match=next(iter(bad))):
        dpx.explorer_step(**kw)


def test_plot_explorer_refuses_other_results():
    fig, axes = plt.subplots(1, 3)
    with pytest.raises(TypeError, match="r must"):
        dpx.plot_explorer({"kind": "bucketed"}, axes)
    plt.close(fig)


def test_cluster_timeline_draws_the_model_and_its_exposed_tail():
    link = AlphaBeta(5e-6, 1 / 25e9)
    sizes = [4 * 1_000_000] * 12
    fig, axes = plt.subplots(1, 2)
    out = dpx.cluster_timeline(axes, sizes, 16, link, compute_seconds=0.05, bucket_bytes=2**23,
                               zoom_last=3)
    want = dp_step_model(sizes, 16, link, compute_seconds=0.05, strategy="bucketed",
                         bucket_bytes=2**23)
    assert out["bucketed"].step == pytest.approx(want.step)
    assert out["exposed"] == pytest.approx(want.step - 0.05)
    labels = [t.get_text() for t in axes[1].texts]
    n = len(want.buckets)
    assert [f"b{i}" for i in range(n - 3, n)] == [x for x in labels if x.startswith("b")]
    lo, hi = axes[1].get_xlim()
    assert lo > 0 and hi >= want.step * 1e3                   # the zoom shows the tail
    # the exposed tail is the bucketed wrapper's: no label of it sits in the naive rows
    assert f"{want.step * 1e3 - 50:.1f} ms" in axes[1].get_title()
    assert all(not (t.get_position()[1] < 2.5) for t in axes[1].texts)
    for bad, err in (({"zoom_last": 0}, ValueError), ({"link": (1e-5, 1e-9)}, TypeError)):
        kw = dict(compute_seconds=0.05, link=link)
        kw.update(bad)
        with pytest.raises(err, match=next(iter(bad))):
            dpx.cluster_timeline(axes, sizes, 16, **kw)
    with pytest.raises(ValueError, match="axes"):
        dpx.cluster_timeline(axes[:1], sizes, 16, link, compute_seconds=0.05)
    plt.close(fig)
