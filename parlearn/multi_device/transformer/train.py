"""Train the tiny GPT on the pydoc corpus, and count what a step costs in FLOPs.

FLOPs per token of one training step (forward and backward), counting a multiply-add as 2:

    6 * N_matmul + 12 * L * s * h

``N_matmul`` is the number of parameters that multiply activations in a matmul (every
linear and the tied output layer; not the embedding lookup, norms or positions): each costs
2 FLOPs per token forward and 4 backward (gradients of the input and of the weight).
Attention adds, per layer and token, ``2 s h`` for ``q k^T`` and ``2 s h`` for the weighted
values, forward, times 3 with backward; the causal mask does not halve it here because the
scores are computed in full and masked (a fused kernel that skips the masked half would).
This is the estimate of Kaplan et al. (2020) and the PaLM paper's appendix (Chowdhery et
al. 2022); ``torch.utils.flop_counter.FlopCounterMode`` counts the same matmuls, so the
two agree exactly (tested).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from parlearn.core.checks import (
    check_bool,
    check_callable,
    check_choice,
    check_float,
    check_int,
    check_tensor,
)
from parlearn.core.device import threads as device_threads
from parlearn.core.recipe import Recipe
from parlearn.multi_device.transformer.corpus import CharCorpus, get_batch, pydoc_corpus
from parlearn.multi_device.transformer.model import (
    GPT,
    GPTConfig,
    check_config,
    check_device,
    count_params,
)

__all__ = ["flops_per_token", "measured_flops", "evaluate", "train"]


def flops_per_token(cfg: GPTConfig, seq: int, *, backward: bool = True) -> int:
    """Modeled FLOPs per token of :class:`GPT` at sequence length ``seq``: forward
    ``2 N_matmul + 4 L s h``, and three times that with backward (module docstring)."""
    check_config(cfg)
    # The model cannot run past max_seq (its mask, positions and RoPE tables end there).
    seq = check_int("seq", seq, lo=1, hi=cfg.max_seq)
    check_bool("backward", backward)
    fwd = 2 * count_params(cfg)["matmul"] + 4 * cfg.n_layers * seq * cfg.d_model
    return 3 * fwd if backward else fwd


def measured_flops(model: GPT, idx: torch.Tensor, targets: torch.Tensor, *,
                   backward: bool = True) -> int:
    """FLOPs of one forward (and backward) as ``FlopCounterMode`` counts them.
    Leaves the model's ``.grad`` as it found it."""
    from torch.utils.flop_counter import FlopCounterMode

    _check_gpt(model)
    _check_ids("idx", idx, model)
    _check_ids("targets", targets, model, like=idx)
    check_bool("backward", backward)
    params = list(model.parameters())
    # Set the user's .grad aside (not merely remember it): backward adds into an existing
    # .grad in place, so the remembered tensor itself would change.
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            _, loss = model(idx, targets)
            if backward:
                loss.backward()
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
    return counter.get_total_flops()


def _check_gpt(model) -> None:
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a parlearn.transformer.GPT, got {type(model).__name__}")


def _check_ids(name: str, ids, model: GPT, like: torch.Tensor | None = None) -> None:
    """``(batch, seq)`` integer token ids below the vocabulary, ``seq <= max_seq``."""
    shape = (None, None) if like is None else tuple(like.shape)
    check_tensor(name, ids, shape=shape, floating=False)
    if ids.shape[1] > model.cfg.max_seq or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"{name} must be (batch, seq) with 1 <= seq <= max_seq="
                         f"{model.cfg.max_seq}, got shape {tuple(ids.shape)}")


@torch.no_grad()
def evaluate(model: GPT, ids: torch.Tensor, *, batch: int = 32, seq: int | None = None,
             batches: int = 8, seed: int = 1) -> float:
    """Mean cross-entropy (nats per character) over ``batches`` seeded windows of ``ids``."""
    _check_gpt(model)
    check_tensor("ids", ids, ndim=1, floating=False)
    batch = check_int("batch", batch, lo=1)
    seq = model.cfg.max_seq if seq is None else check_int("seq", seq, lo=1,
                                                          hi=model.cfg.max_seq)
    batches = check_int("batches", batches, lo=1)
    if len(ids) <= seq:
        raise ValueError(f"ids must be longer than seq={seq}, got {len(ids)} tokens")
    g = torch.Generator().manual_seed(check_int("seed", seed, lo=0))
    dev = model.tok.weight.device
    was = model.training
    model.eval()
    total = 0.0
    for _ in range(batches):
        x, y = get_batch(ids, batch, seq, g)
        total += model(x.to(dev), y.to(dev))[1].item()
    model.train(was)
    return total / batches


def train(cfg: GPTConfig | None = None, *, steps: int = 300, batch: int = 32,
          seq: int | None = None, lr: float = 3e-3, corpus: CharCorpus | None = None,
          device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
          eval_every: int = 50, seed: int = 0, autocast: torch.dtype | None = None,
          progress: bool | Callable[[float, str], None] = True,
          threads: int | None = None) -> dict:
    """Train a :class:`GPT` with :class:`parlearn.core.recipe.Recipe` (AdamW, weight decay 0.1
    on matrices only, global-norm clip 1.0, cosine decay after a warm-up of 5%) on ``corpus``
    (default :func:`pydoc_corpus`); returns ``{"model", "steps", "train_loss",
    "eval_steps", "val_loss", "tokens"}``.

    Batches come from a generator seeded by ``seed``; the model's weights from
    ``cfg.seed``. ``autocast``: e.g. ``torch.bfloat16`` to run forward and loss under
    ``torch.autocast`` (fp32 master weights, as torch.amp does). ``progress``: a tqdm bar
    (True), none (False) or ``progress(fraction, text)`` called at each evaluation.
    ``threads``: torch intra-op threads for the run, the caller's count restored afterwards
    (None: the caller's count); one thread keeps this small model's step fast when other
    programs share the cores (see :mod:`parlearn.core.device`)."""
    if corpus is not None and not isinstance(corpus, CharCorpus):
        raise TypeError(f"corpus must be a CharCorpus or None, got {type(corpus).__name__}")
    if cfg is not None:
        check_config(cfg)
    check_choice("dtype", dtype, (torch.float32, torch.float64))
    check_device("device", device)
    if autocast is not None:
        check_choice("autocast", autocast, (torch.bfloat16, torch.float16))
    check_int("seed", seed, lo=0)
    corpus = pydoc_corpus() if corpus is None else corpus
    cfg = GPTConfig(vocab_size=corpus.vocab_size) if cfg is None else cfg
    if cfg.vocab_size != corpus.vocab_size:
        raise ValueError(f"cfg.vocab_size={cfg.vocab_size} but the corpus has "
                         f"{corpus.vocab_size} symbols")
    steps, batch = check_int("steps", steps, lo=1), check_int("batch", batch, lo=1)
    seq = cfg.max_seq if seq is None else check_int("seq", seq, lo=1, hi=cfg.max_seq)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    eval_every = check_int("eval_every", eval_every, lo=1)
    if not isinstance(progress, bool):
        check_callable("progress", progress)
    if threads is not None:
        check_int("threads", threads, lo=1)
    with contextlib.nullcontext() if threads is None else device_threads(threads):
        return _train(cfg, corpus, steps, batch, seq, lr, device, dtype, eval_every, seed,
                      autocast, progress)


def _train(cfg, corpus, steps, batch, seq, lr, device, dtype, eval_every, seed, autocast,
           progress) -> dict:
    """The training loop of :func:`train`, its arguments already checked."""
    model = GPT(cfg, dtype=dtype, device=device)
    recipe = Recipe(weight_decay=0.1, clip=1.0, warmup=max(1, steps // 20))
    opt = torch.optim.AdamW(recipe.param_groups(model.parameters()), lr=lr, betas=recipe.betas)
    sched = recipe.scheduler(opt, steps)
    g = torch.Generator().manual_seed(seed)
    out: dict = {"steps": [], "train_loss": [], "eval_steps": [], "val_loss": []}
    bar = tqdm(range(steps), desc="training tiny GPT", disable=progress is not True,
               leave=False)
    for step in bar:
        x, y = get_batch(corpus.train, batch, seq, g)
        with torch.autocast(torch.device(device).type, dtype=autocast or torch.bfloat16,
                            enabled=autocast is not None):
            _, loss = model(x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
        opt.step()
        sched.step()
        out["steps"].append(step + 1)
        out["train_loss"].append(loss.item())
        if (step + 1) % eval_every == 0 or step == steps - 1:
            out["eval_steps"].append(step + 1)
            out["val_loss"].append(evaluate(model, corpus.val, batch=batch, seq=seq))
            text = f"step {step + 1}/{steps}, val loss {out['val_loss'][-1]:.3f}"
            if callable(progress):
                progress((step + 1) / steps, text)
            elif progress is True:
                bar.set_postfix_str(text, refresh=False)
    out["model"] = model.eval()
    out["tokens"] = steps * batch * seq
    return out
