"""``python -m parlearn.bench``: every primitive, measured against its baseline.

Each technique module registers one function with :func:`register`. A benchmark
function takes ``(device, quick)`` and returns :class:`Row` objects; every ratio
in a row is measured side by side in this one run (see :func:`parlearn.timing.compare`).
Rows may carry a target (a claim from an issue or paper) and whether it was met.

    python -m parlearn.bench                     # everything, on the default device
    python -m parlearn.bench --quick basics      # one entry, small sizes
    python -m parlearn.bench --device cuda --json results.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .device import describe_str, pick_device

__all__ = ["Row", "register", "registry", "run", "main"]

# Technique modules that register benchmarks; imported only when the bench runs,
# so `import parlearn` stays cheap.
MODULES = (
    "parlearn.basics",
    "parlearn.leapfrog",
    "parlearn.multigrid",
    "parlearn.dither",
    "parlearn.decoding",
)


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
_REGISTRY: dict[str, tuple[str, BenchFn]] = {}


def register(name: str, description: str) -> Callable[[BenchFn], BenchFn]:
    """Decorator: register ``fn(device, quick) -> list[Row]`` under ``name``."""

    def deco(fn: BenchFn) -> BenchFn:
        _REGISTRY[name] = (description, fn)
        return fn

    return deco


def registry() -> dict[str, tuple[str, BenchFn]]:
    """All registered benchmarks (importing the technique modules that exist)."""
    for mod in MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as err:
            if err.name != mod:  # a real missing dependency, not a module yet to be written
                raise
    return dict(_REGISTRY)


def run(names: list[str] | None = None, *, device: str | None = None,
        quick: bool = False) -> list[Row]:
    """Run the named benchmarks (default: all) and return their rows."""
    reg = registry()
    names = list(reg) if not names else names
    unknown = [n for n in names if n not in reg]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; registered: {sorted(reg)}")
    dev = pick_device(device)
    rows: list[Row] = []
    for name in names:
        rows.extend(reg[name][1](dev, quick))
    return rows


def format_table(rows: list[Row]) -> str:
    """The rows as a fixed-width text table."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parlearn.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    parser.add_argument("--device", choices=["cpu", "cuda", "mps"], default=None,
                        help="device to measure on (default: cuda > mps > cpu)")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--list", action="store_true", help="list benchmarks and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, (desc, _) in sorted(registry().items()):
            print(f"{name:<12} {desc}")
        return 0
    try:
        dev = pick_device(args.device)
        print(f"# parlearn.bench on {describe_str(dev)}")
        print("# ratio = baseline time / variant time, medians, measured interleaved in this run")
        rows = run(args.names, device=str(dev), quick=args.quick)
    except ValueError as err:
        parser.error(str(err))
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in rows], fh, indent=2)
    return 0


if __name__ == "__main__":
    # Run the importable module's main: technique modules register into *its* registry,
    # not into this __main__ copy.
    from parlearn.bench import main as _main

    sys.exit(_main())
