"""Putting it together (lesson 19): the tiny GPT on an n-D device mesh, and a planner.

==================  ======================================================================
module              what it holds
==================  ======================================================================
``layout``          :class:`MeshShape`: rank <-> (pp, dp, tp) coordinates, each axis's groups
``stage``           :class:`StageGPT`: one rank's piece of the GPT (its stage, its TP shard)
``composed``        the GPT trained on ``pp x dp x tp`` gloo ranks from the course's own
                    pieces (1F1B, Megatron TP + SP, ZeRO-1), equal to one process
``torch_composed``  the same GPT with torch's ``parallelize_module`` then ``fully_shard``
                    (torchtitan's order) on a ``dp x tp`` mesh
``planner``         plans ``(dp, tp, pp, cp, zero, recompute, micro-batch)``, their modeled
                    memory and step time on a cluster of hardware cards, the ranking
``checks``          several meshes checked against one process in one launch of the ranks
``grading``         the planner's picks run for real on this machine: Kendall tau, memory
                    error
``explore``         the planner's explorer: the best meshes' modeled time, MFU and memory
                    beside a measured run's MFU
==================  ======================================================================

The hardware card the planner reads is :mod:`parlearn.card` (``parlearn.distributed.card``).
"""

from parlearn.multi_device.mesh.checks import mesh_checks
from parlearn.multi_device.mesh.composed import (
    MeshRank,
    assemble,
    mesh_check,
    mesh_train,
    mesh_train_worker,
)
from parlearn.multi_device.mesh.layout import AXES, MeshShape, draw_mesh
from parlearn.multi_device.mesh.stage import StageGPT, check_plan

__all__ = ["AXES", "MeshShape", "draw_mesh", "StageGPT", "MeshRank", "check_plan", "mesh_train",
           "mesh_train_worker", "assemble", "mesh_check", "mesh_checks"]
