"""The bench's parts every technique uses: a :class:`Row` of the table, and how to print it.

Every technique module ends with a plain ``bench(device, quick) -> list[Row]`` function;
``python -m parlearn.bench`` (:mod:`parlearn.bench`) lists them in course order and runs them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from parlearn.core.checks import check_bool, check_str

__all__ = ["Row", "BenchFn", "rows_in_fresh_process", "format_table"]


@dataclass
class Row:
    """One line of the bench table. ``ratio`` = baseline time / variant time (measured)."""

    benchmark: str
    baseline: str
    variant: str
    ratio: float
    device: str
    target: str = ""
    met: bool | None = None
    detail: str = ""


BenchFn = Callable[[torch.device, bool], list[Row]]


def rows_in_fresh_process(module: str, quick: bool) -> list[Row]:
    """``module._bench_rows(quick)``, measured in a fresh Python process.

    JAX starts threads that make every later ``os.fork`` of the process unsafe, and
    ``python -m parlearn.bench`` forks gloo ranks for other entries: JAX benches run here.
    """
    check_str("module", module)
    check_bool("quick", quick)
    import subprocess

    code = ("import importlib, json, sys; from dataclasses import asdict; "
            "m = importlib.import_module(sys.argv[1]); "
            "print(json.dumps([asdict(r) for r in m._bench_rows(sys.argv[2] == '1')]))")
    done = subprocess.run([sys.executable, "-c", code, module, "1" if quick else "0"],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the {module} bench subprocess failed:\n{done.stderr[-3000:]}")
    return [Row(**r) for r in json.loads(done.stdout.strip().splitlines()[-1])]


def format_table(rows: list[Row]) -> str:
    """The rows as a fixed-width text table."""
    if isinstance(rows, str) or not hasattr(rows, "__iter__"):
        raise TypeError(f"rows must be a list of Row, got {rows!r}")
    rows = list(rows)
    for i, r in enumerate(rows):
        if not isinstance(r, Row):
            raise TypeError(f"rows[{i}] must be a Row, got {r!r}")
    head = ("benchmark", "baseline", "parallel variant", "ratio", "device", "target", "met")
    body = [
        (r.benchmark, r.baseline, r.variant, f"{r.ratio:.2f}x", r.device, r.target,
         {True: "yes", False: "NO", None: "-"}[r.met])
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*b) for b in body]
    details = [f"  {r.benchmark} / {r.variant}: {r.detail}" for r in rows if r.detail]
    if details:
        lines += ["", "details:", *details]
    return "\n".join(lines)
