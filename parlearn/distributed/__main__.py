"""``python -m parlearn.dist module:function [args...]``: run a worker on real ranks.

Under ``torchrun`` (RANK/WORLD_SIZE/MASTER_ADDR set) each process joins the group and calls
the worker; without it, :func:`parlearn.distributed.run` starts ``--nproc`` ranks here::

    torchrun --standalone --nproc_per_node 8 -m parlearn.dist parlearn.collectives:ring_check 1000
    python -m parlearn.dist parlearn.collectives:ring_check 1000 --nproc 2
"""

from __future__ import annotations

import ast
import datetime
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist

from parlearn.core.checks import check_callable
from parlearn.distributed.launch import default_backend, run


def _resolve(spec: str) -> Callable:
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"worker must be 'module:function', got {spec!r}")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return check_callable("worker", obj)


def _report(rank: int, value: Any) -> None:
    # One write call per line: torchrun's ranks share one stdout, and print() (two writes when
    # stdout is unbuffered, e.g. PYTHONUNBUFFERED=1) let two ranks' lines interleave.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"rank {rank}: {value!r}\n".encode())


def main(argv: list[str] | None = None) -> int:
    """Under ``torchrun`` (RANK/WORLD_SIZE/MASTER_ADDR set): join the group and call the
    worker with ``(rank, world_size, *args)``, each arg read as a Python literal; print
    ``rank R: value``. Without ``torchrun``: run the worker on ``--nproc`` ranks with
    :func:`run`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m parlearn.dist", description=main.__doc__)
    parser.add_argument("worker", help="module:function, e.g. parlearn.collectives:ring_check")
    parser.add_argument("args", nargs="*", help="extra arguments (Python literals)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks when not under torchrun")
    parser.add_argument("--timeout", type=float, default=60, help="group timeout, seconds")
    opts = parser.parse_args(argv)
    fn = _resolve(opts.worker)
    extra = []
    for a in opts.args:
        try:
            extra.append(ast.literal_eval(a))
        except (ValueError, SyntaxError):
            extra.append(a)
    if "RANK" not in os.environ:
        for rank, value in enumerate(run(fn, opts.nproc, args=extra, timeout=opts.timeout)):
            _report(rank, value)
        return 0
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    device = None
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=opts.timeout),
                             device_id=device)
    try:
        _report(rank, fn(rank, world_size, *extra))
    finally:
        tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
