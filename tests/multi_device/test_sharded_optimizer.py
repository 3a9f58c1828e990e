"""ShardedOptimizer (ZeRO-1/2 around any torch optimizer) equals the plain optimizer on one
process and torch's ZeroRedundancyOptimizer, step by step, in float64, on the users' zoo."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as tdist
import zoo
from ranks import assert_refused_on_every_rank
from torch import nn

from parlearn import dist
from parlearn.multi_device.sharding.optimizer import ShardedOptimizer, owners

STEPS, BATCH = 3, 8
CONFIGS = {
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "adam": (torch.optim.Adam, dict(lr=0.01)),
    "adamw_groups": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
}
MODELS = ["relu", "no_bias", "tied", "frozen", "layernorm_no_affine", "layernorm", "conv"]


def _groups(model: nn.Module, name: str):
    """The GPT recipe's groups for AdamW: no weight decay on biases and norms."""
    if name != "adamw_groups":
        return list(model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2) * 0.9 ** s)


def _data():
    return zoo.batch(BATCH, torch.float64, seed=3)


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def _serial(model_name: str, config: str) -> list[list[torch.Tensor]]:
    model = zoo.build(model_name, torch.float64)
    cls, kw = CONFIGS[config]
    opt = cls(_groups(model, config), **kw)
    sched = _schedule(opt)
    x, y = _data()
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
        sched.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out, opt.state_dict()


def _worker(rank: int, world: int, stage: int) -> dict:
    with warnings.catch_warnings():   # torch's functional optimizers still use torch.jit
        warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated",
                                DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer

    x, y = _data()
    half = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    out = {}
    for model_name in MODELS:
        for config, (cls, kw) in CONFIGS.items():
            ours_model = zoo.build(model_name, torch.float64)
            theirs_model = copy.deepcopy(ours_model)
            ours = ShardedOptimizer(_groups(ours_model, config), cls, stage=stage, **kw)
            theirs = ZeroRedundancyOptimizer(_groups(theirs_model, config),
                                             optimizer_class=cls, **kw)
            s1, s2 = _schedule(ours), _schedule(theirs)
            steps = []
            for _ in range(STEPS):
                for m, opt in ((ours_model, ours), (theirs_model, theirs)):
                    opt.zero_grad()
                    _loss(m, x[half], y[half]).backward()
                for p in theirs_model.parameters():   # what DDP would do for torch's
                    if p.grad is not None:
                        tdist.all_reduce(p.grad)
                        p.grad /= world
                ours.step()
                theirs.step()
                s1.step()
                s2.step()
                steps.append(([p.detach().clone() for p in ours_model.parameters()],
                              [p.detach().clone() for p in theirs_model.parameters()]))
            ours.consolidate_state_dict(to=0)
            state = ours.state_dict() if rank == 0 else None
            out[(model_name, config)] = (steps, state, ours.held_numel())
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_equal_to_one_process_and_to_torch_zero(stage):
    results = dist.run(_worker, 2, args=(stage,), timeout=60)
    for model_name in MODELS:
        for config in CONFIGS:
            serial, serial_state = _serial(model_name, config)
            for rank, per_rank in enumerate(results):
                steps, state, held = per_rank[(model_name, config)]
                for k, (ours, theirs) in enumerate(steps):
                    for a, b, ref in zip(ours, theirs, serial[k], strict=True):
                        where = f"{model_name}/{config}/stage {stage}/rank {rank}/step {k}"
                        torch.testing.assert_close(a, ref, rtol=1e-12, atol=1e-12, msg=where)
                        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=where)
                if rank == 0:   # the consolidated state is the plain optimizer's
                    assert set(state["state"]) == set(serial_state["state"])
                    for i, s in serial_state["state"].items():
                        for key, value in s.items():
                            torch.testing.assert_close(state["state"][i][key], value,
                                                       rtol=1e-12, atol=1e-12)
                    assert ([{k: v for k, v in g.items() if k != "params"}
                             for g in state["param_groups"]]
                            == [{k: v for k, v in g.items() if k != "params"}
                                for g in serial_state["param_groups"]])
                if stage == 2:
                    assert held["grads"] < held["params"]   # others' gradients dropped


def test_frozen_parameters_never_move():
    results = dist.run(_worker, 2, args=(2,), timeout=60)
    before = dict(zoo.build("frozen", torch.float64).named_parameters())
    names = [n for n, _ in zoo.build("frozen", torch.float64).named_parameters()]
    for per_rank in results:
        for config in CONFIGS:
            steps, _, _ = per_rank[("frozen", config)]
            for ours, _ in steps:
                for n, p in zip(names, ours, strict=True):
                    if not before[n].requires_grad:
                        assert torch.equal(p, before[n].detach()), n


def test_owners_follow_torchs_greedy_rule():
    assert owners([10, 30, 20, 5], 2) == [1, 0, 1, 0]
    held = [0, 0]
    owners([30, 20], 2, held)
    assert held == [30, 20] and owners([10], 2, held) == [1]   # counts carry over groups
    assert owners([4, 4, 4], 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="world_size"):
        owners([1], True)


def _bad(rank: int, world: int, which: str):
    model = zoo.build("relu", torch.float64)
    kwargs = {"stage": dict(stage=True), "class": dict(optimizer_class=nn.Linear),
              "lr": dict(lr=-1.0), "lbfgs": dict(optimizer_class=torch.optim.LBFGS),
              "tensor": dict(params=next(model.parameters())),
              "empty": dict(params=[]), "avg": dict(average_grads=1)}[which]
    params = kwargs.pop("params", model.parameters())
    ShardedOptimizer(params, **kwargs)


@pytest.mark.parametrize("which, name", [("stage", "stage"), ("class", "optimizer_class"),
                                         ("lr", "lr"), ("lbfgs", "LBFGS"),
                                         ("tensor", "params"), ("empty", "params"),
                                         ("avg", "average_grads")])
def test_bad_arguments_fail_on_every_rank_naming_them(which, name):
    assert_refused_on_every_rank(_bad, (which,), name=name)


def _mismatch(rank: int, world: int):
    model = zoo.build("relu" if rank == 0 else "tanh", torch.float64)
    if rank == 1:
        model = nn.Sequential(*list(model)[:-1])   # a different parameter list
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    model(torch.ones(2, zoo.IN, dtype=torch.float64)).sum().backward()
    opt.step()


def test_ranks_with_other_parameters_fail_on_every_rank_not_hang():
    with pytest.raises(dist.RankError) as info:
        dist.run(_mismatch, 2, timeout=20)
    assert set(info.value.failures) == {0, 1}
    assert all("must be the same on every rank" in t for t in info.value.failures.values())


def _clip_and_accumulate(rank: int, world: int, stage: int) -> list[torch.Tensor]:
    """Two micro-batches per rank accumulated, the global norm clipped, then one AdamW step."""
    x, y = _data()
    model = zoo.build("layernorm", torch.float64)
    opt = ShardedOptimizer(_groups(model, "adamw_groups"), torch.optim.AdamW, stage=stage,
                           lr=0.01, weight_decay=0.1)
    mine = list(range(rank * BATCH // world, (rank + 1) * BATCH // world))
    norms = []
    for _ in range(2):
        opt.zero_grad()
        for micro in (mine[: len(mine) // 2], mine[len(mine) // 2:]):
            (_loss(model, x[micro], y[micro]) / 2).backward()
        opt.reduce_gradients()
        norms.append(opt.clip_grad_norm_(0.05))
        opt.step()
    return [p.detach().clone() for p in model.parameters()], norms


@pytest.mark.parametrize("stage", [1, 2])
def test_accumulation_and_global_norm_clipping_equal_one_process(stage):
    results = dist.run(_clip_and_accumulate, 2, args=(stage,), timeout=60)
    model = zoo.build("layernorm", torch.float64)
    opt = torch.optim.AdamW(_groups(model, "adamw_groups"), lr=0.01, weight_decay=0.1)
    x, y = _data()
    norms = []
    for _ in range(2):
        opt.zero_grad()
        _loss(model, x, y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
        opt.step()
    assert norms[0] > 0.05   # the clip bites
    for params, got in results:
        for a, b in zip(params, model.parameters(), strict=True):
            torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12)
        for n_ours, n_ref in zip(got, norms, strict=True):
            torch.testing.assert_close(n_ours, n_ref.to(torch.float64), rtol=1e-12, atol=0)
