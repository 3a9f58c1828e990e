"""Putting it together (lesson 19): the tiny GPT on an n-D device mesh, and a planner.

==================  ======================================================================
module              what it holds
==================  ======================================================================
``layout``          :class:`MeshShape`: rank <-> (pp, dp, tp) coordinates, each axis's groups
``composed``        the GPT trained on ``pp x dp x tp`` gloo ranks from the course's own
                    pieces (1F1B, Megatron TP + SP, ZeRO-1), equal to one process
==================  ======================================================================
"""

from parlearn.multi_device.mesh.composed import (
    StageGPT,
    assemble,
    check_plan,
    mesh_check,
    mesh_train,
    mesh_train_worker,
)
from parlearn.multi_device.mesh.layout import AXES, MeshShape

__all__ = ["AXES", "MeshShape", "StageGPT", "check_plan", "mesh_train", "mesh_train_worker",
           "assemble", "mesh_check"]
