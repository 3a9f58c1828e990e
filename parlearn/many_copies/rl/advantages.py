"""Generalised advantage estimation (GAE) with time-outs bootstrapped, for all copies at once.

Time-outs are bootstrapped: an episode cut by the step limit did not end, so its last
reward is followed by ``gamma * V(final observation)``; an episode that *terminated* (the
pole fell) is followed by 0. :func:`gae` (a reverse ``lax.scan``) equals :func:`gae_loop`
(a plain Python loop, the serial reference).

JAX is imported inside :func:`gae`, so ``import parlearn.rl`` does not start it.
"""

from __future__ import annotations

import functools

import numpy as np

from parlearn.many_copies.rl._checks import check_array, check_rate

__all__ = ["gae", "gae_loop"]


# --- GAE with time-outs bootstrapped: serial reference and lax.scan -----------------------

def _check_gae(rewards, values, next_values, terminated, truncated, final_values, gamma, lam):
    """Six (T, N) arrays of one shape (float, float, float, bool, bool, float; concrete ones
    finite), T, N >= 1, and gamma, lam in [0, 1]; returns (gamma, lam)."""
    shape = check_array("rewards", rewards, ndim=2)
    if min(shape) < 1:
        raise ValueError(f"rewards must be (T, N) with T, N >= 1, got shape {shape}")
    for name, a, kind in (("values", values, "float"), ("next_values", next_values, "float"),
                          ("terminated", terminated, "bool"), ("truncated", truncated, "bool"),
                          ("final_values", final_values, "float")):
        got = check_array(name, a, ndim=2, kind=kind)
        if got != shape:
            raise ValueError(f"{name} must have the shape of rewards {shape}, got {got}")
    return check_rate("gamma", gamma), check_rate("lam", lam)


def gae_loop(rewards, values, next_values, terminated, truncated, final_values,
             gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Serial reference (float64 Python loop). Arrays are ``(T, N)``; returns (advantages, returns).

    ``values[t]`` = V(s_t); ``next_values[t]`` = V(s_{t+1}) of the observation after the
    step (a fresh episode's after a reset); ``final_values[t]`` = V(final observation).
    The bootstrap after step t is 0 if terminated, ``final_values[t]`` if truncated, else
    ``next_values[t]``; the advantage recursion stops at every episode end. Rewards and
    values are finite float arrays, ``terminated`` and ``truncated`` bool arrays, all of one
    shape; ``gamma`` and ``lam`` lie in [0, 1].
    """
    gamma, lam = _check_gae(rewards, values, next_values, terminated, truncated, final_values,
                            gamma, lam)
    r, v, nv, fv = (np.asarray(a, np.float64) for a in (rewards, values, next_values,
                                                        final_values))
    term, trunc = np.asarray(terminated, bool), np.asarray(truncated, bool)
    T, N = r.shape
    adv = np.zeros((T, N))
    for n in range(N):
        running = 0.0
        for t in reversed(range(T)):
            if term[t, n]:
                boot, running = 0.0, 0.0
            elif trunc[t, n]:
                boot, running = fv[t, n], 0.0
            else:
                boot = nv[t, n]
            delta = r[t, n] + gamma * boot - v[t, n]
            running = delta + gamma * lam * running
            adv[t, n] = running
    return adv, adv + v


def gae(rewards, values, next_values, terminated, truncated, final_values,
        gamma: float, lam: float):
    """GAE for all copies at once (a reverse ``lax.scan`` over time); equals :func:`gae_loop`.

    One jitted program per shape (``gamma`` and ``lam`` are traced, so other values reuse
    it); inside another jitted function it is inlined. The arguments are checked as in
    :func:`gae_loop` (inside a jitted function: shapes and dtypes; NaN only of concrete arrays).
    """
    gamma, lam = _check_gae(rewards, values, next_values, terminated, truncated, final_values,
                            gamma, lam)
    return _gae_jit()(rewards, values, next_values, terminated, truncated, final_values,
                      gamma, lam)


@functools.cache
def _gae_jit():
    import jax

    return jax.jit(_gae)


def _gae(rewards, values, next_values, terminated, truncated, final_values, gamma, lam):
    import jax
    import jax.numpy as jnp

    boot = jnp.where(terminated, 0.0, jnp.where(truncated, final_values, next_values))
    deltas = rewards + gamma * boot - values
    carry_on = gamma * lam * (1.0 - (terminated | truncated))

    def back(running, xs):
        delta, keep = xs
        running = delta + keep * running
        return running, running

    _, adv = jax.lax.scan(back, jnp.zeros_like(values[0]), (deltas, carry_on), reverse=True)
    return adv, adv + values
