"""Every public callable of every package has a contract test or a written exemption.

The contract files are ``tests/contract/test_contract_*.py``; each holds ``CASES`` (the
generic harness), ``COVERED_ELSEWHERE`` (name -> "tests/file.py::test_name") and ``EXEMPT``
(name -> why). A new public function with none of the three fails here, naming it.

``PENDING`` in a contract file lists public callables whose contract test is still to be
written: the open work, named. It may only shrink: an entry that is covered, or no longer
public, fails here too (delete it).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import harness

HERE = Path(__file__).parent
TESTS = HERE.parent


def _contract_files() -> list:
    out = []
    for path in sorted(HERE.glob("test_contract_*.py")):
        spec = importlib.util.spec_from_file_location(f"_contract_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out.append(module)
    return out


FILES = _contract_files()


def _entries() -> dict[str, tuple[str, str]]:
    """import path -> (file, kind) over every contract file; a name listed twice fails."""
    out: dict[str, tuple[str, str]] = {}
    dup = []
    for module in FILES:
        where = Path(module.__file__).name
        names = ([(c.name, "case") for c in getattr(module, "CASES", [])]
                 + [(n, "elsewhere") for n in getattr(module, "COVERED_ELSEWHERE", {})]
                 + [(n, "exempt") for n in getattr(module, "EXEMPT", {})])
        for name, kind in names:
            if name in out:
                dup.append(f"{name}: {out[name][0]} and {where}")
            out[name] = (where, kind)
    assert not dup, "listed twice:\n" + "\n".join(dup)
    return out


def _pending() -> set[str]:
    return {name for module in FILES for name in getattr(module, "PENDING", ())}


def test_every_public_callable_is_covered():
    public = harness.public_callables()
    covered: dict[int, str] = {}
    for name in _entries():
        covered[id(harness.resolve(name))] = name
    missing = sorted(home for key, home in public.items()
                     if key not in covered and home not in _pending())
    assert not missing, (f"{len(missing)} public callables have no contract test and no "
                         "exemption (add a Case, COVERED_ELSEWHERE or EXEMPT entry):\n"
                         + "\n".join(missing))


def test_every_entry_is_public():
    """No entry for a name that is gone or private (the list would hide a rename)."""
    public = harness.public_callables()
    stale = [name for name in _entries() if id(harness.resolve(name)) not in public]
    assert not stale, f"not a public callable: {stale}"


def test_covered_elsewhere_points_at_real_tests():
    bad = []
    for module in FILES:
        for name, where in getattr(module, "COVERED_ELSEWHERE", {}).items():
            refs = where if isinstance(where, list | tuple) else [where]
            for ref in refs:
                path, _, test = ref.partition("::")
                file = TESTS.parent / path
                if not file.exists() or not re.search(rf"def {re.escape(test)}\b",
                                                      file.read_text()):
                    bad.append(f"{name}: {ref}")
    assert not bad, "COVERED_ELSEWHERE names tests that do not exist:\n" + "\n".join(bad)


def test_exemptions_say_why():
    short = [f"{name}: {why!r}" for module in FILES
             for name, why in getattr(module, "EXEMPT", {}).items()
             if not isinstance(why, str) or len(why.split()) < 4]
    assert not short, "an exemption needs a reason of a few words:\n" + "\n".join(short)


def test_pending_only_shrinks():
    """A pending name that is now covered (or gone) must leave PENDING."""
    public = set(harness.public_callables().values())
    covered = {harness.public_callables().get(id(harness.resolve(n))) for n in _entries()}
    stale = sorted(n for n in _pending() if n not in public or n in covered)
    assert not stale, f"covered or no longer public, delete from PENDING: {stale}"
