"""Value learning in parallel: DQN, EBU, LS-DQN and t-soft (lesson 40).

    from parlearn import value
    y = value.ebu_targets(q_next, actions, rewards, terminal, lengths, beta=0.5, gamma=0.99)
    runs = value.compare_variants(seeds=(0, 1), config=value.DQNConfig(env_steps=4000))

=============  ===========================================================================
module         what it holds
=============  ===========================================================================
``backups``    the primitives beside their references: EBU targets (loop over one
               episode; batched over padded episodes), LS-DQN's last-layer solve (batched
               per action; the joint closed form), t-soft and EMA target updates
``dqn``        a small torch DQN on ``parlearn.rl``'s batched JAX cart-pole, with the
               variants ``"ebu"``, ``"ls-dqn"``, ``"t-soft"``; returns vs env steps
``speed``      EBU batched across episodes vs a loop (measured), and the bench row
=============  ===========================================================================

EBU, LS-DQN and t-soft are reconstructions from the papers' abstracts and summaries: each
function's docstring says what it computes. JAX is imported inside ``dqn.train`` only.
"""

from parlearn.elsewhere.value.backups import (
    TSoftState,
    ebu_targets,
    ebu_targets_loop,
    ema_update,
    ls_last_layer,
    ls_last_layer_closed_form,
    one_step_targets,
    pad_episodes,
    tsoft_init,
    tsoft_update,
)
from parlearn.elsewhere.value.dqn import (
    VARIANTS,
    DQNConfig,
    DQNResult,
    QNet,
    compare_variants,
    returns_vs_steps,
    train,
)
from parlearn.elsewhere.value.speed import bench, ebu_speed, random_episodes

__all__ = ["one_step_targets", "ebu_targets_loop", "ebu_targets", "pad_episodes",
           "ls_last_layer", "ls_last_layer_closed_form", "TSoftState", "tsoft_init",
           "tsoft_update", "ema_update", "VARIANTS", "DQNConfig", "DQNResult", "QNet", "train",
           "returns_vs_steps", "compare_variants", "random_episodes", "ebu_speed", "bench"]
