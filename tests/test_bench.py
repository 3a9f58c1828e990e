import json

import pytest

from parlearn import bench


def test_basics_rows_are_measured(capsys, tmp_path):
    out = tmp_path / "b.json"
    assert bench.main(["--quick", "--device", "cpu", "--json", str(out), "basics"]) == 0
    text = capsys.readouterr().out
    assert "torch.bmm" in text and "ratio" in text
    rows = json.loads(out.read_text())
    assert rows and all(r["ratio"] > 0 and r["device"] == "cpu" for r in rows)


def test_every_registered_entry_prints_a_row(capsys):
    names = sorted(bench.registry())
    rows = bench.run(names, device="cpu", quick=True)
    assert {r.benchmark.split()[0] for r in rows} >= set(names)
    table = bench.format_table(rows)
    assert len(table.splitlines()) >= len(rows) + 2


def test_unknown_benchmark_is_refused():
    with pytest.raises(SystemExit):
        bench.main(["--quick", "nope"])
    with pytest.raises(ValueError, match="unknown benchmark"):
        bench.run(["nope"])
