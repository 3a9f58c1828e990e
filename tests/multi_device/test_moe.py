"""parlearn.moe: routers against brute force, the MoE layer against a per-token formula,
expert parallelism on real gloo ranks against the single-process MoE (float64), the
all-to-all bytes of the ledger against the model, and EP x DP training step by step.

Each distributed case is one ``dist.run`` (group timeout and deadline), so a hang cannot
stall the suite.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

from parlearn import moe, transformer

T = 30  # group timeout (s): generous for a loaded machine


def _logits(t=10, e=4, seed=0):
    return torch.randn(t, e, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_token_choice_equals_brute_force(k):
    logits = _logits(12, 5)
    r = moe.token_choice(logits, k)
    for t in range(12):
        p = [math.exp(v) for v in logits[t].tolist()]
        p = [v / sum(p) for v in p]
        best = sorted(range(5), key=lambda e: -p[e])[:k]
        assert r.expert[t].tolist() == best
        assert torch.allclose(r.gate[t], torch.tensor([p[e] for e in best], dtype=torch.float64))
    assert r.dropped() == 0 and r.kept.all()


def test_capacity_drops_assignments_beyond_the_queue_slot_major():
    logits = _logits(10, 4, seed=3)
    r = moe.token_choice(logits, 2, capacity_factor=0.75)
    cap = math.ceil(0.75 * 10 * 2 / 4)
    assert r.capacity == cap
    seen = [0] * 4
    for j in range(2):  # every first choice queues before any second choice
        for t in range(10):
            e = int(r.expert[t, j])
            assert bool(r.kept[t, j]) == (seen[e] < cap)
            seen[e] += 1
            assert (r.gate[t, j] == 0) == (not r.kept[t, j])
    assert r.counts().tolist() == [min(s, cap) for s in seen]
    assert r.dropped() == sum(max(s - cap, 0) for s in seen) > 0
    assert r.wanted.tolist() == seen


def test_balance_loss_is_its_formula_one_when_uniform_and_grows_when_collapsed():
    r = moe.token_choice(_logits(16, 4), 1)
    f = torch.bincount(r.expert.flatten(), minlength=4).double() / 16
    assert torch.allclose(moe.balance_loss(r), 4 * (f * r.probs.mean(0)).sum())
    uniform = torch.eye(4, dtype=torch.float64).repeat(4, 1) * 3.0  # each expert's own tokens
    assert torch.allclose(moe.balance_loss(moe.token_choice(uniform, 1)),
                          torch.tensor(1.0, dtype=torch.float64))
    collapsed = torch.zeros(16, 4, dtype=torch.float64)
    collapsed[:, 0] = 20.0
    assert 3.99 < moe.balance_loss(moe.token_choice(collapsed, 1)) <= 4.0
    logits = _logits(6, 3)
    assert torch.allclose(moe.z_loss(logits), torch.logsumexp(logits, -1).pow(2).mean())


def test_expert_choice_fills_every_expert_and_never_drops():
    r = moe.expert_choice(_logits(12, 4), k=1, capacity_factor=1.0)
    assert r.counts().tolist() == [3, 3, 3, 3] and r.dropped() == 0
    for e in range(4):  # each expert's tokens are its C most probable
        best = set(r.probs[:, e].topk(3).indices.tolist())
        assert set(torch.nonzero(r.kept[:, e]).flatten().tolist()) == best
        assert torch.equal(r.gate[:, e], torch.where(r.kept[:, e], r.probs[:, e], 0.0))


@pytest.mark.parametrize("routing,cf", [("token", None), ("token", 0.5), ("expert", 1.0)])
def test_layer_equals_the_per_token_formula(routing, cf):
    layer = moe.MoE(6, 10, 4, 2, capacity_factor=cf, routing=routing, groups=2,
                    dtype=torch.float64)
    x = torch.randn(2, 6, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = layer(x)
    want = torch.zeros(12, 6, dtype=torch.float64)
    for part, rows in zip(x.reshape(12, 6).chunk(2), (range(6), range(6, 12)), strict=True):
        r = layer.route(part)
        for t, row in enumerate(rows):
            for j in range(r.expert.shape[1]):
                e = int(r.expert[t, j])
                h = F.gelu(part[t] @ layer.w_up[e]) @ layer.w_down[e]
                want[row] += r.gate[t, j] * h
    torch.testing.assert_close(y.reshape(12, 6), want, rtol=0, atol=1e-15)


def test_building_a_moe_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    moe.moe_gpt(transformer.GPTConfig(vocab_size=10, d_model=8, n_heads=2, n_layers=1,
                                      max_seq=4), 4)
    assert torch.equal(state, torch.get_rng_state())


CASES = {  # (world_size, ep, capacity_factor, empty_expert, routing)
    "ep2": (2, 2, None, False, "token"),
    "ep2-drops": (2, 2, 0.75, False, "token"),
    "ep4-drops-empty-expert": (4, 4, 1.0, True, "token"),
    "ep2xdp2": (4, 2, 1.0, False, "token"),
    "ep2-expert-choice": (2, 2, 1.0, False, "expert"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_equals_single_process_forward_and_backward(case):
    world, ep, cf, empty, routing = CASES[case]
    h, E, k, tokens = 8, 4, 2, 12
    res = moe.layer_check(world, ep, tokens=tokens, d_model=h, n_experts=E, k=k,
                          capacity_factor=cf, routing=routing, empty_expert=empty, timeout=T)
    for r in res:
        assert r["forward"] < 1e-15 and r["grad_x"] < 1e-15
        assert r["grad_router"] < 1e-15 and r["grad_experts"] < 1e-14
    counts = [sum(c) for c in zip(*(r["counts"] for r in res), strict=True)]
    assert counts == res[0]["serial_counts"]
    if routing == "token":  # the split sizes really are uneven
        assert any(len(set(r["counts"])) > 1 for r in res)
        assert any(len(set(r["sent"])) > 1 for r in res)
    if routing == "expert":  # every expert takes exactly C = k T / E tokens of each rank
        assert all(r["counts"] == [k * tokens // E] * E and r["dropped"] == 0 for r in res)
    elif cf is not None:
        assert sum(r["dropped"] for r in res) > 0
    if empty:
        assert counts[-1] == 0
    # Ledger: dispatch payload = rows this rank sends, combine = rows its experts received,
    # plus E int64 split sizes forward; backward is the same two without the sizes.
    for r in res:
        rows = (sum(r["sent"]) + sum(r["received"])) * h * 8
        assert r["ledger"]["forward"]["all_to_all_single"][:2] == (3, E * 8 + rows)
        assert r["ledger"]["backward"]["all_to_all_single"][:2] == (2, rows)
        assert sum(r["sent"]) == r["kept"]


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_bytes_from_the_ledger_equal_the_model(world):
    h, E, k, tokens = 8, 4, 2, 12
    res = moe.layer_check(world, tokens=tokens, d_model=h, n_experts=E, k=k, timeout=T)
    model = moe.all_to_all_bytes(tokens, h, k, world, element_bytes=8)
    dispatched = sum(sum(r["sent"]) for r in res) * h * 8
    combined = sum(sum(r["received"]) for r in res) * h * 8
    assert dispatched == combined == world * model["payload"]
    measured = sum(r["ledger"]["forward"]["all_to_all_single"][1] - E * 8 for r in res)
    assert measured == 2 * world * model["payload"]
    # Wire: rows that leave their rank, against (N-1)/N of the payload under uniform routing.
    wire = sum(sum(s for j, s in enumerate(r["sent"]) if j != i) for i, r in enumerate(res))
    assert 0 < wire * h * 8 <= world * model["payload"]


def test_ep_x_dp_training_equals_single_process_step_by_step():
    res = moe.train_check(4, 2, steps=3, capacity_factor=1.0, timeout=60)
    for r in res:
        for ref, got in r["losses"]:
            assert abs(ref - got) < 1e-12
        assert r["weights"] < 1e-12
    assert res[0]["losses"][0] != res[0]["losses"][-1]


def test_bad_input_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="k=5"):
        moe.token_choice(_logits(4, 4), 5)
    with pytest.raises(ValueError, match="k=5"):
        moe.MoE(4, 8, 4, 5)
    with pytest.raises(ValueError, match="capacity_factor"):
        moe.MoE(4, 8, 4, 1, capacity_factor=0)
    with pytest.raises(ValueError, match="capacity_factor"):
        moe.token_choice(_logits(4, 4), 1, capacity_factor=-1.0)
    with pytest.raises(ValueError, match="divisible by the EP degree"):
        moe.ExpertParallelMoE(moe.MoE(4, 8, 6, 1), 0, 4)
    with pytest.raises(ValueError, match="divisible by the EP degree"):
        moe.layer_check(4, 4, n_experts=6)
    with pytest.raises(ValueError, match="groups=3"):
        moe.MoE(4, 8, 4, groups=3)(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="routing"):
        moe.MoE(4, 8, 4, routing="random")


def test_cost_model():
    assert moe.all_to_all_bytes(10, 8, 2, 4) == {"payload": 640, "wire": 480.0}
    assert moe.imbalance([4, 4, 4, 4]) == 1.0 and moe.imbalance([16, 0, 0, 0]) == 4.0
    trade = moe.capacity_trade([6, 2, 0, 4], 3)
    assert trade == {"dropped": 4, "padding": 4, "rows": 3, "rows_needed": 3}
    assert moe.capacity_trade([6, 2, 0, 4], None)["rows"] == 6


def test_ep_against_replicated_experts_by_hand():
    """3 matrices of 8 x 16 per expert (384 parameters), 4 experts on 2 ranks, 10 tokens,
    k = 2, bf16 on the wire, 16 B of state per parameter."""
    got = moe.ep_vs_replicated(10, 8, 16, 4, 2, 2, matrices=3, element_bytes=2,
                               state_bytes=16)
    assert got["ep"] == {"memory": 2 * 384 * 16, "bytes": 4 * 10 * 2 * 8 * 2 / 2,
                         "flops": 6 * 10 * 2 * 384}
    assert got["replicated"] == {"memory": 4 * 384 * 16, "bytes": 2 / 2 * 4 * 384 * 2,
                                 "flops": 6 * 10 * 2 * 384}
    with pytest.raises(ValueError, match="ep"):
        moe.ep_vs_replicated(10, 8, 16, 4, 2, 3)
    # SwiGLU costs 3/2 of GELU's FLOPs; the all-to-all is the same
    gelu = moe.ep_pays(10, 8, 16, 2, 4, 1e-5, 1e-9, 1e12)
    swiglu = moe.ep_pays(10, 8, 16, 2, 4, 1e-5, 1e-9, 1e12, matrices=3)
    assert math.isclose(swiglu["compute"], 2 * 10 * 2 * 3 * 8 * 16 / 1e12, rel_tol=1e-12)
    assert math.isclose(swiglu["compute"], 1.5 * gelu["compute"], rel_tol=1e-12)
    assert swiglu["all_to_all"] == gelu["all_to_all"]
    # the large-T limit of compute / all-to-all is what the ratio tends to
    big = moe.ep_pays(10**9, 8, 16, 2, 4, 1e-5, 1e-9, 1e12, matrices=3)
    assert math.isclose(big["compute"] / big["all_to_all"], big["limit"], rel_tol=1e-6)
    assert math.isclose(big["limit"], 3 * 16 / (1e12 * 4 * 1e-9 * 3 / 4), rel_tol=1e-12)
    assert big["limit"] == swiglu["limit"]
    # a fit that put beta at 0 (or one rank) leaves nothing that grows with the tokens
    assert moe.ep_pays(10, 8, 16, 2, 4, 1e-5, 0.0, 1e12)["limit"] == math.inf
    assert moe.ep_pays(10, 8, 16, 2, 1, 1e-5, 1e-9, 1e12)["limit"] == math.inf


def test_moe_gpt_trains_and_costs_what_the_dense_one_does_plus_the_router():
    cfg = transformer.GPTConfig(vocab_size=transformer.pydoc_corpus().vocab_size, d_model=16,
                                n_heads=2, n_layers=1, max_seq=16)
    dense = moe.train_moe(cfg, 0, steps=3, batch=4, eval_every=3)
    sparse = moe.train_moe(cfg, 4, steps=3, batch=4, eval_every=3)
    assert sparse["flops_per_token"] - dense["flops_per_token"] == 6 * 16 * 4
    mlp = transformer.count_params(cfg)["mlp"]
    assert sparse["params"] - dense["params"] == 3 * mlp + 16 * 4
    assert len(sparse["counts"]) == 3 and sum(sparse["counts"][0][0]) == 4 * 16



def test_train_moe_runs_on_the_threads_asked_and_gives_the_callers_count_back():
    """The loop runs on ``threads`` (default 1: many small ops spin at OpenMP barriers when
    the cores are shared) and the caller's count is restored, also after an error."""
    cfg = transformer.GPTConfig(vocab_size=transformer.pydoc_corpus().vocab_size, d_model=8,
                                n_heads=2, n_layers=1, max_seq=8)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        moe.train_moe(cfg, 2, steps=2, batch=2, eval_every=1,
                      progress=lambda f, t: seen.append(torch.get_num_threads()))
        assert seen == [1, 1] and torch.get_num_threads() == 2
        seen.clear()
        moe.train_moe(cfg, 2, steps=1, batch=2, eval_every=1, threads=None,
                      progress=lambda f, t: seen.append(torch.get_num_threads()))
        assert seen == [2]

        def boom(f, t):
            raise RuntimeError("stop")
        with pytest.raises(RuntimeError, match="stop"):
            moe.train_moe(cfg, 2, steps=1, batch=2, eval_every=1, progress=boom)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# --- the contract at the edges ------------------------------------------------------------

@pytest.mark.parametrize("routing", ["token", "expert"])
def test_aux_losses_are_zero_not_nan_for_a_group_of_no_tokens(routing):
    layer = moe.MoE(4, 8, 4, 2, capacity_factor=1.25, routing=routing, dtype=torch.float64)
    x = torch.zeros(0, 4, dtype=torch.float64)
    y = layer(x)
    assert y.shape == (0, 4)
    for name in ("balance", "z"):
        assert torch.isfinite(layer.last[name]) and layer.last[name] == 0, name
    (layer.last["balance"] + layer.last["z"]).backward()   # still in the router's graph
    assert torch.isfinite(layer.router.weight.grad).all()
    r = moe.token_choice(torch.zeros(0, 4, dtype=torch.float64), 1, 1.0)
    assert moe.balance_loss(r) == 0 and moe.z_loss(r.logits) == 0


def _ep_rank_without_tokens(rank, world_size):
    full = moe.MoE(4, 8, 4, 2, capacity_factor=2.0, dtype=torch.float64)
    layer = moe.ExpertParallelMoE(full, rank, world_size)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(6 if rank == 0 else 0, 4, generator=gen, dtype=torch.float64)
    y = layer(x)
    loss = y.sum() + layer.last["balance"] + layer.last["z"]
    loss.backward()
    return [float(layer.last["balance"].detach()), float(layer.last["z"].detach()),
            bool(torch.isfinite(layer.router.weight.grad).all())]


def test_expert_parallel_rank_that_received_no_token_has_finite_aux_losses():
    from parlearn.distributed import run

    res = run(_ep_rank_without_tokens, 2, timeout=T, deadline=3 * T)
    assert res[1][:2] == [0.0, 0.0] and res[1][2]
    assert all(math.isfinite(v) for v in res[0][:2]) and res[0][2]


def test_capacity_is_the_formula_in_exact_arithmetic():
    # 1.1 * 90 * 2 / 6 is 33 exactly; in floats it is 33.000000000000004, whose ceiling is 34
    assert moe.capacity(90, 6, 2, 1.1) == 33
    assert moe.capacity(90, 6, 2, None) is None


@given(tokens=st.integers(0, 10**4), n_experts=st.integers(1, 64), k_raw=st.integers(0, 63),
       tenths=st.integers(1, 400))
@example(tokens=90, n_experts=6, k_raw=1, tenths=11)   # the float ceiling's off-by-one
def test_capacity_equals_the_formula_in_exact_arithmetic(tokens, n_experts, k_raw, tenths):
    k = 1 + k_raw % n_experts
    factor = tenths / 10   # a decimal factor such as 1.1 or 1.25's neighbours, as users type
    cap = moe.capacity(tokens, n_experts, k, factor)
    exact = Fraction(tenths, 10) * tokens * k / n_experts
    # the smallest integer >= the exact value, checked without any float
    assert cap >= exact and cap - 1 < exact
    assert moe.capacity(tokens, n_experts, k, Fraction(tenths, 10)) == cap


def _ep_bad_x_on_rank_1(rank, world_size):
    full = moe.MoE(4, 8, 4, 1, dtype=torch.float64)
    layer = moe.ExpertParallelMoE(full, rank, world_size)
    layer(torch.zeros(3, 4 if rank == 0 else 5, dtype=torch.float64))


def _ep_dtype_differs_by_rank(rank, world_size):
    full = moe.MoE(4, 8, 4, 1, dtype=torch.float64)
    layer = moe.ExpertParallelMoE(full, rank, world_size)
    layer(torch.zeros(3, 4, dtype=torch.float64 if rank == 0 else torch.float32))


@pytest.mark.parametrize("worker,match", [(_ep_bad_x_on_rank_1, r"x must end in d_model=4"),
                                          (_ep_dtype_differs_by_rank,
                                           r"x\.dtype must be the same on every rank")])
def test_expert_parallel_bad_x_fails_fast_on_every_rank(worker, match):
    import re
    import time

    from parlearn.distributed import RankError, run

    t0 = time.perf_counter()
    with pytest.raises(RankError) as info:
        run(worker, 2, timeout=10, deadline=30)
    assert sorted(info.value.failures) == [0, 1], info.value
    for rank, text in info.value.failures.items():
        assert re.search(match, text), f"rank {rank}: {text}"
    assert time.perf_counter() - t0 < 10, "the ranks waited for the group timeout"
