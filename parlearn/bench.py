"""``python -m parlearn.bench``: every primitive, measured against its baseline.

Every technique module has a plain ``bench(device, quick) -> list[Row]`` function;
:data:`BENCHES` below is the one table of them. Every ratio in a row is measured side
by side in this one run (see :func:`parlearn.core.timing.compare`).
Rows may carry a target (a claim from a paper, or the project's own goal) and whether it was met.

    python -m parlearn.bench                     # everything, on the default device
    python -m parlearn.bench --quick basics      # one entry, small sizes
    python -m parlearn.bench --device cuda --json results.json
    python -m parlearn.bench --device cuda --record  # store the rows as the lessons' GPU figures
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import asdict

from parlearn.core.bench import BenchFn, Row, format_table
from parlearn.core.checks import check_bool
from parlearn.core.device import describe_str, pick_device

__all__ = ["BENCHES", "registry", "run", "run_by_name", "main", "Row", "format_table"]


# name -> (module with a ``bench(device, quick)`` function, what it measures).
# Modules are imported only when their bench runs, so `import parlearn` stays cheap.
BENCHES: dict[str, tuple[str, str]] = {
    "basics": ("parlearn.core.basics",
               "batched matmul (torch.bmm) vs a Python loop of the same matmuls"),
    # Part 1: training on many devices
    "dist": ("parlearn.distributed.measure",
             "ring all-reduce from send/recv vs all_reduce at 64 KiB and 64 MiB; measured/modeled"),
    "data_parallel": ("parlearn.multi_device.data_parallel.workers",
                      "DP step: bucketed vs naive; 8-bit vs fp32"),
    "sharding": ("parlearn.multi_device.sharding.training",
                 "ZeRO 1-3 on 2 gloo ranks: bytes per rank measured vs modeled; step vs plain DP"),
    "pipeline": ("parlearn.multi_device.pipeline.runtime",
                 "1F1B bubble measured vs (P-1)/(M+P-1); balanced vs equal split"),
    "tensor_parallel": ("parlearn.multi_device.tensor_parallel.conv",
                        "Megatron block and planned tilings: counted vs modeled comm bytes"),
    "batching": ("parlearn.multi_device.batching.tradeoff",
                 "examples and steps to a target loss: SimiGrad vs fixed batches (counted)"),
    # Part 2: beyond backprop's serial chain
    "leapfrog": ("parlearn.serial_chain.leapfrog.cost",
                 "backward schedules on a deep narrow MLP: leapfrog/segments vs serial"),
    "multigrid": ("parlearn.serial_chain.multigrid.cost",
                  "layer-parallel forward/backward (MGRIT) vs the best serial ResNet"),
    "local": ("parlearn.serial_chain.local.cost",
              "asynchronous local-heads pipeline vs pipelined backprop on the same 2 ranks"),
    "neq": ("parlearn.serial_chain.neq.training",
            "NEq backward skipping 75% frozen rows vs full autograd; counted FLOPs as model"),
    "strads": ("parlearn.serial_chain.strads.cost",
               "Lasso CD: STRADS (P=8, 2 gloo ranks) vs sklearn: updates/s, time to gap 1e-6"),
    # Part 3: many copies at once
    "dither": ("parlearn.many_copies.dither.regimes",
               "P=64 noisy copies: one batched forward/backward vs a loop over copies"),
    "qd": ("parlearn.many_copies.qd.throughput",
           "arm evaluations/s: vmap batch 4096 vs 1; MAP-Elites QD-score, batch 4096 vs 64"),
    "rl": ("parlearn.many_copies.rl.throughput",
           "cart-pole env-steps/s (policy + env): 4096 batched envs vs 1"),
    "eigengame": ("parlearn.many_copies.eigengame.speed",
                  "EigenGame samples/s: batched vs batch-1; 8 fake devices vs 1 (JAX)"),
    "decoding": ("parlearn.many_copies.decoding.measure",
                 "forward passes per sequence at >= 99% validity, and the decoder's own time"),
    "replicas": ("parlearn.many_copies.replicas.runs",
                 "R replicas' SGD steps: one vmap program vs a Python loop of R models"),
    # Part 4: the same patterns elsewhere in ML
    "value": ("parlearn.elsewhere.value.speed",
              "EBU targets: one batched sweep over episodes vs a loop over episodes"),
    "filters": ("parlearn.elsewhere.filters",
                "DMU measurement update of N particles: one batched call vs a loop"),
}


def registry() -> dict[str, tuple[str, BenchFn]]:
    """``{name: (description, bench function)}`` for every entry of :data:`BENCHES`."""
    return {name: (desc, importlib.import_module(mod).bench)
            for name, (mod, desc) in BENCHES.items()}


def run(names: list[str] | None = None, *, device: str | None = None,
        quick: bool = False) -> list[Row]:
    """Run the named benchmarks (default: all) and return their rows."""
    return [r for rows in run_by_name(names, device=device, quick=quick).values() for r in rows]


def run_by_name(names: list[str] | None = None, *, device: str | None = None,
                quick: bool = False) -> dict[str, list[Row]]:
    """Like :func:`run`, with each entry's rows under its name."""
    if names is not None and (isinstance(names, str) or not hasattr(names, "__iter__")):
        raise TypeError(f"names must be a list of benchmark names, got {names!r}")
    names = list(BENCHES) if not names else list(names)
    unknown = [n for n in names if not isinstance(n, str) or n not in BENCHES]
    if unknown:
        raise ValueError(f"names: unknown benchmark(s) {unknown}; known: {sorted(BENCHES)}")
    check_bool("quick", quick)
    dev = pick_device(device)
    return {name: importlib.import_module(BENCHES[name][0]).bench(dev, quick) for name in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parlearn.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    parser.add_argument("--device", choices=["cpu", "cuda", "mps"], default=None,
                        help="device to measure on (default: cuda > mps > cpu)")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--record", action="store_true",
                        help="store the rows (CUDA only) as the GPU reference figures the "
                             "lessons show (parlearn/data/gpu_reference.json)")
    parser.add_argument("--list", action="store_true", help="list benchmarks and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, (_, desc) in BENCHES.items():
            print(f"{name:<12} {desc}")
        return 0
    try:
        dev = pick_device(args.device)
        print(f"# parlearn.bench on {describe_str(dev)}")
        print("# ratio = baseline time / variant time: median of the per-repeat ratios, measured "
              "interleaved in this run")
        if args.record and dev.type != "cuda":
            raise ValueError(f"--record stores GPU figures: it needs --device cuda, got {dev}")
        by_name = run_by_name(args.names, device=str(dev), quick=args.quick)
    except ValueError as err:
        parser.error(str(err))
    rows = [r for group in by_name.values() for r in group]
    print(format_table(rows))
    if args.record:
        from parlearn.core import reference

        command = "python -m parlearn.bench " + " ".join(argv if argv is not None else sys.argv[1:])
        out = reference.record(by_name, device=describe_str(dev), command=command.strip())
        print(f"# GPU reference figures written to {out}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in rows], fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
