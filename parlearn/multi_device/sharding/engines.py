"""The real engines: ``ZeroRedundancyOptimizer`` (stage 1) and FSDP2 (stage 3).

:func:`train_engine` trains the same :class:`parlearn.multi_device.sharding.training.Spec`
with what a user would deploy, so the from-scratch stages can be checked equal to it and to
the single-process reference. Both engines are imported inside the worker: importing
:mod:`parlearn.sharding` starts neither.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from parlearn.core.checks import check_choice, check_int
from parlearn.multi_device.sharding.training import Spec, _local_batch, _loss, check_spec
from parlearn.multi_device.sharding.zero import storage_bytes

__all__ = ["train_engine"]


# ---------------------------------------------------------------------------------------------
# The real engines, on the same model, data and ranks
# ---------------------------------------------------------------------------------------------

def _worker_engine(rank: int, world_size: int, spec: Spec, engine: str) -> dict:
    """One rank of :func:`train_engine`."""
    model = spec.model()
    if engine == "zero":
        with warnings.catch_warnings():
            # torch's own package import jit-scripts its functional optimizers (torch 2.13).
            warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated",
                                    DeprecationWarning)
            from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                      lr=spec.lr, foreach=False)

        def flat() -> torch.Tensor:
            return nn.utils.parameters_to_vector(model.parameters()).detach().clone()

        def state_numel() -> int:
            return sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel()
                       for s in opt.optim.state.values())
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        net = fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=spec.lr, foreach=False)

        def flat() -> torch.Tensor:
            return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]).detach()

        def state_numel() -> int:
            return sum(s["exp_avg"].to_local().numel() + s["exp_avg_sq"].to_local().numel()
                       for s in opt.state.values())
    from parlearn import distributed as dist

    out: dict = {"params": [flat()], "losses": [], "records": []}
    for step in range(spec.steps):
        x, y = _local_batch(spec, rank, world_size, step)
        with dist.ledger() as led:
            opt.zero_grad()
            loss = _loss(net, x, y)
            loss.backward()
            opt.step()
        out["losses"].append(loss.item())
        out["records"].append([(r.kind, r.bytes) for r in led.records])
        out["params"].append(flat())
    grads = [p.grad for p in model.parameters()]
    moments = [t for s in (opt.optim.state if engine == "zero" else opt.state).values()
               for k, t in s.items() if k != "step"]
    out["held"] = {"params": storage_bytes(list(model.parameters())),
                   "grads": storage_bytes(grads), "optimizer": storage_bytes(moments)}
    out["state_numel"] = state_numel()
    return out


def train_engine(spec: Spec, engine: str, world_size: int = 2, *, timeout: float = 60) -> list:
    """Train ``spec`` with a real engine on ``world_size`` ranks, one dict per rank.

    ``engine="zero"``: DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer`` around
    Adam (stage 1; it assigns whole tensors to ranks, so shards are uneven).
    ``engine="fsdp2"``: ``fully_shard`` on every layer and the root over
    ``init_device_mesh("cpu", (world_size,))`` (stage 3), with plain ``torch.optim.Adam``
    on the sharded DTensor parameters. Keys: ``params``, ``losses``, ``records`` (per step,
    the collectives the ledger saw: FSDP2's all-gathers and reduce-scatters go through
    ``torch.distributed``'s Python API, DDP's gradient all-reduce runs in C++ and is not
    seen), ``held`` (bytes after the last step; Adam's step counters left out) and
    ``state_numel``.
    """
    from parlearn import distributed as dist

    check_spec(spec)
    check_choice("engine", engine, ("zero", "fsdp2"))
    check_int("world_size", world_size, lo=1)
    return dist.run(_worker_engine, world_size, args=(spec, engine), backend="gloo",
                    timeout=timeout)
