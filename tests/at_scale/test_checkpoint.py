"""Sharded checkpoints that reshard, and ShardedAdam's state dict under them."""

from __future__ import annotations

import os

import pytest
import torch
from parlearn.mesh import MeshShape
from torch import nn

from parlearn import dist
from parlearn.at_scale import checkpoint as ckpt
from parlearn.at_scale import train

SMALL = dict(batch=8, seq=16, d_model=32)


def _adam_roundtrip(rank, world_size, stage, load_world):
    """Train 2 steps with ShardedAdam(stage) on this group, take its state dict, load it into
    a fresh optimizer whose group is the first ``load_world`` ranks, and return both the
    state dicts and one more step's parameters from the loaded and from torch's Adam."""
    from parlearn.sharding import ShardedAdam

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    model[0].bias.requires_grad_(False)            # a frozen parameter: no state
    ref = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    ref.load_state_dict(model.state_dict())
    ref[0].bias.requires_grad_(False)
    x = torch.randn(3, 8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    opt = ShardedAdam(model, stage=stage, lr=0.1)
    torch_opt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=0.1,
                                 foreach=False)
    per = 8 // world_size
    for k in range(2):
        opt.zero_grad()
        model(x[k, rank * per:(rank + 1) * per]).pow(2).mean().backward()
        opt.step()
        torch_opt.zero_grad()
        ref(x[k]).pow(2).mean().backward()
        torch_opt.step()
    sd = opt.state_dict()
    group = torch.distributed.new_group(list(range(load_world)))
    out = {"sd": sd, "torch": {n: {k: v.clone() for k, v in torch_opt.state[p].items()}
                               for n, p in ref.named_parameters() if p.requires_grad}}
    if rank < load_world:
        fresh = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
        fresh.load_state_dict(ref.state_dict())
        fresh[0].bias.requires_grad_(False)
        opt2 = ShardedAdam(fresh, stage=stage, lr=0.1, group=group)
        opt2.load_state_dict(sd)
        per2 = 8 // load_world
        opt2.zero_grad()
        fresh(x[2, rank * per2:(rank + 1) * per2]).pow(2).mean().backward()
        opt2.step()
        out["next"] = opt2.full_parameters()
    torch_opt.zero_grad()
    ref(x[2]).pow(2).mean().backward()
    torch_opt.step()
    out["torch_next"] = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sharded_adam_state_dict_is_torch_adams_state_and_loads_on_fewer_ranks(stage):
    res = dist.run(_adam_roundtrip, 2, args=(stage, 1), timeout=30)
    sd, want = res[0]["sd"], res[0]["torch"]
    assert sd["step"] == 2
    assert set(sd["state"]) == set(want) == {"0.weight", "2.weight", "2.bias"}
    for name, moments in sd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(moments[key], want[name][key], rtol=0, atol=1e-15)
    assert res[1]["sd"]["state"].keys() == sd["state"].keys()
    # The state loaded on ONE rank continues exactly as torch's Adam does.
    torch.testing.assert_close(res[0]["next"], res[0]["torch_next"], rtol=0, atol=1e-14)


def _refuse_state(rank, world_size, bad):
    from parlearn.sharding import ShardedAdam

    model = nn.Linear(3, 2).double()
    opt = ShardedAdam(model, stage=1)
    sd = opt.state_dict()
    if bad == "missing":
        del sd["state"]["bias"]
    elif bad == "shape":
        sd["state"]["bias"]["exp_avg"] = torch.zeros(3, dtype=torch.float64)
    elif bad == "dtype":
        sd["state"]["bias"]["exp_avg"] = torch.zeros(2)
    elif bad == "keys":
        sd = {"state": sd["state"]}
    before = [u.exp_avg.clone() for u in opt.units]
    try:
        opt.load_state_dict(sd)
    finally:
        assert all(torch.equal(b, u.exp_avg) for b, u in zip(before, opt.units, strict=True))


@pytest.mark.parametrize("bad, name", [("missing", "state_dict['state']"),
                                       ("shape", "exp_avg"), ("dtype", "exp_avg"),
                                       ("keys", "state_dict")])
def test_load_state_dict_refuses_another_models_state_changing_nothing(bad, name):
    from ranks import assert_refused_on_every_rank

    assert_refused_on_every_rank(_refuse_state, (bad,), name=name)


@pytest.mark.parametrize("before, after", [
    (MeshShape(dp=4), MeshShape(dp=2, tp=2)),         # ZeRO-1 over 4 -> TP x DP
    (MeshShape(dp=2, tp=2), MeshShape(tp=2, pp=2)),   # -> a pipeline with the tied embedding
    (MeshShape(pp=2, dp=2), MeshShape()),             # -> one process
])
def test_a_checkpoint_resharded_continues_exactly_as_the_uninterrupted_run(before, after):
    res = train.reshard_check(before, after, steps=4, at=2, **SMALL)
    assert res["resumed_from"] == 2
    assert len(res["loss"]) == 4
    assert res["loss_diff"] < 1e-12, res
    assert res["param_diff"] < 1e-12, res
    assert res["save"][1] > 0


@pytest.mark.parametrize("before, after, zero", [
    (MeshShape(dp=2, pp=2), MeshShape(dp=2, tp=2), 2),   # ZeRO-2 owners -> TP x DP
    (MeshShape(dp=2), MeshShape(), 1),                   # -> one process
])
def test_the_whole_recipe_reshards_exactly_optimizer_state_and_schedule(before, after, zero):
    """AdamW's moments kept by their dp owners, and the warm-up + cosine schedule, resume on
    another mesh: the continued run equals the uninterrupted one (float64)."""
    res = train.reshard_check(before, after, steps=4, at=2, recipe=True, zero=zero, **SMALL)
    assert res["resumed_from"] == 2
    assert res["loss_diff"] < 1e-12 and res["param_diff"] < 1e-12, res


def test_a_recipe_resume_that_lost_the_schedule_would_differ(monkeypatch):
    """The check above sees the schedule: resuming with the learning rate left at its
    starting value (the scheduler not restored) moves the parameters off the reference."""
    from parlearn.mesh import MeshRank

    real = MeshRank.load_optimizer_state

    def forget_schedule(self, state_dict):
        lrs = [g["lr"] for g in self.opt.param_groups]
        real(self, state_dict)
        for g, lr in zip(self.opt.param_groups, lrs, strict=True):
            g["lr"] = lr
        self.sched._last_lr = lrs
        self.sched.last_epoch = 0

    monkeypatch.setattr(MeshRank, "load_optimizer_state", forget_schedule)
    res = train.reshard_check(MeshShape(dp=2), MeshShape(dp=2), steps=4, at=2, recipe=True,
                              **SMALL)
    assert res["param_diff"] > 1e-6


def test_a_resumed_run_that_skipped_the_load_would_differ():
    """The check above can fail: continuing on the after-mesh from the INITIAL weights
    (no checkpoint) gives other losses than the uninterrupted run."""
    fresh = train.train(train.TrainSpec(dp=2, steps=4, log=False, **SMALL))
    ref = train.reshard_check(MeshShape(dp=2), MeshShape(dp=2), steps=4, at=2, **SMALL)
    assert abs(fresh[0]["loss"][0] - ref["loss"][0]) < 1e-12
    assert abs(fresh[0]["loss"][3] - ref["loss"][3]) < 1e-12   # same run, same losses
    # A second run resumed from step 0's weights would repeat step 0's loss at step 2.
    assert abs(ref["loss"][2] - ref["loss"][0]) > 1e-3


def test_load_full_reads_every_tensor_whatever_saved_it(tmp_path):
    spec = train.TrainSpec(tp=2, pp=2, steps=1, ckpt=str(tmp_path), log=False, **SMALL)
    ranks = train.train(spec)
    full = ckpt.load_full(ckpt.step_dir(tmp_path, 1))
    assert full["step"] == 1
    assert set(full["params"]) == set(full["exp_avg"]) == set(full["exp_avg_sq"])
    from parlearn.mesh import assemble

    for name, t in assemble(ranks, spec.shape).items():
        assert torch.equal(full["params"][name], t), name


def test_latest_skips_a_save_cut_short_and_load_refuses_it(tmp_path):
    train.train(train.TrainSpec(dp=2, steps=2, every=1, ckpt=str(tmp_path), log=False, **SMALL))
    assert ckpt.latest(tmp_path) == (2, ckpt.step_dir(tmp_path, 2))
    os.remove(os.path.join(ckpt.step_dir(tmp_path, 2), ".metadata"))   # killed mid-save
    assert ckpt.latest(tmp_path) == (1, ckpt.step_dir(tmp_path, 1))
    assert ckpt.latest(tmp_path / "nothing") is None
    with pytest.raises(ValueError, match="directory"):
        ckpt.load_full(ckpt.step_dir(tmp_path, 2))


def _load_other_model(rank, world_size, directory):
    from parlearn.mesh import MeshRank
    from parlearn.transformer import GPTConfig

    from parlearn.at_scale import checkpoint as ck

    me = MeshRank(rank, GPTConfig(d_model=16, n_layers=2, n_heads=4), MeshShape(dp=2),
                  batch=8, seq=16)
    ck.load(me, directory)


def test_load_refuses_a_checkpoint_of_another_model_on_every_rank(tmp_path):
    from ranks import assert_refused_on_every_rank

    train.train(train.TrainSpec(dp=2, steps=1, ckpt=str(tmp_path), log=False, **SMALL))
    assert_refused_on_every_rank(_load_other_model, (ckpt.step_dir(tmp_path, 1),),
                                 name="directory")


def test_modeled_bytes_is_three_float64_copies_of_the_parameters(tmp_path):
    from parlearn.transformer import GPT

    spec = train.TrainSpec(dp=2, steps=1, ckpt=str(tmp_path), log=False, **SMALL)
    saves = train.train(spec)[0]["saves"]
    n = sum(p.numel() for p in GPT(spec.cfg, dtype=torch.float64).parameters())
    step, seconds, written = saves[0]
    assert step == 1 and seconds > 0
    # What DCP wrote holds the payload plus its own per-tensor headers and metadata.
    assert 24 * n < written < 2 * 24 * n


@pytest.mark.parametrize("fn", [ckpt.state, ckpt.modeled_bytes,
                                lambda me: ckpt.save(me, "/tmp/x"),
                                lambda me: ckpt.load(me, "/tmp/x")])
def test_the_rank_functions_refuse_what_is_not_a_mesh_rank(fn):
    with pytest.raises(TypeError, match="me must be a parlearn.mesh.MeshRank"):
        fn(object())


def _bad_mesh_call(rank, world_size, what):
    from parlearn.mesh import MeshRank
    from parlearn.transformer import GPTConfig

    cfg = GPTConfig(d_model=32, n_layers=2, n_heads=4)
    if what == "batch":
        MeshRank(rank, cfg, MeshShape(dp=2), batch=7, seq=16)
    if what == "world":
        MeshRank(rank, cfg, MeshShape(dp=4), batch=8, seq=16)
    me = MeshRank(rank, cfg, MeshShape(dp=2), batch=8, seq=16)
    if what == "idx":
        me.step(torch.zeros(8, 15, dtype=torch.int64), torch.zeros(8, 16, dtype=torch.int64))
    if what == "directory":
        ckpt.save(me, 3)
    if what == "total_steps":
        MeshRank(rank, cfg, MeshShape(dp=2), batch=8, seq=16, total_steps=4)


@pytest.mark.parametrize("what, name", [("batch", "batch"), ("world", "shape.world"),
                                        ("idx", "idx"), ("directory", "directory"),
                                        ("total_steps", "total_steps")])
def test_mesh_rank_and_save_refuse_bad_calls_on_every_rank(what, name):
    from ranks import assert_refused_on_every_rank

    assert_refused_on_every_rank(_bad_mesh_call, (what,), name=name)
