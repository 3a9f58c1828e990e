"""parlearn.card: the fit recovers known rates, JSON round trip, link() fallbacks, presets,
bad input, and one small real calibrate() (FAST mode; its timings are only checked > 0)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from parlearn import card
from parlearn.distributed.cost import AlphaBeta, collective_time

SIZES = [64, 1024, 16384, 262144, 4194304]


def _synthetic(alpha: float, beta: float, flops: dict[str, float], bw: float):
    """Timings made from known alpha, beta, FLOP rates and bandwidth, exactly."""
    links = {}
    for kind in card.LINK_KINDS:
        for n in (2, 4):
            ab = AlphaBeta(alpha * n, beta / n)  # a different truth per (kind, N)
            links[(kind, n)] = (SIZES, [collective_time(kind, s, n, ab) for s in SIZES])
    matmuls = {d: (512, 2 * 512**3 / r) for d, r in flops.items()}
    return links, matmuls, (1 << 26, 2 * (1 << 26) / bw)


def test_fit_card_recovers_known_alpha_beta_flops_and_bandwidth():
    flops = {"float32": 7.3e10, "float64": 3.1e10, "bfloat16": 9.89e14}
    links, matmuls, copy = _synthetic(3e-5, 1 / 2.5e9, flops, 11e9)
    c = card.fit_card(links, matmuls, copy, name="synthetic", memory=8e9, devices=2)
    assert c.measured and c.devices == 2 and c.memory == 8e9
    assert set(c.links) == {f"{k}@{n}" for k in card.LINK_KINDS for n in (2, 4)}
    for kind in card.LINK_KINDS:
        for n in (2, 4):
            got = c.links[f"{kind}@{n}"]
            assert got.alpha == pytest.approx(3e-5 * n, rel=1e-9)
            assert got.beta == pytest.approx(1 / 2.5e9 / n, rel=1e-9)
    for d, r in flops.items():
        assert c.flops[d] == pytest.approx(r, rel=1e-9)
    assert c.mem_bw == pytest.approx(11e9, rel=1e-9)


def _card(**links: AlphaBeta) -> card.Card:
    return card.Card("test card", False, dict(links), {"float32": 1e12}, 1e11, 1e9, 8)


def test_json_round_trip_is_exact(tmp_path):
    flops = {"float32": 7.3e10 / 3, "float64": math.pi * 1e10}
    links, matmuls, copy = _synthetic(1 / 3 * 1e-4, 1 / 7e9, flops, 1e10 / 3)
    c = card.fit_card(links, matmuls, copy, name="round trip", memory=1e9 / 7,
                      notes="threads 1")
    assert card.Card.from_json(c.to_json()) == c
    assert card.Card.load(c.save(tmp_path / "card.json")) == c
    for name in card.PRESETS:
        assert card.Card.from_json(card.preset(name).to_json()) == card.preset(name)
    with pytest.raises(ValueError, match="text"):
        card.Card.from_json(json.dumps({"name": "no format"}))
    with pytest.raises(TypeError, match="text"):
        card.Card.from_json(b"{}")


def test_link_exact_then_nearest_world_size_then_all_reduce():
    ar2, ar8 = AlphaBeta(1e-5, 1e-9), AlphaBeta(2e-5, 2e-9)
    ag4, ag16 = AlphaBeta(3e-5, 3e-9), AlphaBeta(4e-5, 4e-9)
    c = _card(**{"all_reduce@2": ar2, "all_reduce@8": ar8, "all_gather@4": ag4,
                 "all_gather@16": ag16})
    assert c.link("all_gather", 4) is ag4 and c.link("all_gather", 16) is ag16  # exact
    assert c.link("all_gather", 2) is ag4 and c.link("all_gather", 13) is ag16  # nearest N
    assert c.link("all_gather", 10) is ag16  # a tie (6 either way) goes to the larger N
    assert c.link("all_gather_into_tensor", 4) is ag4  # torch names are the same kind
    assert c.link("all_to_all", 2) is ar2 and c.link("all_to_all", 7) is ar8  # all_reduce
    assert c.link("send", 64) is ar8 and c.link("broadcast", 3) is ar2
    only_ag = _card(**{"all_gather@4": ag4})
    with pytest.raises(ValueError, match="kind='reduce_scatter'"):
        only_ag.link("reduce_scatter", 4)


def test_comm_time_is_collective_time_with_the_cards_link():
    c = card.preset("h100-8x-nvlink")
    for kind in card.LINK_KINDS:
        for n, nbytes in ((8, 2**30), (4, 1000.0), (2, 0.0)):
            assert c.comm_time(kind, nbytes, n) == collective_time(kind, nbytes, n,
                                                                   c.link(kind, n))
        assert c.comm_time(kind, 2**30, 1) == 0.0  # one rank sends nothing
    assert c.compute_time(989e12, "bfloat16") == pytest.approx(1.0)
    assert c.compute_time(2e12) == 2e12 / c.flops["float32"]


def test_presets_are_modeled_and_say_where_their_numbers_come_from():
    for name in card.PRESETS:
        c = card.preset(name)
        assert not c.measured and "modeled" in c.name
        assert "ASSUMPTIONS" in c.notes and "datasheet" in c.notes  # alpha is assumed
        assert set(c.flops) >= {"float32", "float64", "bfloat16"}
    nv = card.preset("h100-8x-nvlink")
    assert nv.devices == 8 and nv.flops["bfloat16"] == 989e12 and nv.mem_bw == 3.35e12
    assert "#212" in nv.notes
    # Large-message busbw of the NVLS all_reduce lands on the published ~480 GB/s.
    n, t = 2**33, nv.comm_time("all_reduce", 2**33, 8)
    assert n / t * card.bus_factor("all_reduce", 8) == pytest.approx(480e9, rel=1e-3)
    ib = card.preset("h100-ib")
    assert ib.link("all_reduce", 16).bandwidth == pytest.approx(50e9)  # 400 Gb/s / 8
    assert all(a["source"] and a["convention"] for a in card.anchors())
    assert any(a["value"] == 480e9 and "busbw" in a["convention"] for a in card.anchors())


def test_describe_states_the_conventions_and_the_anchors():
    table = card.describe(card.preset("h100-8x-nvlink"), show_anchors=False)
    assert "MODELED" in table and "busbw" in table and "algbw" in table
    assert "2(N-1)/N" in table and "(N-1)/N" in table and "bidirectional" in table
    assert "published anchors" not in table
    text = card.describe(card.preset("h100-8x-nvlink"))
    assert "published anchors" in text and "nccl-tests" in text and "480" in text
    with pytest.raises(TypeError, match="card"):
        card.describe("h100-ib")
    with pytest.raises(ValueError, match="nbytes"):
        card.describe(card.preset("h100-ib"), 0)


def test_bad_input_names_the_argument():
    c = card.preset("h100-8x-nvlink")
    with pytest.raises(ValueError, match="kind"):
        c.link("allreduce", 8)
    with pytest.raises(ValueError, match="kind"):
        c.comm_time("allreduce", 8, 8)
    with pytest.raises(ValueError, match="world_size"):
        c.comm_time("all_reduce", 8, 0)
    with pytest.raises(ValueError, match="world_size"):
        c.link("all_reduce", 0)
    with pytest.raises(ValueError, match="nbytes"):
        c.comm_time("all_reduce", -1, 8)
    with pytest.raises(ValueError, match="dtype"):
        c.compute_time(1e9, "int8")
    with pytest.raises(ValueError, match="name"):
        card.preset("a100")
    with pytest.raises(ValueError, match="links"):
        _card(**{"allreduce@2": AlphaBeta(0, 0)})
    with pytest.raises(TypeError, match="links"):
        _card(**{"all_reduce@2": (1e-5, 1e-9)})
    with pytest.raises(ValueError, match="world_sizes"):
        card.calibrate(world_sizes=(1,), progress=False)
    with pytest.raises(ValueError, match="kinds"):
        card.calibrate(kinds=("broadcast",), progress=False)
    with pytest.raises(ValueError, match="dtypes"):
        card.calibrate(dtypes=("int8",), progress=False)
    with pytest.raises(ValueError, match="sizes"):
        card.calibrate(sizes=(64,), progress=False)
    with pytest.raises(ValueError, match="sizes"):  # 8 and 11 B both round to 8 on 2 ranks
        card.calibrate(sizes=(8, 11), progress=False)
    with pytest.raises(ValueError, match="kinds"):
        card.calibrate(kinds=(), progress=False)
    with pytest.raises(ValueError, match="threads"):
        card.calibrate(threads=0, progress=False)


def test_calibrate_measures_a_complete_card_and_restores_threads(tmp_path):
    before = torch.get_num_threads()
    path = tmp_path / "mine.json"
    c = card.calibrate(threads=1, path=path, progress=False)
    assert torch.get_num_threads() == before
    assert c.measured and "this machine" in c.name and c.devices >= 1
    assert set(c.links) == {f"{k}@2" for k in card.LINK_KINDS}
    assert set(c.flops) == {"float32", "float64"}
    assert c.link("all_reduce", 2).alpha + c.link("all_reduce", 2).beta > 0
    for v in [*c.flops.values(), c.mem_bw, c.memory]:
        assert math.isfinite(v) and v > 0
    assert "1 thread(s)" in c.notes and "spread" in c.notes
    assert card.Card.load(path) == c
    assert "MEASURED" in card.describe(c)
