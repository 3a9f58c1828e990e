"""Which parallelism for this model on this cluster? Enumerate, predict, rank (modeled).

A :class:`Plan` is one point of the space ``(dp, tp, pp, cp, zero stage, recompute,
micro-batch size)`` with ``dp tp pp cp`` equal to the GPU count. :func:`predict` gives
its per-GPU memory and step time from a workload (what is trained) and a cluster (what it
runs on: a hardware card per node, :mod:`parlearn.card`, and one for the links between
nodes). Every term is a formula, labelled modeled:

- **compute**: ``3 F`` per step for forward and backward, ``F`` the forward FLOPs of the
  global batch (``2 N + 4 L s h`` per token), plus what recomputation repeats (full: ``F``;
  selective: the attention core's ``4 L s h`` per token), split evenly over the GPUs, at
  the card's matmul rate for the workload's dtype times the cluster's ``efficiency``, the
  fraction of that rate a training step's kernels sustain (default: 0.6 of a preset
  card's datasheet PEAK, 1 for a measured card, whose rate is already sustained);
- **pipeline bubble**: the 1F1B makespan stretches each stage's work by ``(M + P - 1) / M``
  for ``M`` micro-batches (:func:`parlearn.pipeline.bubble_formula`, which the simulator
  reproduces for equal stages);
- **TP** (with SP): per layer and micro-batch, 2 all-gathers and 2 reduce-scatters of the
  ``b s h`` activation forward and the same backward (bytes of an all-reduce each pair);
- **CP**: ring attention passes every rank's K and V around the ring, ``cp - 1`` hops per
  layer and micro-batch forward and twice that backward;
- **PP**: one activation forward and one gradient backward per micro-batch and stage;
- **DP**: the gradients' reduce-scatter and the parameters' all-gather per step (the
  bytes of one all-reduce; ZeRO-3 gathers the parameters again for backward: 1.5x) over
  the ``dp cp`` ranks that hold the same shard;

communication is not overlapped with compute (the model is pessimistic where a real
framework overlaps DP's reduce-scatter with backward), and a group uses the inter-node
links as soon as it spans nodes, and so does every hop of a CP ring or a PP chain whose
members span nodes, its slowest hop setting the pace (ranks are numbered tp fastest, then
cp, dp, pp). MFU is ``3 F`` over the step time and the GPUs' datasheet rate (not the
achievable one), the same units as the measured MFU of :data:`MEASURED_MFU`: with no
communication it equals ``efficiency``. Memory
comes from :func:`parlearn.memory.estimate` (Llama shapes) or from the exact count of what
:mod:`parlearn.mesh.composed` keeps (the tiny GPT, :class:`TinyGPT`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from parlearn.core.checks import check_bool, check_choice, check_float, check_int
from parlearn.multi_device.memory.calculator import PRESETS, LlamaShape, estimate
from parlearn.multi_device.pipeline.schedules import bubble_formula
from parlearn.multi_device.transformer.model import GPTConfig, count_params
from parlearn.multi_device.transformer.train import flops_per_token

__all__ = ["Plan", "Cluster", "Prediction", "LlamaWorkload", "TinyGPT", "plans", "predict",
           "rank_plans", "MEASURED_MFU", "PEAK_EFFICIENCY"]

RECOMPUTE = ("none", "selective", "full")

# The fraction of a datasheet peak a training step's kernels are assumed to sustain when
# the card is a preset (Card.measured False). An ASSUMPTION, not a measurement: a step's
# large matmuls run below peak and its attention, norms and small kernels further below;
# the whole-run MFU of MEASURED_MFU (0.38-0.52) also pays for communication and bubbles,
# so the compute alone must run above it. Set Cluster(efficiency=) from a measured large
# matmul where you have one.
PEAK_EFFICIENCY = 0.6

# Published measured MFU of real runs, as anchors to print beside modeled picks (not inputs).
MEASURED_MFU = [
    {"run": "Llama 3 405B pre-training, 8,192-16,384 H100s, BF16 (TP 8, PP 16, CP 1-16)",
     "mfu": (0.38, 0.43),
     "source": "Llama Team, 'The Llama 3 Herd of Models', arXiv:2407.21783 (2024), table 4"},
    {"run": "Megatron-LM, 1T-parameter GPT on 3,072 A100s (PTD-P)", "mfu": (0.52, 0.52),
     "source": "Narayanan et al., SC 2021, arXiv:2104.04473 (163 of 312 TFLOP/s per GPU)"},
]


@dataclass(frozen=True)
class Plan:
    """One configuration; ``micro_batch`` sequences per micro-batch per replica."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 1
    recompute: str = "none"
    micro_batch: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "micro_batch"):
            check_int(name, getattr(self, name), lo=1)
        check_choice("zero", self.zero, (0, 1, 2, 3))
        check_choice("recompute", self.recompute, RECOMPUTE)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def __str__(self) -> str:
        return (f"dp{self.dp} tp{self.tp} pp{self.pp} cp{self.cp} zero{self.zero} "
                f"{self.recompute} mb{self.micro_batch}")


@dataclass(frozen=True)
class Cluster:
    """``card`` describes one node (its devices, FLOP/s, memory and intra-node links);
    ``inter`` the links between nodes (None: one node, and a plan on more than
    ``gpus_per_node`` GPUs is refused); ``gpus_per_node`` how many devices share the node's
    links; ``share`` the compute each rank gets, as a fraction in (0, 1] of one device (CPU
    ranks outnumbering the cores); ``efficiency`` the fraction in (0, 1] of the card's
    FLOP/s a training step sustains (None: :data:`PEAK_EFFICIENCY` = 0.6 for a card of
    datasheet peaks, ``card.measured`` False; 1 for a measured card)."""

    card: object
    gpus_per_node: int = 8
    inter: object | None = None
    share: float = 1.0
    efficiency: float | None = None

    def __post_init__(self) -> None:
        for attr in ("comm_time", "compute_time", "flops", "memory"):
            if not hasattr(self.card, attr):
                raise TypeError(f"card must be a parlearn.card.Card (with {attr}), got "
                                f"{type(self.card).__name__}")
        if self.inter is not None and not hasattr(self.inter, "comm_time"):
            raise TypeError(f"inter must be a parlearn.card.Card or None, got "
                            f"{type(self.inter).__name__}")
        check_int("gpus_per_node", self.gpus_per_node, lo=1)
        check_float("share", self.share, lo=0, hi=1, lo_open=True)
        if self.efficiency is not None:
            check_float("efficiency", self.efficiency, lo=0, hi=1, lo_open=True)

    @property
    def sustained(self) -> float:
        """The fraction of the card's FLOP/s the model charges compute at (``efficiency``,
        or its default)."""
        if self.efficiency is not None:
            return self.efficiency
        return 1.0 if getattr(self.card, "measured", False) else PEAK_EFFICIENCY

    def link(self, kind: str, nbytes: float, group: int, span: int, *,
             extent: int | None = None) -> float:
        """Seconds of one collective over ``group`` ranks whose ranks lie ``span`` apart.
        ``extent``: for one hop (``group=2``) of a ring or chain, how many members that
        ring or chain has (default ``group``): when they span nodes, the hop is priced on
        the inter-node link, since the slowest hop sets every hop's pace."""
        if group <= 1:
            return 0.0
        members = group if extent is None else extent
        card = self.card if self.inter is None or members * span <= self.gpus_per_node \
            else self.inter
        return card.comm_time(kind, nbytes, group)


@dataclass
class Prediction:
    plan: Plan
    memory: dict[str, float]
    time: dict[str, float]
    fits: bool
    mfu: float

    @property
    def step_s(self) -> float:
        return self.time["total"]


# ---------------------------------------------------------------------------------------
# Workloads: what is trained.

@dataclass(frozen=True)
class LlamaWorkload:
    """A Llama-shaped model (:data:`parlearn.memory.PRESETS`), ``batch`` sequences of
    ``seq`` tokens per step (global), bf16 mixed precision."""

    model: LlamaShape | str
    batch: int
    seq: int
    dtype: str = "bfloat16"
    elem: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.model, LlamaShape):
            check_choice("model", self.model, tuple(PRESETS))
        check_int("batch", self.batch, lo=1)
        check_int("seq", self.seq, lo=1)
        if not isinstance(self.dtype, str):
            raise TypeError(f"dtype must be a str naming a card's rate, got {self.dtype!r}")
        check_int("elem", self.elem, lo=1)

    def shape(self) -> LlamaShape:
        return PRESETS[self.model] if isinstance(self.model, str) else self.model

    @property
    def layers(self) -> int:
        return self.shape().layers

    @property
    def hidden(self) -> int:
        return self.shape().hidden

    def forward_flops(self) -> float:
        """Model FLOPs of one forward: ``2 N`` per token for the matmul parameters (not the
        embedding lookup nor the norms: :meth:`LlamaShape.matmul_params`) plus attention
        ``4 L s h`` (scores and values over all ``s`` keys: PaLM's convention, Chowdhery et
        al. 2022, appendix B), as :func:`parlearn.mfu.flop_count` counts with
        ``attention="full"``."""
        m = self.shape()
        return self.batch * self.seq * (2 * m.matmul_params()
                                        + 4 * m.layers * self.seq * m.hidden)

    def attention_flops(self) -> float:
        m = self.shape()
        return self.batch * self.seq * 4 * m.layers * self.seq * m.hidden

    def params(self) -> int:
        return self.shape().n_params()

    def memory(self, plan: Plan) -> dict[str, float]:
        return estimate(self.shape(), plan.micro_batch, self.seq, zero_stage=plan.zero,
                        dp=plan.dp * plan.cp, tp=plan.tp, pp=plan.pp, cp=plan.cp,
                        recompute=plan.recompute,
                        micro_batches=self.batch // (plan.dp * plan.micro_batch))

    def kv_bytes(self, plan: Plan) -> float:
        m = self.shape()
        return 2 * plan.micro_batch * self.seq / plan.cp * m.kv_heads * m.head_dim * self.elem

    def check(self, plan: Plan) -> str | None:
        m = self.shape()
        if m.heads % plan.tp or m.kv_heads % plan.tp:
            return f"tp={plan.tp} must divide heads={m.heads} and kv_heads={m.kv_heads}"
        if m.layers % plan.pp:
            return f"pp={plan.pp} must divide layers={m.layers}"
        if self.seq % plan.cp:
            return f"cp={plan.cp} must divide seq={self.seq}"
        if self.batch % (plan.dp * plan.micro_batch):
            return (f"batch={self.batch} must divide into dp={plan.dp} x micro_batch="
                    f"{plan.micro_batch}")
        return None


@dataclass(frozen=True)
class TinyGPT:
    """The tiny GPT as :mod:`parlearn.mesh.composed` trains it: float64, Adam, SP on,
    ZeRO 0/1, recompute none/full, no CP. Memory is its exact count (tested equal to the
    bytes the ranks hold and the saved-tensor hooks see)."""

    cfg: GPTConfig
    batch: int
    seq: int
    dtype: str = "float64"
    elem: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.cfg, GPTConfig):
            raise TypeError(f"cfg must be a GPTConfig, got {type(self.cfg).__name__}")
        check_int("batch", self.batch, lo=1)
        check_int("seq", self.seq, lo=1, hi=self.cfg.max_seq)
        # The composed mesh trains in float64 and the memory count is of float64 tensors.
        check_choice("dtype", self.dtype, ("float64",))
        check_choice("elem", self.elem, (8,))

    @property
    def layers(self) -> int:
        return self.cfg.n_layers

    @property
    def hidden(self) -> int:
        return self.cfg.d_model

    def forward_flops(self) -> float:
        return self.batch * self.seq * flops_per_token(self.cfg, self.seq, backward=False)

    def attention_flops(self) -> float:
        return self.batch * self.seq * 4 * self.cfg.n_layers * self.seq * self.cfg.d_model

    def params(self) -> int:
        return count_params(self.cfg)["total"]

    def check(self, plan: Plan) -> str | None:
        c = self.cfg
        if plan.cp != 1 or plan.zero > 1 or plan.recompute == "selective":
            return "the composed mesh runs cp=1, zero 0/1 and recompute none/full"
        if c.n_layers % plan.pp:
            return f"pp={plan.pp} must divide n_layers={c.n_layers}"
        if c.n_heads % plan.tp or c.ff % plan.tp or self.seq % plan.tp:
            return f"tp={plan.tp} must divide n_heads, the MLP width and seq"
        if self.batch % (plan.dp * plan.micro_batch):
            return (f"batch={self.batch} must divide into dp={plan.dp} x micro_batch="
                    f"{plan.micro_batch}")
        return None

    def units(self, plan: Plan, stage: int) -> list[int]:
        """Parameter counts of the modules that own parameters on ``stage`` (one TP shard):
        ShardedAdam keeps one flat buffer per such module."""
        c, t = self.cfg, plan.tp
        h, f = c.d_model, c.ff
        first, last = stage == 0, stage == plan.pp - 1
        out = [c.vocab_size * h] if first or last else []
        if first and c.pos == "learned":
            out.append(c.max_seq * h)
        block = [2 * h, h * h // t, h * h // t, h * h // t, h * h // t, 2 * h]  # ln1 q k v o ln2
        block += [h * f // t] * (3 if c.mlp == "swiglu" else 2)
        out += block * (c.n_layers // plan.pp)
        if last:
            out.append(2 * h)
        return out

    def states(self, plan: Plan, stage: int) -> dict[str, float]:
        """Bytes ShardedAdam holds on ``stage``: every unit padded to a multiple of dp."""
        padded = sum(math.ceil(n / plan.dp) * plan.dp for n in self.units(plan, stage))
        moments = padded if plan.zero == 0 else padded // plan.dp
        return {"params": 8 * padded, "grads": 8 * padded, "optimizer": 16 * moments}

    def activations(self, plan: Plan, stage: int) -> float:
        """Bytes autograd saves for one micro-batch on ``stage`` (float64), term by term:
        per block the input and LayerNorm statistics on this rank's ``s/tp`` tokens
        (twice), the gathered LayerNorm outputs (``b s h`` each), q and k after RoPE, v
        and the attention output (``b s h / tp`` each), the softmax (``a/tp b s^2``), the
        MLP's hidden activations (GELU: 2, SwiGLU: 4 of ``b s f / tp``); full recompute
        keeps only each block's input. The last stage adds ln_f and the loss's terms."""
        c, t, b, s = self.cfg, plan.tp, plan.micro_batch, self.seq
        h, a, f, V = c.d_model, c.n_heads, c.ff, c.vocab_size
        sl = s // t
        if plan.recompute == "full":
            block = b * sl * h
        else:
            hidden = (4 if c.mlp == "swiglu" else 2) * b * s * f // t
            block = (2 * (b * sl * h + 2 * b * sl) + 2 * b * s * h + 4 * b * s * h // t
                     + a // t * b * s * s + hidden)
        out = block * (c.n_layers // plan.pp)
        if stage == plan.pp - 1:
            out += b * sl * h + 2 * b * sl + b * sl * h + b * sl * V + 1
        return 8 * out

    def in_flight(self, plan: Plan, stage: int) -> int:
        return min(plan.pp - stage, self.batch // (plan.dp * plan.micro_batch))

    def memory(self, plan: Plan) -> dict[str, float]:
        """The rank with the most bytes: per stage, states plus in-flight activations."""
        best: dict[str, float] = {}
        for stage in range(plan.pp):
            m = self.states(plan, stage)
            m["activations"] = self.in_flight(plan, stage) * self.activations(plan, stage)
            m["total"] = sum(m.values())
            if not best or m["total"] > best["total"]:
                best = m
        return best

    def kv_bytes(self, plan: Plan) -> float:
        return 0.0


# ---------------------------------------------------------------------------------------
# The space, the prediction, the ranking.

def _check_workload(workload) -> None:
    if not isinstance(workload, LlamaWorkload | TinyGPT):
        raise TypeError(f"workload must be a LlamaWorkload or TinyGPT, got "
                        f"{type(workload).__name__}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nonempty(name: str, values, check) -> list:
    """A non-empty list or tuple of values, each checked."""
    if isinstance(values, str) or not isinstance(values, list | tuple) or not values:
        raise TypeError(f"{name} must be a non-empty list or tuple, got {values!r}")
    return [check(v) for v in values]


def plans(workload, gpus: int, *, zero=(0, 1, 2, 3), recompute=RECOMPUTE, cp: bool = True,
          micro_batches=None) -> list[Plan]:
    """Every :class:`Plan` on ``gpus`` GPUs that ``workload`` accepts (shapes divide)."""
    _check_workload(workload)
    gpus = check_int("gpus", gpus, lo=1)
    zero = _nonempty("zero", zero, lambda v: check_choice("zero", v, (0, 1, 2, 3)))
    recompute = _nonempty("recompute", recompute,
                          lambda v: check_choice("recompute", v, RECOMPUTE))
    check_bool("cp", cp)
    if micro_batches is not None:
        micro_batches = _nonempty("micro_batches", micro_batches,
                                  lambda v: check_int("micro_batches", v, lo=1))
    out = []
    for tp, pp, c in itertools.product(_divisors(gpus), repeat=3):
        if gpus % (tp * pp * c) or (c > 1 and not cp):
            continue
        dp = gpus // (tp * pp * c)
        sizes = micro_batches or [b for b in _divisors(workload.batch)
                                  if workload.batch % (dp * b) == 0]
        for z, r, b in itertools.product(zero, recompute, sizes):
            plan = Plan(dp, tp, pp, c, z, r, b)
            if workload.check(plan) is None:
                out.append(plan)
    return out


def predict(workload, plan: Plan, cluster: Cluster) -> Prediction:
    """Modeled memory and step time of ``plan`` (module docstring), and its MFU: model
    FLOPs ``3 F`` (recomputation not counted) over the step time and the GPUs' card rate
    (the datasheet's for a preset card, not the ``efficiency`` fraction of it)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a Plan, got {type(plan).__name__}")
    _check_workload(workload)
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    if cluster.inter is None and plan.gpus > cluster.gpus_per_node:
        raise ValueError(f"plan {plan} needs {plan.gpus} GPUs but cluster has one node of "
                         f"gpus_per_node={cluster.gpus_per_node} and no inter-node link "
                         "(give Cluster(inter=...))")
    why = workload.check(plan)
    if why is not None:
        raise ValueError(f"plan {plan} does not fit the workload: {why}")
    card, e = cluster.card, workload.elem
    M = workload.batch // (plan.dp * plan.micro_batch)
    fwd = workload.forward_flops()
    extra = {"none": 0.0, "selective": workload.attention_flops(), "full": fwd}[plan.recompute]
    compute = card.compute_time((3 * fwd + extra) / plan.gpus, workload.dtype) / (
        cluster.share * cluster.sustained)
    act = plan.micro_batch * workload.seq / plan.cp * workload.hidden * e
    per_layer = 2 * (cluster.link("all_gather", act, plan.tp, 1)
                     + cluster.link("reduce_scatter", act, plan.tp, 1))
    tp_time = 2 * per_layer * M * workload.layers / plan.pp
    # A CP ring of cp ranks tp apart, a PP chain of pp stages tp cp dp apart: a hop is
    # priced by the whole ring's (chain's) extent, which decides whether it crosses nodes.
    cp_time = (3 * (plan.cp - 1) * cluster.link("p2p", workload.kv_bytes(plan), 2, plan.tp,
                                                extent=plan.cp)
               * M * workload.layers / plan.pp) if plan.cp > 1 else 0.0
    pp_time = (2 * M * cluster.link("p2p", act / plan.tp, 2, plan.tp * plan.cp * plan.dp,
                                    extent=plan.pp)) if plan.pp > 1 else 0.0
    grads = workload.params() / (plan.tp * plan.pp) * e
    dp_ranks = plan.dp * plan.cp
    dp_time = (cluster.link("reduce_scatter", grads, dp_ranks, plan.tp)
               + cluster.link("all_gather", grads, dp_ranks, plan.tp) * (
                   2 if plan.zero == 3 else 1))
    busy = compute + tp_time + cp_time
    bubble = busy * bubble_formula(plan.pp, M) / (1 - bubble_formula(plan.pp, M))
    time = {"compute": compute, "tp": tp_time, "cp": cp_time, "pp": pp_time, "dp": dp_time,
            "bubble": bubble}
    time["total"] = sum(time.values())
    memory = workload.memory(plan)
    peak = card.flops[workload.dtype] * plan.gpus * cluster.share
    mfu = 3 * fwd / time["total"] / peak
    return Prediction(plan, memory, time, memory["total"] <= card.memory, mfu)


def rank_plans(workload, cluster: Cluster, gpus: int, **space) -> list[Prediction]:
    """:func:`predict` for every plan of :func:`plans`; those that fit first, fastest first
    (ties: least memory first), then those that do not fit, smallest memory first."""
    _check_workload(workload)
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    preds = [predict(workload, p, cluster) for p in plans(workload, gpus, **space)]
    if not preds:
        raise ValueError(f"no plan on gpus={gpus} fits the workload's shapes")
    return sorted(preds, key=lambda p: (not p.fits, p.step_s if p.fits else 0.0,
                                        p.memory["total"]))
