"""PPO on thousands of batched environments, in JAX (the loop written out).

Rudin et al. (CoRL 2021, arXiv 2109.11978) train walking robots in minutes by stepping
thousands of simulated robots at once on one GPU and running PPO on the whole batch. The
same shape fits in a page here: a batched environment (``jax.vmap`` over copies of a
cart-pole written out in :mod:`parlearn.many_copies.rl.envs`, or any gymnax environment),
a rollout of ``num_steps`` steps of ``num_envs`` copies, generalised advantage estimation
(GAE) and the clipped PPO update.

Each update has three phases (commented in ``_make_update``): a rollout of all copies at
once (:func:`parlearn.many_copies.rl.envs.batch_step`), advantages
(:func:`parlearn.many_copies.rl.advantages.gae`), and epochs of minibatch Adam steps on the
clipped loss, all in one jitted program. :func:`evaluate` and :func:`time_to_target` read
what a run learned.

JAX is imported inside the functions, so ``import parlearn.rl`` does not start it.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np

from parlearn.core.checks import check_float, check_int
from parlearn.many_copies.rl.advantages import gae
from parlearn.many_copies.rl.envs import Env, _check_env, batch_reset, batch_step
from parlearn.many_copies.rl.policy import _adam, _check_params, init_policy, policy_logits_value

__all__ = ["PPOConfig", "PPOResult", "train_ppo", "evaluate", "time_to_target"]


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
    obs, state = batch_reset(env, k_env, cfg.num_envs)
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"params": params, "opt": {"m": zeros, "v": zeros, "count": jnp.zeros(())},
            "obs": obs, "state": state, "ep_ret": jnp.zeros(cfg.num_envs), "key": k_run}


def train_ppo(env: Env, config: PPOConfig | None = None, *, seed: int = 0,
              records: int | None = None, eval_episodes: int = 0) -> PPOResult:
    """Train a PPO policy on ``config.num_envs`` batched copies of ``env``.

    Every update: a rollout of ``num_steps`` steps of all copies (phase 1), GAE (phase 2),
    ``epochs`` x ``minibatches`` Adam steps on the clipped loss (phase 3). The update is
    compiled before the clock starts; updates run in exactly ``records`` chunks, as equal as
    they divide (``records <= config.updates``; default: one update per chunk), and the wall
    time is read between them. With ``eval_episodes > 0`` the policy is also evaluated at
    every chunk boundary (:func:`evaluate`, same seed each time) with the clock stopped.
    Seeded: same arguments, same policy.
    """
    import jax

    _check_env(env)
    cfg = PPOConfig() if config is None else config
    if not isinstance(cfg, PPOConfig):
        raise TypeError(f"config must be a PPOConfig, got {type(cfg).__name__}")
    check_int("seed", seed, lo=0)
    check_int("eval_episodes", eval_episodes, lo=0)
    # records chunks, exactly: chunk i runs updates bounds[i]..bounds[i+1]-1
    records = cfg.updates if records is None else check_int("records", records, lo=1,
                                                            hi=cfg.updates)
    bounds = [i * cfg.updates // records for i in range(records + 1)]
    per_call = -(-cfg.updates // records)  # the longest chunk
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
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
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

    Actions are sampled from the policy; ``params=None`` acts uniformly at random (zero
    logits). Both go through one compiled program, the choice passed as a traced flag, so
    the random baseline beside a default-sized policy (``init_policy``'s shapes) compiles
    nothing new; ``params=None`` runs that policy's network and discards its logits.
    ``params`` must be a policy for ``env`` (its ``obs_dim`` and ``n_actions``).
    """
    import jax

    _check_env(env)
    if params is not None:
        _check_params(params, env.obs_dim, env.n_actions)
    check_int("episodes", episodes, lo=1)
    check_int("max_steps", max_steps, lo=1)
    check_int("seed", seed, lo=0)
    random_policy = params is None
    if random_policy:
        params = init_policy(jax.random.key(0), env.obs_dim, env.n_actions)
    return np.asarray(_evaluator(env, episodes, max_steps)(
        params, jax.random.key(seed), random_policy))


@functools.lru_cache(maxsize=16)
def _evaluator(env: Env, episodes: int, max_steps: int):
    import jax
    import jax.numpy as jnp

    def run(params, key, random_policy):
        k_env, k_run = jax.random.split(key)
        obs, state = jax.vmap(env.reset)(jax.random.split(k_env, episodes))

        def step(carry, key):
            obs, state, total, alive = carry
            k_act, k_env = jax.random.split(key)
            logits = jnp.where(random_policy, 0.0, policy_logits_value(params, obs)[0])
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
    if not isinstance(result, PPOResult):
        raise TypeError(f"result must be a PPOResult (train_ppo), got {type(result).__name__}")
    curve = (result.eval_returns if np.isfinite(result.eval_returns).any()
             else result.returns)
    hit = np.flatnonzero(np.nan_to_num(curve, nan=-np.inf) >= target)
    return None if hit.size == 0 else (float(result.wall_s[hit[0]]), int(result.env_steps[hit[0]]))
