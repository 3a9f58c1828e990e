"""PPO on thousands of batched environments, in JAX (one file, the loop written out).

Rudin et al. (CoRL 2021, arXiv 2109.11978) train walking robots in minutes by stepping
thousands of simulated robots at once on one GPU and running PPO on the whole batch. The
same shape fits in a page here: a batched environment (``jax.vmap`` over copies of a
cart-pole written below, or any gymnax environment), a rollout of ``num_steps`` steps of
``num_envs`` copies, generalised advantage estimation (GAE) and the clipped PPO update.

Time-outs are bootstrapped: an episode cut by the step limit did not end, so its last
reward is followed by ``gamma * V(final observation)``; an episode that *terminated* (the
pole fell) is followed by 0. :func:`gae` (a reverse ``lax.scan``) equals :func:`gae_loop`
(a plain Python loop, the serial reference); ``jax.vmap(env.step)`` equals a loop of
single steps.

JAX is imported inside the functions, so ``import parlearn.rl`` does not start it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parlearn.core.checks import check_choice, check_float, check_int

__all__ = ["Env", "cartpole", "gymnax_env", "batch_step", "gae", "gae_loop", "init_policy",
           "policy_logits_value", "PPOConfig", "PPOResult", "train_ppo", "evaluate",
           "time_to_target", "env_steps_per_second", "bench"]


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


def batch_step(env: Env, keys, states, actions):
    """Step a batch of copies at once: ``jax.vmap(env.step)``."""
    import jax

    return jax.vmap(env.step)(keys, states, actions)


# --- GAE with time-outs bootstrapped: serial reference and lax.scan -----------------------

def gae_loop(rewards, values, next_values, terminated, truncated, final_values,
             gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Serial reference (float64 Python loop). Arrays are ``(T, N)``; returns (advantages, returns).

    ``values[t]`` = V(s_t); ``next_values[t]`` = V(s_{t+1}) of the observation after the
    step (a fresh episode's after a reset); ``final_values[t]`` = V(final observation).
    The bootstrap after step t is 0 if terminated, ``final_values[t]`` if truncated, else
    ``next_values[t]``; the advantage recursion stops at every episode end.
    """
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
    """GAE for all copies at once (a reverse ``lax.scan`` over time); equals :func:`gae_loop`."""
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


# --- the policy: two small MLPs, and Adam, written out -------------------------------------

def init_policy(key, obs_dim: int, n_actions: int, hidden: int = 64) -> dict:
    """Actor and critic MLPs (``obs -> hidden -> hidden -> out``, tanh), scaled-normal init."""
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


# --- PPO ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PPOConfig:
    """PPO hyper-parameters (defaults: CleanRL's CartPole settings, more envs)."""

    num_envs: int = 64
    num_steps: int = 32
    updates: int = 40
    epochs: int = 4
    minibatches: int = 4
    gamma: float = 0.99
    lam: float = 0.95
    clip: float = 0.2
    lr: float = 2.5e-3
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    hidden: int = 64

    def __post_init__(self) -> None:
        for name in ("num_envs", "num_steps", "updates", "epochs", "minibatches", "hidden"):
            check_int(name, getattr(self, name), lo=1)
        for name in ("gamma", "lam"):
            check_float(name, getattr(self, name), lo=0, hi=1)
        for name in ("clip", "lr", "max_grad_norm"):
            check_float(name, getattr(self, name), lo=0, lo_open=True)
        for name in ("ent_coef", "vf_coef"):
            check_float(name, getattr(self, name), lo=0)
        if (self.num_envs * self.num_steps) % self.minibatches:
            raise ValueError(f"minibatches must divide num_envs * num_steps = "
                             f"{self.num_envs * self.num_steps}, got {self.minibatches}")


@dataclass
class PPOResult:
    """Curves of one training run; ``wall_s`` excludes compile time (``compile_s``).

    ``returns[i]`` is the mean return of the training episodes that ended in chunk ``i``
    (NaN if none did); ``eval_returns[i]`` the mean return of the policy evaluated after
    chunk ``i`` (NaN without ``eval_episodes``). Index 0 is before training.
    """

    params: dict
    env_steps: np.ndarray
    returns: np.ndarray
    eval_returns: np.ndarray
    wall_s: np.ndarray
    compile_s: float
    config: PPOConfig
    env: str
    device: str

    @property
    def samples_per_s(self) -> float:
        """Environment steps per second of training (rollout + update), compile excluded."""
        return float(self.env_steps[-1] / self.wall_s[-1])


def _ppo_loss(params, batch, cfg: PPOConfig):
    import jax
    import jax.numpy as jnp

    logits, value = policy_logits_value(params, batch["obs"])
    logp_all = jax.nn.log_softmax(logits)
    logp = jnp.take_along_axis(logp_all, batch["action"][:, None], axis=1)[:, 0]
    ratio = jnp.exp(logp - batch["logp"])
    adv = (batch["adv"] - batch["adv"].mean()) / (batch["adv"].std() + 1e-8)
    policy_loss = -jnp.minimum(ratio * adv,
                               jnp.clip(ratio, 1 - cfg.clip, 1 + cfg.clip) * adv).mean()
    value_loss = 0.5 * ((value - batch["ret"]) ** 2).mean()
    entropy = -(jnp.exp(logp_all) * logp_all).sum(-1).mean()
    return policy_loss + cfg.vf_coef * value_loss - cfg.ent_coef * entropy


def _make_update(env: Env, cfg: PPOConfig):
    """Pure functions ``rollout(carry, key) -> (carry, traj, adv, ret)`` (phases 1-2) and
    ``update(carry, i) -> (carry, mean finished return)`` (one whole PPO update)."""
    import jax
    import jax.numpy as jnp

    def act(carry, key):
        # Phase 1, rollout: one step of every copy at once.
        params, obs, state, ep_ret = carry["params"], carry["obs"], carry["state"], carry["ep_ret"]
        k_act, k_env = jax.random.split(key)
        logits, value = policy_logits_value(params, obs)
        action = jax.random.categorical(k_act, logits)
        logp = jax.nn.log_softmax(logits)[jnp.arange(cfg.num_envs), action]
        env_keys = jax.random.split(k_env, cfg.num_envs)
        obs2, state2, reward, term, trunc, final_obs = batch_step(env, env_keys, state, action)
        ep_ret = ep_ret + reward
        done = term | trunc
        step = {"obs": obs, "action": action, "logp": logp, "value": value, "reward": reward,
                "term": term, "trunc": trunc, "final_obs": final_obs,
                "finished": jnp.where(done, ep_ret, 0.0), "done": done}
        carry = {**carry, "obs": obs2, "state": state2, "ep_ret": jnp.where(done, 0.0, ep_ret)}
        return carry, step

    def rollout(carry, key):
        carry, traj = jax.lax.scan(act, carry, jax.random.split(key, cfg.num_steps))
        params = carry["params"]

        # Phase 2, advantages: GAE over the rollout, time-outs bootstrapped with V(final obs).
        _, last_value = policy_logits_value(params, carry["obs"])
        next_values = jnp.concatenate([traj["value"][1:], last_value[None]])
        _, final_values = policy_logits_value(params, traj["final_obs"])
        adv, ret = gae(traj["reward"], traj["value"], next_values, traj["term"],
                       traj["trunc"], final_values, cfg.gamma, cfg.lam)
        return carry, traj, adv, ret

    def update(carry, i):
        key = jax.random.fold_in(carry["key"], i)
        k_roll, k_perm = jax.random.split(key)
        carry, traj, adv, ret = rollout(carry, k_roll)
        params = carry["params"]
        flat = {"obs": traj["obs"].reshape(-1, env.obs_dim), "action": traj["action"].reshape(-1),
                "logp": traj["logp"].reshape(-1), "adv": adv.reshape(-1), "ret": ret.reshape(-1)}

        # Phase 3, learning: `epochs` passes of shuffled minibatches, clipped surrogate loss.
        n = cfg.num_envs * cfg.num_steps
        lr = cfg.lr * (1.0 - i / cfg.updates)  # linear annealing, as in the PPO paper

        def minibatch_step(state, idx):
            params, opt = state
            batch = jax.tree.map(lambda a: a[idx], flat)
            grads = jax.grad(_ppo_loss)(params, batch, cfg)
            norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
            grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, cfg.max_grad_norm / norm), grads)
            return _adam(grads, params, opt, lr), None

        perms = jax.vmap(lambda k: jax.random.permutation(k, n))(
            jax.random.split(k_perm, cfg.epochs))
        idx = perms.reshape(cfg.epochs * cfg.minibatches, n // cfg.minibatches)
        (params, opt), _ = jax.lax.scan(minibatch_step, (params, carry["opt"]), idx)

        n_done = traj["done"].sum()
        mean_return = jnp.where(n_done > 0, traj["finished"].sum() / jnp.maximum(n_done, 1),
                                jnp.nan)
        return {**carry, "params": params, "opt": opt}, mean_return

    return rollout, update


def _init_carry(env: Env, cfg: PPOConfig, seed: int) -> dict:
    """Initial policy, optimiser state and environments of a run."""
    import jax
    import jax.numpy as jnp

    k_params, k_env, k_run = jax.random.split(jax.random.key(seed), 3)
    params = init_policy(k_params, env.obs_dim, env.n_actions, cfg.hidden)
    obs, state = jax.vmap(env.reset)(jax.random.split(k_env, cfg.num_envs))
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"params": params, "opt": {"m": zeros, "v": zeros, "count": jnp.zeros(())},
            "obs": obs, "state": state, "ep_ret": jnp.zeros(cfg.num_envs), "key": k_run}


def train_ppo(env: Env, config: PPOConfig | None = None, *, seed: int = 0,
              records: int | None = None, eval_episodes: int = 0) -> PPOResult:
    """Train a PPO policy on ``config.num_envs`` batched copies of ``env``.

    Every update: a rollout of ``num_steps`` steps of all copies (phase 1), GAE (phase 2),
    ``epochs`` x ``minibatches`` Adam steps on the clipped loss (phase 3). The update is
    compiled before the clock starts; updates run in ``records`` chunks (default: one
    update per chunk), and the wall time is read between them. With ``eval_episodes > 0``
    the policy is also evaluated at every chunk boundary (:func:`evaluate`, same seed each
    time) with the clock stopped. Seeded: same arguments, same policy.
    """
    import jax

    if not isinstance(env, Env):
        raise TypeError(f"env must be a parlearn.rl.Env, got {type(env).__name__}")
    cfg = PPOConfig() if config is None else config
    if not isinstance(cfg, PPOConfig):
        raise TypeError(f"config must be a PPOConfig, got {type(cfg).__name__}")
    check_int("seed", seed, lo=0)
    check_int("eval_episodes", eval_episodes, lo=0)
    per_call = 1 if records is None else -(-cfg.updates // check_int("records", records, lo=1))
    carry = _init_carry(env, cfg, seed)
    run = _ppo_program(env, cfg, per_call)

    def policy_return() -> float:
        if not eval_episodes:
            return np.nan
        return float(evaluate(env, carry["params"], episodes=eval_episodes, seed=seed).mean())

    # A call with no updates compiles the program (or finds it in jit's cache): its time is
    # reported apart, never mixed into the throughput.
    t0 = time.perf_counter()
    jax.block_until_ready(run(carry, 0, 0))
    compile_s = time.perf_counter() - t0
    steps, returns, evals, wall = [0], [np.nan], [policy_return()], [0.0]
    elapsed = 0.0
    for start in range(0, cfg.updates, per_call):
        stop = min(start + per_call, cfg.updates)
        t0 = time.perf_counter()
        carry, rets = run(carry, start, stop)
        rets = np.asarray(rets)[: stop - start]  # waits for the updates to finish
        elapsed += time.perf_counter() - t0
        wall.append(elapsed)
        returns.append(float(np.nanmean(rets)) if np.isfinite(rets).any() else np.nan)
        evals.append(policy_return())
        steps.append(stop * cfg.num_envs * cfg.num_steps)
    return PPOResult(carry["params"], np.array(steps), np.array(returns), np.array(evals),
                     np.array(wall), compile_s, cfg, env.name, str(jax.devices()[0]))


@functools.lru_cache(maxsize=16)
def _ppo_program(env: Env, cfg: PPOConfig, per_call: int):
    """``run(carry, start, stop)``: updates ``start..stop-1`` in one jitted loop (cached)."""
    import jax
    import jax.numpy as jnp

    _, update = _make_update(env, cfg)

    def run(carry, start, stop):
        def body(i, c):
            c, ret = c
            c, r = update(c, i)
            return c, ret.at[i - start].set(r)
        return jax.lax.fori_loop(start, stop, body, (carry, jnp.full(per_call, jnp.nan)))

    return jax.jit(run)


def evaluate(env: Env, params: dict | None, *, episodes: int = 64, max_steps: int = 500,
             seed: int = 0) -> np.ndarray:
    """Return of the first episode of each of ``episodes`` copies (cut at ``max_steps``).

    Actions are sampled from the policy; ``params=None`` acts uniformly at random.
    """
    import jax

    check_int("episodes", episodes, lo=1)
    check_int("max_steps", max_steps, lo=1)
    check_int("seed", seed, lo=0)
    return np.asarray(_evaluator(env, episodes, max_steps, params is None)(
        params, jax.random.key(seed)))


@functools.lru_cache(maxsize=16)
def _evaluator(env: Env, episodes: int, max_steps: int, random_policy: bool):
    import jax
    import jax.numpy as jnp

    def run(params, key):
        k_env, k_run = jax.random.split(key)
        obs, state = jax.vmap(env.reset)(jax.random.split(k_env, episodes))

        def step(carry, key):
            obs, state, total, alive = carry
            k_act, k_env = jax.random.split(key)
            logits = (jnp.zeros((episodes, env.n_actions)) if random_policy
                      else policy_logits_value(params, obs)[0])
            action = jax.random.categorical(k_act, logits)
            obs, state, r, term, trunc, _ = batch_step(env, jax.random.split(k_env, episodes),
                                                       state, action)
            total = total + alive * r
            return (obs, state, total, alive & ~(term | trunc)), None

        carry = (obs, state, jnp.zeros(episodes), jnp.ones(episodes, bool))
        (_, _, total, _), _ = jax.lax.scan(step, carry, jax.random.split(k_run, max_steps))
        return total

    return jax.jit(run)


def time_to_target(result: PPOResult, target: float) -> tuple[float, int] | None:
    """(wall seconds, env steps) when the return first reached ``target``, or None.

    Uses the evaluated returns when the run has them (``eval_episodes > 0``), else the
    mean return of finished training episodes.
    """
    check_float("target", target)
    curve = (result.eval_returns if np.isfinite(result.eval_returns).any()
             else result.returns)
    hit = np.flatnonzero(np.nan_to_num(curve, nan=-np.inf) >= target)
    return None if hit.size == 0 else (float(result.wall_s[hit[0]]), int(result.env_steps[hit[0]]))


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

    mode = check_choice("mode", mode, ("policy", "random"))
    check_int("steps", steps, lo=1)
    check_int("repeat", repeat, lo=1)
    sizes = [check_int("num_envs[i]", n, lo=1) for n in num_envs]
    if not sizes:
        raise ValueError("num_envs must hold at least one size")
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

    obs, state = jax.vmap(env.reset)(jax.random.split(jax.random.key(seed), n))
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
    from parlearn.core.timing import compare

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
                        + ("" if cmp.reliable else "; UNRELIABLE: busy cores")))]


def bench(device, quick: bool) -> list:
    """The rows of :func:`_bench_rows`, measured in a fresh Python process (JAX must not
    start in the process that forks gloo ranks for other entries), on JAX's default
    device; ``device`` names the torch device of the other benches and is not used."""
    from parlearn.core.bench import rows_in_fresh_process

    return rows_in_fresh_process(__name__, quick)
