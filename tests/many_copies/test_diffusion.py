import math

import pytest
import torch
from torch import nn

from parlearn.many_copies.diffusion import (
    GroupLanguage,
    PairedPhrase,
    TinyMDLM,
    conditional_distance,
    language_family,
    mdlm_corrupt,
    mdlm_loss,
    train_mdlm,
)


@pytest.mark.parametrize("shared", [False, True])
def test_samples_valid_and_halves_uniform(shared):
    lang = PairedPhrase(slots=4, m=4, shared=shared)
    x = lang.sample(4000, generator=torch.Generator().manual_seed(0))
    assert lang.valid(x).all()
    counts = torch.bincount(x[:, 1] - (0 if shared else 0), minlength=lang.vocab)[:4].double()
    assert (counts / counts.sum() - 0.25).abs().max() < 0.03  # each half alone is uniform
    bad = x.clone()
    bad[:, 1] = bad[:, 0]  # (x, x) is never valid: sigma has no fixed point
    assert not lang.valid(bad).any()


def test_exact_denoiser_conditionals():
    lang = PairedPhrase(slots=2, m=4)
    tok = torch.tensor([[lang.mask_id, 1, lang.mask_id, lang.mask_id]])
    p = lang.denoiser(tok)
    assert p[0, 0].argmax() == 0 and p[0, 0].max() == 1  # left = sigma^-1(1) = 0
    torch.testing.assert_close(p[0, 2, 4:8], torch.full((4,), 0.25))
    torch.testing.assert_close(p.sum(-1), torch.ones(1, 4))


def test_denoiser_matches_empirical_conditionals():
    lang = PairedPhrase(slots=1, m=3)
    x = lang.sample(30000, generator=torch.Generator().manual_seed(0))
    right_given_left0 = x[x[:, 0] == 0][:, 1]
    assert (right_given_left0 == 1).all()
    tok = torch.tensor([[0, lang.mask_id]])
    assert lang.denoiser(tok)[0, 1, 1] == 1


def test_fixed_k_formula_limits():
    lang = PairedPhrase(slots=8, m=4)
    assert lang.fixed_k_validity(1) == pytest.approx(1.0)
    assert lang.fixed_k_validity(16) == pytest.approx(4.0**-8)
    assert lang.fixed_k_validity(2) < 1


def test_bad_language():
    with pytest.raises(ValueError, match="m must be"):
        PairedPhrase(m=1)
    with pytest.raises(TypeError, match="slots"):
        PairedPhrase(slots=2.0)
    with pytest.raises(ValueError, match="layout"):
        GroupLanguage(layout="middle")
    with pytest.raises(ValueError, match="peak"):
        GroupLanguage(m=4, peak=0.2)
    with pytest.raises(ValueError, match="size"):
        GroupLanguage(size=1)
    with pytest.raises(TypeError, match="tokens"):
        PairedPhrase().denoiser(torch.zeros(2, 16))
    with pytest.raises(ValueError, match="tokens must lie"):
        PairedPhrase().valid(torch.full((2, 16), 99))
    with pytest.raises(ValueError, match="tokens must have shape"):
        PairedPhrase().valid(torch.zeros(2, 3, dtype=torch.int64))


def test_trained_tiny_model_is_close_to_exact():
    lang = PairedPhrase()
    model = train_mdlm(lang, steps=800, progress=False)
    tv = conditional_distance(model, lang)
    # Stated tolerance: mean total variation below 0.05 on masked positions.
    assert tv < 0.05, tv


@pytest.mark.parametrize("lang", [PairedPhrase(slots=3, m=3), *language_family()[:1],
                                  GroupLanguage(groups=2, size=3, m=4, layout="far", peak=0.7),
                                  GroupLanguage(groups=3, size=2, m=3, shared=True)],
                         ids=lambda x: getattr(x, "name", repr(x)))
def test_exact_denoiser_matches_empirical_conditionals(lang):
    n = 40000
    x = lang.sample(n, generator=torch.Generator().manual_seed(0))
    assert lang.valid(x).all()
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # a few random masks, each checked against the empirical conditional
        keep = torch.zeros(lang.length, dtype=torch.bool)
        keep[torch.randperm(lang.length, generator=g)[:2]] = True  # two known positions
        ctx = x[0].clone()
        ctx[~keep] = lang.mask_id
        p = lang.denoiser(ctx[None])[0]
        match = (x[:, keep] == ctx[keep]).all(-1)
        assert match.sum() > 200
        emp = nn.functional.one_hot(x[match], lang.vocab).double().mean(0)
        # 6 binomial standard errors at worst (p = 1/2), for every entry at once
        assert (p[~keep].double() - emp[~keep]).abs().max() < 3 / match.sum().sqrt()
        # unmasked positions: a one-hot of their own token
        torch.testing.assert_close(p[keep], nn.functional.one_hot(ctx[keep], lang.vocab)
                                   .float())


def test_family_members_differ_as_stated():
    fam = language_family()
    assert {lang.size for lang in fam} == {2, 3, 4}
    assert {lang.shared for lang in fam} == {False, True}
    assert {lang.layout for lang in fam} == {"near", "far"}
    confs = {lang.denoiser(torch.full((1, lang.length), lang.mask_id)).max().item()
             for lang in fam}
    assert min(confs) == pytest.approx(1 / 8) and max(confs) == pytest.approx(0.9)
    far = GroupLanguage(groups=4, size=2, layout="far")
    assert far.positions()[0].tolist() == [0, 4]


class _Fixed(nn.Module):
    """A 'model' returning fixed logits: for loss and distance checks by hand."""

    def __init__(self, logits):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))
        self.logits = logits

    def forward(self, tokens):
        return self.logits.expand(tokens.shape[0], -1, -1) + 0 * self.w


def test_mdlm_loss_is_weighted_by_one_over_t():
    V, B, L = 5, 3, 4
    logits = torch.zeros(B, L, V)  # uniform: cross-entropy log V everywhere
    x = torch.zeros(B, L, dtype=torch.int64)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    t = torch.tensor([[0.5], [0.25], [1.0]])
    expect = math.log(V) * (1 / 0.5 + 2 / 0.25 + 4 / 1.0) / (B * L)
    assert mdlm_loss(logits, x, mask, t).item() == pytest.approx(expect)


def test_mdlm_corrupt_one_rate_per_sequence():
    x = torch.zeros(400, 64, dtype=torch.int64)
    noisy, mask, t = mdlm_corrupt(x, 9, torch.Generator().manual_seed(0))
    assert t.shape == (400, 1) and t.unique().numel() == 400
    assert torch.equal(noisy == 9, mask)
    frac = mask.double().mean(-1)
    assert frac[t[:, 0] < 0.2].mean() < 0.25 and frac[t[:, 0] > 0.8].mean() > 0.75


def test_conditional_distance_is_a_total_variation():
    lang = PairedPhrase(slots=2, m=4)
    exact = torch.log(lang.denoiser(torch.full((1, 4), lang.mask_id)).clamp_min(1e-30))
    assert conditional_distance(_Fixed(exact), lang, n=64) < 0.6
    wrong = torch.full((1, 4, lang.vocab), -1e4)
    wrong[..., 0] = 0.0  # all mass on a token of slot 0: disjoint from slot 1's alphabet
    d = conditional_distance(_Fixed(wrong), lang, n=64)
    assert 0.5 < d <= 1.0 + 1e-6


def test_training_uses_its_seed_not_the_global_rng():
    lang = PairedPhrase(slots=2, m=3)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a = train_mdlm(lang, steps=3, batch=8, width=16, seed=5, progress=False)
    assert torch.equal(state, torch.random.get_rng_state())  # caller's RNG untouched
    torch.manual_seed(999)  # a different global state must not matter
    b = train_mdlm(lang, steps=3, batch=8, width=16, seed=5, progress=False)
    c = train_mdlm(lang, steps=3, batch=8, width=16, seed=6, progress=False)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    m1, m2 = TinyMDLM(6, 4, width=16, seed=1), TinyMDLM(6, 4, width=16, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters(), strict=True))


def test_training_steps_change_the_model_and_report_progress():
    lang = PairedPhrase(slots=2, m=3)
    seen = []
    before = TinyMDLM(lang.vocab, lang.length, width=16, seed=0)
    after = train_mdlm(lang, steps=2, batch=8, width=16, seed=0,
                       progress=lambda f, text: seen.append(f))
    changed = [not torch.equal(p, q) for p, q in zip(before.parameters(), after.parameters(),
                                                     strict=True)]
    assert all(changed)  # same init (same seed), every parameter took its steps
    assert seen and seen[-1] == 1.0


@pytest.mark.parametrize("kw,err,match", [
    ({"steps": 0}, ValueError, "steps"), ({"batch": 2.5}, TypeError, "batch"),
    ({"lr": math.nan}, ValueError, "lr"), ({"lr": -1.0}, ValueError, "lr"),
    ({"width": 0}, ValueError, "width"), ({"seed": -1}, ValueError, "seed"),
    ({"progress": 3}, TypeError, "progress"),
])
def test_train_mdlm_bad_calls(kw, err, match):
    with pytest.raises(err, match=match):
        train_mdlm(PairedPhrase(slots=2), **kw)


def test_tiny_mdlm_bad_calls():
    with pytest.raises(ValueError, match="width"):
        TinyMDLM(4, 4, width=0)
    with pytest.raises(ValueError, match="multiple of heads"):
        TinyMDLM(4, 4, width=10, heads=4)
    with pytest.raises(TypeError, match="seed"):
        TinyMDLM(4, 4, seed=1.5)


def test_unmasked_positions_are_one_hot_even_in_inconsistent_contexts():
    # Known members that disagree (0 then 0, where the language needs 0 then 1): the
    # masked member follows the first one, and each unmasked row stays its own token.
    lang = GroupLanguage(groups=1, size=3, m=4)
    p = lang.denoiser(torch.tensor([[0, 0, lang.mask_id]]))[0]
    assert p[0].argmax() == 0 and p[1].argmax() == 0 and p[1].max() == 1
    assert p[2].argmax() == 2  # x = 0 from member 0: member 2 is 0 + 2
    paired = PairedPhrase(slots=1, m=4)
    q = paired.denoiser(torch.tensor([[0, 0]]))[0]
    assert q[1].argmax() == 0 and q[1].max() == 1
