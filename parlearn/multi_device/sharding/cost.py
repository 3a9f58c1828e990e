"""The memory and communication models of ZeRO (modeled): bytes held and bytes sent.

:func:`memory_model` is the bytes-per-parameter calculator of the Ultra-Scale Playbook and
of the ZeRO paper; :func:`comm_model` the bytes each stage sends; :func:`gpus_needed` the
fewest ranks a model fits on; :func:`ledger_wire_bytes` the same ring bytes for what the
collectives ledger recorded; :func:`draw_stages` the picture of what each rank holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from parlearn.core.checks import check_choice, check_float, check_int
from parlearn.multi_device.sharding.zero import STAGES

__all__ = ["PRECISIONS", "memory_model", "comm_model", "gpus_needed", "ledger_wire_bytes",
           "draw_stages"]


# Bytes per parameter held for (parameters, gradients, optimizer state) with Adam.
# "bf16-mixed" is the ZeRO paper's mixed precision: bf16/fp16 parameters and gradients,
# and an fp32 master copy plus fp32 Adam moments in the optimizer (K = 12).
PRECISIONS: dict[str, tuple[int, int, int]] = {
    "fp64": (8, 8, 16),
    "fp32": (4, 4, 8),
    "bf16-mixed": (2, 2, 12),
}


# ---------------------------------------------------------------------------------------------
# The memory and communication models
# ---------------------------------------------------------------------------------------------

def memory_model(n_params: int, world_size: int, stage: int,
                 precision: str = "bf16-mixed") -> dict[str, float]:
    """Modeled bytes per rank of parameters, gradients and Adam state (no activations).

    With ``(p, g, k)`` bytes per parameter from :data:`PRECISIONS` and ``Psi`` parameters
    (ZeRO paper, Fig. 1; Ultra-Scale Playbook, "ZeRO"):
    stage 0: ``(p + g + k) Psi``; stage 1: ``(p + g) Psi + k Psi / N``;
    stage 2: ``p Psi + (g + k) Psi / N``; stage 3: ``(p + g + k) Psi / N``.
    Returns ``{"params", "grads", "optimizer", "total"}`` in bytes.
    """
    check_int("n_params", n_params, lo=0)
    n = check_int("world_size", world_size, lo=1)
    check_choice("stage", stage, STAGES)
    p, g, k = PRECISIONS[check_choice("precision", precision, tuple(PRECISIONS))]
    out = {"params": p * n_params / (n if stage >= 3 else 1),
           "grads": g * n_params / (n if stage >= 2 else 1),
           "optimizer": k * n_params / (n if stage >= 1 else 1)}
    out["total"] = sum(out.values())
    return out


def comm_model(n_params: int, world_size: int, stage: int,
               bytes_per_element: int = 2) -> dict[str, float]:
    """Modeled bytes each rank sends per step in a ring, by collective.

    A ring all-reduce of ``B`` bytes sends ``2 (N-1)/N B`` per rank; reduce-scatter and
    all-gather ``(N-1)/N B`` each. Stage 0 all-reduces the gradient; stages 1-2 reduce-scatter
    it and all-gather the parameters (the same total); stage 3 all-gathers the parameters
    twice (forward and backward) and reduce-scatters the gradient: 1.5x (ZeRO paper, Sec. 7).
    """
    check_int("n_params", n_params, lo=0)
    n = check_int("world_size", world_size, lo=1)
    check_choice("stage", stage, STAGES)
    b = check_int("bytes_per_element", bytes_per_element, lo=1) * n_params * (n - 1) / n
    if stage == 0:
        return {"all_reduce": 2 * b, "total": 2 * b}
    gathers = 2 if stage == 3 else 1
    return {"reduce_scatter": b, "all_gather": gathers * b, "total": (1 + gathers) * b}


def gpus_needed(n_params: int, gpu_bytes: float, stage: int,
                precision: str = "bf16-mixed", *, max_gpus: int = 1 << 20) -> int | None:
    """The fewest ranks at which :func:`memory_model` fits in ``gpu_bytes`` (None: never)."""
    check_int("n_params", n_params, lo=0)
    check_float("gpu_bytes", gpu_bytes, lo=0, lo_open=True)
    check_choice("stage", stage, STAGES)
    check_choice("precision", precision, tuple(PRECISIONS))
    for n in range(1, check_int("max_gpus", max_gpus, lo=1) + 1):
        if memory_model(n_params, n, stage, precision)["total"] <= gpu_bytes:
            return n
        if stage == 0:
            return None          # nothing is sharded: more ranks never help
    return None


def ledger_wire_bytes(records: Sequence[tuple[str, int]], world_size: int) -> float:
    """Ring bytes sent per rank for ``(kind, payload)`` records (:func:`dist.ring_bytes`)."""
    from parlearn import distributed as dist

    world_size = check_int("world_size", world_size, lo=1)
    if isinstance(records, str) or not isinstance(records, Sequence):
        raise TypeError(f"records must be a sequence of (kind, payload bytes), got {records!r}")
    pairs = []
    for i, rec in enumerate(records):
        if not isinstance(rec, tuple | list) or len(rec) != 2:
            raise TypeError(f"records[{i}] must be a (kind, payload bytes) pair, got {rec!r}")
        # ring_bytes names its own arguments; say which record held the bad one
        pairs.append((check_choice(f"records[{i}] kind", rec[0], dist.KINDS),
                      check_int(f"records[{i}] payload", rec[1], lo=0)))
    return sum(dist.ring_bytes(kind, nbytes, world_size) for kind, nbytes in pairs)


def draw_stages(axes, world_size: int = 4) -> None:
    """Draw what each rank holds in stages 0-3: one panel per stage, one row per rank.

    Each row has three boxes (parameters, gradients, Adam state) of widths 2 : 2 : 12 (the
    ZeRO paper's bf16-mixed bytes per parameter); the filled part is what this rank keeps,
    split into N slices so the shard it owns shows where it sits.
    """
    from matplotlib.patches import Rectangle

    n = check_int("world_size", world_size, lo=1)
    if len(axes) != len(STAGES):
        raise ValueError(f"axes must hold {len(STAGES)} axes, one per stage, got {len(axes)}")
    widths = PRECISIONS["bf16-mixed"]
    colors = ("C0", "C1", "C2")
    names = ("params", "grads", "Adam state")
    for stage, ax in zip(STAGES, axes, strict=True):
        sharded = (stage >= 3, stage >= 2, stage >= 1)
        for r in range(n):
            x = 0.0
            for w, c, full in zip(widths, colors, (not s for s in sharded), strict=True):
                ax.add_patch(Rectangle((x, r), w, 0.8, fill=False, edgecolor="gray"))
                lo, width = (x, w) if full else (x + w * r / n, w / n)
                ax.add_patch(Rectangle((lo, r), width, 0.8, color=c, alpha=0.8))
                x += w + 0.5
        ax.set(xlim=(0, sum(widths) + 1.5), ylim=(n, -0.2), xticks=[], yticks=
               [r + 0.4 for r in range(n)], yticklabels=[f"rank {r}" for r in range(n)])
        total = memory_model(1, n, stage)["total"]
        ax.set_title(f"stage {stage}: {total:.3g} B/param per rank (N={n})", fontsize=10)
    for w, c, name in zip(widths, colors, names, strict=True):
        axes[-1].bar(0, 0, color=c, label=f"{name} ({w} B/param)")
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize="small")
