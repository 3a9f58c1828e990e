"""Checks on real ranks that expert parallelism equals the single-process MoE (lesson 18).

:func:`layer_check` runs one MoE layer forward and backward on ``world_size`` gloo ranks
(EP x DP when ``ep < world_size``) against :class:`MoE` ``(groups=world_size)`` in one
process, float64, and reads the all-to-all bytes from :func:`parlearn.distributed.ledger`.
:func:`train_check` trains the MoE-GPT a few AdamW steps both ways, step by step. The
functions named ``*_worker`` run on the ranks.
"""

from __future__ import annotations

import copy

import torch

from parlearn.core.checks import check_bool, check_float, check_int
from parlearn.distributed import ledger, run
from parlearn.multi_device.moe.layer import MoE, aux_loss, moe_gpt
from parlearn.multi_device.moe.parallel import (
    ExpertParallelMoE,
    mesh_groups,
    sync_grads,
    to_expert_parallel,
)
from parlearn.multi_device.transformer.model import GPTConfig

__all__ = ["layer_check", "train_check", "layer_worker", "train_worker"]


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


def _layer_spec(world_size: int, ep: int, *, tokens: int, d_model: int, d_ff: int,
                n_experts: int, k: int, capacity_factor: float | None, routing: str,
                empty_expert: bool, balance: float, seed: int) -> dict:
    """The layer the ranks build, checked here first: its arguments are refused before any
    rank starts (and nothing is coerced: empty_expert a bool, balance a number)."""
    world_size = check_int("world_size", world_size, lo=1)
    ep = check_int("ep", ep, lo=1, hi=world_size)
    MoE(d_model, d_ff, n_experts, k, capacity_factor=capacity_factor, routing=routing,
        seed=seed)
    if world_size % ep:
        raise ValueError(f"ep={ep} must divide world_size={world_size}")
    if n_experts % ep:
        raise ValueError(f"n_experts={n_experts} must be divisible by the EP degree ep={ep}")
    return {"tokens": check_int("tokens", tokens, lo=1), "d_model": d_model, "d_ff": d_ff,
            "n_experts": n_experts, "k": k, "capacity_factor": capacity_factor,
            "routing": routing, "empty_expert": check_bool("empty_expert", empty_expert),
            "balance": check_float("balance", balance, lo=0), "seed": seed}


def _train_spec(world_size: int, ep: int, *, steps: int, batch: int, n_experts: int, k: int,
                capacity_factor: float | None, balance: float, lr: float, seed: int,
                cfg: dict | None = None) -> dict:
    """The training run's arguments, checked before any rank starts."""
    world_size = check_int("world_size", world_size, lo=1)
    ep = check_int("ep", ep, lo=1, hi=world_size)
    n_experts = check_int("n_experts", n_experts, lo=1)
    k = check_int("k", k, lo=1, hi=n_experts)
    if capacity_factor is not None:
        check_float("capacity_factor", capacity_factor, lo=0, lo_open=True)
    if world_size % ep or n_experts % ep:
        raise ValueError(f"ep={ep} must divide world_size={world_size} and "
                         f"n_experts={n_experts}")
    cfg = _TRAIN_CFG if cfg is None else cfg
    GPTConfig(**cfg)   # checks the model's sizes
    return {"cfg": cfg, "n_experts": n_experts, "k": k, "capacity_factor": capacity_factor,
            "lr": check_float("lr", lr, lo=0, lo_open=True),
            "steps": check_int("steps", steps, lo=1), "batch": check_int("batch", batch, lo=1),
            "balance": check_float("balance", balance, lo=0),
            "seed": check_int("seed", seed, lo=0)}


_TRAIN_CFG = {"vocab_size": 16, "d_model": 8, "n_heads": 2, "n_layers": 1, "max_seq": 6}


def _respec(build, rank: int, world_size: int, ep: int, spec) -> dict:
    """A worker's ``spec`` rebuilt by ``build`` (the check its ``*_check`` ran), so a worker
    started directly refuses what the check would have, before the first message; the
    message names ``spec`` and the field."""
    world_size = check_int("world_size", world_size, lo=1)
    check_int("rank", rank, lo=0, hi=world_size - 1)
    if not isinstance(spec, dict):
        raise TypeError(f"spec must be a dict (what the *_check builds), got "
                        f"{type(spec).__name__}")
    try:
        out = build(world_size, ep, **spec)
    except TypeError as e:
        raise TypeError(f"spec: {e}") from None
    except ValueError as e:
        raise ValueError(f"spec: {e}") from None
    return out


def layer_worker(rank: int, world_size: int, ep: int, spec: dict) -> dict:
    """Worker of :func:`layer_check` (``spec``: the dict it builds); checks everything
    before the first message."""
    spec = _respec(_layer_spec, rank, world_size, ep, spec)
    ep_rank, _, ep_group, dp_group = mesh_groups(world_size, ep)
    T, h, E = spec["tokens"], spec["d_model"], spec["n_experts"]
    g = torch.Generator().manual_seed(spec["seed"])
    full = MoE(h, spec["d_ff"], E, spec["k"], capacity_factor=spec["capacity_factor"],
               routing=spec["routing"], groups=world_size, seed=spec["seed"], dtype=torch.float64)
    x = torch.randn(world_size * T, h, generator=g, dtype=torch.float64)
    w_out = torch.randn(world_size * T, h, generator=g, dtype=torch.float64)
    if spec["empty_expert"]:  # a constant feature that the last expert's router row hates
        x[:, 0] = 1.0
        with torch.no_grad():
            full.router.weight[E - 1, 0] = -50.0
    c = spec["balance"]
    # The reference, in this process: every rank computes it whole.
    xs = x.clone().requires_grad_()
    y = full(xs)
    ((y * w_out).sum() + c * full.last["balance"]).backward()
    # The same on the ranks: this rank's tokens, its experts.
    local = ExpertParallelMoE(full, ep_rank, ep, ep_group)
    mine = slice(rank * T, (rank + 1) * T)
    xl = x[mine].clone().requires_grad_()
    with ledger() as fwd:
        yl = local(xl)
    loss = world_size * (yl * w_out[mine]).sum() + c * local.last["balance"]
    with ledger() as bwd:
        loss.backward()
    sync_grads(local, world_size, dp_group, world_size // ep)
    sl = slice(local.experts[0], local.experts[-1] + 1)
    return {"forward": _gap(yl, y[mine]), "grad_x": _gap(xl.grad / world_size, xs.grad[mine]),
            "grad_router": _gap(local.router.weight.grad, full.router.weight.grad),
            "grad_experts": max(_gap(local.w_up.grad, full.w_up.grad[sl]),
                                _gap(local.w_down.grad, full.w_down.grad[sl])),
            "ledger": {"forward": fwd.summary(), "backward": bwd.summary()},
            "sent": local.last["sent"], "received": local.last["received"],
            "kept": int(local.last["counts"].sum()),
            "counts": local.last["counts"].tolist(), "dropped": local.last["dropped"],
            "serial_counts": full.last["counts"].tolist()}


def layer_check(world_size: int = 2, ep: int | None = None, *, tokens: int = 12,
                d_model: int = 8, d_ff: int = 16, n_experts: int = 4, k: int = 2,
                capacity_factor: float | None = None, routing: str = "token",
                empty_expert: bool = False, balance: float = 0.1, seed: int = 0,
                timeout: float = 30) -> list[dict]:
    """One MoE layer forward and backward on ``world_size`` ranks, ``tokens`` per rank,
    experts over ``ep`` of them (default all), ``routing`` "token" or "expert" choice, against
    the single-process reference; each rank's dict gives the largest differences
    (``forward``, ``grad_x``, ``grad_router``, ``grad_experts``), its ledger summaries and
    the rows it sent to (received from) each EP rank."""
    world_size = check_int("world_size", world_size, lo=1)
    ep = world_size if ep is None else ep
    spec = _layer_spec(world_size, ep, tokens=tokens, d_model=d_model, d_ff=d_ff,
                       n_experts=n_experts, k=k, capacity_factor=capacity_factor,
                       routing=routing, empty_expert=empty_expert, balance=balance, seed=seed)
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    return run(layer_worker, world_size, args=(ep, spec), timeout=timeout,
               deadline=10 * timeout)


def train_worker(rank: int, world_size: int, ep: int, spec: dict) -> dict:
    """Worker of :func:`train_check` (``spec``: the dict it builds); checks everything
    before the first message."""
    spec = _respec(_train_spec, rank, world_size, ep, spec)
    ep_rank, _, ep_group, dp_group = mesh_groups(world_size, ep)
    cfg = GPTConfig(**spec["cfg"])
    serial = moe_gpt(cfg, spec["n_experts"], spec["k"], capacity_factor=spec["capacity_factor"],
                     groups=world_size, dtype=torch.float64)
    model = to_expert_parallel(copy.deepcopy(serial), ep_rank, ep, ep_group)
    opts = [torch.optim.AdamW(m.parameters(), lr=spec["lr"]) for m in (serial, model)]
    g = torch.Generator().manual_seed(spec["seed"])
    b, s, c = spec["batch"], cfg.max_seq, spec["balance"]
    losses, gaps = [], []
    for _ in range(spec["steps"]):
        idx = torch.randint(0, cfg.vocab_size, (world_size * b, s + 1), generator=g)
        x, y = idx[:, :-1], idx[:, 1:]
        _, ce = serial(x, y)
        ref = ce + aux_loss(serial, c)
        opts[0].zero_grad()
        ref.backward()
        opts[0].step()
        mine = slice(rank * b, (rank + 1) * b)
        _, ce_r = model(x[mine], y[mine])
        loss = ce_r + aux_loss(model, c)
        opts[1].zero_grad()
        loss.backward()
        sync_grads(model, world_size, dp_group, world_size // ep)
        opts[1].step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append((ref.item(), mean.item() / world_size))
    for (name, p), q in zip(model.named_parameters(), serial.parameters(), strict=True):
        if name.endswith(("w_up", "w_down")):
            layer = model.get_submodule(name.rsplit(".", 1)[0])
            q = q[layer.experts[0]:layer.experts[-1] + 1]
        gaps.append(_gap(p.detach(), q.detach()))
    return {"losses": losses, "weights": max(gaps)}


def train_check(world_size: int = 4, ep: int = 2, *, steps: int = 3, batch: int = 2,
                n_experts: int = 4, k: int = 1, capacity_factor: float | None = 1.0,
                balance: float = 0.01, lr: float = 1e-2, seed: int = 0, timeout: float = 60
                ) -> list[dict]:
    """Train a 1-layer float64 MoE-GPT ``steps`` AdamW steps with EP over ``ep`` ranks and DP
    over the rest, ``batch`` sequences per rank, beside the single-process run on all the
    batches (``groups=world_size``); each rank returns ``losses`` (reference, mean over
    ranks) per step and ``weights``, the largest weight difference at the end."""
    spec = _train_spec(world_size, ep, steps=steps, batch=batch, n_experts=n_experts, k=k,
                       capacity_factor=capacity_factor, balance=balance, lr=lr, seed=seed)
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    return run(train_worker, world_size, args=(ep, spec), timeout=timeout,
               deadline=10 * timeout)
