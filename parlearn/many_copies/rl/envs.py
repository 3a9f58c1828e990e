"""Batched environments: a cart-pole written out in JAX, or any gymnax environment.

Both sit behind one interface (:class:`Env`): one copy's ``reset`` and ``step``, batched
over thousands of copies with ``jax.vmap`` (:func:`batch_step`); ``jax.vmap(env.step)``
equals a loop of single steps. A step that ends an episode returns the fresh episode's
observation and the one the episode ended on, so a time-out can be bootstrapped.

JAX is imported inside the functions, so ``import parlearn.rl`` does not start it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from parlearn.core.checks import check_int
from parlearn.many_copies.rl._checks import check_array, check_keys, is_traced

__all__ = ["Env", "cartpole", "gymnax_env", "batch_step", "step_loop", "batch_reset"]


# --- environments ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Env:
    """One environment copy; batch it with ``jax.vmap``.

    ``reset(key) -> (obs, state)``; ``step(key, state, action) -> (obs, state, reward,
    terminated, truncated, final_obs)``: on an episode's end the returned ``obs`` and
    ``state`` are already those of a fresh episode, and ``final_obs`` is the observation
    the episode ended on (needed to bootstrap a time-out).
    """

    name: str
    obs_dim: int
    n_actions: int
    reset: Callable = field(repr=False)
    step: Callable = field(repr=False)


def cartpole(max_steps: int = 500) -> Env:
    """Cart-pole (Barto, Sutton & Anderson 1983) with the constants and Euler step of gym's
    CartPole-v1: +1 per step, terminated when |x| > 2.4 or |theta| > 12 degrees, truncated
    after ``max_steps`` steps. State: ``[x, x_dot, theta, theta_dot, t]``.
    """
    max_steps = check_int("max_steps", max_steps, lo=1)
    gravity, m_cart, m_pole, half_len, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    total = m_cart + m_pole

    def reset(key):
        import jax
        import jax.numpy as jnp

        s = jax.random.uniform(key, (4,), minval=-0.05, maxval=0.05)
        return s, jnp.concatenate([s, jnp.zeros(1)])

    def physics(s, action):
        import jax.numpy as jnp

        x, x_dot, th, th_dot, t = s
        force = jnp.where(action == 1, force_mag, -force_mag)
        cos, sin = jnp.cos(th), jnp.sin(th)
        temp = (force + m_pole * half_len * th_dot**2 * sin) / total
        th_acc = (gravity * sin - cos * temp) / (half_len * (4 / 3 - m_pole * cos**2 / total))
        x_acc = temp - m_pole * half_len * th_acc * cos / total
        return jnp.stack([x + tau * x_dot, x_dot + tau * x_acc, th + tau * th_dot,
                          th_dot + tau * th_acc, t + 1])

    def step(key, state, action):
        import jax.numpy as jnp

        s = physics(state, action)
        terminated = (jnp.abs(s[0]) > 2.4) | (jnp.abs(s[2]) > 12 * 2 * jnp.pi / 360)
        truncated = (s[4] >= max_steps) & ~terminated
        obs_new, state_new = reset(key)
        done = terminated | truncated
        return (jnp.where(done, obs_new, s[:4]), jnp.where(done, state_new, s),
                jnp.float32(1.0), terminated, truncated, s[:4])

    return Env(f"cartpole{max_steps}", 4, 2, reset, step)


def gymnax_env(name: str = "CartPole-v1") -> Env:
    """A gymnax environment behind the same interface (needs the ``[massive]`` extra)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a gymnax environment id (str), got {type(name).__name__}")
    try:
        import gymnax
    except ImportError as err:
        raise ImportError("gymnax_env needs gymnax: pip install 'parlearn[massive]'") from err
    if name not in gymnax.registered_envs:
        raise ValueError(f"name must be one of {gymnax.registered_envs}, got {name!r}")
    env, params = gymnax.make(name)

    def reset(key):
        return env.reset(key, params)

    def step(key, state, action):
        obs, state, reward, terminated, truncated, info = env.step(key, state, action, params)
        return (obs, state, reward.astype("float32"), terminated, truncated & ~terminated,
                info["final_observation"])

    return Env(name, int(np.prod(env.observation_space(params).shape)),
               int(env.num_actions), reset, step)


def _check_env(env: Env) -> Env:
    """``env`` if it is an :class:`Env` (what :func:`cartpole` and :func:`gymnax_env` build)."""
    if not isinstance(env, Env):
        raise TypeError(f"env must be a parlearn.rl.Env (cartpole(), gymnax_env()), got "
                        f"{type(env).__name__}")
    return env


def _check_batch(env: Env, keys, states, actions) -> None:
    """One key, one state and one action per copy: keys a batch of n keys; states ``n``
    stacked copies of ``env.reset``'s state (same structure, kinds, shapes after the batch
    axis; concrete floats finite); actions ``n`` integers in [0, env.n_actions) (checked
    when concrete)."""
    import jax

    _check_env(env)
    n = check_keys("keys", keys, batch=True)
    one = _state_spec(env)
    if jax.tree.structure(states) != jax.tree.structure(one):
        raise ValueError(f"states must have the structure of env.reset's state "
                         f"{jax.tree.structure(one)}, got {jax.tree.structure(states)}")
    for leaf, spec in zip(jax.tree.leaves(states), jax.tree.leaves(one), strict=True):
        kind = {"f": "float", "b": "bool"}.get(np.dtype(spec.dtype).kind, "int")
        shape = check_array("states", leaf, kind=kind)
        if shape != (n, *spec.shape):
            raise ValueError(f"states must have shape {(n, *spec.shape)}, one state per key "
                             f"of keys, got {shape}")
    if check_array("actions", actions, kind="int") != (n,):
        raise ValueError(f"actions must have shape ({n},), one action per key of keys, got "
                         f"{tuple(actions.shape)}")
    if not is_traced(actions):
        a = np.asarray(actions)
        if a.min() < 0 or a.max() >= env.n_actions:
            raise ValueError(f"actions must lie in [0, {env.n_actions - 1}] (env.n_actions = "
                             f"{env.n_actions}), got values from {a.min()} to {a.max()}")


def batch_step(env: Env, keys, states, actions):
    """Step a batch of copies at once: ``jax.jit(jax.vmap(env.step))`` (compiled once per
    environment and batch shape; inside another jitted function it is inlined).

    ``keys``: one PRNG key per copy (``(n,)`` keys, or raw ``(n, 2)`` uint32 key data);
    ``states``: ``n`` stacked states of ``env.reset``; ``actions``: ``n`` integers in
    ``[0, env.n_actions)`` (their values are checked when concrete, not while tracing).
    """
    _check_batch(env, keys, states, actions)
    return _batched(env)[1](keys, states, actions)


def step_loop(env: Env, keys, states, actions):
    """Serial reference for :func:`batch_step`: copy ``i`` is stepped alone by ``env.step``
    (jitted once, ``i`` traced), one call per copy in a Python loop; the results are
    stacked with NumPy into :func:`batch_step`'s structure. Arguments as :func:`batch_step`'s."""
    import jax

    _check_batch(env, keys, states, actions)

    one = _batched(env)[2]
    outs = [one(keys, states, actions, i) for i in range(len(actions))]
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *outs)


# batch_reset resets at least this many copies and keeps the first n: one compiled program
# then serves every n up to it (resetting 16384 cart-poles takes about a millisecond;
# compiling one more reset program takes about half a second on a CPU).
_RESET_PAD = 16384


def batch_reset(env: Env, key, n: int):
    """Reset ``n`` copies at once; copy ``i`` is ``env.reset(jax.random.split(key, n)[i])``.

    Returns (obs, states). The copies are reset in one jitted program for
    ``m = max(16384, the next power of two >= n)`` copies, of which the first ``n`` are
    kept (sliced in NumPy, which compiles nothing). With JAX's default
    ``jax_threefry_partitionable=True``, ``split(key, m)[:n] == split(key, n)``, so the
    result equals the unpadded reset exactly (the tests check it); with that option off the
    copies are still independent resets from ``key``, just not those of ``split(key, n)``.
    """
    import jax

    _check_env(env)
    check_keys("key", key, batch=False)
    n = check_int("n", n, lo=1)
    m = max(_RESET_PAD, 1 << (n - 1).bit_length())
    return jax.tree.map(lambda a: jax.device_put(np.asarray(a)[:n]), _batched(env)[0](key, m))


@functools.lru_cache(maxsize=16)
def _state_spec(env: Env):
    """The shapes and dtypes of one copy's state (traced, nothing runs)."""
    import jax

    return jax.eval_shape(env.reset, jax.random.key(0))[1]


@functools.lru_cache(maxsize=16)
def _batched(env: Env):
    import jax

    def reset_many(key, n):
        return jax.vmap(env.reset)(jax.random.split(key, n))

    def step_one(keys, states, actions, i):
        return env.step(keys[i], jax.tree.map(lambda a: a[i], states), actions[i])

    return (jax.jit(reset_many, static_argnums=1), jax.jit(jax.vmap(env.step)),
            jax.jit(step_one))
