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


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_stripped_form_is_what_is_committed(path):
    """nbstripout (the git clean filter `make lab`/`make test` install) leaves lessons as is,
    so `git status` stays clean after a lesson has been run and autosaved."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "nbstripout", "--keep-id", "-t", str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert out.rstrip("\n") == path.read_text().rstrip("\n"), (
        f"{path.name}: run `nbstripout --keep-id lessons/{path.name}` and commit the result")


def test_gitattributes_names_the_filter():
    text = (Path(__file__).parent.parent / ".gitattributes").read_text()
    assert "*.ipynb filter=nbstripout" in text
