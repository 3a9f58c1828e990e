"""shard_module (an FSDP-style wrapper from scratch) trains like one process and like FSDP2's
fully_shard, with any torch optimizer stepping its shards, on the users' zoo."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import zoo
from ranks import assert_refused_on_every_rank
from torch import nn

from parlearn import dist
from parlearn.multi_device.sharding.fsdp import MixedPrecisionPolicy, shard_module

BATCH, STEPS = 8, 2
MODELS = ["relu", "gelu", "no_bias", "tied", "frozen", "layernorm", "layernorm_no_affine",
          "conv"]


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def _serial(name: str, micro: int = 1) -> dict[str, torch.Tensor]:
    model = zoo.build(name, torch.float64)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01,
                            weight_decay=0.1)
    x, y = zoo.batch(BATCH, torch.float64, seed=5)
    for _ in range(STEPS):
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(rank: int, world: int, mode: str) -> dict:
    """Each zoo model sharded over the ranks, each rank on its half batch; ``mode``: one
    backward per step, or two micro-batches accumulated with or without no_sync()."""
    x, y = zoo.batch(BATCH, torch.float64, seed=5)
    mine = list(range(rank * BATCH // world, (rank + 1) * BATCH // world))
    out = {}
    vectors = (lambda n, p: p.dim() < 2) if mode.startswith("replicate") else None
    for name in MODELS:
        model = shard_module(zoo.build(name, torch.float64), replicate=vectors)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        held = []
        for _ in range(STEPS):
            opt.zero_grad()
            if mode in ("one", "replicate"):
                loss = _loss(model, x[mine], y[mine])
                held.append(model.fsdp.held_bytes()["gathered"])   # after forward: resharded
                loss.backward()
            else:
                halves = (mine[: len(mine) // 2], mine[len(mine) // 2:])
                with model.fsdp.no_sync() if mode.endswith("no_sync") else _null():
                    (_loss(model, x[halves[0]], y[halves[0]]) / 2).backward()
                (_loss(model, x[halves[1]], y[halves[1]]) / 2).backward()
            opt.step()
        out[name] = (model.fsdp.full_state_dict(), held, model.fsdp.held_bytes())
    return out


def _modeled_shard_bytes(name: str, world: int) -> int:
    """Modeled: each unit (a top-level child with parameters) keeps ceil(n / N) elements of its
    trainable and of its frozen parameters, 8 bytes each in float64."""
    model = zoo.build(name, torch.float64)
    total = 0
    for child in dict.fromkeys(model.children()):
        for trainable in (True, False):
            n = sum(p.numel() for p in child.parameters() if p.requires_grad == trainable)
            total += 8 * math.ceil(n / world)
    return total


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("mode", ["one", "accumulate", "no_sync", "replicate",
                                  "replicate+no_sync"])
def test_equal_to_one_process_on_the_zoo(mode):
    """"replicate": biases and norms' gains kept whole on every rank (all-reduced)."""
    results = dist.run(_train, 2, args=(mode,), timeout=60)
    for name in MODELS:
        ref = _serial(name)
        for rank, per_rank in enumerate(results):
            state, held_after_forward, held = per_rank[name]
            for key, value in ref.items():
                torch.testing.assert_close(state[key], value, rtol=1e-12, atol=1e-12,
                                           msg=f"{name} {key} rank {rank} ({mode})")
            if mode == "one":
                assert held_after_forward == [0] * STEPS   # nothing gathered stays after forward
                assert held["shards"] == _modeled_shard_bytes(name, 2), name


def _replicated_grads(rank: int, world: int) -> dict:
    x, y = zoo.batch(BATCH, torch.float64, seed=5)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    base = zoo.build("layernorm", torch.float64)
    model = shard_module(copy.deepcopy(base), replicate=lambda n, p: p.dim() < 2)
    _loss(model, x[mine], y[mine]).backward()
    flats = [f for _, fs in model.fsdp.units for f in fs]
    norm = model.fsdp.clip_grad_norm_(1e-3)
    ref = copy.deepcopy(base)
    _loss(ref, x, y).backward()
    return {"replicated": [(f.shard.numel(), f.numel, f.shard.grad.clone()) for f in flats
                           if f.replicated],
            "sharded": [f.shard.numel() for f in flats if not f.replicated],
            "norm": float(norm),
            "want": float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)),
            "vectors": sum(p.numel() for p in base.parameters() if p.dim() < 2)}


def test_replicated_parameters_stay_whole_with_the_same_gradient_on_every_rank():
    """Every rank holds the whole vectors, their gradient is the same on every rank (the
    all-reduced average), and the global norm counts them once: equal to torch's norm of
    the one-process gradient."""
    r0, r1 = dist.run(_replicated_grads, 2, timeout=60)
    assert sum(n for n, _, _ in r0["replicated"]) == r0["vectors"] > 0
    assert all(n == whole for n, whole, _ in r0["replicated"])      # not cut, not padded
    for (_, _, g0), (_, _, g1) in zip(r0["replicated"], r1["replicated"], strict=True):
        assert torch.equal(g0, g1)
    assert r0["sharded"] and r0["sharded"] == r1["sharded"]
    assert abs(r0["norm"] - r0["want"]) < 1e-12 and r0["norm"] == r1["norm"]


def test_frozen_parameters_never_move():
    results = dist.run(_train, 2, args=("one",), timeout=60)
    before = dict(zoo.build("frozen", torch.float64).named_parameters())
    for per_rank in results:
        state = per_rank["frozen"][0]
        for n, p in before.items():
            if not p.requires_grad:
                assert torch.equal(state[n], p.detach()), n


def _against_fsdp2(rank: int, world: int, dtype_name: str) -> list:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed.fsdp import fully_shard
    dtype = getattr(torch, dtype_name)
    x, y = zoo.batch(BATCH, torch.float32, seed=5)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    base = zoo.build("gelu", torch.float32)
    ours, theirs = shard_module(copy.deepcopy(base), mp_policy=MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32)), copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (world,))
    policy = TorchPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in theirs:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(theirs, mesh=mesh, mp_policy=policy)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (ours, theirs)]
    for _ in range(STEPS):
        for m, opt in zip((ours, theirs), opts, strict=True):
            opt.zero_grad()
            _loss(m, x[mine], y[mine]).float().backward()
            opt.step()
    mine_state = ours.fsdp.full_state_dict()
    theirs_state = {n: p.full_tensor() for n, p in theirs.named_parameters()}
    return [(n, mine_state[n], theirs_state[n]) for n in theirs_state]


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_equal_to_fsdp2_with_the_same_policy(dtype_name):
    """Bit for bit: the same gathers, the same compute dtype, the same fp32 reduction and
    master weights as FSDP2 (with a bf16 policy too)."""
    results = dist.run(_against_fsdp2, 2, args=(dtype_name,), timeout=60)
    for per_rank in results:
        for name, ours, theirs in per_rank:
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=name)


def _full_before_any_step(rank: int, world: int, dtype_name: str) -> float:
    base = zoo.build("gelu", torch.float32)
    model = shard_module(copy.deepcopy(base), mp_policy=MixedPrecisionPolicy(
        param_dtype=getattr(torch, dtype_name)))
    full = model.fsdp.full_state_dict()
    assert all(full[n].dtype == torch.float32 for n, _ in base.named_parameters())
    return max((full[n] - p).abs().max().item() for n, p in base.named_parameters())


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_full_state_dict_is_the_fp32_master_not_the_compute_copy(dtype_name):
    """Under a bf16/fp16 policy the shards stay fp32 (the master weights); the full state
    dict gathers those, not the copy rounded to the compute dtype for forward."""
    assert dist.run(_full_before_any_step, 2, args=(dtype_name,), timeout=60) == [0.0, 0.0]


def _bad(rank: int, world: int, which: str):
    model = zoo.build({"bn": "batchnorm"}.get(which, "relu"))
    kwargs = {"policy": dict(mp_policy="bf16"), "reshard": dict(reshard_after_forward=1),
              "units": dict(units=[nn.Linear(2, 2)]), "bn": {}, "module": {},
              "flat_by": dict(flat_by="by dim"), "unhashable": dict(flat_by=lambda n, p: [n]),
              "key": dict(flat_by=lambda n, p: p.dim()),
              "replicate": dict(replicate="vectors"),
              "replicate_bool": dict(replicate=lambda n, p: p.dim())}[which]
    shard_module(3 if which == "module" else model, **kwargs)
    model.fsdp.shards("decay")   # keys are 1 and 2 here


@pytest.mark.parametrize("which, name", [("policy", "mp_policy"),
                                         ("reshard", "reshard_after_forward"),
                                         ("units", "units"), ("bn", "BatchNorm1d"),
                                         ("module", "module"), ("flat_by", "flat_by"),
                                         ("unhashable", "flat_by"), ("key", "key"),
                                         ("replicate", "replicate"),
                                         ("replicate_bool", "replicate")])
def test_bad_arguments_fail_on_every_rank_naming_them(which, name):
    assert_refused_on_every_rank(_bad, (which,), name=name)


def _eval_batchnorm(rank: int, world: int) -> bool:
    model = zoo.build("batchnorm").eval()
    return hasattr(shard_module(model), "fsdp")


def test_batchnorm_in_eval_mode_is_sharded():
    """Only BatchNorm in training mode is refused (above): in eval mode it normalises by its
    running statistics, not by each rank's batch."""
    assert dist.run(_eval_batchnorm, 2, timeout=30) == [True, True]


def test_policy_refuses_non_float_dtypes():
    with pytest.raises(TypeError, match="param_dtype"):
        MixedPrecisionPolicy(param_dtype=torch.int32)
    with pytest.raises(TypeError, match="reduce_dtype"):
        MixedPrecisionPolicy(reduce_dtype="float32")


def _messages(rank: int, world: int, reshard: bool) -> dict:
    model = shard_module(zoo.build("relu", torch.float64), reshard_after_forward=reshard)
    x, y = zoo.batch(4, torch.float64)
    with dist.ledger() as led:
        _loss(model, x, y).backward()
    return {k: led.count(k) for k in ("all_gather_single", "reduce_scatter_single")}


@pytest.mark.parametrize("reshard, gathers", [(True, 5), (False, 3)])
def test_each_unit_is_gathered_again_in_backward_only_when_resharded(reshard, gathers):
    """ZeRO-3's traffic per step: 3 units (the Linears) are gathered for the forward and,
    when resharded after it, again in the backward where it needs them: the second and third
    (their weights carry the gradient to the layer below), not the first (the data needs no
    gradient, so autograd never unpacks its weight). Each gradient is reduce-scattered once."""
    for counts in dist.run(_messages, 2, args=(reshard,), timeout=30):
        assert counts == {"all_gather_single": gathers, "reduce_scatter_single": 3}
