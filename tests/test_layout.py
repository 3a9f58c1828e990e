"""The package's shape: the tree reads as the course, dependencies point down, no circles,
short names are the home modules, and ``import parlearn`` starts nothing."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import parlearn

PKG = Path(parlearn.__file__).parent
# A layer may import its own layer and those below it, never one above.
LAYERS = {"core": 0, "distributed": 1, "multi_device": 2, "serial_chain": 2, "many_copies": 2,
          "elsewhere": 2, "at_scale": 3}   # Part 5 looks at the techniques from above
MAX_LINES = 500  # DESIGN.md: a module over ~400 lines becomes a package


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every parlearn import in the file, lazy ones inside functions too.
    ``from parlearn.a import b`` counts as importing ``parlearn.a.b`` when that is a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                out.append((node.lineno, "." * node.level + (node.module or "")))
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((node.lineno, sub if sub in MODULES else node.module))
    return [(n, m) for n, m in out if m.startswith(("parlearn", "."))]


def _home(name: str) -> str:
    """The module an import of ``name`` executes, short names resolved to their homes."""
    parts = name.split(".")
    if len(parts) > 1 and parts[1] in parlearn.SHORT_NAMES:
        name = ".".join(["parlearn", parlearn.SHORT_NAMES[parts[1]], *parts[2:]])
    return name


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_module_is_in_a_layer():
    top = {name.split(".")[1] for name in MODULES if name.count(".") >= 1}
    assert top <= set(LAYERS) | {"bench"}, top - set(LAYERS)


def test_no_relative_imports():
    bad = [f"{p.relative_to(PKG.parent)}:{n}" for p in MODULES.values()
           for n, m in _imports(p) if m.startswith(".")]
    assert not bad, f"use absolute parlearn.* imports: {bad}"


def test_dependencies_point_down():
    """core imports only core; dist only dist and core; the parts anything but bench."""
    bad = []
    for name, path in MODULES.items():
        mine = _layer(name)
        for line, imported in _imports(path):
            target = _home(imported)
            theirs = _layer(target)
            if target in ("parlearn", "parlearn.bench") and name != "parlearn":
                bad.append(f"{name}:{line} imports {imported} (the top, above every layer)")
            elif mine is not None and theirs is not None and theirs > mine:
                bad.append(f"{name}:{line} imports {imported} (layer {theirs} > {mine})")
    assert not bad, "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        if name in ("parlearn", "parlearn.bench"):
            continue
        graph[name] = {t for _, m in _imports(path) if (t := _home(m)) in MODULES and t != name}
    return graph


def test_no_import_circles():
    assert not _cycles(_graph()), _cycles(_graph())


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_lesson_workers_are_only_imported_beside_them():
    """A ``workers`` module serves its lesson; other techniques must not import it."""
    bad = []
    for name, path in MODULES.items():
        for line, imported in _imports(path):
            target = _home(imported)
            if target.endswith(".workers") and not name.startswith(target.rsplit(".", 1)[0]):
                bad.append(f"{name}:{line} imports {imported}")
    assert not bad, bad


@pytest.mark.parametrize("name", sorted(MODULES), ids=str)
def test_no_module_is_too_long(name):
    n = len(MODULES[name].read_text().splitlines())
    assert n <= MAX_LINES, f"{name} has {n} lines: split it into a package (limit {MAX_LINES})"


@pytest.mark.parametrize("short", sorted(parlearn.SHORT_NAMES))
def test_short_names_are_the_home_modules(short):
    home = importlib.import_module(f"parlearn.{parlearn.SHORT_NAMES[short]}")
    assert importlib.import_module(f"parlearn.{short}") is home
    assert getattr(parlearn, short) is home
    assert home.__spec__.name == home.__name__ == f"parlearn.{parlearn.SHORT_NAMES[short]}"


def test_short_name_submodules_are_one_object():
    import parlearn.data_parallel.workers as short

    from parlearn.multi_device.data_parallel import workers as home

    assert short is home


def test_unknown_attribute_is_a_clear_error():
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        parlearn.nonexistent  # noqa: B018


def test_import_parlearn_imports_no_technique():
    code = ("import sys, parlearn; "
            "print(sorted(m for m in sys.modules if m.startswith(('parlearn', 'torch', 'jax'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=PKG.parent).stdout
    assert out.strip() == "['parlearn']"


def test_bench_registry_points_at_modules_with_bench():
    from parlearn import bench

    for group, (module, _) in bench.BENCHES.items():
        assert module in MODULES, f"{group}: {module} is not a module"
        assert "def bench(" in MODULES[module].read_text(), f"{group}: {module} has no bench"


def test_every_test_file_on_disk_is_collected(pytestconfig):
    """pytest skips folders matching ``norecursedirs`` (``dist``, ``build``, ``venv``, dot
    folders...) without a word: ``tests/dist`` went uncollected that way. Every
    ``tests/**/test_*.py`` must sit under a test path, outside every such folder."""
    import fnmatch

    root = Path(pytestconfig.rootpath)
    skip = pytestconfig.getini("norecursedirs")
    testpaths = [root / p for p in pytestconfig.getini("testpaths")]
    patterns = pytestconfig.getini("python_files")
    files = sorted((root / "tests").rglob("test_*.py"))
    assert files, "no test files found under tests/"
    missed = []
    for f in files:
        rel = f.relative_to(root)
        hidden = [d for d in rel.parts[:-1] if any(fnmatch.fnmatch(d, pat) for pat in skip)]
        outside = not any(tp in f.parents for tp in testpaths)
        unnamed = not any(fnmatch.fnmatch(f.name, pat) for pat in patterns)
        if hidden or outside or unnamed:
            missed.append(f"{rel}: " + ", ".join(
                w for w, bad in ((f"folder {hidden} matches norecursedirs", hidden),
                                 ("outside testpaths", outside),
                                 (f"name not in python_files {patterns}", unnamed)) if bad))
    assert not missed, "test files pytest never collects:\n" + "\n".join(missed)


def test_words_for_users():
    """Lessons, docstrings and bench rows cite papers and sources, never our own issue tracker
    ("issue 29", "the issue's target", "as quoted in issue 32")."""
    import re

    root = PKG.parent
    pattern = re.compile(r"(?i)\b(as quoted in |cited by )?the issue('s)?\b|\bissues? \d+")
    files = [*PKG.rglob("*.py"), *(root / "lessons").glob("*.ipynb"), root / "README.md"]
    hits = [f"{f.relative_to(root)}:{n}: {line.strip()[:80]}" for f in files
            for n, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "words for users, not our issue tracker:\n" + "\n".join(hits)
