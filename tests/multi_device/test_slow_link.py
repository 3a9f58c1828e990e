"""The EMULATED slow link (slow_link) and the 8-bit vs fp32 check built on it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as tdist

from parlearn import distributed as dist
from parlearn.multi_device.data_parallel import compression as C
from parlearn.multi_device.data_parallel import slow_link as S
from parlearn.multi_device.data_parallel import workers as W

TIMEOUT = 60
ALPHA, BW = 1e-3, 1e6     # 1 ms per message, 1 MB/s: the sleep is recorded, never taken


def _hand_seconds(kind: str, payload: int, n: int) -> float:
    """The ring alpha-beta time written out here, not by collective_time."""
    if kind == "all_reduce":
        return 2 * (n - 1) * ALPHA + 2 * (n - 1) / n * payload / BW
    return (n - 1) * ALPHA + (n - 1) / n * payload / BW   # all_to_all / all_gather


def _worker_charges(rank, world, numel):
    slept = []
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    original = tdist.all_reduce
    with S.emulated_link(ALPHA, BW, sleep=slept.append) as link:
        with dist.ledger() as led:
            tdist.all_reduce(x.clone())
            C.compressed_all_reduce(x)
            tdist.all_reduce(x.clone(), async_op=True).wait()
        with pytest.raises(RuntimeError, match="already active"):
            with S.emulated_link(ALPHA, BW):
                pass
        patched = tdist.all_reduce is not original
    restored = tdist.all_reduce is original
    return {"charges": link.charges, "slept": slept, "wire": link.wire_bytes(),
            "records": [(r.kind, r.bytes) for r in led.records], "patched": patched,
            "restored": restored}


@pytest.mark.parametrize("world,numel", [(2, 1001), (3, 999)])
def test_emulated_link_charges_the_ledgers_bytes_at_the_alpha_beta_time(world, numel):
    res = dist.run(_worker_charges, world, args=(numel,), timeout=TIMEOUT)
    for r in res:
        assert r["patched"] and r["restored"]
        # every collective the ledger saw was charged, in order, with its payload
        assert [(c.kind, c.payload) for c in r["charges"]] == r["records"]
        assert [c.kind for c in r["charges"]] == ["all_reduce", "all_to_all_single",
                                                  "all_to_all_single", "all_gather_single",
                                                  "all_gather_single", "all_reduce"]
        for c in r["charges"]:
            assert c.wire_bytes == pytest.approx(dist.ring_bytes(c.kind, c.payload, world))
            assert c.seconds == pytest.approx(_hand_seconds(c.kind, c.payload, world))
        # the sleep is what the link claims, once per collective
        assert r["slept"] == [c.seconds for c in r["charges"]]
        fp32 = r["charges"][0].wire_bytes
        eight = sum(c.wire_bytes for c in r["charges"][1:5])
        padded = world * math.ceil(numel / world)
        # codes + one float32 scale per chunk, both ways, against 4 bytes an entry
        assert eight / fp32 == pytest.approx((padded + 4 * world) / (4 * numel))


def test_dp_steps_on_the_emulated_link_charge_what_the_ledger_counts():
    widths = [8, 32, 4]
    numel = sum(W.mlp_param_bytes(widths)) // 4
    res = dist.run(W.worker_step_time, 2, args=(("bucketed", "compressed"), widths, 4, 2,
                                                4 * numel, 0, (0.0, 1e12)), timeout=TIMEOUT)
    for r in res:
        wire = {k: sum(dist.ring_bytes(c, b, 2) for c, b in r[k]["bytes"].items())
                for k in r}
        for k in r:
            assert r[k]["charged"][0] == pytest.approx(wire[k]) and wire[k] > 0
        padded = 2 * math.ceil(numel / 2)
        assert r["compressed"]["charged"][0] / r["bucketed"]["charged"][0] == pytest.approx(
            (padded + 8) / (4 * numel))
        assert r["bucketed"]["charged"][1] == pytest.approx(4 * numel / 1e12)


def test_emulated_bandwidths_straddle_the_modeled_crossover():
    numel, real, a, q, d = 10**6, dist.AlphaBeta(2e-4, 1 / 2e9), 1e-4, 5e-9, 1e-9
    cross, below, above = S.emulated_bandwidths(numel, 2, real, alpha=a, quantize_s=q,
                                                dequantize_s=d, factor=4)
    assert below == pytest.approx(cross / 4) and above == pytest.approx(cross * 4)

    def times(bw):
        total = dist.AlphaBeta(real.alpha + a, real.beta + 1 / bw)
        return (dist.collective_time("all_reduce", 4 * numel, 2, total),
                C.compressed_all_reduce_time(numel, 2, total, quantize_s=q, dequantize_s=d))

    t32, t8 = times(cross)
    assert t8 == pytest.approx(t32, rel=1e-9)       # equal at the crossover
    t32, t8 = times(below)
    assert t8 < t32
    t32, t8 = times(above)
    assert t8 > t32
    # a real link already slower than the crossover: no emulated bandwidth is above it
    slow = dist.AlphaBeta(2e-4, 1 / 1e6)
    assert S.emulated_bandwidths(numel, 2, slow, alpha=a, quantize_s=q,
                                 dequantize_s=d)[0] == math.inf


def test_slow_link_check_reports_both_sides_with_the_modeled_ratio():
    real = dist.AlphaBeta(1e-4, 1 / 1e9)
    out = W.slow_link_check([8, 64, 4], real, coding=(5e-8, 1e-8), alpha=0.0, steps=3)
    assert out["coding"] == (5e-8, 1e-8)
    assert out["below"]["bandwidth"] < out["crossover"] < out["above"]["bandwidth"]
    # the modeled ratio says 8-bit wins below the crossover and loses above it
    assert out["below"]["modeled"] > 1 > out["above"]["modeled"]
    q, d = out["coding"]
    n = 2 * math.ceil(out["numel"] / 2)
    for side in ("below", "above"):
        o = out[side]
        assert o["q1"] <= o["measured"] <= o["q3"]
        # the modeled ratio written out for 2 ranks: fp32 ring all-reduce 2 alpha + 4 n
        # beta; 8-bit: 4 messages, n code bytes and 8 scale bytes, coding 1.5 n q + 2 n d
        a, b = real.alpha, real.beta + 1 / o["bandwidth"]
        compute = o["steps"]["local"]["median"]
        t32 = compute + 2 * a + 4 * out["numel"] * b
        t8 = compute + 4 * a + (n + 8) * b + 1.5 * n * q + 2 * n * d
        assert o["modeled"] == pytest.approx(t32 / t8, rel=1e-9)
        for k in ("bucketed", "compressed"):
            assert o["charged"][k][0] == pytest.approx(o["wire"][k])


def _worker_refuses(rank, world):
    with pytest.raises(ValueError, match="bandwidth"):
        with S.emulated_link(0.0, 0.0):
            pass
    with pytest.raises(ValueError, match="alpha"):
        with S.emulated_link(-1.0, 1e6):
            pass
    with pytest.raises(TypeError, match="sleep"):
        with S.emulated_link(0.0, 1e6, sleep=3):
            pass
    return True


def test_bad_input_fails_fast():
    assert dist.run(_worker_refuses, 2, timeout=TIMEOUT) == [True, True]
    with pytest.raises(RuntimeError, match="process group"):
        with S.emulated_link(0.0, 1e6):
            pass
    with pytest.raises(TypeError, match="real"):
        S.emulated_bandwidths(10, 2, (1e-4, 1e-9), alpha=0.0, quantize_s=0.0,
                              dequantize_s=0.0)
    with pytest.raises(ValueError, match="factor"):
        S.emulated_bandwidths(10, 2, dist.AlphaBeta(0, 1e-9), alpha=0.0, quantize_s=0.0,
                              dequantize_s=0.0, factor=1.0)
    with pytest.raises(TypeError, match="real"):
        W.slow_link_check([4, 4], (1e-4, 1e-9))


def test_modeled_step_ratio_by_hand_on_four_ranks():
    numel, a, b, q, d, comp = 1001, 3e-4, 1e-9, 4e-9, 1e-9, 0.01
    n = 4 * math.ceil(numel / 4)
    t32 = comp + 6 * a + 2 * 3 / 4 * 4 * numel * b
    t8 = comp + 12 * a + 2 * 3 / 4 * (n + 16) * b + n * 1.25 * q + 2 * n * d
    got = C.modeled_step_ratio(numel, 4, dist.AlphaBeta(a, b), compute_s=comp, quantize_s=q,
                               dequantize_s=d)
    assert got == pytest.approx(t32 / t8, rel=1e-12)
    with pytest.raises(ValueError, match="compute_s"):
        C.modeled_step_ratio(numel, 4, dist.AlphaBeta(a, b), compute_s=-1.0, quantize_s=q,
                             dequantize_s=d)


def _fake_check(skip_above=False):
    side = {"measured": 1.5, "q1": 1.2, "q3": 1.8, "modeled": 1.7,
            "steps": {"local": {"median": 0.01}},
            "charged": {"bucketed": (400.0, 0.1), "compressed": (108.0, 0.03)}}
    above = ({"bandwidth": math.inf, "skipped": "8-bit pays at every bandwidth"} if skip_above
             else {**side, "bandwidth": 4e8, "measured": 0.5, "q1": 0.4, "q3": 0.6})
    return {"crossover": 1e8, "alpha": 1e-4, "numel": 100, "coding": (5e-9, 1e-9),
            "below": {**side, "bandwidth": 2.5e7}, "above": above}


def test_plot_check_draws_the_crossover_the_model_and_each_measured_side():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real = dist.AlphaBeta(2e-4, 1e-9)
    fig, ax = plt.subplots()
    lines = S.plot_check(ax, _fake_check(), real)
    labels = [h.get_label() for h in ax.get_lines() + ax.containers]
    assert len(lines) == 2 and "1.50x" in lines[0] and "0.50x" in lines[1]
    assert any("crossover 100 MB/s" in lab and "modeled" in lab for lab in labels)
    assert sum("EMULATED" in lab and "measured" in lab for lab in labels) == 2
    vline = [ln for ln in ax.get_lines() if "crossover" in ln.get_label()][0]
    assert vline.get_xdata()[0] == pytest.approx(100.0)      # MB/s
    plt.close(fig)
    fig, ax = plt.subplots()
    lines = S.plot_check(ax, _fake_check(skip_above=True), real)
    assert lines[0].startswith("above: not measured") and len(lines) == 2
    plt.close(fig)
