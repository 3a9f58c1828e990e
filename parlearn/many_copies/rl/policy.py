"""PPO's policy: actor and critic MLPs as plain ``jnp`` arrays, and Adam written out.

JAX is imported inside the functions, so ``import parlearn.rl`` does not start it.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["init_policy", "policy_logits_value"]


# --- the policy: two small MLPs, and Adam, written out -------------------------------------

def init_policy(key, obs_dim: int, n_actions: int, hidden: int = 64) -> dict:
    """Actor and critic MLPs (``obs -> hidden -> hidden -> out``, tanh), scaled-normal init.

    One jitted program per (obs_dim, n_actions, hidden): eagerly, each layer's random
    draw compiles a program of its own (about half a second each on a CPU).
    """
    return _init_jit()(key, int(obs_dim), int(n_actions), int(hidden))


@functools.cache
def _init_jit():
    import jax

    return jax.jit(_init_policy, static_argnums=(1, 2, 3))


def _init_policy(key, obs_dim: int, n_actions: int, hidden: int) -> dict:
    import jax
    import jax.numpy as jnp

    def mlp(key, sizes, last_scale):
        keys = jax.random.split(key, len(sizes) - 1)
        layers = []
        for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True)):
            scale = last_scale if i == len(sizes) - 2 else np.sqrt(2.0)
            layers.append({"w": jax.random.normal(k, (a, b)) * scale / np.sqrt(a),
                           "b": jnp.zeros(b)})
        return layers

    k_pi, k_v = jax.random.split(key)
    return {"pi": mlp(k_pi, [obs_dim, hidden, hidden, n_actions], 0.01),
            "v": mlp(k_v, [obs_dim, hidden, hidden, 1], 1.0)}


def policy_logits_value(params: dict, obs):
    """Action logits and state value for a batch of observations."""
    import jax.numpy as jnp

    def mlp(layers, x):
        for layer in layers[:-1]:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        return x @ layers[-1]["w"] + layers[-1]["b"]

    return mlp(params["pi"], obs), mlp(params["v"], obs)[..., 0]


def _adam(grads, params, opt, lr, b1=0.9, b2=0.999, eps=1e-5):
    import jax
    import jax.numpy as jnp

    count = opt["count"] + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["v"], grads)
    step = lr * jnp.sqrt(1 - b2**count) / (1 - b1**count)
    params = jax.tree.map(lambda p, m, v: p - step * m / (jnp.sqrt(v) + eps), params, m, v)
    return params, {"m": m, "v": v, "count": count}
