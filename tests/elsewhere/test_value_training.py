"""Seeded DQN runs on the batched JAX cart-pole, in a fresh interpreter (fresh_process in
tests/conftest.py: JAX's threads make later forks of the main pytest process unsafe).
Returns vs env steps for DQN and each variant."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.fresh_process

pytest.importorskip("jax")

from parlearn.elsewhere import value as V  # noqa: E402

SHORT = V.DQNConfig(env_steps=320, num_envs=4, learn_start=100, ls_every=20, ls_size=200)


@pytest.mark.parametrize("variant", V.VARIANTS)
def test_each_variant_is_seeded_and_leaves_callers_rng_alone(variant):
    cfg = replace(SHORT, variant=variant)
    state = torch.get_rng_state()
    a, b = V.train(cfg, seed=3), V.train(cfg, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert a.returns == b.returns and a.end_steps == b.end_steps and a.returns
    assert a.updates == (320 - 100) // 4 + 1
    assert V.train(cfg, seed=4).returns != a.returns
    curve = V.returns_vs_steps([a, b], bins=3)
    assert curve["per_run"].shape == (2, 3) and curve["steps"][-1] == 320


def test_tsoft_with_infinite_nu_trains_exactly_like_dqn():
    dqn = V.train(replace(SHORT, variant="dqn"), seed=1)
    ts = V.train(replace(SHORT, variant="t-soft", nu=math.inf), seed=1)
    assert ts.returns == dqn.returns


def test_ebu_with_beta_zero_changes_only_the_sampling():
    """beta = 0 gives one-step targets, so EBU differs from DQN only in drawing transitions
    from whole episodes: a run stays valid and seeded (not equal to DQN: other samples)."""
    a = V.train(replace(SHORT, variant="ebu", beta=0.0), seed=2)
    assert a.returns == V.train(replace(SHORT, variant="ebu", beta=0.0), seed=2).returns


def test_dqn_learns_on_cartpole():
    """A short run: the last windows' training returns beat the random-play first window."""
    cfg = V.DQNConfig(env_steps=5000, num_envs=4)
    curve = V.returns_vs_steps([V.train(cfg, seed=0)], bins=6)
    assert np.nanmean(curve["mean"][-2:]) > 2 * curve["mean"][0], curve["mean"]


def test_each_variant_changes_the_run():
    """Same seed, same sizes: each variant's one change alters what the agent does."""
    base = V.train(replace(SHORT, variant="dqn"), seed=5)
    for v in ("ebu", "ls-dqn", "t-soft"):
        run = V.train(replace(SHORT, variant=v), seed=5)
        for net in ("online", "target"):
            a, b = getattr(run, net), getattr(base, net)
            assert any(not torch.equal(a[k], b[k]) for k in a), (v, net)
