"""Data parallelism (naive, bucketed, DDP), the 8-bit dynamic tree type, its all-reduce."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

from parlearn import distributed as dist
from parlearn.multi_device import data_parallel as D
from parlearn.multi_device.data_parallel import compression as C
from parlearn.multi_device.data_parallel import workers as W

TIMEOUT = 60  # every multi-rank run is bounded: a hung rank raises instead of hanging


# --------------------------------------------------------------------------- 8-bit type

def test_code_table_has_256_distinct_sorted_codes_with_minus_one_zero_one():
    values, codes = C.sorted_codes()
    assert values.numel() == 256 and torch.unique(values).numel() == 256
    assert bool((values[1:] > values[:-1]).all())
    for v in (-1.0, 0.0, 1.0):
        assert bool((values == v).any())
    assert sorted(codes.tolist()) == list(range(256))


def test_code_layout_sign_exponent_run_indicator_fraction():
    table = C.code_table()
    assert table[0b0_1_111111] == 1.0                       # z=0, all fraction bits set
    assert table[0b1_1_111111] == -1.0
    assert table[0b0_1_000000] == pytest.approx(0.1 + 0.9 / 64)
    assert table[0b0_01_11111] == pytest.approx(0.1)         # z=1 tops out at 10**-1
    assert table[0b0_0000001] == pytest.approx(1e-6)        # z=6: no fraction bits left
    assert table[0] == 0.0
    # every exponent z holds 2**(6-z) positive codes, in (10**-(z+1), 10**-z]
    pos = table[table > 0]
    for z in range(7):
        inside = ((pos > 10.0 ** -(z + 1) * (1 + 1e-12)) & (pos <= 10.0 ** -z * (1 + 1e-12)))
        assert int(inside.sum()) == 2 ** (6 - z)


def test_quantize_dequantize_roundtrip_every_code(any_device):
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8).to(any_device)
    scale = 3.7
    back, s = C.quantize(C.dequantize(codes, scale, torch.float64), scale=scale)
    assert back.device == codes.device
    assert torch.equal(back, codes) and float(s) == scale


def test_quantize_is_nearest_code(any_device):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(500, generator=gen, dtype=torch.float64) * torch.logspace(
        -6, 0, 500, dtype=torch.float64)).to(any_device)
    codes, s = C.quantize(x)
    table = C.code_table().to(any_device)
    brute = (x[:, None] / s - table[None, :]).abs().min(1).values
    got = (C.dequantize(codes, 1.0, torch.float64) - x / s).abs()
    assert torch.allclose(got, brute, rtol=0, atol=1e-15)
    assert float(s) == float(x.abs().max())


def test_relative_error_small_where_linear_int8_fails():
    m = torch.logspace(-5, 0, 5001, dtype=torch.float64)
    tree = C.relative_error(m, "dynamic_tree")
    lin = C.relative_error(m, "linear_int8")
    assert float(tree.mean()) < 0.10
    assert float(lin.mean()) > 0.5
    small = m < 1e-2
    assert float(tree[small].mean()) < 0.2 * float(lin[small].mean())


def test_bad_inputs_fail_fast():
    with pytest.raises(ValueError, match="scale"):
        C.quantize(torch.tensor([2.0]), scale=1.0)
    with pytest.raises(TypeError, match="codes"):
        C.dequantize(torch.zeros(3, dtype=torch.int64), 1.0)
    with pytest.raises(ValueError, match="magnitudes"):
        C.relative_error(torch.tensor([0.0, 0.5]))
    with pytest.raises(ValueError, match="kind"):
        C.relative_error(torch.tensor([0.5]), "int4")


def _worker_compressed(rank, world, xs, steps):
    ef, plain, outs, recs = C.ErrorFeedback(), [], [], []
    for t in range(steps):
        with dist.ledger() as led:
            outs.append(C.compressed_all_reduce(xs[t][rank], error_feedback=ef))
        recs.append([(r.kind, r.bytes) for r in led.records])
        plain.append(C.compressed_all_reduce(xs[t][rank], average=False))
        assert torch.equal(plain[-1], C.compressed_all_reduce(xs[t][rank], average=False,
                                                              reference_coding=True))
        # out=: a given buffer, or x itself (in place), gets the same bits
        x = xs[t][rank]
        buf = torch.full_like(x, float("nan"))
        assert C.compressed_all_reduce(x, average=False, out=buf) is buf
        assert torch.equal(buf, plain[-1])
        y = x.clone()
        assert C.compressed_all_reduce(y, average=False, out=y) is y
        assert torch.equal(y, plain[-1])
    refused = ""
    try:                                  # every rank refuses before sending anything
        C.compressed_all_reduce(torch.tensor([1.0, float("nan")]))
    except ValueError as err:
        refused = str(err)
    for bad in (torch.empty(xs[0][rank].numel() + 1), torch.empty_like(xs[0][rank]).double()):
        try:
            C.compressed_all_reduce(xs[0][rank], out=bad)
            refused += " | accepted a bad out"
        except (ValueError, TypeError) as err:
            assert str(err).startswith("out must"), err
    return outs, plain, recs, refused


@pytest.mark.parametrize("world,n", [(2, 12), (3, 11), (3, 3 * C._BLOCK + 5)])
def test_compressed_all_reduce_equals_reference_and_sends_a_quarter(world, n):
    # the last size gives chunks of _BLOCK + 2 elements: the CPU's blocked reduction and
    # decoding then run over two blocks per chunk, the second of 2 elements (1 padding)
    gen = torch.Generator().manual_seed(world)
    steps = 3
    xs = [[torch.randn(n, generator=gen) for _ in range(world)] for _ in range(steps)]
    res = dist.run(_worker_compressed, world, args=(xs, steps), timeout=TIMEOUT)
    efs = [C.ErrorFeedback() for _ in range(world)]
    for t in range(steps):
        ref = C.compressed_all_reduce_reference(xs[t], error_feedback=efs)
        plain = C.compressed_all_reduce_reference(xs[t], average=False)
        for r in range(world):
            assert torch.equal(res[r][0][t], ref)
            assert torch.equal(res[r][1][t], plain)
        exact = torch.stack(xs[t]).mean(0)
        assert float((ref - exact).abs().max()) < 0.05 * float(exact.abs().max())
    assert all(r[3] == "x must not contain NaN or infinity" for r in res)
    # wire bytes by the ledger: codes are 1/4 of a float32 ring all-reduce, plus scales
    m = -(-n // world)
    wire = sum(dist.ring_bytes(k, b, world) for k, b in res[0][2][0])
    fp32 = dist.ring_bytes("all_reduce", 4 * world * m, world)
    scales = 2 * (world - 1) * 4
    assert wire == pytest.approx(fp32 / 4 + scales)
    assert {k for k, _ in res[0][2][0]} == {"all_to_all_single", "all_gather_single"}


def test_error_feedback_carries_the_residual():
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, generator=gen) * torch.logspace(-4, 0, 64) for _ in range(2)]
    efs = [C.ErrorFeedback() for _ in range(2)]
    # summed over steps, error feedback's results track the exact sum; without it, the
    # same rounding error repeats every step
    with_ef = sum(C.compressed_all_reduce_reference(xs, error_feedback=efs) for _ in range(20))
    without = 20 * C.compressed_all_reduce_reference(xs)
    exact = 20 * torch.stack(xs).mean(0)
    assert float((with_ef - exact).abs().sum()) < 0.3 * float((without - exact).abs().sum())


# ------------------------------------------------------------------ data parallel engines

def _data(steps=3, batch=8, d_in=5, classes=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(batch, d_in, generator=gen, dtype=torch.float64) for _ in range(steps)]
    ys = [torch.randint(0, classes, (batch,), generator=gen) for _ in range(steps)]
    return xs, ys


@pytest.mark.parametrize("kind", ["naive", "bucketed", "ddp"])
@pytest.mark.parametrize("optimizer,accum", [("sgd", 2), ("adam", 1)])
def test_data_parallel_equals_single_process_step_by_step(kind, optimizer, accum):
    xs, ys = _data()
    model = D.TiedMLP(5, 6, 3)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = D.train_reference(copy.deepcopy(model), xs, ys, lr=0.05, optimizer=optimizer)
    res = dist.run(D.worker_train, 2, args=(kind, copy.deepcopy(model), xs, ys, 0.05,
                                            optimizer, accum, 200), timeout=TIMEOUT)
    before = start
    for t in range(len(xs)):
        # not vacuous: every trained parameter moved in this step
        for n, v in ref[t].items():
            moved = float((v - before[n]).abs().max())
            assert (moved == 0.0) if n.startswith("frozen") else (moved > 1e-4), (t, n)
        for r in range(2):
            for n, v in ref[t].items():
                assert torch.allclose(res[r]["snapshots"][t][n], v, rtol=0, atol=1e-13), (t, n)
        before = ref[t]


def _worker_compressed_train(rank, world, model, xs, ys, lr):
    wrapped = D.CompressedDP(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    snaps = []
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(wrapped(D.shard(x, rank, world)),
                                          D.shard(y, rank, world)).backward()
        opt.step()
        snaps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return snaps


def test_compressed_dp_trains_a_frozen_tied_model_as_its_reference():
    # CompressedDP (one buffer kept across steps, decoded in place) on a model with a
    # frozen layer and a weight used twice: each step equals SGD on the reference
    # all-reduce of the two ranks' flattened gradients, bit for bit
    xs, ys = _data()
    model = D.TiedMLP(5, 6, 3)
    res = dist.run(_worker_compressed_train, 2, args=(copy.deepcopy(model), xs, ys, 0.05),
                   timeout=TIMEOUT)
    ref = copy.deepcopy(model)
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.05)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for t, (x, y) in enumerate(zip(xs, ys, strict=True)):
        flats = []
        for r in range(2):
            loss = torch.nn.functional.cross_entropy(ref(D.shard(x, r, 2)), D.shard(y, r, 2))
            flats.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
        avg, offset = C.compressed_all_reduce_reference(flats), 0
        for p in params:
            p.grad = avg[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()
        for n, v in ref.named_parameters():
            v = v.detach()
            moved = float((v - before[n]).abs().max())
            assert (moved == 0.0) if n.startswith("frozen") else (moved > 1e-4), (t, n)
            for r in range(2):
                assert torch.equal(res[r][t][n], v), (t, r, n)
        before = {n: p.detach().clone() for n, p in ref.named_parameters()}


def test_bucketed_hooks_fire_during_backward_and_every_grad_is_in_one_bucket():
    xs, ys = _data(steps=2)
    model = D.TiedMLP(5, 6, 3)
    res = dist.run(D.worker_train, 2, args=("bucketed", model, xs, ys, 0.05, "sgd", 2, 200),
                   timeout=TIMEOUT)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    buckets = res[0]["buckets"]
    flat = [n for b in buckets for n in b]
    assert sorted(flat) == sorted(trainable) and len(flat) == len(set(flat))
    assert len(buckets) > 1
    events = [(w, lab) for w, lab, _ in res[0]["events"]]
    # split into backward passes; accum=2: the first of each step is inside no_sync
    passes, cur = [], []
    for e in events:
        if e[0] == "forward" and cur:
            passes.append(cur)
            cur = []
        cur.append(e)
    passes.append(cur)
    assert len(passes) == 4
    for i, full in enumerate(passes):
        # "done" is logged by the all-reduce's completion callback on gloo's thread, so where
        # it falls among the backward's events is a race: check it only against its launch,
        # and the hook order on the backward's own thread without it.
        for b in range(len(buckets)):
            if ("done", str(b)) in full:
                assert full.index(("launch", str(b))) < full.index(("done", str(b)))
        p = [e for e in full if e[0] != "done"]
        kinds = [w for w, _ in p]
        if i % 2 == 0:                                    # no_sync: nothing is sent
            assert "launch" not in kinds and "end" not in kinds
            continue
        grads = [j for j, w in enumerate(kinds) if w == "grad"]
        launches = [j for j, w in enumerate(kinds) if w == "launch"]
        assert [p[j][1] for j in launches] == [str(b) for b in range(len(buckets))]
        # the first bucket leaves while gradients are still being produced
        assert launches[0] < grads[-1]
        assert kinds[-1] == "end" and max(launches) < len(kinds) - 1
        # each bucket launches right after its last gradient arrives
        for b, names in enumerate(buckets):
            last = max(j for j in grads if p[j][1] in names)
            assert p[last + 1] == ("launch", str(b))


def test_step_time_events_align_on_one_clock_across_ranks():
    # Each rank's events are relative to its own step start t0; shifted by t0 they share one
    # clock, on which no all-reduce can complete before the other rank has produced the
    # gradients it carries (the naive wrapper sends only after backward ends).
    res = dist.run(W.worker_step_time, 2, args=(("naive", "bucketed"), [8, 32, 32, 4], 4, 2),
                   timeout=TIMEOUT)
    for kind, done in (("naive", "reduced"), ("bucketed", "done")):
        at = [[(w, t + r[kind]["t0"]) for w, _, t in r[kind]["events"]] for r in res]
        for me, other in ((0, 1), (1, 0)):
            first_done = min(t for w, t in at[me] if w == done)
            if kind == "naive":
                assert first_done >= max(t for w, t in at[other] if w == "grad")
            assert max(t for w, t in at[me] if w == done) >= min(
                t for w, t in at[other] if w == "launch" or w == "grad")


def test_wrappers_refuse_bad_input():
    with pytest.raises(RuntimeError, match="process group"):
        D.NaiveDP(D.TiedMLP(2, 2, 2))
    with pytest.raises(ValueError, match="kind"):
        D.worker_train(0, 1, "zero", None, [], [], 0.1)
    with pytest.raises(ValueError, match="batch of 5"):
        D.shard(torch.zeros(5), 0, 2)


def test_ddp_dettmers8_hook_trains_and_sends_a_quarter():
    from parlearn.core.datasets import digits

    data = digits(n_train=200)
    out = {}
    for method in ("fp32", "ddp_dettmers8_hook"):
        out[method] = dist.run(W.worker_digits, 2, args=(method, data, 6, 16, 0.2, 16, 0, 3),
                               timeout=TIMEOUT)[0]
    wire8 = sum(dist.ring_bytes(k, b, 2) for k, b in out["ddp_dettmers8_hook"]["bytes"].items())
    wire32 = sum(dist.ring_bytes(k, b, 2) for k, b in out["fp32"]["bytes"].items())
    assert wire8 == pytest.approx(wire32 / 4 + 8, rel=0.01)
    acc8, acc32 = out["ddp_dettmers8_hook"]["accuracy"], out["fp32"]["accuracy"]
    assert acc8[-1] > 0.2 and abs(acc8[-1] - acc32[-1]) < 0.1


@functools.lru_cache(maxsize=1)
def _digits_args():
    from parlearn.core.datasets import digits

    return (digits(n_train=200), 8, 16, 0.2, 16, 0, 4)


@functools.lru_cache(maxsize=1)
def _fp32_digits():
    return dist.run(W.worker_digits, 2, args=("fp32", *_digits_args()), timeout=TIMEOUT)[0]


@pytest.mark.parametrize("method", ["ddp_fp16_hook", "ddp_powersgd_hook", "8bit_ef"])
def test_other_compressed_methods_train_like_fp32(method):
    args = _digits_args()
    ref = _fp32_digits()
    got = dist.run(W.worker_digits, 2, args=(method, *args), timeout=TIMEOUT)
    assert got[0]["accuracy"] == got[1]["accuracy"]       # replicas stayed identical
    assert abs(got[0]["accuracy"][-1] - ref["accuracy"][-1]) < 0.15


# --------------------------------------------------------------------------- cost model

def test_dp_step_model_hand_computed():
    ab = dist.AlphaBeta(alpha=1e-3, beta=1e-6)
    sizes = [1000, 2000, 3000]          # bytes in registration order
    t = [2e-3 + n * 1e-6 for n in sizes]     # N=2 ring all-reduce: 2 alpha + n beta
    naive = D.dp_step_model(sizes, 2, ab, compute_seconds=0.03, strategy="naive")
    assert naive.comm == pytest.approx(sum(t)) and naive.step == pytest.approx(0.03 + sum(t))
    one = D.dp_step_model(sizes, 2, ab, compute_seconds=0.03, strategy="one_bucket")
    assert one.comm == pytest.approx(2e-3 + 6000e-6)
    # buckets of one tensor each, backward 0.02 s after a 0.01 s forward; reverse order:
    # 3000 B ready at 0.01 + 0.02 * 3/6, then 2000 B at 0.01 + 0.02 * 5/6, then 1000 B
    b = D.dp_step_model(sizes, 2, ab, compute_seconds=0.03, strategy="bucketed",
                        bucket_bytes=2500)
    r = [0.02, 0.01 + 0.02 * 5 / 6, 0.03]
    e0 = r[0] + t[2]
    e1 = max(r[1], e0) + t[1]
    e2 = max(r[2], e1) + t[0]
    assert [s[2] for s in b.buckets] == pytest.approx([e0, e1, e2])
    assert b.step == pytest.approx(max(0.03, e2))
    assert b.hidden == pytest.approx(0.03 + sum(t) - b.step) and b.hidden > 0
    assert D.dp_step_model(sizes, 1, ab, compute_seconds=0.03).step == 0.03
    with pytest.raises(ValueError, match="strategy"):
        D.dp_step_model(sizes, 2, ab, compute_seconds=0.1, strategy="ring")


# --------------------------------------------------------------------------- stragglers

def _straggler_data(workers, steps, batch=4, seed=5):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(steps, batch, 5, generator=gen, dtype=torch.float64)
          for _ in range(workers)]
    ys = [torch.randint(0, 3, (steps, batch), generator=gen) for _ in range(workers)]
    return xs, ys


@pytest.mark.parametrize("b", [0, 1])
def test_backup_workers_never_wait_for_the_straggler(b):
    from parlearn.multi_device.data_parallel.stragglers import DelayModel

    steps, workers = 3, 3
    xs, ys = _straggler_data(workers, steps)
    model = D.mlp([5, 4, 3], dtype=torch.float64)
    delays = DelayModel(kind="none", slow=((3, 0.5),))     # rank 3 is always late
    res = dist.run(_backup, workers + 1, args=(model, xs, ys, b, delays, steps),
                   timeout=TIMEOUT)
    server = res[0]
    for t in range(steps):
        used = sorted(server["accepted"][t])
        if b == 1:
            assert used == [1, 2] and 3 in server["late"][t]     # decided without rank 3
        else:
            assert used == [1, 2, 3] and server["late"][t] == []
        want = sum(res[w]["grads"][t] for w in used) / len(used)
        assert torch.allclose(server["grad"][t], want, rtol=0, atol=1e-15)
        for w in used:     # the gradients used were computed at this step's parameters
            assert torch.equal(res[w]["thetas"][t], res[1]["thetas"][t])
        if t:
            assert not torch.equal(res[1]["thetas"][t], res[1]["thetas"][t - 1])


def _backup(rank, world, model, xs, ys, b, delays, steps):
    from parlearn.multi_device.data_parallel.stragglers import worker_backup_sgd

    return worker_backup_sgd(rank, world, model, xs, ys, b, delays, lr=0.1, steps=steps)


def test_order_statistics_and_tradeoff():
    from parlearn.multi_device.data_parallel.stragglers import (
        DelayModel,
        backup_tradeoff,
        expected_order_statistic,
    )

    exp = DelayModel(kind="exponential", mean=2.0)
    assert expected_order_statistic(1, 1, exp) == pytest.approx(2.0)
    assert expected_order_statistic(3, 3, exp) == pytest.approx(2.0 * (1 + 1 / 2 + 1 / 3))
    assert expected_order_statistic(1, 4, exp) == pytest.approx(2.0 / 4)
    par = DelayModel(kind="pareto", mean=1.0, shape=3.0)
    assert expected_order_statistic(1, 1, par) == pytest.approx(1.0)
    # Monte Carlo from the delay model's own draws agrees with the closed forms
    for model in (exp, par):
        draws = torch.tensor([[model.delay(r, s) for r in range(5)] for s in range(4000)])
        mc = draws.sort(1).values.mean(0)
        for k in (1, 3, 5):
            assert float(mc[k - 1]) == pytest.approx(expected_order_statistic(k, 5, model),
                                                     rel=0.1)
    t0 = backup_tradeoff(8, 0, exp, compute_seconds=1.0)
    t2 = backup_tradeoff(8, 2, exp, compute_seconds=1.0)
    assert t2["time_per_step"] < t0["time_per_step"] and t2["variance"] > t0["variance"]
    with pytest.raises(ValueError, match="b must"):
        backup_tradeoff(4, 4, exp, compute_seconds=1.0)


def test_order_statistic_median_is_not_the_mean():
    """A median of measured steps must be compared with the median of X_(k:n), not its mean:
    for the largest of n exponentials the median is -mu ln(1 - 2^(-1/n)) (1.58 mu for n = 3,
    where the mean is 1.83 mu)."""
    from parlearn.multi_device.data_parallel.stragglers import (
        DelayModel,
        expected_order_statistic,
        order_statistic_quantile,
    )

    exp = DelayModel(kind="exponential", mean=0.04)
    for n in (1, 3, 8):
        closed = -0.04 * math.log(1 - 0.5 ** (1 / n))
        assert order_statistic_quantile(n, n, exp) == pytest.approx(closed, rel=1e-9)
    assert order_statistic_quantile(3, 3, exp) < 0.9 * expected_order_statistic(3, 3, exp)
    # the minimum of n exponentials is exponential with mean mu / n: median mu ln 2 / n
    assert order_statistic_quantile(1, 4, exp) == pytest.approx(0.04 * math.log(2) / 4)
    assert order_statistic_quantile(2, 5, exp, q=0.9) > order_statistic_quantile(2, 5, exp)
    # Monte Carlo medians of the delay model's own draws agree (exponential and Pareto)
    for model in (exp, DelayModel(kind="pareto", mean=1.0, shape=3.0)):
        draws = torch.tensor([[model.delay(r, s) for r in range(5)] for s in range(4000)])
        mc = draws.sort(1).values.median(0).values
        for k in (1, 3, 5):
            assert float(mc[k - 1]) == pytest.approx(order_statistic_quantile(k, 5, model),
                                                     rel=0.1)
    assert order_statistic_quantile(2, 3, DelayModel(kind="none")) == 0.0


def test_compressed_all_reduce_time_counts_its_four_collectives():
    ab = dist.AlphaBeta(alpha=1e-3, beta=1e-6)
    # N=2, 10 elements: 10 code bytes and 8 scale bytes, each all_to_all + all_gather,
    # each a + n/2 b on 2 ranks (ring)
    want = 4 * 1e-3 + 2 * (10 / 2 + 8 / 2) * 1e-6
    assert C.compressed_all_reduce_time(10, 2, ab) == pytest.approx(want)
    assert C.compressed_all_reduce_time(10, 1, ab) == 0.0


def test_step_spans_and_summaries_from_event_logs():
    ev = [("forward", "", 0.0), ("backward", "", 1.0), ("grad", "b", 1.5), ("launch", "0", 1.6),
          ("grad", "a", 2.0), ("launch", "1", 2.1), ("done", "0", 2.5), ("done", "1", 3.0),
          ("end", "", 3.1)]
    spans = W.step_spans(ev, "r0")
    assert ("r0 compute", "forward", 0.0, 1.0) in spans
    assert ("r0 compute", "backward", 1.0, 2.0) in spans
    assert ("r0 comm", "all-reduce bucket 0", 1.6, 2.5) in spans
    assert ("r0 comm", "all-reduce bucket 1", 2.1, 3.0) in spans
    naive = W.step_spans([("grad", "a", 1.0), ("reduced", "a", 1.5), ("reduced", "b", 2.5)], "r")
    assert naive == [("r comm", "all-reduce a", 1.0, 1.5), ("r comm", "all-reduce b", 1.5, 2.5)]
    res = [{"k": {"times": [9.0, 1.0, 2.0, 3.0], "bytes": {"all_reduce": 8}}},
           {"k": {"times": [9.0, 4.0, 1.0, 1.0], "bytes": {"all_reduce": 8}}}]
    s = W.summarize_steps(res)["k"]          # slowest rank per step: 4, 2, 3 after the first
    assert s["median"] == 3.0 and s["bytes"] == {"all_reduce": 8}
    assert D.mlp_param_bytes([3, 4, 2]) == [48, 16, 32, 8]


def test_models_leave_the_global_rng_alone():
    state = torch.random.get_rng_state()
    D.TiedMLP(4, 6, 3, seed=2)
    D.mlp([4, 6, 3], seed=2)
    assert torch.equal(state, torch.random.get_rng_state())
    a, b = D.mlp([4, 6, 3], seed=2), D.mlp([4, 6, 3], seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


# ------------------------------------------------------------------ the users' model zoo

ZOO_STEPS, ZOO_BATCH, ZOO_LR = 2, 14, 0.1  # 7 rows a rank: a prime shard


def _zoo_data(dtype):
    from zoo import batch

    pairs = [batch(ZOO_BATCH, dtype, seed=10 + t) for t in range(ZOO_STEPS)]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _worker_zoo_dp(rank, world):
    """Every zoo model and dtype under each from-scratch wrapper, in one launch: the
    parameters after each step (or the refusal's message), the frozen ones' .grad."""
    from zoo import ZOO, build, cases

    out = {}
    for name, dtype in cases():
        xs, ys = _zoo_data(dtype)
        for kind, wrap in (("naive", D.NaiveDP), ("bucketed",
                                                  functools.partial(D.BucketedDP,
                                                                    bucket_bytes=256)),
                           ("compressed", D.CompressedDP)):
            model = build(name, dtype)
            try:
                wrapped = wrap(model, record=False)
            except ValueError as e:
                out[kind, name, dtype] = str(e)
                continue
            params = [p for p in model.parameters() if p.requires_grad]
            opt = (torch.optim.SGD(params, lr=ZOO_LR) if kind == "compressed"
                   else torch.optim.SGD(params, lr=ZOO_LR, momentum=0.9))
            snaps = []
            for x, y in zip(xs, ys, strict=True):
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(wrapped(D.shard(x, rank, world)),
                                                  D.shard(y, rank, world)).backward()
                opt.step()
                snaps.append({n: p.detach().clone() for n, p in model.named_parameters()})
            wrapped.remove_hooks()
            out[kind, name, dtype] = {"snaps": snaps, "frozen_grads": [
                p.grad for p in model.parameters() if not p.requires_grad]}
    # Ranks bringing different models: a ValueError on every rank, before any broadcast.
    try:
        D.NaiveDP(build("relu" if rank == 0 else "tied"))
    except ValueError as e:
        out["mismatch"] = str(e)
    assert set(ZOO) >= {n for _, n, _ in [k for k in out if k != "mismatch"]}
    return out


def _compressed_reference(model, xs, ys):
    """SGD on the reference 8-bit all-reduce of the two ranks' flattened gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=ZOO_LR)
    snaps = []
    for x, y in zip(xs, ys, strict=True):
        flats = []
        for r in range(2):
            loss = torch.nn.functional.cross_entropy(model(D.shard(x, r, 2)), D.shard(y, r, 2))
            flats.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
        avg, offset = C.compressed_all_reduce_reference(flats), 0
        for p in params:
            p.grad = avg[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()
        snaps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return snaps


def test_dp_wrappers_on_the_zoo_equal_one_process_or_refuse_up_front():
    """NaiveDP and BucketedDP on every zoo model (frozen, tied, bias-free, LayerNorm, conv,
    other activations; float32/64; 7-row shards) equal single-process SGD with momentum;
    CompressedDP equals SGD on its reference 8-bit all-reduce, bit for bit; frozen
    parameters never move nor get a .grad; BatchNorm is refused naming it; ranks with
    different models get a ValueError each, not a hang."""
    from zoo import FEATURES, assert_frozen_unmoved, build, cases, frozen

    from parlearn.core.device import threads

    res = dist.run(_worker_zoo_dp, 2, timeout=TIMEOUT * 3)
    for r in range(2):
        assert "differs between ranks" in res[r]["mismatch"]
    for name, dtype in cases():
        xs, ys = _zoo_data(dtype)
        atol = 1e-12 if dtype == torch.float64 else 2e-6
        for kind in ("naive", "bucketed", "compressed"):
            got = [res[r][kind, name, dtype] for r in range(2)]
            if "batchnorm" in FEATURES[name]:
                assert all("BatchNorm1d" in g and "module" in g for g in got), got
                continue
            model = build(name, dtype)
            still = frozen(model)
            start = {n: p.detach().clone() for n, p in model.named_parameters()}
            if kind == "compressed":
                # One thread, as each rank runs: a float32 conv's gradient sums in an order
                # that depends on the thread count, and 8-bit codes can flip on its last bit.
                with threads(1):
                    ref = _compressed_reference(model, xs, ys)
            else:
                ref = D.train_reference(model, xs, ys, lr=ZOO_LR, optimizer="sgd")
            assert_frozen_unmoved(model, still)
            for n, v in ref[-1].items():  # not vacuous: every trainable parameter moved
                assert (n in still) == torch.equal(v, start[n]), (kind, name, n)
            for g in got:
                assert all(fg is None for fg in g["frozen_grads"]), (kind, name)
                for t, snap in enumerate(ref):
                    for n, v in snap.items():
                        if kind == "compressed":
                            assert torch.equal(g["snaps"][t][n], v), (kind, name, dtype, t, n)
                        else:
                            torch.testing.assert_close(g["snaps"][t][n], v, rtol=0, atol=atol,
                                                       msg=f"{kind} {name} {dtype} {t} {n}")


def test_dp_wrappers_refuse_bad_arguments_naming_them_before_any_rank_work():
    """No process group exists here: each refusal comes from the argument checks, which run
    before the wrappers look for ranks, broadcast or hook anything."""
    net = D.TiedMLP(2, 2, 2)
    for wrap in (D.NaiveDP, D.BucketedDP, D.CompressedDP):
        for module in ("a model", None, 3):
            with pytest.raises(TypeError, match="module"):
                wrap(module)
        for record in (1, "yes", None):
            with pytest.raises(TypeError, match="record"):
                wrap(net, record=record)
    for bucket_bytes in (0, -1, True, 2.5, "1MB"):
        with pytest.raises((TypeError, ValueError), match="bucket_bytes"):
            D.BucketedDP(net, bucket_bytes=bucket_bytes)
    for flag in ("error_feedback", "reference_coding"):
        with pytest.raises(TypeError, match=flag):
            D.CompressedDP(net, **{flag: 1})
    with pytest.raises(TypeError, match="module"):
        D.make_ddp("a model")
    with pytest.raises((TypeError, ValueError), match="bucket_bytes"):
        D.make_ddp(net, bucket_bytes=True)
    bn = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    for wrap in (D.NaiveDP, D.BucketedDP, D.CompressedDP):
        for mode in (True, False):   # in eval mode too: the wrapped model will be trained
            with pytest.raises(ValueError, match="BatchNorm1d"):
                wrap(bn.train(mode))
    for kind in ("zero", True, 1):
        with pytest.raises(ValueError, match="kind"):
            D.worker_train(0, 1, kind, net, [], [], 0.1)
    with pytest.raises((TypeError, ValueError), match="accum"):
        D.worker_train(0, 1, "naive", net, [], [], 0.1, accum=0)


def test_refuse_batch_statistics_refuses_any_batchnorm_or_only_one_in_training_mode():
    """The DP wrappers, ZeRO and backup workers refuse every BatchNorm; shard_module passes
    ``training_only=True``: one in eval mode normalises by its running statistics."""
    from parlearn.multi_device.data_parallel.ddp import refuse_batch_statistics

    bn = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    with pytest.raises(ValueError, match=r"BatchNorm1d at '1': NaiveDP averages"):
        refuse_batch_statistics(bn.eval(), "NaiveDP")
    refuse_batch_statistics(bn.eval(), "shard_module", training_only=True)
    with pytest.raises(ValueError, match=r"BatchNorm1d at '1' in training mode: shard_module"):
        refuse_batch_statistics(bn.train(), "shard_module", training_only=True)
    refuse_batch_statistics(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)),
                            "NaiveDP")
