"""Lessons are committed clean and follow the course's shape; nbval executes them."""

import json
from pathlib import Path

import pytest

LESSONS = sorted((Path(__file__).parent.parent / "lessons").glob("*.ipynb"))


def test_there_are_lessons():
    assert LESSONS and LESSONS[0].name == "00_start_here.ipynb"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"])
             if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))]
    assert not dirty, f"{path.name}: clear outputs of cells {dirty} before committing"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_shape(path):
    nb = json.loads(path.read_text())
    text = "\n".join("".join(c["source"]) for c in nb["cells"])
    for part in ("Learning goals", "Exercises", "References", "settings.banner()"):
        assert part in text, f"{path.name} lacks {part!r}"
