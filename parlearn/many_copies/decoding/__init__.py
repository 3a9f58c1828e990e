"""Parallel decoders for masked-diffusion LMs, mean-field among them (lesson 33).

    from parlearn import decoding
    res = decoding.decode(denoiser, length=16, batch=64, mask_id=mask_id, strategy="mean_field")

=================  =======================================================================
module             what it holds
=================  =======================================================================
``strategies``     which masked positions to commit per pass: sequential, fixed-k,
                   random, threshold, factor, entropy bound, and their shared helpers
``mean_field``     the mean-field decoder (a reconstruction): overlap couplings, the damped
                   Gauss-Seidel fixed point and its serial reference, ``tau="auto"``
``loop``           :func:`decode`, the unmasking loop any denoiser runs in, the
                   ``STRATEGIES`` table and the checks of their parameters
``measure``        sweeps of the strategies' settings, the language-family table, bench
=================  =======================================================================

The masked-diffusion LMs and the languages they are measured on are in
:mod:`parlearn.many_copies.diffusion` (same lesson). Everything is re-exported here.
"""

from parlearn.many_copies.decoding.loop import (
    STRATEGIES,
    DecodeResult,
    Denoiser,  # noqa: F401 (a type alias, not in __all__)
    decode,
)
from parlearn.many_copies.decoding.mean_field import (
    Coupling,  # noqa: F401 (a type alias, not in __all__)
    _mean_field_commit_loop,  # noqa: F401 (private; the serial reference tests and lesson 33 use)
    auto_tau,
    coupling_matrix,
    mean_field_commit,
    overlap_coupling,
    overlap_coupling_dense,
)
from parlearn.many_copies.decoding.measure import (
    FAMILY_TAUS,
    GRIDS,
    bench,  # noqa: F401 (decoding.bench, as before the split; not in __all__ then either)
    best_setting,
    family_table,
    format_family_table,
    sweep,
)
from parlearn.many_copies.decoding.strategies import (
    _entropy,  # noqa: F401 (private; the tests use it)
    confidence,
)

__all__ = ["STRATEGIES", "GRIDS", "FAMILY_TAUS", "DecodeResult", "decode", "overlap_coupling",
           "overlap_coupling_dense", "coupling_matrix", "auto_tau", "mean_field_commit",
           "confidence", "sweep", "best_setting", "family_table", "format_family_table"]
