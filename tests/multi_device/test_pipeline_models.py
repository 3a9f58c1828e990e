"""parlearn.pipeline on models a user brings, not built by ``make_model``: a flat
``nn.Sequential`` of layers and activations (so a stage may begin with Tanh, LayerNorm or
GELU), a frozen layer, weights tied inside a stage, float32. Every schedule, our ranks and
torch's, must equal the single-process gradients; what cannot work is refused before any
rank starts, naming the argument."""

import itertools

import pytest
import torch
from torch import nn

from parlearn import distributed as dist
from parlearn.multi_device import pipeline as pl
from parlearn.multi_device.pipeline.torch_pipeline import TORCH_ZOO, run_torch_zoo
from parlearn.multi_device.pipeline.zoo import zoo_schedule

TOL = 1e-12


def _odd_model(dtype=torch.float64) -> nn.Sequential:
    """Eight flat layers: Linear, Tanh, LayerNorm, a frozen Linear, GELU, Linear, ReLU,
    Linear. Initialised from its own generator."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, 6),
                          nn.GELU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).to(dtype)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) / 2)
    model[3].requires_grad_(False)
    return model


def _data(dtype=torch.float64, n=12):
    gen = torch.Generator().manual_seed(4)
    return (torch.randn(n, 4, generator=gen, dtype=dtype),
            torch.randn(n, 3, generator=gen, dtype=dtype))


def _max_err(a, b):
    assert len(a) == len(b)
    return max((u - v).abs().max().item() for u, v in zip(a, b, strict=True))


def _cuts(n_layers, stages):
    """Every way to cut ``n_layers`` into ``stages`` non-empty contiguous stages."""
    for ends in itertools.combinations(range(1, n_layers), stages - 1):
        bounds = (0, *ends, n_layers)
        yield [b - a for a, b in itertools.pairwise(bounds)]


@pytest.fixture(scope="module")
def odd():
    model = _odd_model()
    x, y = _data()
    ref = pl.reference_grads(model, x, y)
    # The reference leaves the frozen layer out and has a gradient for every other one.
    assert len(ref) == sum(p.requires_grad for p in model.parameters()) == 8
    assert all(g.abs().max() > 1e-3 for g in ref)
    return model, x, y, ref


@pytest.mark.parametrize("kind", pl.SCHEDULES)
def test_every_two_stage_cut_equals_single_process(odd, kind):
    # A cut at every layer boundary: stage 1 begins with each kind of layer in turn.
    model, x, y, ref = odd
    for counts in _cuts(len(model), 2):
        for run in pl.run_pipeline(kind, model, x, y, 2, [1, 4], counts=counts, timeout=30):
            assert _max_err(run.grads, ref) < TOL, (kind, counts, run.micro_batches)


@pytest.mark.parametrize("kind", pl.SCHEDULES)
def test_flat_three_stage_cuts_equal_single_process(kind):
    # The case: Linear and activations only, three stages, some of them without
    # any weight (zero-bubble has no W to form there).
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(),
                          nn.Linear(5, 3)).double()
    x, y = _data()
    ref = pl.reference_grads(model, x, y)
    for counts in _cuts(len(model), 3):
        run = pl.run_pipeline(kind, model, x, y, 3, 4, counts=counts, timeout=30)
        assert _max_err(run.grads, ref) < TOL, (kind, counts)


@pytest.mark.parametrize("kind", pl.SCHEDULES)
def test_a_first_stage_with_nothing_to_train(kind):
    # Stage 0 is one layer with no gradient to form: an activation, or a frozen layer.
    x, y = _data()
    for first in (nn.Tanh(), nn.Linear(4, 4).requires_grad_(False)):
        model = nn.Sequential(first, nn.Linear(4, 5), nn.GELU(), nn.Linear(5, 3)).double()
        ref = pl.reference_grads(model, x, y)
        run = pl.run_pipeline(kind, model, x, y, 2, 3, counts=[1, 3], timeout=30)
        assert _max_err(run.grads, ref) < TOL, (kind, first)


def test_virtual_and_torch_schedules_on_the_odd_model(odd):
    model, x, y, ref = odd
    # 2 ranks x 2 chunks of 2 layers: chunks begin with LayerNorm, GELU and ReLU.
    scheds = [zoo_schedule("interleaved", 2, 4, 2), zoo_schedule("zb-v", 2, 4)]
    for run in pl.run_schedule(scheds, model, x, y, timeout=30):
        assert _max_err(run.grads, ref) < TOL, run.kind
    for kind in pl.SCHEDULES:
        for grads in pl.run_torch_pipeline(kind, model, x, y, 2, [2, 4], counts=[3, 5],
                                           timeout=30):
            assert _max_err(grads, ref) < TOL, kind


def test_hydra_trains_models_with_a_frozen_layer_as_if_alone(odd):
    model, x, y, _ = odd
    data = [(x, y)]
    trained = pl.hydra_train([model], data, 2, 3, steps=2, lr=0.1, kind="zb", counts=[3, 5])
    alone = pl.hydra_reference([model], data, steps=2, lr=0.1)
    assert _max_err(list(trained[0].parameters()), list(alone[0].parameters())) < TOL
    assert torch.equal(trained[0][3].weight, model[3].weight)      # frozen stays
    assert _max_err(list(trained[0].parameters()), list(model.parameters())) > 1e-3


def test_weights_tied_inside_a_stage_are_one_tensor():
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.GELU(),
                          nn.Linear(5, 5), nn.Linear(5, 3)).double()
    model[4].weight = model[2].weight
    x, y = _data()
    ref = pl.reference_grads(model, x, y)
    assert len(ref) == 7                                    # the tied weight once
    for kind in pl.SCHEDULES:
        run = pl.run_pipeline(kind, model, x, y, 2, 3, counts=[1, 5], timeout=30)
        assert _max_err(run.grads, ref) < TOL, kind


def test_float32_models_send_float32(odd):
    model = _odd_model(torch.float32)
    x, y = _data(torch.float32)
    ref = pl.reference_grads(model, x, y)
    run = pl.run_pipeline("1f1b", model, x, y, 3, 4, counts=[2, 3, 3], timeout=30)
    # float32: micro-batch sums round differently from the full batch's, no more.
    assert _max_err(run.grads, ref) < 1e-5


def test_what_cannot_run_is_refused_before_any_rank_starts(monkeypatch):
    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks started")

    monkeypatch.setattr(dist, "run", no_ranks)
    x, y = _data()
    wrong_width = nn.Sequential(nn.Tanh(), nn.Linear(5, 3)).double()
    with pytest.raises(ValueError, match=r"model\[1\] \(Linear\)"):
        pl.run_pipeline("1f1b", wrong_width, x, y, 2, 2)
    wrong_out = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    with pytest.raises(ValueError, match="y has rows of shape"):
        pl.run_pipeline("gpipe", wrong_out, x, y, 2, 2)
    tied = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 3)).double()
    tied[2].weight = tied[0].weight
    with pytest.raises(ValueError, match=r"model\[0\] and model\[2\] share a parameter"):
        pl.run_pipeline("zb", tied, x, y, 2, 2, counts=[2, 2])
    with pytest.raises(ValueError, match="share a parameter"):
        pl.run_torch_pipeline("1f1b", tied, x, y, 2, 2, counts=[2, 2])
    with pytest.raises(ValueError, match="share a parameter"):
        pl.run_schedule(zoo_schedule("interleaved", 2, 2, 2), tied, x, y)
    with pytest.raises(ValueError, match="share a parameter"):
        pl.hydra_train([tied], [(x, y)], 2, 2, counts=[2, 2])


def test_the_probe_leaves_the_global_rng_and_the_model_alone():
    model = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.5), nn.BatchNorm1d(5),
                          nn.Linear(5, 3)).double()
    x, y = _data()
    state = torch.random.get_rng_state()
    stats = model[2].running_mean.clone()
    from parlearn.multi_device.pipeline.partition import _probe

    shapes = _probe(model, x, y)
    assert [tuple(s) for s, _ in shapes] == [(4,), (5,), (5,), (5,), (3,)]
    assert all(d == torch.float64 for _, d in shapes)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(model[2].running_mean, stats)


def test_layer_costs_measure_a_frozen_layer(odd):
    model, x, _, _ = odd
    costs = pl.layer_costs(model, x, repeat=1)
    assert len(costs) == len(model) and all(c > 0 for c in costs)
    assert all(p.grad is None for p in model.parameters())   # the caller's .grad untouched


@pytest.mark.parametrize("name", sorted(TORCH_ZOO))
def test_torchs_multi_stage_schedules_on_the_odd_model(odd, name):
    """torch's interleaved / zero-bubble schedules (two virtual stages per rank) on the user's
    flat model with a frozen layer equal the single-process gradients."""
    model, x, y, ref = odd
    assert _max_err(run_torch_zoo(name, model, x, y, 2, 4, timeout=60), ref) < TOL
