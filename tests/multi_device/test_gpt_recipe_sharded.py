"""The tiny GPT's whole recipe, unchanged, under ZeRO-1, ZeRO-2 and the FSDP-style wrapper on 2
gloo ranks equals one process step by step in float64: AdamW with betas (0.9, 0.95) and weight
decay 0.1 on matrices only (norms, biases excluded), clipping by the global gradient norm,
warm-up then cosine decay, two accumulated micro-batches per rank."""

from __future__ import annotations

import pytest
import torch

from parlearn import dist
from parlearn.core.recipe import Recipe
from parlearn.multi_device.sharding import ShardedOptimizer, shard_module
from parlearn.multi_device.transformer import GPT, GPTConfig

CFG = GPTConfig(vocab_size=29, d_model=16, n_heads=2, n_layers=2, max_seq=8, seed=3)
STEPS, BATCH, SEQ, MICRO = 3, 8, 8, 2


RECIPE = Recipe(weight_decay=0.1, clip=0.5, warmup=2, betas=(0.9, 0.95))


def _batches():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g)
            for _ in range(STEPS)]


def _serial(decay_all: bool = False) -> list[dict[str, torch.Tensor]]:
    """One process; ``decay_all`` decays norms and biases too (one flat shard per unit)."""
    model = GPT(CFG, dtype=torch.float64)
    groups = model.parameters() if decay_all else RECIPE.param_groups(model.parameters())
    opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = RECIPE.scheduler(opt, STEPS)
    out = []
    for ids in _batches():
        opt.zero_grad()
        _, loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE.clip)
        opt.step()
        sched.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _ranks(rank: int, world: int, how: str) -> list[dict[str, torch.Tensor]]:
    model = GPT(CFG, dtype=torch.float64)
    if how == "fsdp":
        # One flat shard per unit and kind, so the groups pick matrices apart from vectors.
        model = shard_module(model, flat_by=lambda name, p: "decay" if p.dim() >= 2 else "none")
        opt = torch.optim.AdamW([{"params": model.fsdp.shards("decay"), "weight_decay": 0.1},
                                 {"params": model.fsdp.shards("none"), "weight_decay": 0.0}],
                                lr=3e-3, betas=(0.9, 0.95))
    elif how == "fsdp-decay-all":
        model = shard_module(model)   # one flat per unit: weight decay reaches every tensor
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95),
                                weight_decay=0.1)
    else:
        opt = ShardedOptimizer(RECIPE.param_groups(model.parameters()), torch.optim.AdamW,
                               stage=int(how[-1]),
                               lr=3e-3, betas=(0.9, 0.95))
    sched = RECIPE.scheduler(opt, STEPS)
    out = []
    per_rank = BATCH // world
    for ids in _batches():
        opt.zero_grad()
        mine = ids[rank * per_rank:(rank + 1) * per_rank]
        for m in range(MICRO):
            part = mine[m * per_rank // MICRO:(m + 1) * per_rank // MICRO]
            _, loss = model(part[:, :-1], part[:, 1:])
            (loss / MICRO).backward()
        if how.startswith("fsdp"):
            model.fsdp.clip_grad_norm_(RECIPE.clip)
        else:
            opt.reduce_gradients()
            opt.clip_grad_norm_(RECIPE.clip)
        opt.step()
        sched.step()
        out.append(model.fsdp.full_state_dict() if how.startswith("fsdp")
                   else {n: p.detach().clone() for n, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("how", ["zero1", "zero2", "fsdp", "fsdp-decay-all"])
def test_the_gpt_recipe_sharded_equals_one_process(how):
    results = dist.run(_ranks, 2, args=(how,), timeout=60)
    reference = _serial(decay_all=how == "fsdp-decay-all")
    for rank, steps in enumerate(results):
        for k, (got, want) in enumerate(zip(steps, reference, strict=True)):
            for name, value in want.items():
                torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12,
                                           msg=f"{how} rank {rank} step {k} {name}")
