"""The tiny GPT of lesson 16 trained with context parallelism: each rank holds a shard of
every sequence (lesson 17).

Everything in a block except attention acts token by token, so a rank runs the embedding,
the LayerNorms, the projections, the MLP and the loss on its own tokens alone. Two things
need the rank to know WHERE its tokens are: rotary positions (each token is rotated by its
global position's angle, not by its index in the shard) and attention, which needs the
keys of the whole sequence: :func:`ring_attention`, :func:`ulysses_attention` or
:func:`allgather_attention` (Llama 3's choice) brings them.

The loss is the mean over all ``b S`` tokens, so a rank adds up its tokens' cross-entropy
and divides by ``b S``; the ranks' parameter gradients are partial sums (every rank holds
every weight, as in data parallelism) and one all-reduce per step adds them up. After it
every rank holds the full-batch gradient and takes the same optimizer step, which is why
:func:`cp_train` equals :func:`serial_train` step by step (float64).
"""

from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn.functional as F

from parlearn.core.checks import check_choice, check_float, check_int, check_tensor
from parlearn.core.recipe import Recipe
from parlearn.distributed.agree import agree
from parlearn.multi_device.context_parallel.allgather import allgather_attention
from parlearn.multi_device.context_parallel.blocks import LAYOUTS, shard_index
from parlearn.multi_device.context_parallel.ring import ring_attention
from parlearn.multi_device.context_parallel.ulysses import ulysses_attention
from parlearn.multi_device.transformer.corpus import get_batch, pydoc_corpus
from parlearn.multi_device.transformer.model import GPT, GPTConfig, _rotate_half

__all__ = ["cp_forward", "train_batches", "serial_train", "cp_train", "cp_train_worker",
           "cp_train_runs"]

_ATTENTION = {"ring": ring_attention, "ulysses": ulysses_attention,
              "allgather": allgather_attention}


def _check_cp_forward(model, idx, targets, positions, seq, layout, scheme) -> None:
    check_choice("scheme", scheme, tuple(_ATTENTION))
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a parlearn GPT, got {type(model).__name__}")
    check_choice("layout", layout, LAYOUTS)
    seq = check_int("seq", seq, lo=1, hi=model.cfg.max_seq)
    check_tensor("idx", idx, ndim=2, floating=False)
    check_tensor("targets", targets, shape=tuple(idx.shape), floating=False)
    check_tensor("positions", positions, ndim=1, floating=False)
    # The positions must be where ``layout`` puts this rank's tokens: the attention's causal
    # mask follows the layout, the rotary angles follow the positions; a contradiction
    # would mix the two silently.
    want = shard_index(seq, tdist.get_world_size(), tdist.get_rank(), layout)
    if positions.shape != want.shape or not torch.equal(positions.cpu(), want):
        raise ValueError(f"positions must be rank {tdist.get_rank()}'s shard of seq={seq} in "
                         f"layout={layout!r}, {want.tolist()}, got {positions.tolist()}")
    if idx.shape[1] != len(want):
        raise ValueError(f"idx must hold this rank's {len(want)} tokens per row "
                         f"(seq={seq}, layout={layout!r}), got shape {tuple(idx.shape)}")


def cp_forward(model: GPT, idx: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor,
               *, seq: int, layout: str = "contiguous", scheme: str = "ring") -> torch.Tensor:
    """This rank's share of the loss: the SUM of cross-entropy over its tokens ``idx``
    (``(batch, shard_len)``, global ``positions``) divided by ``batch * seq``, so the
    ranks' shares add up to the mean loss of the whole sequence. Must run on a group."""
    if not tdist.is_initialized():
        raise RuntimeError("cp_forward needs an initialised torch.distributed group")
    # Checked on every rank, then agreed before the first message, so a refusal on one rank
    # is an error on every rank (not a hang of the others inside the attention exchange).
    err = None
    try:
        _check_cp_forward(model, idx, targets, positions, seq, layout, scheme)
    except (TypeError, ValueError) as e:
        err = e
    agree({"seq": seq, "layout": layout, "scheme": scheme,
           "idx batch": idx.shape[0] if isinstance(idx, torch.Tensor) and idx.dim() else None},
          err)
    attention = _ATTENTION[scheme]
    b, s = idx.shape
    x = model.tok(idx)
    if model.pos is not None:
        x = x + model.pos(positions)
    cos, sin = model.cos[positions], model.sin[positions]
    for block in model.blocks:
        a = block.attn
        h = block.ln1(x)
        q, k, v = (lin(h).view(b, s, a.n_heads, -1).transpose(1, 2) for lin in (a.q, a.k, a.v))
        if a.rope:
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        y = attention(q, k, v, seq=seq, layout=layout, causal=True)
        x = x + a.o(y.transpose(1, 2).reshape(b, s, -1))
        x = x + block.mlp(block.ln2(x))
    logits = F.linear(model.ln_f(x), model.head_weight)
    return F.cross_entropy(logits.reshape(b * s, -1), targets.reshape(b * s),
                           reduction="sum") / (b * seq)


def train_batches(steps: int, batch: int, seq: int, seed: int
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(idx, targets)`` of each step, drawn from the pydoc corpus by ``seed``: the
    same list on every rank, so a rank can cut out its share without any message."""
    steps, batch, seq = (check_int(n, v, lo=1) for n, v in
                         (("steps", steps), ("batch", batch), ("seq", seq)))
    seed = check_int("seed", seed, lo=0)
    gen = torch.Generator().manual_seed(seed)
    ids = pydoc_corpus().train
    return [get_batch(ids, batch, seq, gen) for _ in range(steps)]


def _cfg(cfg: GPTConfig, seq: int) -> GPTConfig:
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
    if seq > cfg.max_seq:
        raise ValueError(f"seq={seq} must be at most cfg.max_seq={cfg.max_seq}")
    return cfg


_OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}


def _check_train_args(cfg: GPTConfig, steps: int, batch: int, seq: int, lr: float, seed: int,
                      layout: str, scheme: str) -> tuple[GPTConfig, int, int, int, float, int]:
    """Refuse, naming the argument, what :func:`cp_train` and its worker cannot run; the
    checked ``(cfg, steps, batch, seq, lr, seed)``."""
    steps, batch, seq = (check_int(n, v, lo=1) for n, v in
                         (("steps", steps), ("batch", batch), ("seq", seq)))
    check_choice("layout", layout, LAYOUTS)
    check_choice("scheme", scheme, tuple(_ATTENTION))
    lr = check_float("lr", lr, lo=0, lo_open=True)
    seed = check_int("seed", seed, lo=0)
    return _cfg(cfg, seq), steps, batch, seq, lr, seed


def serial_train(cfg: GPTConfig, *, steps: int = 3, batch: int = 2, seq: int = 16,
                 lr: float = 1e-2, seed: int = 0, optimizer: str = "adamw",
                 recipe: Recipe | None = None) -> dict:
    """The reference: the same GPT (float64), data and ``optimizer`` steps ("adamw" or
    "adam", torch's defaults but ``lr``) in one process. With ``recipe`` (a
    :class:`parlearn.core.recipe.Recipe`, ``optimizer="adamw"`` only): AdamW with its decay
    groups and betas, its global-norm clip and its schedule over ``steps``, peak ``lr``.
    Returns ``{"loss": [per step], "params": {name: tensor}, "grad_norm": [per step, the
    norm before clipping] (with a recipe; else empty)}``."""
    steps, batch, seq = (check_int(n, v, lo=1) for n, v in
                         (("steps", steps), ("batch", batch), ("seq", seq)))
    check_choice("optimizer", optimizer, tuple(_OPTIMIZERS))
    lr = check_float("lr", lr, lo=0, lo_open=True)
    seed = check_int("seed", seed, lo=0)
    if recipe is not None:
        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a parlearn.core.recipe.Recipe or None, got "
                            f"{type(recipe).__name__}")
        if optimizer != "adamw":
            raise ValueError(f"recipe runs AdamW: optimizer must be 'adamw', got {optimizer!r}")
    model = GPT(_cfg(cfg, seq), dtype=torch.float64)
    if recipe is None:
        opt, sched = _OPTIMIZERS[optimizer](model.parameters(), lr=lr), None
    else:
        opt = torch.optim.AdamW(recipe.param_groups(model.parameters()), lr=lr,
                                betas=recipe.betas)
        sched = recipe.scheduler(opt, steps)
    losses, norms = [], []
    for idx, tgt in train_batches(steps, batch, seq, seed):
        opt.zero_grad()
        loss = model(idx, tgt)[1]
        loss.backward()
        if recipe is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                              recipe.clip)))
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
    return dict(loss=losses, grad_norm=norms,
                params={n: p.detach().clone() for n, p in model.named_parameters()})


def cp_train_worker(rank: int, world_size: int, cfg: GPTConfig, steps: int, batch: int,
                    seq: int, lr: float, seed: int, layout: str, scheme: str) -> dict:
    """Worker: :func:`serial_train`'s loop with each sequence sharded over the ranks by
    ``layout``; loss shares and gradients summed by all-reduce. Every argument is checked
    before the first message (:func:`cp_train` gives every rank the same ones)."""
    world_size = check_int("world_size", world_size, lo=1)
    rank = check_int("rank", rank, lo=0, hi=world_size - 1)
    cfg, steps, batch, seq, lr, seed = _check_train_args(cfg, steps, batch, seq, lr, seed,
                                                         layout, scheme)
    model = GPT(cfg, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    pos = shard_index(seq, world_size, rank, layout)
    losses = []
    for idx, tgt in train_batches(steps, batch, seq, seed):
        opt.zero_grad()
        loss = cp_forward(model, idx[:, pos], tgt[:, pos], pos, seq=seq, layout=layout,
                          scheme=scheme)
        loss.backward()
        for p in model.parameters():
            tdist.all_reduce(p.grad)
        total = loss.detach().clone()
        tdist.all_reduce(total)
        opt.step()
        losses.append(float(total))
    return dict(loss=losses, params={n: p.detach().clone() for n, p in model.named_parameters()})


def cp_train(cfg: GPTConfig, world_size: int = 2, *, steps: int = 3, batch: int = 2,
             seq: int = 16, lr: float = 1e-2, seed: int = 0, layout: str = "zigzag",
             scheme: str = "ring", timeout: float = 60) -> list[dict]:
    """Run :func:`cp_train_worker` on ``world_size`` real ranks; one dict per rank, as
    :func:`serial_train` returns."""
    from parlearn.distributed import run

    world_size = check_int("world_size", world_size, lo=2)
    cfg, steps, batch, seq, lr, seed = _check_train_args(cfg, steps, batch, seq, lr, seed,
                                                         layout, scheme)
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    return run(cp_train_worker, world_size, timeout=timeout,
               args=(cfg, steps, batch, seq, lr, seed, layout, scheme))


def _check_runs(runs) -> list[tuple[str, str]]:
    """``runs``: a non-empty list of ``(scheme, layout)`` pairs, each one :func:`cp_train`
    can run; the checked pairs."""
    if not isinstance(runs, list | tuple) or not runs:
        raise TypeError(f"runs must be a non-empty list of (scheme, layout) pairs, got {runs!r}")
    out = []
    for i, pair in enumerate(runs):
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise TypeError(f"runs[{i}] must be a (scheme, layout) pair, got {pair!r}")
        out.append((check_choice(f"runs[{i}] scheme", pair[0], tuple(_ATTENTION)),
                    check_choice(f"runs[{i}] layout", pair[1], LAYOUTS)))
    return out


def cp_train_runs(cfg: GPTConfig, world_size: int = 2, *, runs: list, steps: int = 3,
                  batch: int = 2, seq: int = 16, lr: float = 1e-2, seed: int = 0,
                  timeout: float = 60) -> list[list[dict]]:
    """:func:`cp_train` for each ``(scheme, layout)`` of ``runs`` in one launch of the ranks:
    ``result[i]`` is what ``cp_train(..., scheme=runs[i][0], layout=runs[i][1])`` returns
    (one dict per rank)."""
    from parlearn.distributed import run_many

    runs = _check_runs(runs)
    world_size = check_int("world_size", world_size, lo=2)
    cfg, steps, batch, seq, lr, seed = _check_train_args(cfg, steps, batch, seq, lr, seed,
                                                         runs[0][1], runs[0][0])
    timeout = check_float("timeout", timeout, lo=0, lo_open=True)
    return run_many(cp_train_worker, world_size,
                    [(cfg, steps, batch, seq, lr, seed, layout, scheme) for scheme, layout in runs],
                    timeout=timeout)
