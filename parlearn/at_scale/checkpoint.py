"""Sharded checkpoints that reshard: the mesh trainer saved with ``torch.distributed.checkpoint``.

    ckpt.save(me, "run/step_000004")      # on every rank of a (pp, dp, tp) mesh
    ckpt.load(me, "run/step_000004")      # on every rank of ANOTHER mesh, or one process
    ckpt.load_full("run/step_000004")     # in one process, no group: whole tensors

Each rank of :class:`parlearn.mesh.MeshRank` holds a piece of the model: a pipeline stage's
blocks, each linear cut along the dim tensor parallelism splits, the same piece on every
dp replica. :func:`state` describes that piece to torch's distributed checkpoint (DCP) as
``DTensor`` s on the rank's own ``(dp, tp)`` sub-mesh: ``Shard(dim)`` along tp for a cut
weight, ``Replicate()`` along dp (and along tp for the rest). DCP then writes every chunk
once (a replicated chunk by one of its holders), records each chunk's global offset in
``.metadata``, and on load reads, for whatever layout the loading ranks ask for, the pieces
that overlap it. That is what makes a checkpoint saved on ``dp=4`` loadable on
``dp=2 x tp=2`` or in one process: the files hold global tensors in chunks, not one rank's
buffers.

The optimizer state (Adam's two moments) is saved the same way, per parameter, with the
parameter's placements. :class:`~parlearn.sharding.ShardedAdam` keeps ZeRO-1 moments as a
slice of a flat buffer, which no ``DTensor`` placement describes, so :func:`state` first
all-gathers them over the dp group (``ShardedAdam.state_dict``): one extra all-gather of
the moments per save, in exchange for a checkpoint any mesh can read. A run with the whole
recipe (AdamW in :class:`~parlearn.sharding.ShardedOptimizer`) keeps each tensor's moments
on one dp owner; they are broadcast from it (``MeshRank.optimizer_state``), and on load the
schedule resumes at the saved step. The step count is
saved too; the data order needs nothing more, because each step's batch is drawn from
the seed and the step number alone.

A checkpoint is complete once ``.metadata`` exists: DCP's coordinator writes it after
every rank's data, so a job killed mid-save leaves a folder :func:`latest` skips.

Modeled size: ``3 x 8 x N`` bytes for N float64 parameters (weights and two moments), plus
DCP's metadata; :func:`save` reports the measured bytes and seconds beside it.
"""

from __future__ import annotations

import os
import re
import time
import warnings

import torch
import torch.distributed as tdist

from parlearn.core.checks import check_int

__all__ = ["state", "save", "load", "load_full", "latest", "step_dir", "modeled_bytes"]

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def _check_rank(me) -> None:
    from parlearn.multi_device.mesh import MeshRank

    if not isinstance(me, MeshRank):
        raise TypeError(f"me must be a parlearn.mesh.MeshRank, got {type(me).__name__}")


def _check_dir(name: str, directory) -> str:
    if not isinstance(directory, str | os.PathLike) or not str(directory):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {directory!r}")
    return str(directory)


def _metadata(directory: str):
    """The tensors' metadata of the complete checkpoint in ``directory`` (refused when
    there is none: no ``.metadata``, so no save, or one cut short)."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise ValueError(f"directory={directory!r} holds no complete checkpoint "
                         "(no .metadata)")
    return dcp.FileSystemReader(directory).read_metadata().state_dict_metadata


def _placements(name: str, tp: int):
    from torch.distributed.tensor import Replicate, Shard

    from parlearn.multi_device.mesh.stage import shard_dim

    dim = shard_dim(name)
    return [Replicate(), Replicate() if dim is None or tp == 1 else Shard(dim)]


def state(me) -> dict:
    """This rank's state for DCP: ``model.<name>``, ``optim.<name>.exp_avg`` and
    ``optim.<name>.exp_avg_sq`` as DTensors on the rank's ``(dp, tp)`` sub-mesh (copies,
    not the live tensors), and ``step``. Collective over the dp group (the moments'
    all-gather): call it on every rank."""
    from torch.distributed.tensor import DTensor

    _check_rank(me)
    sub, tp = me.mesh["dp", "tp"], me.shape.tp
    out: dict = {}

    def put(key: str, name: str, local: torch.Tensor) -> None:
        out[key] = DTensor.from_local(local.detach().clone(), sub, _placements(name, tp),
                                      run_check=False)

    for name, p in me.model.named_parameters():
        put(f"model.{name}", name, p)
    opt = me.optimizer_state()
    for name, moments in opt["state"].items():
        for key, t in moments.items():
            put(f"optim.{name}.{key}", name, t)
    out["step"] = torch.tensor(opt["step"], dtype=torch.int64)
    return out


def modeled_bytes(me) -> int:
    """The checkpoint's modeled payload: every parameter of the WHOLE model (all stages, all
    tp shards, once) and its two Adam moments, at the parameters' element size, plus the
    8-byte step. Local; no message."""
    from parlearn.multi_device.transformer.model import count_params

    _check_rank(me)
    # The mesh trains in float64; count_params counts the tied weight once.
    return 3 * 8 * count_params(me.cfg)["total"] + 8


def save(me, directory) -> dict:
    """Save ``me``'s share of the run into ``directory`` (every rank calls it, with the same
    path). Returns ``{"seconds": wall time of the save on this rank, "bytes": bytes of the
    files in the folder (read after every rank has written), "modeled": modeled_bytes}``."""
    import torch.distributed.checkpoint as dcp

    _check_rank(me)
    directory = _check_dir("directory", directory)
    t0 = time.perf_counter()
    sd = state(me)
    dcp.save(sd, checkpoint_id=directory)
    seconds = time.perf_counter() - t0
    tdist.barrier()
    written = sum(e.stat().st_size for e in os.scandir(directory) if e.is_file())
    return {"seconds": seconds, "bytes": written, "modeled": modeled_bytes(me)}


@torch.no_grad()
def load(me, directory) -> int:
    """Load a checkpoint saved by :func:`save` from ANY mesh into ``me`` (every rank calls
    it): parameters, Adam moments (each rank keeps its ZeRO shard) and the step count,
    which it returns. Refuses a checkpoint of another model (a missing or differently
    shaped tensor) on every rank before changing anything."""
    import torch.distributed.checkpoint as dcp

    _check_rank(me)
    directory = _check_dir("directory", directory)
    meta = _metadata(directory)
    sd = state(me)
    for key, value in sd.items():
        want = tuple(value.shape)
        have = getattr(meta.get(key), "size", None)
        if key != "step" and (have is None or tuple(have) != want):
            raise ValueError(f"directory={directory!r} does not fit this model: {key} has "
                             f"shape {None if have is None else tuple(have)} there, {want} here")
    dcp.load(sd, checkpoint_id=directory)
    for name, p in me.model.named_parameters():
        p.copy_(sd[f"model.{name}"].to_local())
    names = [k[len("optim."):-len(".exp_avg")] for k in sd
             if k.startswith("optim.") and k.endswith(".exp_avg")]
    me.load_optimizer_state({"step": int(sd["step"]), "state": {
        n: {k: sd[f"optim.{n}.{k}"].to_local() for k in ("exp_avg", "exp_avg_sq")}
        for n in names}})
    return int(sd["step"])


def load_full(directory) -> dict:
    """Read a checkpoint in ONE process (no process group) as whole tensors:
    ``{"step": n, "params": {name: t}, "exp_avg": {name: t}, "exp_avg_sq": {name: t}}``,
    whatever mesh saved it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    directory = _check_dir("directory", directory)
    meta = _metadata(directory)
    sd = {k: torch.zeros(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()
          if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():   # DCP warns that there is no group: that is the point
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(sd, checkpoint_id=directory, no_dist=True)
    out: dict = {"step": int(sd.pop("step")), "params": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for key, t in sd.items():
        if key.startswith("model."):
            out["params"][key[len("model."):]] = t
        else:
            name, moment = key[len("optim."):].rsplit(".", 1)
            out[moment][name] = t
    return out


def step_dir(root, step: int) -> str:
    """``root/step_000042``: where the checkpoint after ``step`` steps lives."""
    root = _check_dir("root", root)
    step = check_int("step", step, lo=0)
    return os.path.join(root, f"step_{step:06d}")


def latest(root) -> tuple[int, str] | None:
    """The newest COMPLETE checkpoint under ``root`` as ``(step, path)``; None when there is
    none (or no ``root``). A folder without ``.metadata`` (a save cut short) is skipped."""
    root = _check_dir("root", root)
    if not os.path.isdir(root):
        return None
    found = []
    for entry in os.scandir(root):
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir() and os.path.isfile(os.path.join(entry.path, ".metadata")):
            found.append((int(m.group(1)), entry.path))
    return max(found) if found else None
