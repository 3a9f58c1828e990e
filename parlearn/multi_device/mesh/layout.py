"""Where each rank sits on an n-D mesh, and which ranks talk over each axis.

A mesh of ``pp x dp x tp`` ranks is numbered with ``tp`` fastest, then ``dp``, then ``pp``
(torchtitan's order of mesh dimensions, ``["pp", "dp", "tp"]`` here):

    rank = (pp_i * dp + dp_i) * tp + tp_i

so the ranks of one tensor-parallel group are neighbours: on a real cluster they share a
node and its NVLink, which TP needs because it communicates inside every layer. Data
parallelism communicates once per step (its gradients can wait for the whole backward)
and pipeline parallelism only sends activations between neighbouring stages, so both
tolerate the slower links between nodes. The order of the axes is a statement about
bandwidth: the most talkative axis innermost.
"""

from __future__ import annotations

from dataclasses import dataclass

from parlearn.core.checks import check_int

__all__ = ["AXES", "MeshShape"]

AXES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class MeshShape:
    """``dp`` data-parallel replicas x ``tp`` tensor-parallel shards x ``pp`` pipeline
    stages; ``world == dp * tp * pp`` ranks."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            check_int(name, getattr(self, name), lo=1)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def dims(self) -> tuple[int, int, int]:
        """Sizes in mesh order (:data:`AXES`)."""
        return self.pp, self.dp, self.tp

    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp": stage, "dp": replica, "tp": shard}`` of ``rank``."""
        rank = check_int("rank", rank, lo=0, hi=self.world - 1)
        return {"pp": rank // (self.dp * self.tp), "dp": rank // self.tp % self.dp,
                "tp": rank % self.tp}

    def rank(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        """The rank at mesh coordinates ``(pp, dp, tp)``."""
        pp = check_int("pp", pp, lo=0, hi=self.pp - 1)
        dp = check_int("dp", dp, lo=0, hi=self.dp - 1)
        tp = check_int("tp", tp, lo=0, hi=self.tp - 1)
        return (pp * self.dp + dp) * self.tp + tp

    def groups(self, axis: str) -> list[list[int]]:
        """The groups of ranks that communicate along ``axis`` ("pp", "dp", "tp" or
        "embedding": the first and last stage of each pipeline, which hold the two copies
        of a tied embedding)."""
        if axis not in (*AXES, "embedding"):
            raise ValueError(f"axis must be one of {(*AXES, 'embedding')}, got {axis!r}")
        P, D, T = range(self.pp), range(self.dp), range(self.tp)
        if axis == "tp":
            return [[self.rank(s, d, t) for t in T] for s in P for d in D]
        if axis == "dp":
            return [[self.rank(s, d, t) for d in D] for s in P for t in T]
        if axis == "pp":
            return [[self.rank(s, d, t) for s in P] for d in D for t in T]
        return [sorted({self.rank(0, d, t), self.rank(self.pp - 1, d, t)}) for d in D for t in T]

    def __str__(self) -> str:
        return f"dp={self.dp} x tp={self.tp} x pp={self.pp}"
