"""PPO on batched environments (parlearn.rl): GAE with time-outs bootstrapped equals the
reference loop; batched steps equal single steps; a short seeded training run beats a random
policy by a wide margin; gymnax's CartPole is the same system and trains too."""

import numpy as np
import pytest
import torch

# JAX starts threads: these tests run in a fresh interpreter (see fresh_process in
# tests/conftest.py).
pytestmark = pytest.mark.fresh_process

jax = pytest.importorskip("jax")
jnp = jax.numpy

from parlearn.many_copies import rl  # noqa: E402

ENV = rl.cartpole()


def _gae_inputs(T=37, N=5, seed=0):
    rng = np.random.default_rng(seed)
    r, v, nv, fv = (rng.normal(size=(T, N)).astype(np.float32) for _ in range(4))
    term = rng.random((T, N)) < 0.1
    trunc = (rng.random((T, N)) < 0.1) & ~term
    return r, v, nv, term, trunc, fv


def test_gae_equals_reference_loop():
    args = _gae_inputs()
    adv, ret = rl.gae(*(jnp.asarray(a) for a in args), gamma=0.97, lam=0.9)
    adv_ref, ret_ref = rl.gae_loop(*args, gamma=0.97, lam=0.9)
    np.testing.assert_allclose(adv, adv_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, ret_ref, rtol=1e-5, atol=1e-5)


def test_gae_bootstraps_time_outs_but_not_terminations():
    # One step, reward 1, V(s)=0.5, V(final obs)=2, V(next, a fresh episode)=7.
    args = [np.array([[x]], np.float32) for x in (1.0, 0.5, 7.0)]
    fv = np.array([[2.0]], np.float32)
    for term, trunc, boot in [(False, False, 7.0), (False, True, 2.0), (True, False, 0.0)]:
        flags = [np.array([[term]]), np.array([[trunc]])]
        adv, _ = rl.gae(*(jnp.asarray(a) for a in (*args, *flags, fv)), gamma=0.9, lam=0.8)
        adv_ref, _ = rl.gae_loop(*args, *flags, fv, gamma=0.9, lam=0.8)
        assert float(adv[0, 0]) == pytest.approx(1.0 + 0.9 * boot - 0.5)
        assert adv_ref[0, 0] == pytest.approx(1.0 + 0.9 * boot - 0.5)


def _check_batch_equals_single(env, n=8, steps=60):
    step = jax.jit(env.step)
    keys = jax.random.split(jax.random.key(0), n)
    obs, state = jax.vmap(env.reset)(keys)
    single = [env.reset(k) for k in keys]
    rng = np.random.default_rng(0)
    ended = 0
    for t in range(steps):
        actions = jnp.asarray(rng.integers(0, env.n_actions, n))
        keys = jax.random.split(jax.random.key(100 + t), n)
        out = rl.batch_step(env, keys, state, actions)
        state = out[1]
        for i in range(n):
            o = step(keys[i], single[i][1], actions[i])
            single[i] = (o[0], o[1])
            for a, b in zip(jax.tree.leaves(o), jax.tree.leaves(jax.tree.map(
                    lambda x, i=i: x[i], out)), strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        ended += int(out[3].sum())
    assert ended > 0  # the comparison covered episode ends and resets


def test_batched_env_steps_equal_single_steps():
    _check_batch_equals_single(ENV)


def test_step_loop_is_a_loop_of_single_steps_and_equals_batch_step():
    env = rl.cartpole(max_steps=5)  # short episodes: the steps below cross resets
    step = jax.jit(env.step)
    keys = jax.random.split(jax.random.key(3), 6)
    obs, state = jax.vmap(env.reset)(keys)
    actions = np.array([0, 1, 1, 0, 1, 0], np.int32)
    truncated = 0
    for t in range(7):
        keys = jax.random.split(jax.random.key(200 + t), 6)
        looped = rl.step_loop(env, keys, state, actions)
        batched = rl.batch_step(env, keys, state, actions)
        for i in range(6):
            one = step(keys[i], state[i], actions[i])
            for a, b in zip(one, looped, strict=True):
                np.testing.assert_array_equal(np.asarray(a), b[i])
        for a, b in zip(looped, batched, strict=True):
            np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-7)
        truncated += int(looped[4].sum())
        state = batched[1]
    assert truncated > 0


@pytest.mark.parametrize("n", [1, 7, 1024, 16385])
def test_batch_reset_equals_unpadded_vmap_reset(n):
    # batch_reset resets a padded batch and keeps the first n: the same copies as
    # vmap(env.reset) over split(key, n), under JAX's default partitionable threefry.
    key = jax.random.key(11)
    obs, state = rl.batch_reset(ENV, key, n)
    ref_obs, ref_state = jax.vmap(ENV.reset)(jax.random.split(key, n))
    assert obs.shape == (n, ENV.obs_dim)
    np.testing.assert_array_equal(np.asarray(obs), np.asarray(ref_obs))
    np.testing.assert_array_equal(np.asarray(state), np.asarray(ref_state))


def test_truncation_after_max_steps():
    env = rl.cartpole(max_steps=5)
    obs, state = env.reset(jax.random.key(0))
    flags = []
    for t in range(5):
        obs, state, r, term, trunc, final = env.step(jax.random.key(t), state, t % 2)
        flags.append((bool(term), bool(trunc)))
    assert flags == [(False, False)] * 4 + [(False, True)]
    assert float(state[4]) == 0.0  # a fresh episode after the time-out,
    np.testing.assert_array_equal(obs, state[:4])  # whose observation is returned
    assert not np.array_equal(np.asarray(final), np.asarray(obs))  # and the last one kept


def test_ppo_rollout_advantages_equal_reference():
    # The wiring inside PPO: values of the next and the final observations go to the right
    # slots of GAE. A 15-step limit puts time-outs inside the 40-step rollout.
    env, cfg = rl.cartpole(max_steps=15), rl.PPOConfig(num_envs=4, num_steps=40)
    carry = rl._init_carry(env, cfg, 0)
    rollout, _ = rl._make_update(env, cfg)
    new, traj, adv, _ = jax.jit(rollout)(carry, jax.random.key(1))
    value = jax.jit(lambda o: rl.policy_logits_value(carry["params"], o)[1])
    next_obs = jnp.concatenate([traj["obs"][1:], new["obs"][None]])
    adv_ref, _ = rl.gae_loop(traj["reward"], value(traj["obs"]), value(next_obs), traj["term"],
                             traj["trunc"], value(traj["final_obs"]), cfg.gamma, cfg.lam)
    assert bool(traj["trunc"].any()) and bool(traj["term"].any())
    np.testing.assert_allclose(adv, adv_ref, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def trained():
    cfg = rl.PPOConfig(num_envs=64, num_steps=32, updates=40)
    return rl.train_ppo(ENV, cfg, seed=0, records=10, eval_episodes=64)


def test_trained_policy_beats_random_by_a_wide_margin(trained):
    ret = rl.evaluate(ENV, trained.params, episodes=64, seed=1).mean()
    rand = rl.evaluate(ENV, None, episodes=64, seed=1).mean()
    assert rand < 40
    assert ret > rand + 150, (ret, rand)


def test_time_to_target_and_curves(trained):
    assert trained.env_steps[-1] == 40 * 64 * 32
    assert np.all(np.diff(trained.wall_s) > 0) and trained.compile_s > 0
    hit = rl.time_to_target(trained, 150.0)
    assert hit is not None and 0 < hit[1] <= trained.env_steps[-1]
    assert rl.time_to_target(trained, 1e6) is None


def test_seeded_and_callers_rng_untouched():
    cfg = rl.PPOConfig(num_envs=8, num_steps=16, updates=2)
    np_state, torch_state = np.random.get_state(), torch.get_rng_state()  # noqa: NPY002
    a = rl.train_ppo(ENV, cfg, seed=5)
    b = rl.train_ppo(ENV, cfg, seed=5)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(x, y)
    assert np.array_equal(np.random.get_state()[1], np_state[1])  # noqa: NPY002
    assert torch.equal(torch.get_rng_state(), torch_state)


def test_env_steps_per_second_reports_a_curve():
    r = rl.env_steps_per_second(ENV, [1, 32], steps=8, repeat=2)
    assert r["num_envs"] == [1, 32] and all(v > 0 for v in r["steps_per_s"])


# --- against gymnax (the [massive] extra) ------------------------------------------------

def test_cartpole_is_gymnax_cartpole():
    gymnax = pytest.importorskip("gymnax")
    env, params = gymnax.make("CartPole-v1")
    from gymnax.environments.classic_control.cartpole import EnvState

    s = np.random.default_rng(0).uniform(-0.2, 0.2, (50, 4)).astype(np.float32)
    for i in range(50):
        for a in (0, 1):
            gs = EnvState(x=s[i, 0], x_dot=s[i, 1], theta=s[i, 2], theta_dot=s[i, 3], time=3)
            g_obs, _, _, g_term, _ = env.step_env(jax.random.key(0), gs, a, params)
            state = jnp.concatenate([jnp.asarray(s[i]), jnp.array([3.0])])
            *_, term, _, final = ENV.step(jax.random.key(0), state, a)
            np.testing.assert_allclose(final, g_obs, rtol=1e-6, atol=1e-6)
            assert bool(term) == bool(g_term)


def test_ppo_trains_on_gymnax_env():
    pytest.importorskip("gymnax")
    env = rl.gymnax_env("CartPole-v1")
    _check_batch_equals_single(env, n=4, steps=40)
    res = rl.train_ppo(env, rl.PPOConfig(num_envs=64, num_steps=32, updates=40), seed=0)
    ret = rl.evaluate(env, res.params, episodes=64, seed=1).mean()
    assert ret > rl.evaluate(env, None, episodes=64, seed=1).mean() + 150


# --- bad calls fail fast --------------------------------------------------------------------

@pytest.mark.parametrize("call, exc, match", [
    (lambda: rl.cartpole(0), ValueError, "max_steps"),
    (lambda: rl.PPOConfig(num_envs=0), ValueError, "num_envs"),
    (lambda: rl.PPOConfig(gamma=1.5), ValueError, "gamma"),
    (lambda: rl.PPOConfig(lr=0.0), ValueError, "lr"),
    (lambda: rl.PPOConfig(num_envs=3, num_steps=3, minibatches=4), ValueError, "minibatches"),
    (lambda: rl.PPOConfig(updates=2.0), TypeError, "updates"),
    (lambda: rl.train_ppo("cartpole"), TypeError, "env"),
    (lambda: rl.train_ppo(ENV, {"lr": 1}), TypeError, "config"),
    (lambda: rl.train_ppo(ENV, seed=-1), ValueError, "seed"),
    (lambda: rl.evaluate(ENV, None, episodes=0), ValueError, "episodes"),
    (lambda: rl.time_to_target(None, float("nan")), ValueError, "target"),
    (lambda: rl.env_steps_per_second(ENV, [1], mode="fast"), ValueError, "mode"),
    (lambda: rl.env_steps_per_second(ENV, []), ValueError, "num_envs"),
    (lambda: rl.gymnax_env(3), TypeError, "name"),
    (lambda: rl.batch_reset(ENV, jax.random.key(0), 0), ValueError, "n"),
])
def test_bad_calls_fail_fast(call, exc, match):
    with pytest.raises(exc, match=match):
        call()

