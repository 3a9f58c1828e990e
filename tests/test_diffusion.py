import pytest
import torch

from parlearn.diffusion import PairedPhrase, conditional_distance, train_mdlm


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
    with pytest.raises(ValueError, match="tokens must have shape"):
        PairedPhrase().valid(torch.zeros(2, 3, dtype=torch.int64))


def test_trained_tiny_model_is_close_to_exact():
    lang = PairedPhrase()
    model = train_mdlm(lang, steps=800, progress=False)
    tv = conditional_distance(model, lang)
    # Stated tolerance: mean total variation below 0.05 on masked positions.
    assert tv < 0.05, tv
