"""Part 5, running it for real.

==================  ======================================================================
module              what it holds
==================  ======================================================================
``mfu``             MFU you can trust: peaks, FLOP counts, utilisation, an audit
``traces``          profiler traces of real ranks: compute, exposed communication, idle
``critical``        the critical path of a step across ranks: whose work, which call, who
                    made the others wait
``overlap``         how much communication hides behind compute, measured and modeled
``plan_trace``      the planner's predicted step beside the measured trace, part by part
``hangs``           the classic hangs on real ranks, each diagnosed by the flight recorder
``checkpoint``      sharded checkpoints (``torch.distributed.checkpoint``) that reshard
``train``           the mesh trainer under ``torchrun``: checkpoints, resume, a killed rank
``goodput``         how often to checkpoint: Young's interval, modeled and measured
==================  ======================================================================

Short names: ``from parlearn import mfu, hangs, checkpoint, train``;
``python -m parlearn.train``.
"""

__all__: list[str] = []
