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

__all__ = ["AXES", "MeshShape", "draw_mesh"]

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


def draw_mesh(shape: MeshShape, axes) -> None:
    """Draw the ranks of ``shape`` as a grid (rows: pipeline stages; columns: dp replica,
    then tp shard), once per axis on ``axes`` (three matplotlib axes), with each of that
    axis's groups in its own colour."""
    if not isinstance(shape, MeshShape):
        raise TypeError(f"shape must be a MeshShape, got {type(shape).__name__}")
    if len(axes) != 3:
        raise ValueError(f"axes must hold 3 matplotlib axes (tp, dp, pp), got {len(axes)}")
    cols = shape.dp * shape.tp
    for ax, axis in zip(axes, ("tp", "dp", "pp"), strict=True):
        for colour, group in enumerate(shape.groups(axis)):
            for r in group:
                c = shape.coords(r)
                x, y = c["dp"] * shape.tp + c["tp"], c["pp"]
                ax.add_patch(_rect(x, y, f"C{colour % 10}"))
                ax.text(x + 0.5, y + 0.5, str(r), ha="center", va="center", color="white",
                        fontsize=11, fontweight="bold")
        ax.set(xlim=(0, cols), ylim=(shape.pp, 0), xticks=[i + 0.5 for i in range(cols)],
               yticks=[i + 0.5 for i in range(shape.pp)], aspect="equal",
               title=f"{axis} groups ({len(shape.groups(axis))})")
        ax.set_xticklabels([f"dp{d}\ntp{t}" for d in range(shape.dp) for t in range(shape.tp)],
                           fontsize=8)
        ax.set_yticklabels([f"stage {s}" for s in range(shape.pp)], fontsize=8)


def _rect(x: float, y: float, colour: str):
    from matplotlib.patches import Rectangle

    return Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, color=colour)
