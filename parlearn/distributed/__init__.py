"""Real ranks on one machine, what they send, and what that costs.

    from parlearn.distributed import collectives, run
    run(collectives.ring_check, world_size=2)

=====================  ====================================================================
module                 what it holds
=====================  ====================================================================
``launch``             :func:`run`: k ranks of a ``torch.distributed`` group from a notebook;
                       :func:`run_many`: many calls of one worker in one launch
``traffic``            :func:`ledger`: every collective a rank issues, its bytes and time
``flight``             the flight recorder: every call each rank makes, written before it
                       starts (``run(..., doctor=True)``)
``diagnosis``          :func:`diagnose` reads those records: where each rank of a hung run
                       waits, and why
``cost``               the alpha-beta model: closed forms per collective, the fit
``collectives``        ring all-reduce from send/recv, and the workers lesson 10 runs
``measure``            sweeps of real collectives, the fitted alpha-beta, ring vs gloo,
                       the load of other programs, bench rows
``card``               a hardware card: measured or modeled alpha-beta, FLOP/s, memory
``__main__``           ``python -m parlearn.distributed`` / ``torchrun -m parlearn.distributed``
=====================  ====================================================================

The names a notebook uses are re-exported here. Everything in Parts 1-4 that moves bytes
between ranks builds on this package; it builds only on :mod:`parlearn.core`.
"""

from parlearn.distributed.card import Card
from parlearn.distributed.cost import (
    ALGORITHMS,
    KINDS,
    AlphaBeta,
    collective_time,
    fit_alpha_beta,
    hierarchical_all_reduce_time,
    ring_bytes,
)
from parlearn.distributed.diagnosis import Call, diagnose
from parlearn.distributed.flight import read_records, recording
from parlearn.distributed.launch import RankError, default_backend, device_for, run, run_many
from parlearn.distributed.measure import (
    DEFAULT_SIZES,
    STUDY_SIZES,
    measure_alpha_beta,
    measure_links,
    other_load,
    ring_vs_gloo,
    sweep_collective,
)
from parlearn.distributed.traffic import Ledger, Record, ledger

__all__ = ["run", "run_many", "RankError", "device_for", "default_backend", "ledger", "Ledger",
           "Record",
           "AlphaBeta", "KINDS", "ALGORITHMS", "collective_time", "fit_alpha_beta", "ring_bytes",
           "sweep_collective", "measure_alpha_beta", "measure_links", "DEFAULT_SIZES", "Card",
           "ring_vs_gloo", "other_load", "STUDY_SIZES", "Call", "diagnose", "read_records",
           "recording", "hierarchical_all_reduce_time"]
