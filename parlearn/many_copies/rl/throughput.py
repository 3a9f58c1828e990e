"""Throughput, measured: environment steps per second against the number of batched copies.

:func:`env_steps_per_second` times jitted rollouts (policy and environment, or the
environment alone); :func:`bench` measures its rows in a fresh Python process. JAX is
imported inside the functions, so ``import parlearn.rl`` does not start it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from parlearn.core.checks import check_choice, check_int
from parlearn.many_copies.rl.envs import Env, _check_env, batch_reset, batch_step, cartpole
from parlearn.many_copies.rl.policy import init_policy, policy_logits_value

__all__ = ["env_steps_per_second", "bench"]


# --- throughput: samples per second vs number of environments ------------------------------

def env_steps_per_second(env: Env, num_envs, *, steps: int = 64, repeat: int = 5,
                         seed: int = 0, mode: str = "policy") -> dict:
    """Measured environment steps per second of a jitted rollout, per number of copies.

    ``mode="policy"``: each step runs the (untrained) policy network and the batched
    environment, as in a PPO rollout; ``mode="random"``: the environment alone, random
    actions. Compile time is excluded and reported. Returns ``{"num_envs",
    "steps_per_s", "spread", "compile_s", "device", "mode"}``.
    """
    import jax

    from parlearn.core.timing import measure

    _check_env(env)
    if isinstance(num_envs, str | bytes) or not isinstance(num_envs, Sequence | np.ndarray):
        raise TypeError(f"num_envs must be a list of ints (numbers of copies), got "
                        f"{type(num_envs).__name__}")
    sizes = [check_int(f"num_envs[{i}]", n, lo=1) for i, n in enumerate(num_envs)]
    if not sizes:
        raise ValueError("num_envs must hold at least one size")
    mode = check_choice("mode", mode, ("policy", "random"))
    check_int("steps", steps, lo=1)
    check_int("repeat", repeat, lo=1)
    check_int("seed", seed, lo=0)
    out: dict = {"num_envs": sizes, "steps_per_s": [], "spread": [], "compile_s": [],
                 "device": str(jax.devices()[0]), "mode": mode}
    for n in sizes:
        t0 = time.perf_counter()
        call = _rollout(env, n, steps, mode, seed)
        out["compile_s"].append(time.perf_counter() - t0)
        t = measure(call, warmup=1, repeat=repeat)
        out["steps_per_s"].append(n * steps / t.median)
        out["spread"].append(t.spread)
    return out


def _rollout(env: Env, n: int, steps: int, mode: str, seed: int) -> Callable[[], Any]:
    """A compiled rollout of ``steps`` steps of ``n`` copies, as a zero-argument call."""
    import jax
    import jax.numpy as jnp

    params = init_policy(jax.random.key(seed), env.obs_dim, env.n_actions)

    def rollout(obs, state, key):
        def step(carry, key):
            obs, state = carry
            k_act, k_env = jax.random.split(key)
            logits = (policy_logits_value(params, obs)[0] if mode == "policy"
                      else jnp.zeros((n, env.n_actions)))
            action = jax.random.categorical(k_act, logits)
            obs, state, *_ = batch_step(env, jax.random.split(k_env, n), state, action)
            return (obs, state), None
        return jax.lax.scan(step, (obs, state), jax.random.split(key, steps))[0]

    obs, state = batch_reset(env, jax.random.key(seed), n)
    key = jax.random.key(seed + 1)
    fn = jax.jit(rollout).lower(obs, state, key).compile()
    return lambda: jax.block_until_ready(fn(obs, state, key))


def _bench_rows(quick: bool) -> list:
    """Cart-pole rollout with policy inference: ``big`` batched copies for ``T`` steps vs one
    copy for ``big * T`` steps (the same env-steps), timed interleaved.

    Runs in a fresh interpreter through :func:`bench`.
    """
    import jax

    from parlearn.core.bench import Row
    from parlearn.core.timing import UNRELIABLE, compare

    env, big, steps = cartpole(), (1024 if quick else 4096), 32
    t0 = time.perf_counter()
    calls = {"1 env": _rollout(env, 1, big * steps, "policy", 0),
             f"{big} envs": _rollout(env, big, steps, "policy", 0)}
    compile_s = time.perf_counter() - t0
    cmp = compare(calls, repeat=3 if quick else 7)
    lo, hi = cmp.speedup_range(f"{big} envs")
    work = big * steps
    return [Row("rl", f"cart-pole rollout, 1 env x {work} steps (jit)",
                f"vmap {big} envs x {steps} steps", cmp.speedup(f"{big} envs"),
                str(jax.devices()[0]),
                detail=(f"{work / cmp.timings['1 env'].median:.3g} vs "
                        f"{work / cmp.timings[f'{big} envs'].median:.3g} env-steps/s with policy "
                        f"inference; IQR {lo:.1f}-{hi:.1f}x; compile {compile_s:.2f} s excluded"
                        + ("" if cmp.reliable else f"; WARNING: {UNRELIABLE}")))]


def bench(device, quick: bool) -> list:
    """The rows of :func:`_bench_rows`, measured in a fresh Python process (JAX must not
    start in the process that forks gloo ranks for other entries), on JAX's default
    device; ``device`` names the torch device of the other benches and is not used."""
    from parlearn.core.bench import rows_in_fresh_process

    return rows_in_fresh_process(__name__, quick)
