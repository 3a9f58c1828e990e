"""parlearn.sharding: every stage equals single-process Adam, the real engines equal it too,
memory and bytes sent equal their models, and the JAX update with psum_scatter is exact."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from parlearn.multi_device import sharding as S

# Two layers of 42 and 24 parameters: even for 2 ranks, padded for 4 (42 -> 44) and 5.
SPEC = S.Spec(sizes=(5, 7, 3), steps=3, batch=3)
TOL = 1e-12


def _assert_equal_to_serial(ranks: list[dict], serial: dict) -> None:
    for before, after in zip(serial["params"][:-1], serial["params"][1:], strict=True):
        # The step really moves the model: equality below is not equality of two copies of
        # the initial parameters.
        assert (after - before).abs().max() > 1e-4
    for out in ranks:
        assert len(out["params"]) == len(serial["params"])
        for got, want in zip(out["params"], serial["params"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=TOL)


# --- pieces that need no ranks ---------------------------------------------------------------

def test_flat_shard_pads_uneven_sizes_and_unpads_exactly():
    shapes = [torch.Size([3]), torch.Size([2, 5])]          # 13 elements
    tensors = [torch.arange(3.0), torch.arange(10.0).reshape(2, 5) + 100]
    layouts = [S.FlatShard(shapes, 4, r) for r in range(4)]
    assert layouts[0].numel == 13 and layouts[0].padded == 16 and layouts[0].padding == 3
    assert [(lay.lo, lay.hi) for lay in layouts] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    flat = layouts[0].flatten(tensors)
    assert flat.shape == (16,) and torch.equal(flat[13:], torch.zeros(3))
    for got, want in zip(layouts[0].views(flat), tensors, strict=True):
        assert torch.equal(got, want) and got.data_ptr() >= flat.data_ptr()
    assert torch.equal(torch.cat([lay.shard(flat) for lay in layouts]), flat)
    # Views share the buffer: writing through the flat buffer is seen by the tensor.
    flat[3] = -1.0
    assert layouts[0].views(flat)[1][0, 0] == -1.0


def test_adam_on_shards_equals_torch_adam_on_the_whole_tensor(any_device):
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(11, generator=gen, dtype=torch.float64).to(any_device)
    grads = [torch.randn(11, generator=gen, dtype=torch.float64).to(any_device)
             for _ in range(4)]
    ref = p0.clone().requires_grad_()
    opt = torch.optim.Adam([ref], lr=0.05, betas=(0.8, 0.99), eps=1e-6, foreach=False)
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for t, g in enumerate(grads, start=1):
        ref.grad = g.clone()
        opt.step()
        for sl in (slice(0, 4), slice(4, 8), slice(8, 11)):     # three uneven shards
            S.adam_update(p[sl], g[sl], m[sl], v[sl], t, lr=0.05, betas=(0.8, 0.99), eps=1e-6)
        assert torch.equal(p, ref.detach())


def test_storage_bytes_counts_each_storage_once_and_freed_storage_as_zero():
    flat = torch.zeros(10, dtype=torch.float64)
    views = [flat[:4], flat[4:], flat]
    assert S.storage_bytes(views + [None]) == 80
    other = torch.zeros(3, dtype=torch.float32)
    assert S.storage_bytes([*views, other]) == 92
    flat.untyped_storage().resize_(0)
    assert S.storage_bytes(views + [other]) == 12


def test_draw_stages_titles_carry_the_modeled_bytes_per_parameter():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4)
    S.draw_stages(axes, world_size=4)
    titles = [ax.get_title() for ax in axes]
    plt.close(fig)
    assert [t.split(":")[1].split()[0] for t in titles] == ["16", "7", "5.5", "4"]
    with pytest.raises(ValueError, match="axes"):
        S.draw_stages(axes[:2], world_size=4)


def test_memory_model_reproduces_the_zero_paper_figure_1():
    psi, n = 7_500_000_000, 64                  # 7.5B parameters, 64 GPUs, K = 12
    totals = [S.memory_model(psi, n, s, "bf16-mixed")["total"] / 1e9 for s in S.STAGES]
    assert totals == pytest.approx([120.0, 31.40625, 16.640625, 1.875])
    fp32 = S.memory_model(1000, 4, 2, "fp32")
    assert fp32 == {"params": 4000.0, "grads": 1000.0, "optimizer": 2000.0, "total": 7000.0}


def test_comm_model_stage_1_2_equal_all_reduce_and_stage_3_is_one_and_a_half():
    dp = S.comm_model(1000, 4, 0, 4)
    assert dp == {"all_reduce": 6000.0, "total": 6000.0}        # 2 (N-1)/N * 4000 bytes
    for stage in (1, 2):
        assert S.comm_model(1000, 4, stage, 4)["total"] == dp["total"]
    assert S.comm_model(1000, 4, 3, 4) == {"reduce_scatter": 3000.0, "all_gather": 6000.0,
                                          "total": 9000.0}


def test_gpus_needed_picks_the_fewest_ranks_that_fit():
    psi, gib = 7_000_000_000, 2**30
    # 16 bytes/param = 104 GiB replicated: no number of 80 GiB GPUs helps plain DP.
    assert S.gpus_needed(psi, 80 * gib, 0) is None
    # Stage 1: 4 psi = 26.1 GiB fixed + 78.2 GiB / N <= 80 GiB -> N = 2.
    assert S.gpus_needed(psi, 80 * gib, 1) == 2
    # 24 GiB cards: stage 1's fixed 26.1 GiB never fits; stage 2: 13.0 + 91.3/N -> N = 9.
    assert S.gpus_needed(psi, 24 * gib, 1, max_gpus=4096) is None
    assert S.gpus_needed(psi, 24 * gib, 2) == 9
    assert S.gpus_needed(psi, 24 * gib, 3) == 5                # 104.3 / N <= 24


def test_bad_arguments_fail_fast_with_their_names():
    with pytest.raises(ValueError, match="stage"):
        S.memory_model(10, 2, 4)
    with pytest.raises(ValueError, match="precision"):
        S.memory_model(10, 2, 1, "fp8")
    with pytest.raises(ValueError, match="world_size"):
        S.comm_model(10, 0, 1)
    with pytest.raises(ValueError, match="rank"):
        S.FlatShard([torch.Size([3])], 2, 2)
    with pytest.raises(ValueError, match="steps"):
        S.Spec(steps=0)
    with pytest.raises(ValueError, match="engine"):
        S.train_engine(SPEC, "deepspeed")
    with pytest.raises(TypeError, match="model"):
        S.ShardedAdam("not a model", stage=1)
    with pytest.raises(RuntimeError, match="process group"):
        S.ShardedAdam(S.mlp((2, 2)), stage=1)


def test_mlp_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b = S.mlp((4, 6, 2), seed=3), S.mlp((4, 6, 2), seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_importing_sharding_starts_neither_jax_nor_fsdp():
    code = ("import sys, parlearn.multi_device.sharding; "
            "bad = [m for m in ('jax', 'torch.distributed.fsdp', 'torch.distributed.optim') "
            "if m in sys.modules]; assert not bad, bad")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


# --- from scratch on real ranks ----------------------------------------------------------------

@pytest.mark.parametrize("stage,world_size", [(0, 2), (1, 2), (2, 2), (3, 2), (1, 4), (2, 5),
                                              (3, 4), (3, 5)])
def test_every_stage_equals_single_process_adam_step_by_step(stage, world_size):
    ranks = S.train_sharded(SPEC, stage, world_size, timeout=60)
    _assert_equal_to_serial(ranks, S.train_serial(SPEC, world_size))
    for out in ranks:
        n, padded = out["n_params"], out["padded_numel"]
        if world_size > 2:
            assert padded > n                      # the uneven case really is padded
        assert padded - n < 2 * world_size         # at most N-1 per unit, two units
        # Adam state: both moments, of the whole model (stage 0) or of this rank's shard.
        assert out["state_numel"] == 2 * (padded if stage == 0 else padded // world_size)
        # Bytes held after each step equal the model at the padded parameter count.
        want = S.memory_model(padded, world_size, stage, "fp64")
        for held in out["held"]:
            assert held == {k: int(v) for k, v in want.items()}
        # Bytes sent per step equal the model's (ring) figure, at the padded count.
        for records in out["records"]:
            wire = S.ledger_wire_bytes(records, world_size)
            assert wire == pytest.approx(S.comm_model(padded, world_size, stage, 8)["total"])
            kinds = [k for k, _ in records]
            if stage == 0:
                assert set(kinds) == {"all_reduce"}
            else:
                gathers = kinds.count("all_gather_single")
                assert gathers == (4 if stage == 3 else 2)          # per unit: 2 or 1
                assert kinds.count("reduce_scatter_single") == 2


@pytest.mark.parametrize("stage,backwards,error", [(2, 2, "second backward"),
                                                   (3, 2, "second backward"),
                                                   (3, 0, "without a complete backward")])
def test_stages_2_and_3_refuse_anything_but_one_backward_per_step(stage, backwards, error):
    from parlearn import distributed as dist

    with pytest.raises(dist.RankError, match=error):
        dist.run(S._worker_misuse, 2, args=(SPEC, stage, backwards), backend="gloo",
                 timeout=30)
    # One backward per step is fine (the exactness tests train that way).
    dist.run(S._worker_misuse, 2, args=(SPEC, stage, 1), backend="gloo", timeout=30)


def test_stages_1_and_2_send_exactly_what_plain_dp_sends():
    ws = 2
    sent = {s: [S.ledger_wire_bytes(r, ws) for r in S.train_sharded(SPEC, s, ws)[0]["records"]]
            for s in (0, 1, 2)}
    assert sent[0][0] > 0
    assert sent[1] == sent[0] and sent[2] == sent[0]


@pytest.mark.parametrize("sizes", [(5, 7, 3), (16, 48, 48, 10), (64, 96, 33)])
def test_measured_memory_equals_the_model_for_three_model_sizes(sizes):
    ws = 2
    spec = S.Spec(sizes=sizes, steps=1, batch=2)
    for out in S.measure_memory(spec, ws, timeout=60):
        padded = out["padded_numel"]
        assert 0 <= padded - spec.n_params < ws * (len(sizes) - 1)
        for stage in S.STAGES:
            want = S.memory_model(padded, ws, stage, "fp64")
            assert out[stage] == {k: int(v) for k, v in want.items()}, stage
        # And what sharding buys: each stage holds strictly less than the one before.
        totals = [out[s]["total"] for s in S.STAGES]
        assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4


# --- the real engines -------------------------------------------------------------------------

@pytest.mark.parametrize("engine,stage", [("zero", 1), ("fsdp2", 3)])
def test_real_engines_equal_the_from_scratch_stages(engine, stage):
    ws = 2
    ours = S.train_sharded(SPEC, stage, ws)
    theirs = S.train_engine(SPEC, engine, ws, timeout=90)
    _assert_equal_to_serial(theirs, S.train_serial(SPEC, ws))
    for a, b in zip(ours, theirs, strict=True):
        for pa, pb in zip(a["params"], b["params"], strict=True):
            torch.testing.assert_close(pa, pb, rtol=0, atol=TOL)
    state = [out["state_numel"] for out in theirs]
    if engine == "zero":
        # Whole tensors go to ranks: the state adds up to the model's but is not split evenly.
        assert sum(state) == 2 * SPEC.n_params
    else:
        # FSDP2 splits every tensor along dim 0: each rank about half, never the whole.
        assert all(s < 2 * SPEC.n_params for s in state)
        assert sum(state) == 2 * SPEC.n_params
        # ...and issues the collectives of our stage 3: per unit and step, two all-gathers
        # of the parameters (forward, backward) and one reduce-scatter of the gradient.
        for a, b in zip(ours, theirs, strict=True):
            for mine, fsdp in zip(a["records"], b["records"], strict=True):
                assert sorted(k for k, _ in fsdp) == sorted(k for k, _ in mine)
                # FSDP2 pads each tensor's dim 0, we pad each flat unit: it sends no less.
                assert S.ledger_wire_bytes(fsdp, ws) >= S.ledger_wire_bytes(mine, ws)


# --- JAX ----------------------------------------------------------------------------------------

def test_jax_psum_scatter_update_equals_unsharded_and_hlo_has_a_reduce_scatter():
    out = S.jax_sharded_adam_subprocess(8, timeout=300)
    assert out["n_devices"] == 8 and out["padded"] > out["numel"]
    assert out["max_update"] > 1e-4                  # the steps move the weights...
    assert out["max_abs_diff"] < 1e-13               # ...and both versions move them alike
    counts = out["collectives"]
    assert counts["reduce-scatter"] == 1 and counts["all-gather"] == 1
    assert counts["all-reduce"] == 0
    assert out["hlo_shapes"]["reduce-scatter"] == [f"f64[{out['padded'] // 8}]{{0}}"]


# --- bench ------------------------------------------------------------------------------------

def test_bench_quick_rows_report_memory_measured_equal_to_model():
    rows = S.bench(torch.device("cpu"), True)
    assert [r.variant for r in rows] == ["ZeRO-1 step", "ZeRO-2 step", "ZeRO-3 step"]
    assert all(r.met for r in rows) and all(r.ratio > 0 for r in rows)


# --- models a user brings: frozen layers, tied weights, LayerNorm, GELU ----------------------

def _odd_model() -> torch.nn.Sequential:
    """A frozen layer, a layer whose bias alone is frozen, two layers sharing one weight,
    LayerNorm and GELU: shapes the sharding stages must handle beside plain MLPs."""
    nn = torch.nn
    model = nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 6),
                          nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6),
                          nn.Linear(6, 3)).double()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / 2)
    model[3].requires_grad_(False)             # a frozen layer
    model[8].bias.requires_grad_(False)        # a module with one frozen parameter
    model[7].weight = model[5].weight          # tied: one tensor used by two layers
    return model


def _odd_data(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(8, 5, generator=gen, dtype=torch.float64),
            torch.randn(8, 3, generator=gen, dtype=torch.float64))


def _odd_loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _worker_odd(rank: int, world_size: int, stage: int, steps: int) -> dict:
    model = _odd_model()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    opt = S.ShardedAdam(model, stage=stage, lr=0.05)
    params = [opt.full_parameters()]
    for step in range(steps):
        x, y = _odd_data(step)
        rows = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)
        opt.zero_grad()
        _odd_loss(model, x[rows], y[rows]).backward()
        opt.step()
        params.append(opt.full_parameters())
    opt.remove_hooks()
    return {"params": params, "frozen_grads": [p.grad for p in frozen],
            "unit_numel": sum(u.layout.numel for u in opt.units),
            "held_params": opt.held_bytes()["params"],
            "unit_param_numel": sum(u.layout.shard_numel if stage == 3 else u.layout.padded
                                    for u in opt.units)}


@pytest.mark.parametrize("stage", S.STAGES)
def test_frozen_and_tied_parameters_train_like_torch_adam(stage):
    from parlearn import distributed as dist

    steps = 3
    model = _odd_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05, foreach=False)
    serial = {"params": [torch.nn.utils.parameters_to_vector(model.parameters()).clone()]}
    for step in range(steps):
        opt.zero_grad()
        _odd_loss(model, *_odd_data(step)).backward()
        opt.step()
        serial["params"].append(
            torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone())
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    moved = (serial["params"][-1] - serial["params"][0]) != 0
    assert int((~moved).sum()) == n_frozen          # frozen stay, every other one moves
    ranks = dist.run(_worker_odd, 2, args=(stage, steps), backend="gloo", timeout=30)
    _assert_equal_to_serial(ranks, serial)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for out in ranks:
        assert out["frozen_grads"] == [None, None, None]   # no gradient made for them
        assert out["unit_numel"] == n_trainable     # the tied weight is held (and Adam'd) once
        # What the rank holds: its units' buffers (or shards in stage 3) plus the frozen ones.
        assert out["held_params"] == 8 * (out["unit_param_numel"] + n_frozen)


def test_every_stage_argument_refuses_a_bool():
    """True == 1 in Python: ``zero=True`` once ran ZeRO-1. Every stage argument refuses bools
    (and floats standing for ints) before any work, ShardedAdam before it looks for ranks."""
    from parlearn.multi_device.mesh.planner import Plan

    calls = {
        "memory_model": lambda v: S.memory_model(10, 2, v),
        "comm_model": lambda v: S.comm_model(10, 2, v),
        "gpus_needed": lambda v: S.gpus_needed(10, 1e3, v),
        "train_sharded": lambda v: S.train_sharded(SPEC, v),
        "ShardedAdam": lambda v: S.ShardedAdam(torch.nn.Linear(2, 2), stage=v),
    }
    for name, call in calls.items():
        for value in (True, False, 1.0):
            with pytest.raises(ValueError, match="stage") as info:
                call(value)
            assert repr(value) in str(info.value), name
    for value in (True, False, 1.0):
        with pytest.raises(ValueError, match="zero"):
            Plan(zero=value)


# --- the users' model zoo ---------------------------------------------------------------------

def _zoo_steps(dtype):
    from zoo import batch

    return [batch(14, dtype, seed=20 + t) for t in range(2)]  # 7 rows a rank: a prime shard


def _worker_zoo_zero(rank: int, world_size: int) -> dict:
    """Every zoo model and dtype under every stage, in one launch: the parameters after
    each step (or the refusal's message) and the frozen parameters' .grad."""
    from zoo import build, cases

    out = {}
    for stage in S.STAGES:
        for name, dtype in cases():
            model = build(name, dtype)
            try:
                opt = S.ShardedAdam(model, stage=stage, lr=0.05)
            except ValueError as e:
                out[stage, name, dtype] = str(e)
                continue
            params = []
            for x, y in _zoo_steps(dtype):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[7 * rank:7 * (rank + 1)]),
                                                  y[7 * rank:7 * (rank + 1)]).backward()
                opt.step()
                params.append(opt.full_parameters())
            opt.remove_hooks()
            out[stage, name, dtype] = {"params": params, "frozen_grads": [
                p.grad for p in model.parameters() if not p.requires_grad]}
    try:
        S.ShardedAdam(build("relu" if rank == 0 else "tied"), stage=1)
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


def test_sharded_adam_on_the_zoo_equals_torch_adam_or_refuses_up_front():
    """Every stage on every zoo model (frozen, tied, bias-free, LayerNorm with and without
    affine, conv, other activations; float32/64) equals torch's Adam on the whole batch;
    frozen parameters never move and get no .grad; BatchNorm is refused naming it (each
    rank's statistics are of its shard); different models on the ranks: ValueError on each."""
    from zoo import FEATURES, build, cases, frozen

    from parlearn import distributed as dist

    ranks = dist.run(_worker_zoo_zero, 2, backend="gloo", timeout=180)
    for out in ranks:
        assert "differs between ranks" in out["mismatch"]
    for name, dtype in cases():
        model = build(name, dtype)
        still = frozen(model)
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05,
                               foreach=False)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        want = []
        for x, y in _zoo_steps(dtype):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            want.append(torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone())
        for n, p in model.named_parameters():  # frozen stay, every other tensor moves
            assert (n in still) == torch.equal(p.detach(), start[n]), (name, n)
        atol = 1e-12 if dtype == torch.float64 else 1e-5
        for stage in S.STAGES:
            for out in ranks:
                got = out[stage, name, dtype]
                if "batchnorm" in FEATURES[name]:
                    assert isinstance(got, str) and "BatchNorm1d" in got, got
                    continue
                assert all(g is None for g in got["frozen_grads"]), (stage, name)
                for t, w in enumerate(want):
                    torch.testing.assert_close(got["params"][t], w, rtol=0, atol=atol,
                                               msg=f"stage {stage} {name} {dtype} step {t}")


def test_sharded_adam_refuses_bad_arguments_naming_them_before_looking_for_ranks():
    """No process group here: every refusal comes from the argument checks, first."""
    net = S.mlp((2, 2))
    for kwargs, name in [(dict(stage=4), "stage"), (dict(stage=True), "stage"),
                         (dict(stage=1, lr=0.0), "lr"), (dict(stage=1, lr=math.nan), "lr"),
                         (dict(stage=1, lr=True), "lr"), (dict(stage=1, betas=(0.9,)), "betas"),
                         (dict(stage=1, betas=(1.0, 0.9)), "betas"),
                         (dict(stage=1, betas=[0.9, 0.99]), "betas"),
                         (dict(stage=1, eps=-1.0), "eps"), (dict(stage=1, eps="0"), "eps")]:
        with pytest.raises((TypeError, ValueError), match=name):
            S.ShardedAdam(net, **kwargs)
    bn = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    with pytest.raises(ValueError, match="BatchNorm1d"):
        S.ShardedAdam(bn, stage=1)
