"""The same GPT with torch's composable APIs, in torchtitan's order: TP, then FSDP2.

On a ``dp x tp`` :class:`~torch.distributed.device_mesh.DeviceMesh` (mesh dims
``("dp", "tp")``, tp innermost as in :mod:`parlearn.mesh.layout`):

1. ``parallelize_module`` on each block with ``ColwiseParallel`` on q, k, v and the MLP's
   first projection(s) and ``RowwiseParallel`` on the attention output and the MLP's second
   projection (the plan of :mod:`parlearn.mesh.composed`, written as DTensor layouts). Each
   attention module is told it now has ``n_heads / tp`` heads, because its projections
   return local shards (torchtitan does the same);
2. ``fully_shard`` (FSDP2) on each block and then on the root over the ``dp`` sub-mesh: it
   shards every parameter, DTensor shards included, along dim 0 over dp, all-gathers them
   for forward and backward, and reduce-scatters (averages) the gradients.

TP must come first: FSDP2 shards what it finds, and a parameter that TP turns into a
DTensor afterwards would escape its flat parameter bookkeeping. Pipeline parallelism is
not composed here: ``torch.distributed.pipelining`` needs every stage to own its
parameters, and the GPT's output layer is its embedding (tied), which would need the
embedding-group all-reduce written by hand around torch's schedule; lesson 13 runs torch's
pipeline schedules on their own.
"""

from __future__ import annotations

import logging

import torch

from parlearn.core.checks import check_float, check_int
from parlearn.multi_device.context_parallel.gpt import train_batches
from parlearn.multi_device.transformer.model import GPT, GPTConfig

__all__ = ["torch_mesh_worker", "torch_mesh_train"]


def _check_args(cfg, dp, tp, steps, batch, seq, lr, seed) -> None:
    from parlearn.multi_device.mesh.layout import MeshShape
    from parlearn.multi_device.mesh.stage import check_plan

    dp, tp = check_int("dp", dp, lo=1), check_int("tp", tp, lo=1)
    for name, v in (("steps", steps), ("batch", batch), ("seq", seq)):
        check_int(name, v, lo=1)
    check_float("lr", lr, lo=0, lo_open=True)
    check_int("seed", seed, lo=0)
    check_plan(cfg, MeshShape(dp, tp, 1), batch, seq, 1, False)


def torch_mesh_worker(rank: int, world_size: int, cfg: GPTConfig, dp: int, tp: int, steps: int,
                      batch: int, seq: int, lr: float, seed: int) -> dict:
    """Worker: Adam steps of the GPT under TP (``parallelize_module``) then FSDP2
    (``fully_shard``) on a ``dp x tp`` mesh. Returns the losses and the full parameters
    (``full_tensor()``: a collective, so every rank calls it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    # Every rank checks before its first collective (the mesh's own set-up is one).
    _check_args(cfg, dp, tp, steps, batch, seq, lr, seed)
    if world_size != dp * tp:
        raise ValueError(f"world_size={world_size} must equal dp * tp = {dp * tp}")
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = GPT(cfg, dtype=torch.float64)
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(),
            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    if cfg.mlp == "swiglu":
        plan["mlp.gate"] = ColwiseParallel()
    if tp > 1:
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
            block.attn.n_heads = cfg.n_heads // tp
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    me = mesh.get_coordinate()[0]
    local = batch // dp
    losses = []
    for idx, tgt in train_batches(steps, batch, seq, seed):
        opt.zero_grad()
        loss = model(idx[me * local:(me + 1) * local], tgt[me * local:(me + 1) * local])[1]
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(float(total) / world_size)  # tp ranks hold the same loss: mean over all
    # Gathering a (dp, tp)-sharded DTensor logs a performance note per rank: not our concern
    # for a one-off read of the result.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return {"loss": losses,
            "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}}


def torch_mesh_train(cfg: GPTConfig, dp: int, tp: int, *, steps: int = 3, batch: int = 8,
                     seq: int = 16, lr: float = 1e-2, seed: int = 0,
                     timeout: float = 60) -> list[dict]:
    """Run :func:`torch_mesh_worker` on ``dp * tp`` gloo ranks; one dict per rank."""
    from parlearn.distributed import run

    _check_args(cfg, dp, tp, steps, batch, seq, lr, seed)
    return run(torch_mesh_worker, dp * tp, backend="gloo", timeout=timeout,
               args=(cfg, dp, tp, steps, batch, seq, lr, seed))
