"""PPO on thousands of batched environments, in JAX (lesson 31, beside :mod:`parlearn.qd`).

    from parlearn import rl
    result = rl.train_ppo(rl.cartpole(), rl.PPOConfig(num_envs=1024))

=================  =======================================================================
module             what it holds
=================  =======================================================================
``envs``           :class:`Env`, a cart-pole written out in JAX, any gymnax environment
                   behind the same interface, and :func:`batch_step`,
                   :func:`batch_reset` (``jax.vmap``, jitted); :func:`step_loop`, the
                   serial reference (one copy per call)
``advantages``     GAE with time-outs bootstrapped: the serial reference
                   :func:`gae_loop` and :func:`gae`, a reverse ``lax.scan``
``policy``         actor and critic MLPs as plain arrays, and Adam written out
``ppo``            :func:`train_ppo`: rollout, advantages and clipped updates in one jitted
                   loop; :func:`evaluate`, :func:`time_to_target`
``throughput``     env-steps per second against the number of copies (measured), bench
=================  =======================================================================

JAX is imported inside the functions, so ``import parlearn.rl`` does not start it.
Everything is re-exported here.
"""

from parlearn.many_copies.rl.advantages import gae, gae_loop
from parlearn.many_copies.rl.envs import (
    Env,
    batch_reset,
    batch_step,
    cartpole,
    gymnax_env,
    step_loop,
)
from parlearn.many_copies.rl.policy import init_policy, policy_logits_value
from parlearn.many_copies.rl.ppo import (
    PPOConfig,
    PPOResult,
    _init_carry,  # noqa: F401 (private; the tests use it)
    _make_update,  # noqa: F401 (private; the tests use it)
    evaluate,
    time_to_target,
    train_ppo,
)
from parlearn.many_copies.rl.throughput import bench, env_steps_per_second

__all__ = ["Env", "cartpole", "gymnax_env", "batch_step", "step_loop", "batch_reset", "gae",
           "gae_loop", "init_policy", "policy_logits_value", "PPOConfig", "PPOResult",
           "train_ppo", "evaluate", "time_to_target", "env_steps_per_second", "bench"]
