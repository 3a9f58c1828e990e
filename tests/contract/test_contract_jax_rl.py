"""The argument contract of parlearn.rl's JAX functions: GAE, the batched environments, the
policy, PPO's training and evaluation, and the throughput measurement (see harness.py).

Starting JAX starts threads, and a later fork of this process (gloo ranks) would then warn
or deadlock, so every test here runs in a child pytest (``fresh_process``, tests/conftest.py).
This module's top level is still imported by the main process to collect it (and by
test_completeness.py): it imports no JAX, and its ``good()`` builders make NumPy arrays and
Python numbers only, never JAX arrays (PRNG keys are raw ``uint32`` key data).
"""

from __future__ import annotations

import functools
import importlib.util
import math

import numpy as np
import pytest
from harness import Case, contract_tests

pytestmark = pytest.mark.fresh_process

HAS_GYMNAX = importlib.util.find_spec("gymnax") is not None


@functools.cache
def _env():
    """One cart-pole (10-step episodes) for every call: the rl functions cache their compiled
    programs per environment object."""
    from parlearn.many_copies.rl.envs import cartpole
    return cartpole(max_steps=10)


def _nan(a):
    a = a.copy()
    a.flat[0] = math.nan
    return a


def _key(n=None, seed=0):
    """Raw uint32 PRNG key data: one key (2,) or a batch (n, 2)."""
    shape = (2,) if n is None else (n, 2)
    return np.arange(seed, seed + math.prod(shape), dtype=np.uint32).reshape(shape)


# --- GAE ------------------------------------------------------------------------------------

def _gae_kwargs(T=6, N=3):
    """Column 0 runs on, column 1 terminates at step 2, column 2 times out at step 3;
    next_values[t] = values[t + 1] (the next observation is the next step's)."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((T + 1, N))
    term, trunc = np.zeros((T, N), bool), np.zeros((T, N), bool)
    term[2, 1], trunc[3, 2] = True, True
    return dict(rewards=rng.standard_normal((T, N)), values=values[:-1],
                next_values=values[1:], terminated=term, truncated=trunc,
                final_values=rng.standard_normal((T, N)), gamma=0.9, lam=1.0)


def _bootstrap(kw):
    return np.where(kw["terminated"], 0.0,
                    np.where(kw["truncated"], kw["final_values"], kw["next_values"]))


def _discounted_returns(kw):
    """lam = 1: the rewards discounted to each episode's end (or the rollout's), plus the
    discounted bootstrap there (the values telescope away)."""
    r, boot, g = kw["rewards"], _bootstrap(kw), kw["gamma"]
    ends = kw["terminated"] | kw["truncated"]
    T, N = r.shape
    out = np.zeros((T, N))
    for n in range(N):
        for t in range(T):
            e = next((k for k in range(t, T) if ends[k, n]), T - 1)
            out[t, n] = (sum(g ** (k - t) * r[k, n] for k in range(t, e + 1))
                         + g ** (e - t + 1) * boot[e, n])
    return out


def _gae_invariants(result, kw):
    """returns - advantages = values; lam = 1: discounted returns; lam = 0: one-step TD."""
    adv, ret = (np.asarray(a, np.float64) for a in result)
    np.testing.assert_allclose(ret - adv, kw["values"], atol=1e-5)
    if kw["lam"] == 1.0:
        np.testing.assert_allclose(ret, _discounted_returns(kw), rtol=1e-5, atol=1e-5)
    if kw["lam"] == 0.0:
        td = kw["rewards"] + kw["gamma"] * _bootstrap(kw) - kw["values"]
        np.testing.assert_allclose(adv, td, rtol=1e-5, atol=1e-5)


def _gae_equals_loop(result, kw):
    from parlearn.many_copies.rl.advantages import gae_loop

    _gae_invariants(result, kw)
    for a, b in zip(result, gae_loop(**kw), strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5)


_F, _B = np.zeros((6, 3)), np.zeros((6, 3), bool)
GAE_BAD = {
    "rewards": [_F.astype(np.int64), _B, _nan(_F), _F[0], _F[None], np.zeros((0, 3))],
    "values": [np.zeros((6, 2)), np.zeros((5, 3)), _nan(_F), _F.astype(np.int32)],
    "next_values": [np.zeros((6, 2)), _F.T, np.full((6, 3), np.inf)],
    "terminated": [_F, _F.astype(np.int64), np.zeros((6, 2), bool), _B[0]],
    "truncated": [_F, np.ones((6, 3), np.int8), np.zeros((7, 3), bool)],
    "final_values": [np.zeros((6, 4)), _nan(_F), _B],
}
RATES = {"gamma": (0.0, 1.0), "lam": (0.0, 1.0)}


# --- environments and policy ----------------------------------------------------------------

def _states(n=4, seed=0):
    """n cart-pole states near upright, at step 0: [x, x_dot, theta, theta_dot, t]."""
    s = np.random.default_rng(seed).uniform(-0.05, 0.05, (n, 5)).astype(np.float32)
    s[:, 4] = 0
    return s


def _step_kwargs():
    return dict(env=_env(), keys=_key(4), states=_states(), actions=np.array([0, 1, 1, 0]))


def _euler(state, action):
    """gym's CartPole-v1 Euler step, in NumPy: the observation after one step."""
    x, x_dot, th, th_dot = (state[:, i].astype(np.float64) for i in range(4))
    force = np.where(action == 1, 10.0, -10.0)
    cos, sin = np.cos(th), np.sin(th)
    temp = (force + 0.05 * th_dot**2 * sin) / 1.1
    th_acc = (9.8 * sin - cos * temp) / (0.5 * (4 / 3 - 0.1 * cos**2 / 1.1))
    x_acc = temp - 0.05 * th_acc * cos / 1.1
    return np.stack([x + 0.02 * x_dot, x_dot + 0.02 * x_acc, th + 0.02 * th_dot,
                     th_dot + 0.02 * th_acc], axis=1)


def _one_euler_step(result, kw):
    """Near upright at step 0 nothing ends: +1 each, the Euler step's observation, t = 1."""
    obs, state, reward, term, trunc, final = (np.asarray(a) for a in result)
    np.testing.assert_allclose(final, _euler(kw["states"], kw["actions"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(obs, final)
    np.testing.assert_array_equal(state[:, 4], 1.0)
    assert np.all(reward == 1.0) and not term.any() and not trunc.any()


def _batch_equals_loop(result, kw):
    from parlearn.many_copies.rl.envs import step_loop

    _one_euler_step(result, kw)
    for a, b in zip(result, step_loop(**kw), strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-7)


def _fresh_episodes(result, kw):
    obs, state = (np.asarray(a) for a in result)
    assert obs.shape == (kw["n"], 4) and np.all(np.abs(obs) <= 0.05)
    np.testing.assert_array_equal(state[:, :4], obs)
    np.testing.assert_array_equal(state[:, 4], 0.0)


def _np_params(obs_dim=3, n_actions=2, hidden=4, seed=0):
    """Actor and critic MLPs as init_policy lays them out, as float32 NumPy arrays."""
    rng = np.random.default_rng(seed)

    def mlp(sizes):
        return [{"w": rng.standard_normal((a, b)).astype(np.float32),
                 "b": rng.standard_normal(b).astype(np.float32)}
                for a, b in zip(sizes[:-1], sizes[1:], strict=True)]

    return {"pi": mlp([obs_dim, hidden, hidden, n_actions]), "v": mlp([obs_dim, hidden, 1])}


def _with(params, net, i, key, value):
    out = {k: [dict(layer) for layer in v] for k, v in params.items()}
    out[net][i][key] = value
    return out


def _bad_params():
    p = _np_params()
    return ["params", {}, {"pi": p["pi"]}, {**p, "q": p["v"]}, {"pi": [], "v": p["v"]},
            {"pi": (3,), "v": p["v"]},
            _with(p, "pi", 0, "w", _nan(p["pi"][0]["w"])),  # NaN
            _with(p, "pi", 1, "w", np.zeros((5, 4), np.float32)),  # does not chain
            _with(p, "pi", 0, "b", np.zeros(5, np.float32)),  # bias of another width
            _with(p, "v", 0, "w", np.zeros((2, 4), np.float32)),  # another obs width
            _with(p, "v", 1, "w", np.zeros((4, 2), np.float32)),  # two values
            _with(p, "v", 1, "b", np.zeros(1, np.int32)),
            _with(p, "pi", 0, "w", p["pi"][0]["w"][0])]  # 1-D


def _forward(result, kw):
    """The same MLPs in NumPy (float64): tanh hidden layers, linear outputs."""
    def mlp(layers, x):
        for layer in layers[:-1]:
            x = np.tanh(x @ layer["w"] + layer["b"])
        return x @ layers[-1]["w"] + layers[-1]["b"]

    obs = kw["obs"].astype(np.float64)
    np.testing.assert_allclose(result[0], mlp(kw["params"]["pi"], obs), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result[1], mlp(kw["params"]["v"], obs)[..., 0], rtol=1e-5,
                               atol=1e-5)


def _policy_layout(result, kw):
    o, a, h = kw["obs_dim"], kw["n_actions"], kw["hidden"]
    for net, out in (("pi", a), ("v", 1)):
        shapes = [tuple(np.shape(layer["w"])) for layer in result[net]]
        assert shapes == [(o, h), (h, h), (h, out)], (net, shapes)
        assert all(not np.any(np.asarray(layer["b"])) for layer in result[net])


def _episode_returns(result, kw):
    """+1 a step: each return is a whole number of steps, 1 to max_steps."""
    assert result.shape == (kw["episodes"],)
    assert np.all((result >= 1) & (result <= kw["max_steps"]) & (result == np.round(result)))


def _ppo_config():
    from parlearn.many_copies.rl.ppo import PPOConfig
    return PPOConfig(num_envs=2, num_steps=2, updates=3, epochs=1, minibatches=1, hidden=4)


ENV_BAD = ["cartpole", None, 3]
KEY_BAD = [np.zeros(2, np.float32), np.zeros(3, np.uint32), np.zeros((2, 2), np.uint32),
           np.zeros(2, np.int32)]
KEYS_BAD = [np.zeros((4, 2), np.float32), np.zeros((4, 3), np.uint32), _key(),
            np.zeros((0, 2), np.uint32), _key(3), np.zeros((4, 2, 2), np.uint32)]
STEP_BAD = {"env": ENV_BAD, "keys": KEYS_BAD,
            "states": [_states()[:, :4], _states(3), _states().astype(np.int32),
                       _nan(_states()), (_states(),), None],
            "actions": [np.array([0, 1, 2, 0]), np.array([0, -1, 1, 0]), np.zeros(4),
                        np.zeros(4, bool), np.zeros(3, np.int32), np.zeros((4, 1), np.int32)]}

CASES: list[Case] = [
    Case("parlearn.many_copies.rl.advantages.gae_loop", _gae_kwargs, ranges=RATES, bad=GAE_BAD,
         check=_gae_invariants),
    Case("parlearn.many_copies.rl.advantages.gae", _gae_kwargs, ranges=RATES, bad=GAE_BAD,
         check=_gae_equals_loop),
    Case("parlearn.many_copies.rl.envs.batch_reset",
         lambda: dict(env=_env(), key=_key(seed=5), n=3),
         ranges={"n": (1, None)}, bad={"env": ENV_BAD, "key": KEY_BAD},
         check=_fresh_episodes),
    Case("parlearn.many_copies.rl.envs.step_loop", _step_kwargs, bad=STEP_BAD,
         check=_one_euler_step),
    Case("parlearn.many_copies.rl.envs.batch_step", _step_kwargs, bad=STEP_BAD,
         check=_batch_equals_loop),
    Case("parlearn.many_copies.rl.policy.init_policy",
         lambda: dict(key=_key(), obs_dim=3, n_actions=2, hidden=4),
         ranges={"obs_dim": (1, None), "n_actions": (1, None), "hidden": (1, None)},
         bad={"key": KEY_BAD}, check=_policy_layout),  # a small compile per shape drawn
    Case("parlearn.many_copies.rl.policy.policy_logits_value",
         lambda: dict(params=_np_params(),
                      obs=np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)),
         bad={"params": _bad_params(),
              "obs": [np.zeros((5, 4)), np.zeros((5, 3), np.int32), np.zeros((5, 3), bool),
                      _nan(np.zeros((5, 3))), np.array(1.0)]},
         check=_forward),
    # One compile (episodes and max_steps are static, so their bad values are listed rather
    # than drawn from a range, which would compile each draw); seeds reuse it.
    Case("parlearn.many_copies.rl.ppo.evaluate",
         lambda: dict(env=_env(), params=None, episodes=4, max_steps=8, seed=0),
         ranges={"seed": (0, None)},
         bad={"env": ENV_BAD,
              "params": ["params", _np_params(obs_dim=3), _np_params(obs_dim=4, n_actions=3),
                         {"pi": []}],
              "episodes": [0, -1], "max_steps": [0, -2]},
         legal={"params": [None]}, check=_episode_returns),
    # trains: refusals only (each comes before JAX compiles anything)
    Case("parlearn.many_copies.rl.ppo.train_ppo",
         lambda: dict(env=_env(), config=_ppo_config(), seed=0, records=3, eval_episodes=0),
         ranges={"seed": (0, None), "records": (1, 3), "eval_episodes": (0, None)},
         bad={"env": ENV_BAD, "config": ["ppo", {"lr": 1.0}]},
         legal={"config": [None], "records": [None]}, run_good=False),
    # measures (compiles a rollout per size and times it): refusals only
    Case("parlearn.many_copies.rl.throughput.env_steps_per_second",
         lambda: dict(env=_env(), num_envs=[1, 2], steps=2, repeat=1, seed=0, mode="random"),
         ranges={"steps": (1, None), "repeat": (1, None), "seed": (0, None)},
         bad={"env": ENV_BAD, "num_envs": [[], [0], [1, True], [1.5], 4, "12", None]},
         run_good=False),
]

COVERED_ELSEWHERE: dict[str, str | list[str]] = {}
if HAS_GYMNAX:
    CASES.append(Case(
        "parlearn.many_copies.rl.envs.gymnax_env", lambda: dict(name="CartPole-v1"),
        check=lambda r, kw: None if (r.obs_dim, r.n_actions) == (4, 2) else pytest.fail(f"{r}")))
else:  # the [massive] extra is missing: a name cannot be looked up, only the error checked
    COVERED_ELSEWHERE["parlearn.many_copies.rl.envs.gymnax_env"] = [
        "tests/contract/test_contract_jax_rl.py::test_gymnax_env_without_gymnax_names_the_extra",
        "tests/many_copies/test_rl.py::test_bad_calls_fail_fast"]

test_refuses, test_accepts, test_accepts_range = contract_tests(CASES)

EXEMPT: dict[str, str] = {}

# Public callables whose contract test is still to be written (test_completeness: only shrinks).
PENDING: list[str] = []


def test_gymnax_env_without_gymnax_names_the_extra(monkeypatch):
    """Without gymnax, a name of the wrong type is still refused first; a string asks for the
    extra that brings gymnax."""
    import sys

    from parlearn.many_copies.rl.envs import gymnax_env

    monkeypatch.setitem(sys.modules, "gymnax", None)  # import gymnax now fails
    with pytest.raises(TypeError, match="name"):
        gymnax_env(3)
    with pytest.raises(ImportError, match=r"parlearn\[massive\]"):
        gymnax_env("CartPole-v1")
