"""Three value-learning primitives, each a pure torch function beside its serial reference.

- **Episodic Backward Update** (Lee, Choi & Chung, NeurIPS 2019): targets for a whole
  episode, computed backward from its end with the diffusion factor ``beta``.
  :func:`ebu_targets_loop` is the paper's loop over one episode; :func:`ebu_targets` runs
  many padded episodes at once (serial in time, one batched step for all episodes per time
  step: what ``vmap`` over episodes produces, written with an explicit batch dimension).
- **LS-DQN** (Levine, Zahavy, Mankowitz, Tamar & Mannor, NeurIPS 2017): re-fit the last
  layer by regularised least squares on the network's features, with a Gaussian prior
  centred on the current weights. :func:`ls_last_layer` solves one small system per action
  in one batched ``torch.linalg.solve``; :func:`ls_last_layer_closed_form` is the paper's
  single joint system on action-blocked features.
- **t-soft target update** (Kobayashi & Ilboudo, Neural Networks 2021): the target network's
  moving average with a Student-t weight that shrinks the copy of outlying updates.
  :func:`tsoft_update` (a reconstruction, see its docstring) and the plain EMA
  :func:`ema_update` it reduces to as ``nu -> inf``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from parlearn.core.checks import check_bool, check_float, check_tensor

__all__ = ["one_step_targets", "ebu_targets_loop", "ebu_targets", "pad_episodes",
           "ls_last_layer", "ls_last_layer_closed_form", "TSoftState", "tsoft_init",
           "tsoft_update", "ema_update"]


# --- one-step targets (DQN) -----------------------------------------------------------------

def one_step_targets(q_next: torch.Tensor, rewards: torch.Tensor, done: torch.Tensor,
                     gamma: float) -> torch.Tensor:
    """DQN's targets ``r + gamma * (1 - done) * max_a Q_target(s', a)``, for any batch shape.

    ``q_next``: ``(..., A)`` target-network values at the next states; ``done``: True where
    the transition terminated (a time-out is not done: it is bootstrapped).
    """
    q_next = check_tensor("q_next", q_next, floating=True)
    if q_next.dim() == 0 or q_next.shape[-1] == 0:
        raise ValueError(f"q_next must end in an axis of A >= 1 actions, got shape "
                         f"{tuple(q_next.shape)}")
    batch = tuple(q_next.shape[:-1])
    rewards = check_tensor("rewards", rewards, shape=batch, floating=True)
    done = check_tensor("done", done, shape=batch, dtype=torch.bool)
    gamma = check_float("gamma", gamma, lo=0, hi=1)
    return rewards + gamma * (~done).to(q_next.dtype) * q_next.max(-1).values


# --- Episodic Backward Update ---------------------------------------------------------------

def _check_actions(actions: torch.Tensor, n_actions: int) -> None:
    """Every action in ``[0, A)``: a negative index would wrap to the last action."""
    if actions.numel() and (int(actions.min()) < 0 or int(actions.max()) >= n_actions):
        raise ValueError(f"actions must lie in [0, {n_actions - 1}], got values from "
                         f"{int(actions.min())} to {int(actions.max())}")


def _check_beta_gamma(beta: float, gamma: float) -> tuple[float, float]:
    return check_float("beta", beta, lo=0, hi=1), check_float("gamma", gamma, lo=0, hi=1)


def ebu_targets_loop(q_next: torch.Tensor, actions: torch.Tensor, rewards: torch.Tensor,
                     terminal: bool, beta: float, gamma: float) -> torch.Tensor:
    """EBU targets of one episode of ``T`` transitions, Algorithm 1 of Lee et al. as a loop.

    ``q_next[k]`` is the target network's ``Q(S_{k+1}, .)`` (shape ``(T, A)``), ``actions[k]``
    the action taken in ``S_k``, ``rewards[k]`` its reward; ``terminal`` says whether the
    episode ended in a terminal state (else its last target bootstraps from ``q_next[T-1]``,
    a time-out, which the paper's episodes do not have). Going backward, the entry of the
    action actually taken next is pulled toward the target already computed for it,

        Q~[k, A_{k+1}] <- beta * y_{k+1} + (1 - beta) * Q~[k, A_{k+1}],
        y_k = R_k + gamma * max_a Q~[k, a],

    so ``beta = 0`` gives DQN's one-step targets and ``beta = 1`` backs the whole observed
    return up through the max. Returns ``y`` of shape ``(T,)``; the inputs are not changed.
    """
    q_next = check_tensor("q_next", q_next, ndim=2, floating=True)
    T = q_next.shape[0]
    if T == 0:
        raise ValueError("q_next must hold at least one transition, got T = 0")
    actions = check_tensor("actions", actions, shape=(T,), floating=False)
    rewards = check_tensor("rewards", rewards, shape=(T,), floating=True)
    terminal = check_bool("terminal", terminal)
    beta, gamma = _check_beta_gamma(beta, gamma)
    if T == 0:
        raise ValueError("q_next must hold at least one transition, got T = 0")
    if q_next.shape[1] == 0:
        raise ValueError("q_next must hold at least one action, got A = 0")
    _check_actions(actions, q_next.shape[1])
    qt = q_next.clone()
    y = torch.empty(T, dtype=q_next.dtype, device=q_next.device)
    y[T - 1] = rewards[T - 1] + (0.0 if terminal else gamma * qt[T - 1].max())
    for k in range(T - 2, -1, -1):
        a = int(actions[k + 1])
        qt[k, a] = beta * y[k + 1] + (1 - beta) * qt[k, a]
        y[k] = rewards[k] + gamma * qt[k].max()
    return y


def ebu_targets(q_next: torch.Tensor, actions: torch.Tensor, rewards: torch.Tensor,
                terminal: torch.Tensor, lengths: torch.Tensor, beta: float,
                gamma: float) -> torch.Tensor:
    """EBU targets of ``B`` episodes at once, padded to length ``L``: shape ``(B, L)``.

    The same recursion as :func:`ebu_targets_loop`, one backward sweep of ``L`` steps in
    which every step updates all ``B`` episodes together (masks stand in for the per-episode
    ``if``s, so an episode of length ``T_b < L`` only starts at step ``T_b - 1``). Inputs:
    ``q_next (B, L, A)``, ``actions (B, L)``, ``rewards (B, L)``, ``terminal (B,)`` bool,
    ``lengths (B,)`` ints in ``[1, L]``. Padding positions of the result are 0.
    """
    q_next = check_tensor("q_next", q_next, ndim=3, floating=True)
    B, L, A = q_next.shape
    actions = check_tensor("actions", actions, shape=(B, L), floating=False)
    rewards = check_tensor("rewards", rewards, shape=(B, L), floating=True)
    terminal = check_tensor("terminal", terminal, shape=(B,), dtype=torch.bool)
    lengths = check_tensor("lengths", lengths, shape=(B,), floating=False)
    beta, gamma = _check_beta_gamma(beta, gamma)
    if B and (int(lengths.min()) < 1 or int(lengths.max()) > L):
        raise ValueError(f"lengths must lie in [1, {L}], got {lengths.tolist()}")
    if A == 0:
        raise ValueError("q_next must hold at least one action, got A = 0")
    _check_actions(actions, A)
    dt, dev = q_next.dtype, q_next.device
    # Every mask is built once, before the sweep: step k's body is then three small ops.
    steps = torch.arange(L, device=dev)[None, :]
    valid = steps < lengths[:, None]
    goes_on = steps + 1 < lengths[:, None]          # the episode has a step k + 1
    nxt = torch.cat([actions[:, 1:], torch.zeros_like(actions[:, :1])], dim=1).long()
    mix = torch.nn.functional.one_hot(nxt, A).bool() & goes_on[:, :, None]
    last = valid & ~goes_on                          # an episode's last step bootstraps
    disc = torch.where(last, gamma * (~terminal).to(dt)[:, None],  # only if not terminal
                       torch.tensor(gamma, dtype=dt, device=dev))
    ys = []
    y_next = torch.zeros(B, dtype=dt, device=dev)
    for k in range(L - 1, -1, -1):
        q = q_next[:, k, :]
        # The entry of the action taken at k + 1 mixes in y_{k+1}; padding never does (mix
        # is False there), so values computed past an episode's end never leak into it.
        q = torch.where(mix[:, k], beta * y_next[:, None] + (1 - beta) * q, q)
        y_next = rewards[:, k] + disc[:, k] * q.max(-1).values
        ys.append(y_next)
    y = torch.stack(ys[::-1], dim=1)
    return torch.where(valid, y, torch.zeros_like(y))


def pad_episodes(episodes: Sequence[dict]) -> dict:
    """Stack episodes (dicts of per-step tensors ``obs``, ``next_obs``, ``actions``,
    ``rewards`` and a bool ``terminal``) into padded ``(B, L, ...)`` tensors plus
    ``lengths``; pads with zeros (which :func:`ebu_targets` masks out)."""
    if isinstance(episodes, str | dict) or not isinstance(episodes, Sequence):
        raise TypeError(f"episodes must be a sequence of dicts, got {type(episodes).__name__}")
    if not episodes:
        raise ValueError("episodes must hold at least one episode")
    keys = ("obs", "next_obs", "actions", "rewards")
    for b, e in enumerate(episodes):
        if not isinstance(e, dict) or not {*keys, "terminal"} <= set(e):
            raise TypeError(f"episodes[{b}] must be a dict with {[*keys, 'terminal']}, got "
                            f"{e!r}")
        t = check_tensor(f"episodes[{b}]['rewards']", e["rewards"], ndim=1).shape[0]
        if t == 0:
            raise ValueError(f"episodes[{b}] must hold at least one step")
        for key in keys:
            first = check_tensor(f"episodes[0][{key!r}]", episodes[0][key])
            v = check_tensor(f"episodes[{b}][{key!r}]", e[key])
            if v.shape[0] != t or v.shape[1:] != first.shape[1:] or v.dtype != first.dtype:
                raise ValueError(f"episodes[{b}][{key!r}] must be ({t}, "
                                 f"*{tuple(first.shape[1:])}) of dtype {first.dtype}, got "
                                 f"{tuple(v.shape)} {v.dtype}")
    lengths = torch.tensor([len(e["rewards"]) for e in episodes])
    L = int(lengths.max())
    out: dict = {"lengths": lengths,
                 "terminal": torch.tensor([bool(e["terminal"]) for e in episodes])}
    for key in ("obs", "next_obs", "actions", "rewards"):
        first = episodes[0][key]
        pad = torch.zeros((len(episodes), L, *first.shape[1:]), dtype=first.dtype)
        for b, e in enumerate(episodes):
            pad[b, : len(e[key])] = e[key]
        out[key] = pad
    return out


# --- LS-DQN: the last layer by regularised least squares -------------------------------------

def _with_bias(features: torch.Tensor) -> torch.Tensor:
    return torch.cat([features, torch.ones_like(features[:, :1])], dim=1)


def _check_ls(features, actions, targets, w_prior, lam):
    features = check_tensor("features", features, ndim=2, floating=True)
    n, d = features.shape
    actions = check_tensor("actions", actions, shape=(n,), floating=False)
    targets = check_tensor("targets", targets, shape=(n,), floating=True)
    w_prior = check_tensor("w_prior", w_prior, ndim=2, floating=True)
    if w_prior.shape[1] != d + 1:
        raise ValueError(f"w_prior must be (A, {d + 1}) (weights and bias per action), "
                         f"got {tuple(w_prior.shape)}")
    if n and (int(actions.min()) < 0 or int(actions.max()) >= w_prior.shape[0]):
        raise ValueError(f"actions must lie in [0, {w_prior.shape[0] - 1}]")
    lam = check_float("lam", lam, lo=0, lo_open=True)
    return features, actions, targets, w_prior, lam


def ls_last_layer(features: torch.Tensor, actions: torch.Tensor, targets: torch.Tensor,
                  w_prior: torch.Tensor, lam: float) -> torch.Tensor:
    """LS-DQN's re-fit of the last linear layer, one batched solve over the ``A`` actions.

    Minimises ``sum_i (phi_i . w_{a_i} - y_i)^2 + lam * ||w - w_prior||^2`` over the
    weights-and-bias rows ``w`` (shape ``(A, d + 1)``): the MAP estimate under a Gaussian
    prior centred on the current weights ``w_prior``, Levine et al.'s Bayesian
    regularisation. The features ``phi`` (``(n, d)``, a bias 1 appended here) only meet the
    row of their own action, so the joint system splits into ``A`` systems
    ``(Phi_a' Phi_a + lam I) w_a = Phi_a' y_a + lam w_prior_a`` solved together.
    """
    features, actions, targets, w_prior, lam = _check_ls(features, actions, targets,
                                                         w_prior, lam)
    phi = _with_bias(features)
    onehot = torch.nn.functional.one_hot(actions.long(), w_prior.shape[0]).to(phi.dtype)
    gram = torch.einsum("na,nd,ne->ade", onehot, phi, phi)
    rhs = torch.einsum("na,nd,n->ad", onehot, phi, targets) + lam * w_prior
    eye = torch.eye(phi.shape[1], dtype=phi.dtype, device=phi.device)
    return torch.linalg.solve(gram + lam * eye, rhs)


def ls_last_layer_closed_form(features: torch.Tensor, actions: torch.Tensor,
                              targets: torch.Tensor, w_prior: torch.Tensor,
                              lam: float) -> torch.Tensor:
    """The reference: Levine et al.'s one joint system on action-blocked features.

    Row ``i`` of the design matrix holds ``[phi_i, 1]`` in the block of action ``a_i`` and
    zeros elsewhere (``n x A(d+1)``); ``w = (X'X + lam I)^-1 (X'y + lam w_prior)``, formed
    with an explicit inverse, reshaped to ``(A, d + 1)``.
    """
    features, actions, targets, w_prior, lam = _check_ls(features, actions, targets,
                                                         w_prior, lam)
    phi = _with_bias(features)
    n, d1 = phi.shape
    A = w_prior.shape[0]
    X = torch.zeros(n, A * d1, dtype=phi.dtype, device=phi.device)
    for i in range(n):
        a = int(actions[i])
        X[i, a * d1:(a + 1) * d1] = phi[i]
    eye = torch.eye(A * d1, dtype=phi.dtype, device=phi.device)
    w = torch.linalg.inv(X.T @ X + lam * eye) @ (X.T @ targets + lam * w_prior.reshape(-1))
    return w.reshape(A, d1)


# --- target-network updates: EMA and t-soft --------------------------------------------------

def _check_pairs(target, online) -> None:
    """Two equally long sequences of tensors, pairwise of one shape and floating: ``add_``
    would otherwise broadcast an online tensor into a larger target without a word."""
    for name, seq in (("target", target), ("online", online)):
        if isinstance(seq, torch.Tensor) or not isinstance(seq, Sequence):
            raise TypeError(f"{name} must be a sequence of tensors, got {type(seq).__name__}")
    if len(target) != len(online):
        raise ValueError(f"target and online must hold as many tensors, got {len(target)} "
                         f"and {len(online)}")
    for i, (t, o) in enumerate(zip(target, online, strict=True)):
        check_tensor(f"target[{i}]", t, floating=True)
        check_tensor(f"online[{i}]", o, shape=tuple(t.shape), floating=True)


@torch.no_grad()
def ema_update(target: Sequence[torch.Tensor], online: Sequence[torch.Tensor],
               tau: float) -> None:
    """The soft update ``target <- (1 - tau) * target + tau * online``, in place."""
    _check_pairs(target, online)
    tau = check_float("tau", tau, lo=0, hi=1, lo_open=True)
    for t, o in zip(target, online, strict=True):
        t.mul_(1 - tau).add_(o, alpha=tau)


@dataclass
class TSoftState:
    """Per parameter tensor: the running variance ``sigma2`` of the squared gaps and the
    decayed sum ``W`` of past Student-t weights; ``last_tau`` is the rate of the last step."""

    sigma2: list[float]
    W: list[float]
    last_tau: list[float]


def tsoft_init(target: Sequence[torch.Tensor], tau: float, eps: float = 1e-8) -> TSoftState:
    """A fresh state for :func:`tsoft_update`: ``sigma2 = eps``, ``W = (1 - tau) / tau``
    (the weight sum at which a weight of 1 gives exactly the rate ``tau``)."""
    tau = check_float("tau", tau, lo=0, hi=1, lo_open=True, hi_open=True)
    eps = check_float("eps", eps, lo=0, lo_open=True)
    if isinstance(target, torch.Tensor) or not isinstance(target, Sequence):
        raise TypeError(f"target must be a sequence of tensors, got {type(target).__name__}")
    for i, t in enumerate(target):
        check_tensor(f"target[{i}]", t, floating=True)
    n = len(target)
    return TSoftState([eps] * n, [(1 - tau) / tau] * n, [tau] * n)


@torch.no_grad()
def tsoft_update(target: Sequence[torch.Tensor], online: Sequence[torch.Tensor],
                 state: TSoftState, tau: float, nu: float, eps: float = 1e-8) -> None:
    """t-soft update of the target network, in place: a reconstruction from the abstract.

    Kobayashi & Ilboudo derive the soft update as the running mean of a normal distribution
    and replace it with a Student-t's. Reconstructed here, per parameter tensor ``p`` with
    ``n`` entries: ``D = mean((online - target)^2) / sigma2``, the Student-t weight
    ``w = (nu + 1) / (nu + D)`` (``w = 1`` at ``nu = inf``), the rate ``tau_t = w / (W + w)``,
    then ``target <- (1 - tau_t) target + tau_t online``,
    ``sigma2 <- max(eps, (1 - tau_t) sigma2 + tau_t mean((online - target_old)^2))`` and
    ``W <- (1 - tau) (W + w)``. A gap far beyond the usual ones (``D >> 1``) gets a small
    weight and is copied slowly; as ``nu -> inf`` every ``w -> 1``, ``W`` stays at its
    fixed point ``(1 - tau) / tau`` and ``tau_t = tau``: the plain EMA.
    """
    _check_pairs(target, online)
    if not isinstance(state, TSoftState):
        raise TypeError(f"state must be a TSoftState (tsoft_init), got {type(state).__name__}")
    tau = check_float("tau", tau, lo=0, hi=1, lo_open=True, hi_open=True)
    nu = check_float("nu", nu, lo=0, lo_open=True, finite=False)
    eps = check_float("eps", eps, lo=0, lo_open=True)
    if len(state.W) != len(target):
        raise ValueError(f"state holds {len(state.W)} tensors, target {len(target)}")
    for i, (t, o) in enumerate(zip(target, online, strict=True)):
        gap2 = float(((o - t) ** 2).mean())
        w = 1.0 if math.isinf(nu) else (nu + 1) / (nu + gap2 / state.sigma2[i])
        rate = w / (state.W[i] + w)
        t.mul_(1 - rate).add_(o, alpha=rate)
        state.sigma2[i] = max(eps, (1 - rate) * state.sigma2[i] + rate * gap2)
        state.W[i] = (1 - tau) * (state.W[i] + w)
        state.last_tau[i] = rate
