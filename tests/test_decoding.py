import math

import pytest
import torch

from parlearn import decoding as D
from parlearn.diffusion import PairedPhrase

LANG = PairedPhrase(slots=8, m=4)


def _decode(strategy, batch=256, seed=0, lang=LANG, **kw):
    return D.decode(lang.denoiser, length=lang.length, batch=batch, mask_id=lang.mask_id,
                    strategy=strategy, generator=torch.Generator().manual_seed(seed), **kw)


@pytest.mark.parametrize("tau", [0.2, 0.3, 0.6, 0.95])
def test_mean_field_with_zero_coupling_is_threshold(tau):
    a = _decode("mean_field", tau=tau, lam=0.0)
    b = _decode("threshold", tau=tau)
    assert torch.equal(a.tokens, b.tokens)
    assert len(a.trace) == len(b.trace)
    assert all(torch.equal(x, y) for x, y in zip(a.trace, b.trace, strict=True))


def test_mean_field_zero_coupling_commit_rule_on_random_confidences():
    g = torch.Generator().manual_seed(0)
    conf = torch.rand(64, 20, generator=g)
    masked = torch.rand(64, 20, generator=g) < 0.7
    commit, *_ = D.mean_field_commit(conf, torch.zeros(64, 20, 20), masked, tau=0.5,
                                     beta=8.0, eta=0.5)
    assert torch.equal(commit, (conf > 0.5) & masked)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("lam", [0.2, 2.0, 4.0])  # away from the critical beta*lam/4 = 1
def test_fixed_point_converges(shared, lam):
    lang = PairedPhrase(slots=8, m=4, shared=shared)
    res = _decode("mean_field", lang=lang, batch=32, tau=0.2, lam=lam)  # default eta = 0.5
    assert max(res.stats["mf_residual"]) < 1e-6
    assert res.stats["mf_unconverged"] == 0


def test_symmetric_ties_are_broken():
    conf = torch.full((1, 2), 0.25)
    J = torch.tensor([[[0.0, 2.0], [2.0, 0.0]]])
    masked = torch.ones(1, 2, dtype=torch.bool)
    commit, q, *_ = D.mean_field_commit(conf, J, masked, tau=0.2, beta=8.0, eta=0.5)
    assert commit.sum() == 1  # exactly one half of the pair
    # A synchronous (Jacobi) update would have kept them equal forever:
    qs = torch.full((2,), torch.sigmoid(torch.tensor(8 * (math.log(1 / 3) - math.log(0.25)))))
    h = torch.logit(torch.tensor(0.25)) - math.log(0.2 / 0.8)
    for _ in range(50):
        qs = 0.5 * qs + 0.5 * torch.sigmoid(8 * (h - 2.0 * qs.flip(0)))
    assert qs[0] == qs[1]


@pytest.mark.parametrize("k", [2, 3, 5, 16])
def test_fixed_k_validity_matches_formula(k):
    n = 2000
    res = _decode("fixed_k", batch=n, k=k)
    v = LANG.valid(res.tokens).double().mean().item()
    p = LANG.fixed_k_validity(k)
    se = math.sqrt(max(p * (1 - p), 1e-12) / n)
    assert abs(v - p) <= 3 * se + 1e-9, (v, p)


def test_mean_field_frontier_target_and_sequential():
    mf = _decode("mean_field", batch=512, tau=0.2, lam=2.0)
    assert LANG.valid(mf.tokens).double().mean() >= 0.99
    assert mf.mean_passes <= 2.5
    seq = _decode("sequential", batch=128)
    assert LANG.valid(seq.tokens).all() and seq.mean_passes == 16
    assert seq.tokens_per_pass == pytest.approx(1.0)


def test_control_defeats_overlap_but_not_oracle():
    ctrl = PairedPhrase(slots=8, m=4, shared=True)
    blind = _decode("mean_field", lang=ctrl, batch=64, tau=0.2, lam=2.0)
    oracle = _decode("mean_field", lang=ctrl, batch=64, tau=0.2, lam=2.0,
                     coupling=ctrl.oracle_coupling)
    assert blind.mean_passes > 3 * oracle.mean_passes
    assert ctrl.valid(oracle.tokens).all()


@pytest.mark.parametrize("strategy,kw", [("random", {"steps": 8}), ("factor", {"f": 1.0}),
                                         ("entropy_bound", {"gamma": 0.5}),
                                         ("fixed_k", {"k": 4})])
def test_every_strategy_finishes(strategy, kw):
    res = _decode(strategy, batch=32, **kw)
    assert (res.tokens != LANG.mask_id).all()
    assert sum(t.sum().item() for t in res.trace) == 32 * 16


def test_prompt_is_kept_and_logits_accepted():
    prompt = torch.full((16,), LANG.mask_id)
    prompt[0] = 2  # slot 0 left half fixed: right must be 3
    res = D.decode(lambda t: torch.log(LANG.denoiser(t).clamp_min(1e-9)), length=16, batch=8,
                   mask_id=LANG.mask_id, strategy="threshold", tau=0.3, prompt=prompt,
                   generator=torch.Generator().manual_seed(0))
    assert (res.tokens[:, 0] == 2).all() and (res.tokens[:, 1] == 3).all()
    assert (res.generated == 15).all()


def test_bad_inputs():
    den = LANG.denoiser
    with pytest.raises(ValueError, match="length"):
        D.decode(den, length=0, batch=1, mask_id=LANG.mask_id, strategy="sequential")
    with pytest.raises(ValueError, match="strategy"):
        D.decode(den, length=16, batch=1, mask_id=LANG.mask_id, strategy="beam")
    with pytest.raises(ValueError, match="takes"):
        D.decode(den, length=16, batch=1, mask_id=LANG.mask_id, strategy="threshold", k=3)
    with pytest.raises(ValueError, match="tau"):
        D.decode(den, length=16, batch=1, mask_id=LANG.mask_id, strategy="threshold", tau=1.5)
    with pytest.raises(ValueError, match="denoiser must return"):
        D.decode(lambda t: torch.zeros(t.shape[0], 3), length=16, batch=1,
                 mask_id=LANG.mask_id, strategy="sequential")
    with pytest.raises(ValueError, match="mask_id"):
        D.decode(den, length=16, batch=1, mask_id=-1, strategy="sequential")
    # mask id inside the vocabulary that the denoiser predicts: misuse
    with pytest.raises(ValueError, match="mask token"):
        D.decode(lambda t: torch.full((*t.shape, 4), 0.25), length=4, batch=1, mask_id=2,
                 strategy="sequential")
