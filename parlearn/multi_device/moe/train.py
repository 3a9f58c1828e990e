"""Train an MoE-GPT beside the dense tiny GPT at equal compute per token (lesson 18).

With ``k = 1`` and experts as wide as the dense MLP, a token runs through one expert: the
same matmul FLOPs as the dense model plus the router's ``2 h E`` per layer (counted in
``flops_per_token``), while the MLP parameters are ``E`` times as many. The loop is
:func:`parlearn.transformer.train`'s (AdamW, warm-up then cosine, clipping at 1) with the
auxiliary losses added, and it records the tokens each expert got at every step.

Threads: the MoE step is many small ops (a gather, a matmul and a scatter per expert).
Each multi-threaded op ends at an OpenMP barrier where a thread that finishes first
spins, waiting for the others; when other programs share the cores and deschedule one
thread, the rest spin through their time slices. On 2 shared cores with two busy programs
beside it, a step with torch's default 2 threads measured 18x slower than with one thread
(one thread: 3x slower than on quiet cores, the share of the cores it gets). So
:func:`train_moe` runs on one thread by default and gives the caller's count back after.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from parlearn.core.checks import check_callable, check_float, check_int
from parlearn.core.device import threads as device_threads
from parlearn.multi_device.moe.cost import imbalance
from parlearn.multi_device.moe.layer import aux_loss, moe_gpt, moe_layers
from parlearn.multi_device.moe.modern import FineGrainedMoE, fine_grained_shape, modern_gpt
from parlearn.multi_device.transformer.corpus import CharCorpus, get_batch, pydoc_corpus
from parlearn.multi_device.transformer.model import GPT, GPTConfig
from parlearn.multi_device.transformer.train import evaluate, flops_per_token

__all__ = ["train_moe"]


def train_moe(cfg: GPTConfig, n_experts: int = 0, k: int = 1, *, balance: float = 0.01,
              z: float = 0.0, capacity_factor: float | None = None, granularity: int = 1,
              shared: int = 0, bias_rate: float = 0.0, steps: int = 200,
              batch: int = 16, lr: float = 3e-3, corpus: CharCorpus | None = None,
              eval_every: int = 50, seed: int = 0,
              progress: bool | Callable[[float, str], None] | None = None,
              threads: int | None = 1) -> dict:
    """Train the dense :class:`GPT` (``n_experts=0``) or :func:`moe_gpt` on ``corpus``
    (default :func:`pydoc_corpus`) with loss ``cross-entropy + aux_loss(balance, z)``.
    Returns ``{"model", "steps", "train_loss", "eval_steps", "val_loss", "counts"
    (per step, per layer, tokens per expert after capacity), "imbalance" (per step, the
    mean over layers of max/mean), "dropped" (per step), "params", "flops_per_token"}``.

    ``granularity``, ``shared``, ``bias_rate``: other than 1, 0, 0 the model is
    :func:`modern_gpt` (fine-grained and shared experts, the router's selection bias moved
    by ``bias_rate`` after every optimizer step, :meth:`FineGrainedMoE.update_bias`); with
    them the model equals :func:`moe_gpt`'s.

    ``progress``: a tqdm bar (True), none (None or False) or ``progress(fraction, text)``
    called at each evaluation. ``threads``: torch intra-op threads for the run (default 1,
    see the module docstring; None: the caller's count), the caller's count restored
    afterwards."""
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
    n_experts = check_int("n_experts", n_experts, lo=0)
    # The dense model (n_experts=0) routes nothing: k other than 1 would be ignored.
    k = check_int("k", k, lo=1, hi=max(n_experts, 1))
    balance, z = check_float("balance", balance, lo=0), check_float("z", z, lo=0)
    if capacity_factor is not None:
        check_float("capacity_factor", capacity_factor, lo=0, lo_open=True)
    granularity = check_int("granularity", granularity, lo=1)
    shared = check_int("shared", shared, lo=0)
    bias_rate = check_float("bias_rate", bias_rate, lo=0)
    modern = (granularity, shared, bias_rate) != (1, 0, 0.0)
    if modern and n_experts == 0:
        raise ValueError(f"the dense model (n_experts=0) has no router: granularity="
                         f"{granularity}, shared={shared}, bias_rate={bias_rate} need experts")
    if modern:
        fine_grained_shape(n_experts, k, cfg.ff, granularity, shared)
    steps, batch = check_int("steps", steps, lo=1), check_int("batch", batch, lo=1)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    eval_every = check_int("eval_every", eval_every, lo=1)
    seed = check_int("seed", seed, lo=0)
    if progress is not None and not isinstance(progress, bool):
        check_callable("progress", progress)
    if threads is not None:
        check_int("threads", threads, lo=1)
    if corpus is not None and not isinstance(corpus, CharCorpus):
        raise TypeError(f"corpus must be a CharCorpus or None, got {type(corpus).__name__}")
    corpus = pydoc_corpus() if corpus is None else corpus
    with contextlib.nullcontext() if threads is None else device_threads(threads):
        if n_experts == 0:
            model = GPT(cfg)
        elif modern:
            model = modern_gpt(cfg, n_experts, k, granularity=granularity, shared=shared,
                               capacity_factor=capacity_factor, bias_rate=bias_rate)
        else:
            model = moe_gpt(cfg, n_experts, k, capacity_factor=capacity_factor)
        return _train(model, cfg, n_experts, balance, z, steps, batch, lr, corpus,
                      eval_every, seed, progress)


def _train(model, cfg, n_experts, balance, z, steps, batch, lr, corpus, eval_every, seed,
           progress) -> dict:
    """The loop of :func:`train_moe`, its arguments already checked."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warm) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps))))
    g = torch.Generator().manual_seed(seed)
    out: dict = {"steps": [], "train_loss": [], "eval_steps": [], "val_loss": [],
                 "counts": [], "imbalance": [], "dropped": []}
    bar = tqdm(range(steps), desc=f"training {'MoE' if n_experts else 'dense'} GPT",
               disable=progress is not True, leave=False)
    for step in bar:
        x, y = get_batch(corpus.train, batch, cfg.max_seq, g)
        _, loss = model(x, y)
        if n_experts:
            loss = loss + aux_loss(model, balance, z)
            layers = moe_layers(model)
            counts = [m.last["counts"].tolist() for m in layers]
            out["counts"].append(counts)
            out["imbalance"].append(sum(imbalance(c) for c in counts) / len(counts))
            out["dropped"].append(sum(m.last["dropped"] for m in layers))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        for m in moe_layers(model) if n_experts else ():
            if isinstance(m, FineGrainedMoE) and m.bias_rate:
                m.update_bias()
        out["steps"].append(step + 1)
        out["train_loss"].append(loss.item())
        if (step + 1) % eval_every == 0 or step == steps - 1:
            out["eval_steps"].append(step + 1)
            out["val_loss"].append(evaluate(model, corpus.val, batch=batch, batches=4))
            text = f"step {step + 1}/{steps}, val loss {out['val_loss'][-1]:.3f}"
            if callable(progress):
                progress((step + 1) / steps, text)
            elif progress is True:
                bar.set_postfix_str(text, refresh=False)
    out["model"] = model.eval()
    out["params"] = sum(p.numel() for p in model.parameters())
    # The router's 2 h E forward (6 h E with backward) per layer, E the routed experts.
    routed = moe_layers(model)[0].n_experts if n_experts else 0
    out["flops_per_token"] = flops_per_token(cfg, cfg.max_seq) + (
        6 * cfg.n_layers * cfg.d_model * routed)
    return out
