"""The training recipe: its groups, its schedule, its refusals."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from parlearn.core.recipe import Recipe


def test_groups_decay_matrices_only_and_leave_frozen_tensors_out():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2, bias=False))
    model[0].bias.requires_grad_(False)
    decay, plain = Recipe(weight_decay=0.2).param_groups(model.named_parameters())
    assert decay["weight_decay"] == 0.2 and plain["weight_decay"] == 0.0
    assert [id(p) for p in decay["params"]] == [id(model[0].weight), id(model[2].weight)]
    assert [id(p) for p in plain["params"]] == [id(model[1].weight), id(model[1].bias)]


def test_schedule_warms_up_linearly_then_follows_the_cosine_to_the_floor():
    r = Recipe(warmup=4, floor=0.1)
    steps = 20
    cos = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / steps)) for i in range(steps + 1)]
    assert [r.factor(i, steps) for i in range(4)] == pytest.approx(
        [(i + 1) / 4 * cos[i] for i in range(4)])
    assert r.factor(10, steps) == pytest.approx(0.55)      # half-way down the cosine
    assert r.factor(steps, steps) == pytest.approx(0.1)    # the floor
    assert r.factor(steps + 5, steps) == pytest.approx(0.1)
    p = torch.zeros(2, 2, requires_grad=True)
    opt = torch.optim.AdamW(r.param_groups([p]), lr=2.0)
    sched = r.scheduler(opt, steps)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * r.factor(i, steps) for i in range(6)])


@pytest.mark.parametrize("kwargs, name", [
    (dict(weight_decay=-0.1), "weight_decay"), (dict(clip=0.0), "clip"),
    (dict(clip=True), "clip"), (dict(warmup=0), "warmup"), (dict(warmup=2.0), "warmup"),
    (dict(floor=1.5), "floor"), (dict(betas=(0.9,)), "betas"),
    (dict(betas=(0.9, 1.0)), "betas"),
])
def test_bad_recipes_are_refused_naming_the_argument(kwargs, name):
    with pytest.raises((TypeError, ValueError), match=name):
        Recipe(**kwargs)


def test_bad_uses_are_refused():
    r = Recipe()
    with pytest.raises(TypeError, match="params"):
        r.param_groups(torch.zeros(2, requires_grad=True))
    with pytest.raises(ValueError, match="params"):
        r.param_groups([torch.zeros(2)])
    with pytest.raises(TypeError, match="optimizer"):
        r.scheduler("adamw", 10)
    with pytest.raises(ValueError, match="steps"):
        r.factor(0, 0)


@given(warmup=st.integers(1, 50), steps=st.integers(1, 500),
       floor=st.floats(0.0, 1.0, allow_nan=False), step=st.integers(0, 1000))
@settings(max_examples=200, deadline=None)
def test_factor_stays_between_the_floor_and_one_and_never_rises_after_warm_up(
        warmup, steps, floor, step):
    r = Recipe(warmup=warmup, floor=floor)
    f = r.factor(step, steps)
    warm = min(1.0, (step + 1) / warmup)
    assert warm * floor - 1e-12 <= f <= warm + 1e-12
    if step >= warmup - 1:   # past the warm-up: the cosine only falls
        assert r.factor(step + 1, steps) <= f + 1e-12
