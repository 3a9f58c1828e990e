"""GPU reference figures: only CUDA rows are recorded, and they come back labelled."""

import json

import pytest

from parlearn import bench
from parlearn.core import reference
from parlearn.core.bench import Row


def _rows(device="cuda"):
    return {"dither": [Row("dither P=64 batch=1", "loop over copies", "one batched pass", 41.5,
                           device, "", None, "IQR 40-43x, 1 thread(s)")],
            "qd": [Row("qd arms", "batch 1", "batch 4096", 900.0, device)]}


def test_recorded_rows_come_back_with_their_label(tmp_path):
    path = tmp_path / "ref.json"
    out = reference.record(_rows(), device="device=cuda | GPU: NVIDIA H100 80GB HBM3",
                           command="python -m parlearn.bench --device cuda --record", path=path,
                           date="2026-12-07")
    assert out == path
    ref = reference.load(path)
    assert ref.date == "2026-12-07" and "H100" in ref.device and "--record" in ref.command
    assert [r.ratio for r in ref.rows_for("dither")] == [41.5]
    assert ref.rows_for("qd")[0].variant == "batch 4096" and ref.rows_for("rl") == []
    text = reference.table("dither", path=path)
    assert "Measured on a GPU, not on this machine" in text and "H100" in text
    assert "2026-12-07" in text and "41.50x" in text and "900" not in text
    assert "recorded no rows" in reference.table("rl", path=path)


def test_without_a_file_the_lesson_says_how_to_get_one(tmp_path, capsys):
    path = tmp_path / "none.json"
    assert reference.load(path) is None
    assert "make gpu-check" in reference.table("dither", path=path)
    reference.show("dither", path=path)
    assert "No GPU reference figures" in capsys.readouterr().out


def test_cpu_rows_are_never_recorded_as_gpu_figures(tmp_path):
    path = tmp_path / "ref.json"
    mixed = _rows()
    mixed["rl"] = [Row("rl envs", "1 env", "4096 envs", 30.0, "cpu")]
    with pytest.raises(ValueError, match="rows: only rows measured on CUDA"):
        reference.record(mixed, device="x", command="y", path=path)
    assert not path.exists()
    with pytest.raises(SystemExit):                      # --record refuses a CPU run
        bench.main(["--quick", "--device", "cpu", "--record", "basics"])


@pytest.mark.parametrize("kwargs, match", [
    (dict(rows=[Row("a", "b", "c", 1.0, "cuda")]), "rows must be a dict"),
    (dict(rows={"dither": "abc"}), r"rows\['dither'\] must be a list"),
    (dict(rows={"dither": [1.0]}), r"rows\['dither'\] must hold"),
    (dict(rows={"dither": []}), "rows must not be empty"),
    (dict(rows={3: []}), "rows key"),
    (dict(device=""), "device"),
    (dict(command=3), "command"),
    (dict(path=3), "path"),
    (dict(date=True), "date"),
])
def test_bad_arguments_are_refused_naming_them(tmp_path, kwargs, match):
    call = dict(rows=_rows(), device="gpu", command="cmd", path=tmp_path / "r.json")
    call.update(kwargs)
    with pytest.raises((TypeError, ValueError), match=match):
        reference.record(**call)
    for bad in (None, 3, ""):
        with pytest.raises((TypeError, ValueError), match="benchmark"):
            reference.table(bad, path=tmp_path / "r.json")


def test_a_file_that_is_not_a_reference_is_refused(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"rows": {}}))
    with pytest.raises(ValueError, match="not a GPU reference file"):
        reference.load(path)


def test_the_packaged_file_if_any_holds_only_gpu_rows():
    ref = reference.load()
    if ref is None:
        pytest.skip("no GPU figures recorded in this copy (no CUDA machine has run make gpu-check)")
    assert ref.rows and all(r.device.startswith("cuda") for g in ref.rows.values() for r in g)
    assert set(ref.rows) <= set(bench.BENCHES)


def test_any_cuda_row_set_round_trips_and_any_other_device_is_refused(tmp_path_factory):
    # Property: record then load gives back every row of every entry unchanged; a set with
    # one row measured anywhere but CUDA is refused whole and writes nothing.
    from hypothesis import given, settings
    from hypothesis import strategies as st

    text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
    ratio = st.floats(1e-3, 1e6, allow_nan=False, allow_infinity=False)

    def rows(devices):
        row = st.builds(Row, text, text, text, ratio, devices, text,
                        st.sampled_from([None, True, False]), text)
        return st.dictionaries(st.sampled_from(["dither", "qd", "rl", "gpt"]),
                               st.lists(row, min_size=1, max_size=3), min_size=1, max_size=3)

    @settings(max_examples=60, deadline=None)
    @given(rows(st.sampled_from(["cuda", "cuda:0", "cuda:1"])),
           st.sampled_from(["cpu", "mps", "xla", "meta", ""]), st.data())
    def prop(good, other, data):
        path = tmp_path_factory.mktemp("ref") / "ref.json"
        reference.record(good, device="H100", command="cmd", path=path, date="2026-12-07")
        ref = reference.load(path)
        for name, want in good.items():
            assert ref.rows_for(name) == list(want)
        bad = {k: list(v) for k, v in good.items()}
        name = data.draw(st.sampled_from(sorted(bad)))
        i = data.draw(st.integers(0, len(bad[name]) - 1))
        r = bad[name][i]
        bad[name][i] = Row(r.benchmark, r.baseline, r.variant, r.ratio, other, r.target, r.met,
                           r.detail)
        path2 = path.with_name("bad.json")
        with pytest.raises(ValueError, match="only rows measured on CUDA"):
            reference.record(bad, device="H100", command="cmd", path=path2)
        assert not path2.exists()
    prop()
