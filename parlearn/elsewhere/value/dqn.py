"""A small DQN in torch on ``parlearn.rl``'s batched JAX cart-pole, and the three variants.

``variant`` picks what changes from plain DQN (uniform replay, one-step targets, a soft
(EMA) target network):

- ``"ebu"``: each update samples whole episodes and uses their Episodic Backward Update
  targets (:func:`~parlearn.elsewhere.value.backups.ebu_targets`, batched over episodes);
- ``"ls-dqn"``: every ``ls_every`` updates the last layer is re-fitted by regularised least
  squares on the replay's features (:func:`~parlearn.elsewhere.value.backups.ls_last_layer`);
- ``"t-soft"``: the target network follows the online one by
  :func:`~parlearn.elsewhere.value.backups.tsoft_update` instead of the EMA.

Everything random draws from private generators seeded by ``seed`` (a ``torch.Generator``
for the network, exploration and replay, JAX keys for the environments). JAX is imported
inside :func:`train`, so importing this module does not start it.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from parlearn.core.checks import check_callable, check_choice, check_float, check_int, check_seed
from parlearn.core.device import threads as _threads
from parlearn.elsewhere.value.backups import (
    ebu_targets,
    ema_update,
    ls_last_layer,
    one_step_targets,
    pad_episodes,
    tsoft_init,
    tsoft_update,
)

__all__ = ["VARIANTS", "DQNConfig", "DQNResult", "QNet", "train", "returns_vs_steps",
           "compare_variants"]

VARIANTS = ("dqn", "ebu", "ls-dqn", "t-soft")


@dataclass(frozen=True)
class DQNConfig:
    """Sizes and rates of a run. ``env_steps`` counts steps of all copies together; the
    replay keeps every finished episode of the run (no eviction: runs here are short)."""

    variant: str = "dqn"
    env_steps: int = 4000
    num_envs: int = 4
    max_steps: int = 200          # cart-pole time-out (CartPole-v0's 200, for short runs)
    hidden: int = 64
    lr: float = 1e-3
    gamma: float = 0.99
    batch: int = 64
    learn_start: int = 400        # env steps before the first update (epsilon still near 1)
    eps_end: float = 0.05         # epsilon decays linearly from 1 over half the run
    tau: float = 0.02             # target network rate (EMA; t-soft's base rate)
    beta: float = 0.5             # EBU diffusion factor
    ebu_episodes: int = 4         # episodes per EBU update
    ls_every: int = 100           # LS-DQN: updates between re-fits
    ls_size: int = 2000           # LS-DQN: most recent transitions in a re-fit
    ls_lam: float = 1.0           # LS-DQN: prior strength toward the current weights
    nu: float = 1.0               # t-soft degrees of freedom

    def __post_init__(self) -> None:
        check_choice("variant", self.variant, VARIANTS)
        for name in ("env_steps", "num_envs", "max_steps", "hidden", "batch", "ebu_episodes",
                     "ls_every", "ls_size"):
            check_int(name, getattr(self, name), lo=1)
        check_int("learn_start", self.learn_start, lo=0)
        check_float("lr", self.lr, lo=0, lo_open=True)
        check_float("gamma", self.gamma, lo=0, hi=1)
        check_float("eps_end", self.eps_end, lo=0, hi=1)
        check_float("tau", self.tau, lo=0, hi=1, lo_open=True, hi_open=True)
        check_float("beta", self.beta, lo=0, hi=1)
        check_float("ls_lam", self.ls_lam, lo=0, lo_open=True)
        check_float("nu", self.nu, lo=0, lo_open=True, finite=False)


@dataclass
class DQNResult:
    """Returns of the training episodes (epsilon-greedy) and the env step each ended at;
    the final online and target networks' ``state_dict``s."""

    config: DQNConfig
    seed: int
    returns: list[float] = field(default_factory=list)
    end_steps: list[int] = field(default_factory=list)
    updates: int = 0
    wall_s: float = 0.0
    online: dict = field(default_factory=dict, repr=False)   # final state_dicts
    target: dict = field(default_factory=dict, repr=False)


class QNet(torch.nn.Module):
    """``obs -> hidden -> hidden -> A`` (ReLU); ``features`` is the last hidden layer,
    the ``phi`` LS-DQN re-fits the ``head`` on."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int, generator: torch.Generator):
        for name, v in (("obs_dim", obs_dim), ("n_actions", n_actions), ("hidden", hidden)):
            check_int(name, v, lo=1)
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # nn.Linear's own init draws from the global RNG
            self._build(obs_dim, n_actions, hidden)
        with torch.no_grad():  # torch's default init, drawn from the private generator
            for p in self.parameters():
                bound = 1 / np.sqrt(p.shape[-1] if p.dim() > 1 else hidden)
                p.copy_((torch.rand(p.shape, generator=generator) * 2 - 1) * bound)

    def _build(self, obs_dim: int, n_actions: int, hidden: int) -> None:
        self.body = torch.nn.Sequential(torch.nn.Linear(obs_dim, hidden), torch.nn.ReLU(),
                                        torch.nn.Linear(hidden, hidden), torch.nn.ReLU())
        self.head = torch.nn.Linear(hidden, n_actions)

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        return self.body(obs)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(obs))


class _Replay:
    """Finished episodes, stored flat (for uniform transitions) and by span (for EBU)."""

    def __init__(self, cap: int, obs_dim: int):
        self.obs = torch.zeros(cap, obs_dim)
        self.next_obs = torch.zeros(cap, obs_dim)
        self.actions = torch.zeros(cap, dtype=torch.long)
        self.rewards = torch.zeros(cap)
        self.done = torch.zeros(cap, dtype=torch.bool)
        self.spans: list[tuple[int, int, bool]] = []
        self.n = 0

    def add_episode(self, steps: list[tuple], terminal: bool) -> None:
        lo, hi = self.n, self.n + len(steps)
        for i, (o, a, r, o2) in enumerate(steps):
            self.obs[lo + i], self.actions[lo + i] = torch.from_numpy(o), a
            self.rewards[lo + i], self.next_obs[lo + i] = r, torch.from_numpy(o2)
        self.done[hi - 1] = terminal
        self.spans.append((lo, hi, terminal))
        self.n = hi

    def episode(self, k: int) -> dict:
        lo, hi, terminal = self.spans[k]
        return {"obs": self.obs[lo:hi], "next_obs": self.next_obs[lo:hi],
                "actions": self.actions[lo:hi], "rewards": self.rewards[lo:hi],
                "terminal": terminal}


@functools.lru_cache(maxsize=8)
def _env_and_step(max_steps: int, n: int):
    """The cart-pole and its jitted batched step for ``n`` copies, built once per size:
    compiling the step took seconds of each run on busy cores, and the runs of a comparison
    all share it (the step is a pure function of its arguments)."""
    import jax

    from parlearn.many_copies.rl import batch_step, cartpole

    env = cartpole(max_steps)

    @jax.jit
    def step(key, state, action):
        key, sub = jax.random.split(key)
        return (key, *batch_step(env, jax.random.split(sub, n), state, action))

    return env, step


def _targets_and_batch(cfg: DQNConfig, replay: _Replay, target: QNet, g: torch.Generator):
    """(obs, actions, targets) of one update: uniform transitions with one-step targets, or
    (EBU) every transition of a few sampled episodes with backward-update targets, of which
    ``batch`` are drawn so an update costs what DQN's does."""
    if cfg.variant != "ebu":
        idx = torch.randint(0, replay.n, (cfg.batch,), generator=g)
        with torch.no_grad():
            y = one_step_targets(target(replay.next_obs[idx]), replay.rewards[idx],
                                 replay.done[idx], cfg.gamma)
        return replay.obs[idx], replay.actions[idx], y
    ks = torch.randint(0, len(replay.spans), (cfg.ebu_episodes,), generator=g).tolist()
    p = pad_episodes([replay.episode(k) for k in ks])
    with torch.no_grad():
        y = ebu_targets(target(p["next_obs"]), p["actions"], p["rewards"], p["terminal"],
                        p["lengths"], cfg.beta, cfg.gamma)
    valid = torch.arange(y.shape[1])[None, :] < p["lengths"][:, None]
    obs, act, y = p["obs"][valid], p["actions"][valid], y[valid]
    pick = torch.randperm(len(y), generator=g)[: cfg.batch]
    return obs[pick], act[pick], y[pick]


def _ls_refit(cfg: DQNConfig, replay: _Replay, net: QNet, target: QNet) -> None:
    """LS-DQN: the head re-fitted in float64 on the most recent ``ls_size`` transitions."""
    lo = max(0, replay.n - cfg.ls_size)
    sl = slice(lo, replay.n)
    with torch.no_grad():
        y = one_step_targets(target(replay.next_obs[sl]), replay.rewards[sl],
                             replay.done[sl], cfg.gamma).double()
        phi = net.features(replay.obs[sl]).double()
        w0 = torch.cat([net.head.weight, net.head.bias[:, None]], 1).double()
        w = ls_last_layer(phi, replay.actions[sl], y, w0, cfg.ls_lam).float()
        net.head.weight.copy_(w[:, :-1])
        net.head.bias.copy_(w[:, -1])


def _check_run(config, progress, threads) -> None:
    if not isinstance(config, DQNConfig):
        raise TypeError(f"config must be a DQNConfig, got {type(config).__name__}")
    if progress is not None:
        check_callable("progress", progress)
    if threads is not None:
        check_int("threads", threads, lo=1)


def train(config: DQNConfig, seed: int = 0,
          progress: Callable[[float], None] | None = None, threads: int | None = 1) -> DQNResult:
    """Train one agent on ``parlearn.rl.cartpole(config.max_steps)`` with ``num_envs``
    copies stepped together (``jax.vmap``); one update per batched step once
    ``learn_start`` env steps are played. Returns every training episode's return.

    ``threads`` pins torch's intra-op threads for the run and restores the caller's count
    after (``None``: as they are); 1 by default because this network's ops are tiny and,
    on shared cores, a second thread's spin-waits made them ~100x slower here.
    """
    _check_run(config, progress, threads)
    seed = check_int("seed", seed, lo=0)
    if threads is None:
        return _train(config, seed, progress)
    with _threads(check_int("threads", threads, lo=1)):
        return _train(config, seed, progress)


def _train(config: DQNConfig, seed: int, progress: Callable[[float], None] | None) -> DQNResult:
    import jax

    if not isinstance(config, DQNConfig):
        raise TypeError(f"config must be a DQNConfig, got {type(config).__name__}")
    seed = check_seed("seed", seed)
    cfg, N = config, config.num_envs
    env, step = _env_and_step(cfg.max_steps, N)

    g = torch.Generator().manual_seed(seed)
    net = QNet(env.obs_dim, env.n_actions, cfg.hidden, g)
    target = copy.deepcopy(net)
    t_params, o_params = list(target.parameters()), list(net.parameters())
    ts_state = tsoft_init(t_params, cfg.tau) if cfg.variant == "t-soft" else None
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    replay = _Replay(cfg.env_steps + N, env.obs_dim)
    result = DQNResult(cfg, seed)
    key = jax.random.key(seed)
    obs, state = jax.vmap(env.reset)(jax.random.split(jax.random.fold_in(key, 1), N))
    obs = np.array(obs)  # a writable copy: torch.from_numpy refuses JAX's read-only buffers
    running: list[list[tuple]] = [[] for _ in range(N)]
    start, done_steps = time.perf_counter(), 0
    while done_steps < cfg.env_steps:
        eps = max(cfg.eps_end, 1 - (1 - cfg.eps_end) * done_steps / (cfg.env_steps / 2))
        with torch.no_grad():
            greedy = net(torch.from_numpy(obs)).argmax(1)
        explore = torch.rand(N, generator=g) < eps
        action = torch.where(explore, torch.randint(0, env.n_actions, (N,), generator=g),
                             greedy)
        key, nobs, state, rew, term, trunc, final = step(key, state, action.numpy())
        nobs, rew, term, trunc, final = map(np.array, (nobs, rew, term, trunc, final))
        done_steps += N
        for i in range(N):
            running[i].append((obs[i], int(action[i]), float(rew[i]), final[i]))
            if term[i] or trunc[i]:
                replay.add_episode(running[i], bool(term[i]))
                result.returns.append(float(sum(s[2] for s in running[i])))
                result.end_steps.append(done_steps)
                running[i] = []
        obs = nobs
        if done_steps < cfg.learn_start or not replay.spans:
            continue
        o, a, y = _targets_and_batch(cfg, replay, target, g)
        q = net(o).gather(1, a[:, None])[:, 0]
        loss = torch.nn.functional.smooth_l1_loss(q, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        result.updates += 1
        if cfg.variant == "t-soft":
            tsoft_update(t_params, o_params, ts_state, cfg.tau, cfg.nu)
        else:
            ema_update(t_params, o_params, cfg.tau)
        if cfg.variant == "ls-dqn" and result.updates % cfg.ls_every == 0:
            _ls_refit(cfg, replay, net, target)
        if progress is not None:
            progress(done_steps / cfg.env_steps)
    result.wall_s = time.perf_counter() - start
    result.online, result.target = net.state_dict(), target.state_dict()
    return result


def returns_vs_steps(results: list[DQNResult], bins: int = 10) -> dict:
    """Mean training-episode return in ``bins`` equal windows of env steps, per run and
    over runs: ``{"steps" (window ends), "per_run" (runs x bins, NaN where no episode
    ended), "mean", "min", "max"}`` (over runs, ignoring empty windows)."""
    check_int("bins", bins, lo=1)
    if not isinstance(results, list | tuple) or not results:
        raise ValueError(f"results must be a non-empty list of DQNResult, got {results!r:.80}")
    for r in results:
        if not isinstance(r, DQNResult):
            raise TypeError(f"results must hold DQNResult, got {type(r).__name__}")
    if len({r.config.env_steps for r in results}) != 1:
        raise ValueError("results must share one config.env_steps (the windows are of it), "
                         f"got {sorted({r.config.env_steps for r in results})}")
    total = results[0].config.env_steps
    edges = np.linspace(0, total, bins + 1)
    per_run = np.full((len(results), bins), np.nan)
    for i, r in enumerate(results):
        where = np.clip(np.searchsorted(edges, r.end_steps, side="left") - 1, 0, bins - 1)
        for b in range(bins):
            sel = [ret for ret, w in zip(r.returns, where, strict=True) if w == b]
            if sel:
                per_run[i, b] = np.mean(sel)
    seen = ~np.isnan(per_run).all(0)
    stats = {k: np.full(bins, np.nan) for k in ("mean", "min", "max")}
    for k, fn in (("mean", np.nanmean), ("min", np.nanmin), ("max", np.nanmax)):
        stats[k][seen] = fn(per_run[:, seen], 0)  # all-NaN windows stay NaN, without a warning
    return {"steps": edges[1:], "per_run": per_run, **stats}


def compare_variants(variants=VARIANTS, seeds=(0, 1), config: DQNConfig | None = None,
                     progress: Callable[[float, str], None] | None = None,
                     threads: int | None = 1) -> dict:
    """``{variant: [DQNResult per seed]}``: every variant with the same sizes and seeds."""
    base = DQNConfig() if config is None else config
    _check_run(base, progress, threads)
    if isinstance(variants, str) or isinstance(seeds, int):
        raise TypeError(f"variants and seeds must be lists, got {variants!r} and {seeds!r}")
    variants = [check_choice("variants[i]", v, VARIANTS) for v in variants]
    seeds = [check_int("seeds[i]", s, lo=0) for s in seeds]
    if not variants or not seeds:
        raise ValueError("variants and seeds must each hold at least one entry")
    out: dict = {}
    total, done = len(variants) * len(seeds), 0
    for v in variants:
        out[v] = []
        for s in seeds:
            if progress is not None:
                progress(done / total, f"{v}, seed {s}")
            out[v].append(train(replace(base, variant=v), s, threads=threads))
            done += 1
    return out
