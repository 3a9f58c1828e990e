"""EigenGame (lesson 32): PCA as a game whose players all move at once, sharded over a JAX mesh.

    from parlearn import eigengame as eg
    res = eg.fit(x, k=8, method="mu", batch=64)
    eg.abs_cosines(res["v"], eg.top_eigenvectors(x, 8)[1])

=================  =======================================================================
module             what it holds
=================  =======================================================================
``inputs``         data with known eigenvectors, starting vectors, ``eigh``'s answer, and
                   how close the players are (:func:`abs_cosines`, :func:`longest_streak`)
``game``           the players' directions (mu and alpha), one :func:`update`, and the
                   Monte Carlo test that mu's minibatch direction is unbiased
``training``       the serial reference :func:`fit` and :func:`fit_sharded` on a
                   ``("data", "players")`` mesh with ``jax.shard_map``, side by side
``devices``        parallel equals serial (:func:`compare_sharded`), the compiled step's
                   collective bytes, and :func:`run_with_devices` (fake devices, a child)
``speed``          batched vs batch-1 updates, sharded vs one device (measured), bench rows
=================  =======================================================================

JAX is imported inside the functions: ``import parlearn.eigengame`` does not start it, so a
lesson can still ask for fake CPU devices first. Everything is re-exported here.
"""

from parlearn.many_copies.eigengame.devices import (
    _from_json,  # noqa: F401 (private; run_with_devices's child reads its payload with it)
    _jsonable,  # noqa: F401 (private; the child writes its result with it)
    collective_bytes,
    compare_sharded,
    run_with_devices,
)
from parlearn.many_copies.eigengame.game import METHODS, direction, minibatch_bias, update
from parlearn.many_copies.eigengame.inputs import (
    abs_cosines,
    init_vectors,
    longest_streak,
    synthetic_data,
    top_eigenvectors,
)
from parlearn.many_copies.eigengame.speed import bench, sharded_throughput, throughput
from parlearn.many_copies.eigengame.training import fit, fit_sharded

__all__ = ["METHODS", "synthetic_data", "init_vectors", "top_eigenvectors", "direction",
           "update", "fit", "fit_sharded", "abs_cosines", "longest_streak", "minibatch_bias",
           "compare_sharded", "collective_bytes", "run_with_devices", "throughput",
           "sharded_throughput", "bench"]
