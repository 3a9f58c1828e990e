"""PPO's policy: actor and critic MLPs as plain ``jnp`` arrays, and Adam written out.

JAX is imported inside the functions, so ``import parlearn.rl`` does not start it.
"""

from __future__ import annotations

import functools

import numpy as np

from parlearn.core.checks import check_int
from parlearn.many_copies.rl._checks import check_array, check_keys

__all__ = ["init_policy", "policy_logits_value"]


# --- the policy: two small MLPs, and Adam, written out -------------------------------------

def init_policy(key, obs_dim: int, n_actions: int, hidden: int = 64) -> dict:
    """Actor and critic MLPs (``obs -> hidden -> hidden -> out``, tanh), scaled-normal init.

    One jitted program per (obs_dim, n_actions, hidden): eagerly, each layer's random
    draw compiles a program of its own (about half a second each on a CPU).
    """
    check_keys("key", key, batch=False)
    obs_dim = check_int("obs_dim", obs_dim, lo=1)
    n_actions = check_int("n_actions", n_actions, lo=1)
    return _init_jit()(key, obs_dim, n_actions, check_int("hidden", hidden, lo=1))


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


def _check_params(params, obs_dim: int | None = None,
                  n_actions: int | None = None) -> tuple[int, int]:
    """``params`` as :func:`init_policy` builds them: ``{"pi": layers, "v": layers}``, each a
    list of ``{"w": (a, b), "b": (b,)}`` float arrays that chain, both taking the same
    observation width, ``v`` ending in 1 output (concrete arrays finite). Returns (obs_dim,
    n_actions); refuses other widths where ``obs_dim`` or ``n_actions`` are given."""
    if not isinstance(params, dict) or set(params) != {"pi", "v"}:
        raise TypeError("params must be a dict with keys 'pi' and 'v' (init_policy), got "
                        + (f"keys {sorted(params)}" if isinstance(params, dict)
                           else type(params).__name__))
    widths = {}
    for net in ("pi", "v"):
        layers = params[net]
        if not isinstance(layers, list | tuple) or not layers:
            raise TypeError(f"params[{net!r}] must be a non-empty list of layers, got "
                            f"{type(layers).__name__}")
        width = None
        for i, layer in enumerate(layers):
            where = f"params[{net!r}][{i}]"
            if not isinstance(layer, dict) or set(layer) != {"w", "b"}:
                raise TypeError(f"{where} must be a dict with keys 'w' and 'b'")
            a, b = check_array(f"{where}['w']", layer["w"], ndim=2)
            if check_array(f"{where}['b']", layer["b"], ndim=1) != (b,):
                raise ValueError(f"{where}['b'] must have shape ({b},) like the columns of "
                                 f"its 'w' {(a, b)}, got {tuple(layer['b'].shape)}")
            if width is not None and a != width:
                raise ValueError(f"{where}['w'] must have {width} rows (the previous layer's "
                                 f"outputs), got shape {(a, b)}")
            widths.setdefault(net, (a, b))
            width = b
        widths[net] = (widths[net][0], width)
    if widths["pi"][0] != widths["v"][0]:
        raise ValueError(f"params['pi'] and params['v'] must take the same observation width, "
                         f"got {widths['pi'][0]} and {widths['v'][0]}")
    if widths["v"][1] != 1:
        raise ValueError(f"params['v'] must end in 1 output (the value), got {widths['v'][1]}")
    dims = widths["pi"]
    for name, want, got in (("obs_dim", obs_dim, dims[0]), ("n_actions", n_actions, dims[1])):
        if want is not None and want != got:
            raise ValueError(f"params must be a policy for {name}={want} (the env's), got "
                             f"{name}={got}")
    return dims


def policy_logits_value(params: dict, obs):
    """Action logits and state value for a batch of observations.

    ``params`` as :func:`init_policy` builds them; ``obs``: float ``(..., obs_dim)``
    (concrete ones finite; inside a jitted function only shapes and dtypes are checked).
    """
    import jax.numpy as jnp

    obs_dim, _ = _check_params(params)
    shape = check_array("obs", obs)
    if not shape or shape[-1] != obs_dim:
        raise ValueError(f"obs must have shape (..., {obs_dim}) (the policy's obs_dim), got "
                         f"{shape}")

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
