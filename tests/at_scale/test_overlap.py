"""overlap_study: measured parts that add up, beside lesson 11's model fed the same compute."""

from __future__ import annotations

import pytest

from parlearn.at_scale import overlap as O
from parlearn.distributed import AlphaBeta


def test_each_kind_is_measured_on_every_rank_and_modeled(tmp_path):
    link = AlphaBeta(1e-4, 1e-9)
    res = O.overlap_study(str(tmp_path), widths=(16, 32, 4), steps=3, bucket_bytes=256,
                          link=link)
    assert res["link"] is link
    for kind in O.KINDS:
        assert len(res[kind]["measured"]) == 2 and len(res[kind]["traces"]) == 2
        for m in res[kind]["measured"]:
            assert m["compute"] + m["exposed"] + m["idle"] == pytest.approx(m["step"])
            assert m["steps"] == 2
        model = res[kind]["modeled"]
        assert model.compute == pytest.approx(max(m["compute"] for m in res[kind]["measured"]))
    assert res["naive"]["modeled"].hidden == 0.0      # nothing can overlap after backward
    assert res["naive"]["measured"][0]["hidden"] == pytest.approx(0.0, abs=1e-4)


def test_bad_calls_are_refused_before_any_rank(tmp_path):
    with pytest.raises(ValueError, match="kinds"):
        O.overlap_study(str(tmp_path), kinds=["zero"])
    with pytest.raises(ValueError, match="steps"):
        O.overlap_study(str(tmp_path), steps=1)
    with pytest.raises(TypeError, match="link"):
        O.overlap_study(str(tmp_path), link=3.0)
    with pytest.raises(TypeError, match="out_dir"):
        O.overlap_study(3)
