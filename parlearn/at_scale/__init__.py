"""Part 5, running it for real.

==================  ======================================================================
module              what it holds
==================  ======================================================================
``mfu``             MFU you can trust: peaks, FLOP counts, utilisation, an audit
``traces``          profiler traces of real ranks: compute, exposed communication, idle
``overlap``         how much communication hides behind compute, measured and modeled
``checkpoint``      sharded checkpoints (``torch.distributed.checkpoint``) that reshard
``train``           the mesh trainer under ``torchrun``: checkpoints, resume, a killed rank
==================  ======================================================================

Short names: ``from parlearn import mfu, checkpoint, train``; ``python -m parlearn.train``.
"""

__all__: list[str] = []
