"""Tests of parlearn.repurpose: the permutation keeps the function, the K-rank split equals
the pruned net in one process, off-block mass falls on a planted structure, the refit never
fits worse than plain pruning, and bytes counted by the ledger equal the byte model."""

import math

import pytest
import torch
import zoo
from torch import nn

from parlearn.core.device import threads
from parlearn.serial_chain import repurpose as rp


def _net(widths, seed=0):
    g = torch.Generator().manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        lin = nn.Linear(a, b, dtype=torch.float64)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(b, a, generator=g, dtype=torch.float64) / a ** 0.5)
            lin.bias.copy_(torch.randn(b, generator=g, dtype=torch.float64) * 0.1)
        layers += [lin, nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _x(n=64, d=6, seed=1):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _planted(k=4, width=16, depth=3, noise=0.02, seed=0):
    """Hidden-to-hidden weights block-diagonal (k blocks) plus small noise, then every hidden
    layer shuffled by a random permutation: the blocks are there, but hidden."""
    net = _net([6] + [width] * depth + [5], seed)
    g = torch.Generator().manual_seed(seed + 100)
    lins = rp.linears(net)
    blocks = torch.arange(width) // (width // k)
    with torch.no_grad():
        for lin in lins[1:-1]:
            lin.weight.mul_(torch.where(blocks[:, None] == blocks[None, :], 1.0, noise))
    perms = [torch.randperm(width, generator=g) for _ in range(depth)]
    return rp.permute(net, perms)


def test_permutation_keeps_the_function():
    net = _net([6, 12, 12, 12, 5])
    g = torch.Generator().manual_seed(3)
    perms = [torch.randperm(12, generator=g) for _ in range(3)]
    moved = rp.permute(net, perms)
    x = _x()
    assert (moved(x) - net(x)).abs().max().item() < 1e-13
    # the permutation really moved the weights (a no-op would pass the line above)
    assert (rp.linears(moved)[1].weight - rp.linears(net)[1].weight).abs().max() > 0.1


def test_restructure_keeps_the_function_and_lowers_the_mass():
    net = _planted()
    x = _x(128)
    moved, hist = rp.restructure(net, 4, x, sweeps=4)
    assert (moved(x) - net(x)).abs().max().item() < 1e-13
    # coordinate descent: the off-block share never rises
    assert all(b <= a + 1e-12 for a, b in zip(hist, hist[1:], strict=False)), hist
    # the planted blocks are found: the cross mass falls from most of it to the noise's share
    energy = rp.calibration_energy(moved, x)
    assert rp.off_block_mass(net, 4, energy) > 0.5
    assert rp.off_block_mass(moved, 4, energy) < 0.02
    assert hist[-1] == pytest.approx(rp.off_block_mass(moved, 4, energy), rel=1e-9)


def test_split_on_ranks_equals_the_pruned_net():
    net = _net([6, 8, 8, 8, 5], seed=2)
    x = _x(40)
    moved = rp.restructure(net, 2, x)[0]
    pruned = rp.prune_and_refit(moved, 2, x, 0.5)
    got = rp.split_inference(pruned, 2, x[:7])
    assert got["rank_spread"] == 0.0
    assert (got["logits"] - pruned(x[:7])).abs().max().item() < 1e-12
    # the ledger's bytes are exactly the messages the weights need
    assert got["bytes"] == pytest.approx(sum(rp.comm_bytes(pruned, 2, batch=7).values()))
    # and the pruned net differs from the unpruned one (the comparison is not vacuous)
    assert (pruned(x[:7]) - moved(x[:7])).abs().max().item() > 1e-6


def test_split_on_four_ranks_unpruned_is_the_net():
    net = _net([6, 8, 8, 8, 5], seed=4)
    x = _x(9)
    got = rp.split_inference(net, 4, x)
    assert (got["logits"] - net(x)).abs().max().item() < 1e-12
    # nothing pruned, dense weights: every rank needs every other rank's activations
    # 2 exchanges x 8 neurons x 3 other ranks, then the ring all-reduce of 5 logits; x 9 rows x 8 B
    assert got["bytes"] == pytest.approx(2 * 8 * 3 * 9 * 8 + 2 * 3 * 5 * 9 * 8)


def test_megatron_baseline_equals_the_net_and_its_byte_model():
    for widths in ([6, 8, 8, 8, 5], [6, 8, 8, 5]):
        net = _net(widths, seed=5)
        x = _x(7)
        got = rp.megatron_inference(net, 2, x)
        assert (got["logits"] - net(x)).abs().max().item() < 1e-12
        assert got["bytes"] == pytest.approx(rp.megatron_bytes(net, 2, batch=7))


def test_pruning_cuts_messages_and_refit_fits_no_worse():
    net = _net([6, 12, 12, 12, 5], seed=6)
    x = _x(200)
    moved = rp.restructure(net, 3, x)[0]
    full = sum(int(m.sum()) for m in rp.message_mask(moved, 3))
    assert full == 2 * 12 * 2  # dense: each of 2 exchanges sends 12 neurons to 2 others
    for p in (0.25, 0.5, 1.0):
        cut = rp.prune_and_refit(moved, 3, x, p, refit=False)
        fit = rp.prune_and_refit(moved, 3, x, p, refit=True)
        assert sum(int(m.sum()) for m in rp.message_mask(fit, 3)) == round(full * (1 - p))
        # layer-wise least squares: on the calibration data the refit output is closer
        e_cut = (cut(x) - moved(x)).pow(2).mean().item()
        e_fit = (fit(x) - moved(x)).pow(2).mean().item()
        assert e_fit < e_cut
    # prune=1: block-diagonal hidden-to-hidden weights, only the logits all-reduce is left
    bd = rp.prune_and_refit(moved, 3, x, 1.0)
    assert rp.comm_bytes(bd, 3)["exchange"] == 0
    same = rp.prune_and_refit(moved, 3, x, 0.0)
    pairs = zip(same.parameters(), moved.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_pruning_keeps_the_heavy_messages():
    net = _planted(k=2, width=8, noise=0.05)
    x = _x(100)
    moved = rp.restructure(net, 2, x)[0]
    energy = rp.calibration_energy(moved, x)
    cut = rp.prune_and_refit(moved, 2, x, 0.5, refit=False)
    w, wc = rp.linears(moved)[1].weight, rp.linears(cut)[1].weight
    blocks = torch.arange(8) // 4
    cross = blocks[:, None] != blocks[None, :]
    mass = ((w ** 2) * energy[1][None, :] * cross).T.reshape(8, 2, 4).sum(2)  # [i, b]
    kept = (wc != 0).T.reshape(8, 2, 4).any(2) & cross.T.reshape(8, 2, 4).any(2)
    dropped = ~kept & cross.T.reshape(8, 2, 4).any(2)
    assert mass[kept].min() >= mass[dropped].max()


def test_digits_mlp_learns_and_leaves_global_state():
    state = torch.get_rng_state()
    with threads(1):  # tiny matmuls: one thread is faster on a shared machine
        net, data = rp.digits_mlp(hidden=16, depth=2, steps=60, n_train=400)
    assert torch.equal(state, torch.get_rng_state())
    assert rp.accuracy(net, data.x_test, data.y_test) > 0.8
    assert all(p.grad is None for p in net.parameters())
    a, _ = rp.digits_mlp(hidden=16, depth=2, steps=5, n_train=50, seed=3)
    b, _ = rp.digits_mlp(hidden=16, depth=2, steps=5, n_train=50, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_tradeoff_runs_and_is_monotone_in_bytes():
    with threads(1):
        net, data = rp.digits_mlp(hidden=16, depth=2, steps=60, n_train=400)
        out = rp.tradeoff(net, data, 4, [0.0, 0.5, 1.0])
    assert out["bytes"] == sorted(out["bytes"], reverse=True)
    assert out["accuracy"][0] == pytest.approx(out["dense"])


def test_bad_input_fails_fast():
    net = _net([6, 8, 8, 5])
    x = _x()
    with pytest.raises(ValueError, match="k=3 must divide"):
        rp.comm_bytes(net, 3)
    with pytest.raises(ValueError, match="prune"):
        rp.prune_and_refit(net, 2, x, 1.5)
    with pytest.raises(TypeError, match="refit"):
        rp.prune_and_refit(net, 2, x, 0.5, refit=1)
    with pytest.raises(TypeError, match="net must be"):
        rp.linears(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="perms must hold"):
        rp.permute(net, [torch.arange(8)])
    with pytest.raises(ValueError, match=r"perms\[0\] must be a permutation"):
        rp.permute(net, [torch.zeros(8, dtype=torch.long), torch.arange(8)])
    with pytest.raises(ValueError, match=r"x must have shape \(\*, 6\)"):
        rp.split_inference(net, 2, torch.zeros(3, dtype=torch.float64))


# --- the users' model zoo ------------------------------------------------------------------

@pytest.mark.parametrize("name,dtype", zoo.cases(names=["relu", "frozen"]))
def test_zoo_restructure_and_prune_keep_the_function(name, dtype):
    """Linear-ReLU nets from the zoo, float32 as well as float64 (float32 used to fail on a
    float64 one-hot): the restructured net computes the same function, and pruning nothing
    keeps it too; the user's net is left as it was."""
    net = zoo.build(name, dtype)
    x, _ = zoo.batch(13, dtype)
    saved = [p.clone() for p in net.parameters()]
    with zoo.kept_state(net):
        out, history = rp.restructure(net, 2, x, sweeps=1, restarts=2)
        same = rp.prune_and_refit(out, 2, x, 0.0)
        pruned = rp.prune_and_refit(out, 2, x, 0.5)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out(x), net(x), **tol)
    torch.testing.assert_close(same(x), net(x), **tol)
    assert all(torch.isfinite(p).all() for p in pruned.parameters())
    assert history[-1] <= history[0]
    assert all(torch.equal(p, s) for p, s in zip(net.parameters(), saved, strict=True))


@pytest.mark.parametrize("name", [n for n in zoo.ZOO if n not in ("relu", "frozen")])
def test_zoo_nets_repurpose_cannot_handle_are_refused_up_front(name):
    x, _ = zoo.batch(7)
    with pytest.raises((TypeError, ValueError), match="net"):
        rp.restructure(zoo.build(name), 2, x)


def test_calibration_refuses_a_dtype_other_than_the_nets():
    net = zoo.build("relu", torch.float32)
    x, _ = zoo.batch(7, torch.float64)
    with pytest.raises(TypeError, match="x"):
        rp.calibration_energy(net, x)
    with pytest.raises(TypeError, match="x_calib"):
        rp.prune_and_refit(net, 2, x, 0.5)


@pytest.mark.parametrize("entry", [rp.split_inference, rp.megatron_inference])
def test_rank_entry_points_refuse_before_any_rank_starts(monkeypatch, entry):
    import parlearn.distributed

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started for a call that should have been refused")

    monkeypatch.setattr(parlearn.distributed, "run", no_ranks)
    net = zoo.build("relu")
    x, _ = zoo.batch(7)
    for name, kw in [("k", dict(k=5)), ("k", dict(k=0)), ("k", dict(k=True)),
                     ("x", dict(x=x.float())), ("x", dict(x=x[:, :5])), ("x", dict(x="x")),
                     ("net", dict(net=zoo.build("no_bias"))), ("net", dict(net="net")),
                     ("timeout", dict(timeout=0.0)), ("timeout", dict(timeout=math.inf))]:
        args = dict(net=net, k=2, x=x)
        args.update(kw)
        with pytest.raises((ValueError, TypeError), match=name):
            entry(**args)


ACCEPTED = ["relu", "frozen"]


@pytest.mark.parametrize("name,dtype", zoo.cases(names=ACCEPTED))
def test_zoo_every_entry_point_keeps_the_function_on_nets_it_accepts(name, dtype):
    """On the zoo's Linear-ReLU nets: split and Megatron inference on real ranks give the
    net's own logits with the bytes their models count; a permutation of hidden neurons
    keeps the function; the groups, masks and off-block mass are well formed; the pruning
    trade-off at 0 pruning is the dense accuracy. The user's net is left as it was."""
    from parlearn.core.datasets import Split

    net = zoo.build(name, dtype)
    x, y = zoo.batch(7, dtype)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    saved = [p.clone() for p in net.parameters()]
    itemsize = torch.finfo(dtype).bits // 8
    with zoo.kept_state(net), torch.no_grad():
        want = net(x)
        split = rp.split_inference(net, 2, x)
        mega = rp.megatron_inference(net, 2, x)
        torch.testing.assert_close(split["logits"], want, **tol)
        torch.testing.assert_close(mega["logits"], want, **tol)
        assert split["bytes"] == pytest.approx(sum(rp.comm_bytes(net, 2, batch=7,
                                                                  itemsize=itemsize).values()))
        assert mega["bytes"] == pytest.approx(rp.megatron_bytes(net, 2, batch=7,
                                                                itemsize=itemsize))
        energy = rp.calibration_energy(net, x)
        groups, history = rp.assign_groups(net, 2, energy, sweeps=1, restarts=2)
        assert all(torch.bincount(g).tolist() == [zoo.HIDDEN // 2] * 2 for g in groups)
        assert history[-1] <= history[0]
        perms = [torch.argsort(g, stable=True) for g in groups]
        torch.testing.assert_close(rp.permute(net, perms)(x), want, **tol)
        assert 0.0 <= rp.off_block_mass(net, 2, energy) <= 1.0
        masks = rp.message_mask(net, 2)
        assert all(m.dtype == torch.bool for m in masks)
        data = Split(x, y, x, y, zoo.OUT)
        out = rp.tradeoff(net, data, 2, [0.0], sweeps=1)
        assert out["accuracy"][0] == pytest.approx(out["dense"])
    assert all(torch.equal(p, s) for p, s in zip(net.parameters(), saved, strict=True))


ENTRIES = {
    "split_inference": lambda net, x: rp.split_inference(net, 2, x),
    "megatron_inference": lambda net, x: rp.megatron_inference(net, 2, x),
    "comm_bytes": lambda net, x: rp.comm_bytes(net, 2),
    "megatron_bytes": lambda net, x: rp.megatron_bytes(net, 2),
    "message_mask": lambda net, x: rp.message_mask(net, 2),
    "off_block_mass": lambda net, x: rp.off_block_mass(net, 2),
    "assign_groups": lambda net, x: rp.assign_groups(net, 2, []),
    "permute": lambda net, x: rp.permute(net, []),
    "prune_and_refit": lambda net, x: rp.prune_and_refit(net, 2, x, 0.5),
    "calibration_energy": lambda net, x: rp.calibration_energy(net, x),
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("name", [n for n in zoo.ZOO if n not in ACCEPTED])
def test_zoo_every_entry_point_refuses_nets_it_cannot_handle(entry, name):
    x, _ = zoo.batch(7)
    with pytest.raises((TypeError, ValueError), match="net"):
        ENTRIES[entry](zoo.build(name), x)


def _split_worker_on(rank, world, name):
    x, _ = zoo.batch(7)
    worker = rp.split_worker if name.startswith("split") else rp.megatron_worker
    return worker(rank, world, zoo.build(name.split(":")[1]), x)


@pytest.mark.parametrize("worker", ["split", "megatron"])
def test_zoo_rank_workers_refuse_on_every_rank(worker):
    from ranks import assert_refused_on_every_rank

    assert_refused_on_every_rank(_split_worker_on, (f"{worker}:tanh",), name="net")
