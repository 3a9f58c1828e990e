"""parlearn.context_parallel: every scheme equals full attention, forward and backward,
float64, on real gloo ranks; bytes and memory equal their formulas."""

from __future__ import annotations

import pytest
import torch

from parlearn import context_parallel as cp
from parlearn import distributed as dist
from parlearn.distributed import RankError, ring_bytes, run
from parlearn.multi_device.context_parallel import ring as ring_module

TOL = 1e-12


# ---------------------------------------------------------------------------------------
# serial pieces

@pytest.mark.parametrize("causal", [False, True])
def test_blocks_merged_over_key_chunks_equal_full_attention(causal):
    q, k, v, w = cp.attention_inputs(11, batch=2, heads=3, head_dim=4, seed=1)
    chunks = [(0, 4), (4, 7), (7, 11)]
    o = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    for a, b in reversed(chunks):  # any order
        bo, bl, _ = cp.block_attention(q, k[..., a:b, :], v[..., a:b, :], [(0, 11)], [(a, b)],
                                       causal)
        o, lse = cp.merge(o, lse, bo, bl)
    assert torch.allclose(o, cp.full_attention(q, k, v, causal), atol=TOL, rtol=0)

    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    (cp.full_attention(qs, ks, vs, causal) * w).sum().backward()
    delta = (w * o).sum(-1)
    dq = torch.zeros_like(q)
    for a, b in chunks:
        bq, bk, bv = cp.block_backward(q, k[..., a:b, :], v[..., a:b, :], w, lse, delta,
                                       [(0, 11)], [(a, b)], causal)
        dq += bq
        assert torch.allclose(bk, ks.grad[..., a:b, :], atol=TOL, rtol=0)
        assert torch.allclose(bv, vs.grad[..., a:b, :], atol=TOL, rtol=0)
    assert torch.allclose(dq, qs.grad, atol=TOL, rtol=0)


def test_layouts_cover_the_sequence_once():
    for layout in cp.LAYOUTS:
        for n in (2, 3, 4):
            idx = torch.cat([cp.shard_index(19, n, r, layout) for r in range(n)])
            assert sorted(idx.tolist()) == list(range(19))
    assert cp.shard_chunks(8, 2, 0, "zigzag") == [(0, 2), (6, 8)]
    assert cp.shard_chunks(8, 2, 1, "zigzag") == [(2, 4), (4, 6)]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_causal_work_naive_vs_zigzag(n):
    seq = 8 * n
    naive = cp.causal_work(seq, n, "contiguous")
    zig = cp.causal_work(seq, n, "zigzag")
    c = seq // n
    assert naive == [(r + 1) * c * c for r in range(n)]  # rank r: r full tiles + diagonal
    assert len(set(zig)) == 1 and sum(zig) < sum(naive)
    assert cp.idle_fraction(naive) == pytest.approx((n - 1) / (2 * n))
    assert cp.idle_fraction(zig) == 0.0
    # uneven: equal to within one chunk's tile
    uneven = cp.causal_work(seq + 3, n, "zigzag")
    chunk = (seq + 3) // (2 * n) + 1
    assert max(uneven) - min(uneven) <= chunk * chunk
    assert cp.causal_work(seq, n, "contiguous", causal=False) == [seq * c] * n


# ---------------------------------------------------------------------------------------
# every scheme vs full attention on real ranks

CASES = [(scheme, n, causal, layout) for scheme in cp.SCHEMES for n in (2, 3, 4)
         for causal in (False, True) for layout in cp.LAYOUTS]


@pytest.mark.parametrize("scheme,n,causal,layout", CASES)
def test_scheme_equals_full_attention(scheme, n, causal, layout):
    seq = 4 * n + 1  # does not divide evenly
    err = cp.attention_check(scheme, n, seq, heads=12, head_dim=2, batch=2, causal=causal,
                             layout=layout, timeout=20)
    assert max(err[k] for k in ("o", "dq", "dk", "dv")) < TOL, err


def test_attention_checks_in_one_launch_equal_one_launch_per_case():
    cases = [dict(scheme=s, seq=13, heads=12, head_dim=2, batch=2, causal=c, layout=lay)
             for s, c, lay in (("ring", True, "zigzag"), ("ulysses", False, "contiguous"),
                               ("allgather", True, "contiguous"))]
    together = cp.attention_checks(3, cases, timeout=20)
    assert len(together) == len(cases)
    for case, got in zip(cases, together, strict=True):
        alone = cp.attention_check(case.pop("scheme"), 3, case.pop("seq"), timeout=20, **case)
        for k in ("o", "dq", "dk", "dv"):
            assert got[k] == alone[k] and got[k] < TOL
        assert got["saved_full"] == alone["saved_full"]
        for g, a in zip(got["ranks"], alone["ranks"], strict=True):
            assert g["saved"] == a["saved"]
            for phase in ("forward", "backward"):   # (count, bytes); the seconds differ
                assert {k: v[:2] for k, v in g[phase].items()} == {
                    k: v[:2] for k, v in a[phase].items()}
            assert torch.equal(g["o"], a["o"]) and torch.equal(g["dk"], a["dk"])


def test_attention_checks_refuses_a_bad_case_before_the_ranks_start():
    good = dict(scheme="ring", seq=8)
    with pytest.raises(ValueError, match="seq"):
        cp.attention_checks(2, [good, dict(scheme="ring", seq=3, layout="zigzag")])
    with pytest.raises(ValueError, match="cases"):
        cp.attention_checks(2, [good, dict(scheme="ring", seq=8, colour="red")])


def _stale_kv(monkeypatch):
    """The diffusers#14265 bug, applied to our ring backward: every step reuses the K/V
    block it saw first instead of the one it received."""
    real, first = ring_module.block_backward, {}

    def stale(q, k, v, *args):
        first.setdefault("kv", (k, v))
        return real(q, *first["kv"], *args)

    monkeypatch.setattr(ring_module, "block_backward", stale)


def test_ring_backward_that_reuses_first_kv_is_caught(monkeypatch):
    _stale_kv(monkeypatch)  # forked ranks inherit the patch
    err = cp.attention_check("ring", 2, 8, causal=False, timeout=20)
    assert err["o"] < TOL  # the forward is untouched: why the bug stayed silent
    assert err["dq"] > 1e-3 and err["dk"] > 1e-3


def test_ledger_bytes_equal_the_formulas():
    b, seq, heads, d, n = 2, 16, 4, 2, 4
    for scheme in cp.SCHEMES:
        r = cp.attention_check(scheme, n, seq, batch=b, heads=heads, head_dim=d, timeout=20)
        model = cp.scheme_cost(scheme, batch=b, seq=seq, heads=heads, head_dim=d,
                               world_size=n)
        for rank in r["ranks"]:
            for phase in ("forward", "backward"):
                kinds = {kind for kind, _ in model[phase]}
                assert set(rank[phase]) - {"irecv"} == kinds, (scheme, phase)
                for kind in kinds:
                    count, nbytes, _ = rank[phase][kind]
                    assert count == sum(1 for k, _ in model[phase] if k == kind)
                    assert nbytes == sum(x for k, x in model[phase] if k == kind)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_memory_measured_equals_modeled(causal):
    b, seq, heads, d = 1, 16, 4, 2
    shape = dict(batch=b, seq=seq, heads=heads, head_dim=d, causal=causal)
    for scheme in cp.SCHEMES:
        for n in (2, 4):
            r = cp.attention_check(scheme, n, seq, timeout=20,
                                   **{k: v for k, v in shape.items() if k != "seq"})
            assert r["saved_full"] == cp.attention_memory("full", **shape)
            want = cp.attention_memory(scheme, world_size=n, **shape)
            assert [x["saved"] for x in r["ranks"]] == [want] * n


def test_ring_timeline_has_n_blocks_and_n_minus_1_waits():
    r = cp.attention_check("ring", 3, 9, causal=True, timeout=20)
    for rank in r["ranks"]:
        labels = [e[0] for e in rank["timeline"]]
        assert labels.count("fwd compute") == 3 and labels.count("fwd wait") == 2
        assert labels.count("bwd compute") == 3 and labels.count("bwd grad wait") == 3
        summary = cp.timeline_summary(rank["timeline"])
        assert summary["fwd compute"] > 0
    work = [dict((e[0], e[1]) for e in rank["timeline"])["work"] for rank in r["ranks"]]
    assert work == cp.causal_work(9, 3, "contiguous")


def test_hiding_shard_is_where_block_compute_equals_one_hop():
    ab = dist.AlphaBeta(alpha=50e-6, beta=1 / 10e9)
    b, heads, d, e, flops = 2, 4, 16, 2, 1e12
    s = cp.hiding_shard(ab, flops, batch=b, heads=heads, head_dim=d, elt=e)
    h = heads * d
    compute = lambda n: 4 * b * n * n * h / flops  # noqa: E731
    hop = lambda n: ab.alpha + 2 * b * n * h * e * ab.beta  # noqa: E731
    assert compute(s) == pytest.approx(hop(s), rel=1e-9)
    assert compute(0.99 * s) < hop(0.99 * s) and compute(1.01 * s) > hop(1.01 * s)
    with pytest.raises(TypeError, match="model"):
        cp.hiding_shard((50e-6, 1e-10), flops, batch=b, heads=heads, head_dim=d)
    with pytest.raises(ValueError, match="flops"):
        cp.hiding_shard(ab, 0.0, batch=b, heads=heads, head_dim=d)


def test_modeled_sp_moves_tp_bytes_and_ring_volume_does_not_fall_with_n():
    shape = dict(batch=2, seq=64, heads=8, head_dim=4)
    for n in (2, 4, 8):
        assert (cp.scheme_cost("sp", world_size=n, **shape)["wire"]
                == cp.scheme_cost("tp", world_size=n, **shape)["wire"])
    ring = [cp.scheme_cost("ring", world_size=n, **shape)["wire"] for n in (2, 4, 8)]
    uly = [cp.scheme_cost("ulysses", world_size=n, **shape)["wire"] for n in (2, 4, 8)]
    assert ring[0] < ring[1] < ring[2] < 2 * ring[0]  # (3N-2) blocks of S/N tokens: -> 3S
    assert uly[0] > uly[1] > uly[2]


def test_gqa_kv_heads_shrink_ring_and_ulysses_key_value_bytes():
    shape = dict(batch=1, seq=64, heads=32, head_dim=4, elt=2)
    n, s = 4, 64 // 4
    mha = cp.scheme_cost("ring", world_size=n, **shape)
    gqa = cp.scheme_cost("ring", world_size=n, kv_heads=8, **shape)
    assert mha == cp.scheme_cost("ring", world_size=n, kv_heads=32, **shape)
    assert gqa["forward"] == [("isend", 2 * s * 8 * 4 * 2)] * (n - 1)  # K and V of 8 heads
    assert gqa["wire"] * 4 == mha["wire"]                               # Llama 3: 8 of 32
    uly = cp.scheme_cost("ulysses", world_size=n, kv_heads=8, **shape)
    assert uly["forward"][0] == ("all_to_all_single", s * (32 + 2 * 8) * 4 * 2)  # q + k + v
    assert cp.scheme_cost("sp", world_size=n, kv_heads=8, **shape) == cp.scheme_cost(
        "sp", world_size=n, **shape)
    with pytest.raises(ValueError, match="kv_heads"):
        cp.scheme_cost("ring", world_size=n, kv_heads=5, **shape)
    with pytest.raises(ValueError, match="kv_heads"):
        cp.scheme_cost("ulysses", world_size=16, kv_heads=8, **shape)


def test_zigzag_ring_timeline_counts_the_balanced_work():
    r = cp.attention_check("ring", 3, 20, causal=True, layout="zigzag", timeout=20)
    work = [dict((e[0], e[1]) for e in rank["timeline"])["work"] for rank in r["ranks"]]
    assert work == cp.causal_work(20, 3, "zigzag")
    assert max(work) - min(work) <= (20 // 6 + 1) ** 2


# ---------------------------------------------------------------------------------------
# the tiny GPT trained with context parallelism

@pytest.mark.parametrize("scheme,layout", [("ring", "zigzag"), ("ring", "contiguous"),
                                           ("ulysses", "zigzag"), ("allgather", "zigzag")])
def test_gpt_trained_with_cp_equals_one_process_step_by_step(scheme, layout):
    from parlearn import transformer

    cfg = transformer.GPTConfig(d_model=16, n_heads=4, n_layers=2, max_seq=16)
    ref = cp.serial_train(cfg, steps=3, batch=2, seq=13)  # 13 tokens: uneven shards
    ranks = cp.cp_train(cfg, 2, steps=3, batch=2, seq=13, layout=layout, scheme=scheme)
    for r in ranks:
        assert r["loss"] == pytest.approx(ref["loss"], abs=1e-12, rel=0)
        for name, p in ref["params"].items():  # AdamW divides by sqrt(v): looser than TOL
            assert torch.allclose(r["params"][name], p, atol=1e-10, rtol=0), name


def test_cp_train_runs_is_each_run_in_one_launch_equal_to_one_process():
    # Lesson 17's three trainings in one launch of the ranks: each equals cp_train and the
    # one-process run, and a bad run is refused before the first one starts.
    from parlearn import transformer

    cfg = transformer.GPTConfig(d_model=16, n_heads=4, n_layers=2, max_seq=16)
    ref = cp.serial_train(cfg, steps=2, batch=2, seq=13)
    runs = [("ring", "zigzag"), ("ulysses", "contiguous"), ("allgather", "zigzag")]
    out = cp.cp_train_runs(cfg, 2, runs=runs, steps=2, batch=2, seq=13)
    assert len(out) == len(runs)
    for ranks in out:
        assert len(ranks) == 2
        for r in ranks:
            assert r["loss"] == pytest.approx(ref["loss"], abs=1e-12, rel=0)
            for name, p in ref["params"].items():
                assert torch.allclose(r["params"][name], p, atol=1e-10, rtol=0), name
    with pytest.raises(ValueError, match=r"runs\[1\]"):
        cp.cp_train_runs(cfg, 2, runs=[("ring", "zigzag"), ("spiral", "zigzag")], steps=1,
                         batch=1, seq=8)


# ---------------------------------------------------------------------------------------
# Megatron sequence parallelism

def _serial_block(seq, b, h, hid):
    full = cp.serial_block(h, hid, 0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(seq, b, h, generator=gen, dtype=torch.float64).requires_grad_(True)
    w = torch.randn(seq, b, h, generator=gen, dtype=torch.float64)
    y = x + full[1:](full[0](x))
    (y * w).sum().backward()
    return full, x, y.detach()


@pytest.mark.parametrize("n", [2, 4])
def test_sequence_parallel_equals_serial_and_moves_tp_bytes(n):
    seq, b, h, hid = 8, 2, 4, 8
    full, x, y = _serial_block(seq, b, h, hid)
    ranks = run(cp.sp_block_worker, n, args=(seq, b, h, hid, 0), timeout=20)
    for name in ("sp", "torch"):
        got_y = torch.cat([r[name]["y"] for r in ranks])
        got_dx = torch.cat([r[name]["dx"] for r in ranks])
        assert torch.allclose(got_y, y, atol=TOL, rtol=0)
        assert torch.allclose(got_dx, x.grad, atol=TOL, rtol=0)
    w1 = torch.cat([r["sp"]["w1"] for r in ranks])
    w2 = torch.cat([r["sp"]["w2"] for r in ranks], dim=1)
    assert torch.allclose(w1, full[1].weight.grad, atol=TOL, rtol=0)
    assert torch.allclose(w2, full[3].weight.grad, atol=TOL, rtol=0)
    for got, p in zip(ranks[0]["sp"]["ln"], full[0].parameters(), strict=True):
        assert torch.allclose(got, p.grad, atol=TOL, rtol=0)
    for got, p in zip(ranks[0]["torch"]["grads"], full.parameters(), strict=True):
        assert torch.allclose(got, p.grad, atol=TOL, rtol=0)
    for r in ranks:
        tp, sp = r["tp"]["ledger"], r["sp"]["ledger"]
        assert [x.kind for x in tp] == ["all_reduce"] * 2
        assert sorted(x.kind for x in sp) == ["all_gather"] * 2 + ["reduce_scatter"] * 2
        wire = [sum(ring_bytes(x.kind, x.bytes, n) for x in led) for led in (tp, sp)]
        assert wire[0] == wire[1]
        model = cp.scheme_cost("sp", batch=b, seq=seq, heads=1, head_dim=h, world_size=n)
        assert wire[1] == model["wire"]
        assert r["sp"]["saved"] < r["tp"]["saved"]


# ---------------------------------------------------------------------------------------
# bad input

def _ulysses_on(rank, world_size, heads):
    q = torch.zeros(1, heads, 4, 2, dtype=torch.float64)
    cp.ulysses_attention(q, q, q, seq=4 * world_size)


def _ring_on_one(rank, world_size):
    q = torch.zeros(1, 1, 4, 2, dtype=torch.float64)
    cp.ring_attention(q, q, q, seq=4)


def _ring_wrong_shard(rank, world_size):
    q = torch.zeros(1, 1, 3, 2, dtype=torch.float64)
    cp.ring_attention(q, q, q, seq=8)


def test_bad_input_is_refused_naming_the_argument():
    with pytest.raises(RankError, match="divide the number of heads"):
        run(_ulysses_on, 4, args=(2,), timeout=10)   # degree 4 > 2 heads
    with pytest.raises(RankError, match="divide the number of heads"):
        run(_ulysses_on, 2, args=(3,), timeout=10)   # 2 does not divide 3
    with pytest.raises(RankError, match="world_size >= 2"):
        run(_ring_on_one, 1, timeout=10)
    with pytest.raises(RankError, match="q holds 3 tokens"):
        run(_ring_wrong_shard, 2, timeout=10)
    with pytest.raises(RankError, match="divisible by world_size"):
        run(cp.sp_block_worker, 2, args=(7, 1, 4, 8, 0), timeout=10)
    with pytest.raises(ValueError, match="seq=3 is shorter"):
        cp.shard_chunks(3, 2, 0, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        cp.shard_chunks(8, 2, 0, "spiral")
    with pytest.raises(ValueError, match="heads"):
        cp.scheme_cost("ulysses", batch=1, seq=8, heads=3, head_dim=2, world_size=2)
    with pytest.raises(RuntimeError, match="initialised"):
        cp.ring_attention(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2),
                          torch.zeros(1, 1, 2, 2), seq=4)


# ---------------------------------------------------------------------------------------
# torch's experimental context_parallel

def test_torch_context_parallel_has_no_cpu_attention():
    """torch 2.13's context_parallel shards SDPA's CUDA kernels only: on CPU the attention
    op has no sharding strategy. If this starts passing, compare it with ours on CPU."""
    with pytest.raises(RankError, match="does not have a sharding strategy"):
        run(cp.torch_cp_worker, 2, args=("cpu",), timeout=20)


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="torch's context_parallel needs CUDA SDPA kernels; 2 GPUs (NCCL)")
def test_torch_context_parallel_cuda_equals_full_attention():
    errs = run(cp.torch_cp_worker, 2, args=("cuda",), timeout=60)
    assert max(errs) < 1e-4


# ---------------------------------------------------------------------------------------
# the contract at the edges: bad input fails fast, on every rank, naming the argument

def _fails_on_every_rank(worker, n, match, args=(), timeout=10):
    """``worker`` on ``n`` ranks must fail on every rank with a message matching ``match``,
    well before the group timeout (a refusal, not a hang)."""
    import re
    import time

    t0 = time.perf_counter()
    with pytest.raises(RankError) as info:
        run(worker, n, args=args, timeout=timeout, deadline=3 * timeout)
    assert sorted(info.value.failures) == list(range(n)), info.value
    for rank, text in info.value.failures.items():
        assert re.search(match, text), f"rank {rank}: {text}"
    assert time.perf_counter() - t0 < timeout, "the ranks waited for the group timeout"


def _ring_mixed_dtypes(rank, world_size):
    q = torch.zeros(1, 1, 4, 2, dtype=torch.float64)
    k = torch.zeros(1, 1, 4, 2, dtype=torch.float32)
    cp.ring_attention(q, k, k, seq=8)


def _ring_apply_mixed_dtypes(rank, world_size):
    q = torch.zeros(1, 1, 4, 2, dtype=torch.float64)
    k = torch.zeros(1, 1, 4, 2, dtype=torch.float32)
    cp.RingAttention.apply(q, k, k, 8, "contiguous", False, None)


def _ring_dtype_differs_by_rank(rank, world_size):
    dtype = torch.float64 if rank == 0 else torch.float32
    q = torch.zeros(1, 1, 4, 2, dtype=dtype)
    cp.ring_attention(q, q, q, seq=8)


def _ring_bad_shard_on_rank_1(rank, world_size):
    q = torch.zeros(1, 1, 4 if rank == 0 else 3, 2, dtype=torch.float64)
    cp.ring_attention(q, q, q, seq=8)


def _ulysses_heads_differ_by_rank(rank, world_size):
    q = torch.zeros(1, 2 + 2 * rank, 4, 2, dtype=torch.float64)
    cp.ulysses_attention(q, q, q, seq=8)


def _allgather_bad(rank, world_size, what):
    q = torch.zeros(1, 4, 4, 2, dtype=torch.float64)
    kv = {"kv_heads": torch.zeros(1, 3, 4, 2, dtype=torch.float64),
          "dtype": torch.zeros(1, 2, 4, 2, dtype=torch.float32),
          "shard": torch.zeros(1, 2, 3 if rank == 1 else 4, 2, dtype=torch.float64)}[what]
    if what == "shard":
        q = torch.zeros(1, 4, kv.shape[2], 2, dtype=torch.float64)
    cp.allgather_attention(q, kv, kv, seq=8, causal=True)


@pytest.mark.parametrize("what, match", [("kv_heads", "kv_heads=3 must divide"),
                                         ("dtype", "k must have dtype"),
                                         ("shard", "q holds 3 tokens")])
def test_allgather_attention_refuses_on_every_rank_before_the_gather(what, match):
    _fails_on_every_rank(_allgather_bad, 2, match, args=(what,))


def _allgather_gqa(rank, world_size):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 12, 3, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 12, 3, generator=g, dtype=torch.float64) for _ in range(2))
    idx = cp.shard_index(12, world_size, rank, "zigzag")
    qs, ks, vs = (t[..., idx, :].clone().requires_grad_(True) for t in (q, k, v))
    out = cp.allgather_attention(qs, ks, vs, seq=12, layout="zigzag", causal=True)
    out.sum().backward()
    return idx, out.detach(), ks.grad, vs.grad


def test_allgather_attention_with_grouped_query_heads_equals_full_attention():
    """Two K/V heads serve four query heads (Llama 3's grouping): outputs and the K/V
    gradients, reduce-scattered back to their shards, equal one process."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 12, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 12, 3, generator=g, dtype=torch.float64).requires_grad_(True)
            for _ in range(2))
    want = cp.full_attention(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1),
                             True)
    want.sum().backward()
    for idx, out, dk, dv in run(_allgather_gqa, 2, timeout=20):
        assert torch.allclose(out, want.detach()[..., idx, :], atol=TOL, rtol=0)
        assert torch.allclose(dk, k.grad[..., idx, :], atol=TOL, rtol=0)
        assert torch.allclose(dv, v.grad[..., idx, :], atol=TOL, rtol=0)


def test_ring_attention_checks_dtypes_and_agreement_before_the_first_send():
    _fails_on_every_rank(_ring_mixed_dtypes, 2, r"q, k and v must have one dtype")
    _fails_on_every_rank(_ring_apply_mixed_dtypes, 2, r"q, k and v must have one dtype")
    _fails_on_every_rank(_ring_dtype_differs_by_rank, 2,
                         r"q dtype must be the same on every rank")
    # a refusal on one rank only is an error on the other rank too, not a hang
    _fails_on_every_rank(_ring_bad_shard_on_rank_1, 2, r"q holds 3 tokens")
    _fails_on_every_rank(_ulysses_heads_differ_by_rank, 2,
                         r"q \(batch, heads, head_dim\) must be the same on every rank")


def _cp_forward_wrong_positions(rank, world_size):
    from parlearn import transformer
    from parlearn.multi_device.context_parallel.gpt import cp_forward

    cfg = transformer.GPTConfig(d_model=8, n_heads=2, n_layers=1, max_seq=16)
    model = transformer.GPT(cfg, dtype=torch.float64)
    idx = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = cp.shard_index(12, world_size, rank, "contiguous")
    # the tokens and positions of the contiguous layout, but layout="zigzag"
    cp_forward(model, idx[:, pos], idx[:, pos], pos, seq=12, layout="zigzag")


def test_cp_forward_refuses_positions_that_contradict_the_layout():
    _fails_on_every_rank(_cp_forward_wrong_positions, 2,
                         r"positions must be rank \d's shard of seq=12 in layout='zigzag'")


def _gather_uneven(rank, world_size):
    x = torch.zeros(3 + rank, 2, 4, dtype=torch.float64)   # 7 tokens cut 3 + 4
    cp.GatherSequence.apply(x)


def _scatter_uneven(rank, world_size):
    cp.ScatterSequence.apply(torch.zeros(7, 2, 4, dtype=torch.float64))


def _sp_block_uneven(rank, world_size):
    full = cp.serial_block(4, 8, 0)
    block = cp.SequenceParallelBlock(full, rank, world_size)
    block(torch.zeros(3 + rank, 2, 4, dtype=torch.float64))


def _sum_over_ranks_shapes_differ(rank, world_size):
    from parlearn.multi_device.tensor_parallel import SumOverRanks

    SumOverRanks.apply(torch.zeros(2 + rank, 3, dtype=torch.float64))


def _copy_to_ranks_shapes_differ(rank, world_size):
    from parlearn.multi_device.tensor_parallel import CopyToRanks

    CopyToRanks.apply(torch.zeros(2, 3 + rank, dtype=torch.float64))


def _copy_to_ranks_not_a_tensor(rank, world_size):
    from parlearn.multi_device.tensor_parallel import CopyToRanks

    CopyToRanks.apply(torch.zeros(2, 3) if rank == 0 else [[0.0] * 3] * 2)


def test_sequence_parallel_refuses_uneven_slices_on_every_rank():
    _fails_on_every_rank(_copy_to_ranks_shapes_differ, 2,
                         r"x\.shape must be the same on every rank")
    _fails_on_every_rank(_copy_to_ranks_not_a_tensor, 2, r"x must be a torch\.Tensor")
    _fails_on_every_rank(_gather_uneven, 2, r"x\.shape must be the same on every rank")
    _fails_on_every_rank(_scatter_uneven, 2, r"sequence of x .*divisible by the group size 2")
    _fails_on_every_rank(_sp_block_uneven, 2, r"x\.shape must be the same on every rank")
    _fails_on_every_rank(_sum_over_ranks_shapes_differ, 2,
                         r"x\.shape must be the same on every rank")


def test_merge_refuses_shapes_it_would_broadcast():
    o, lse = torch.zeros(2, 3, 4), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="o2"):
        cp.merge(o, lse, torch.zeros(1, 3, 4), lse)
    with pytest.raises(ValueError, match="lse2"):
        cp.merge(o, lse, o, torch.zeros(2, 1))
    with pytest.raises(ValueError, match="lse1"):
        cp.merge(o, torch.zeros(3), o, lse)
    with pytest.raises(TypeError, match="o2"):
        cp.merge(o, lse, o.double(), lse)


def test_block_attention_refuses_chunks_that_do_not_cover_the_rows():
    q, k, v, _ = cp.attention_inputs(6, seed=0)
    with pytest.raises(ValueError, match="q_chunks"):   # 8 rows claimed, 6 held
        cp.block_attention(q, k, v, [(0, 8)], [(0, 6)], True)
    with pytest.raises(ValueError, match="k_chunks"):
        cp.block_attention(q, k, v, [(0, 6)], [(0, 4)], False)
    with pytest.raises(ValueError, match="q_chunks"):
        cp.block_attention(q, k, v, [(3, 1)], [(0, 6)], False)
    with pytest.raises(TypeError, match="k"):
        cp.block_attention(q, k.float(), v, [(0, 6)], [(0, 6)], False)


def test_diagrams_draw_the_schedules_the_code_runs():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from parlearn.multi_device.context_parallel import diagrams

    fig, axes = plt.subplots(1, 3)
    held = diagrams.draw_ring(axes[0], 3)
    assert held == [[0, 2, 1], [1, 0, 2], [2, 1, 0]]     # step t: the block of rank r - t
    cells = [t.get_text() for t in axes[0].texts if t.get_text().startswith("K/V")]
    assert cells[:3] == ["K/V 0", "K/V 2", "K/V 1"]
    uly = diagrams.draw_ulysses(axes[1], 2, heads=4)
    assert uly["before"] == [[0] * 4, [1] * 4] and uly["after"] == [[0, 0, 1, 1]] * 2
    owners = diagrams.draw_zigzag(axes[2], 3)
    assert owners == {"contiguous": [0, 0, 1, 1, 2, 2], "zigzag": [0, 1, 2, 2, 1, 0]}
    assert any("tiles per rank: 7, 7, 7" in t.get_text() for t in axes[2].texts)
    plt.close(fig)
    with pytest.raises(ValueError, match="world_size"):
        diagrams.draw_ring(None, 1)
    with pytest.raises(ValueError, match="heads"):
        diagrams.draw_ulysses(None, 4, heads=6)


def test_layout_timing_interleaves_both_layouts_in_one_launch():
    r = cp.layout_timing(2, 16, heads=1, head_dim=2, repeat=2, timeout=30)
    assert set(r) == set(cp.LAYOUTS)
    for per_rank in r.values():
        assert len(per_rank) == 2 and all(len(x) == 2 and min(x) > 0 for x in per_rank)
    with pytest.raises(ValueError, match="seq"):
        cp.layout_timing(4, 7)
