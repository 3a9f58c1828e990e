"""A particle filter whose measurement update is a network run on every particle at once.

Reconstruction of the *Deep Measurement Update* (DMU) seed from its abstract only: a
conditional encoder-decoder that turns a raw depth observation into a likelihood for each
state hypothesis of a Bayes filter, trained on synthetic data alone. What is built here (our
choices, not the paper's): a generated 2-D grid world; a robot on the free cells; a depth scan
of ``rays`` ray-cast distances with Gaussian noise; an encoder that embeds the scan once per
step and a decoder that, conditioned on each particle's position, scores it. The network is
trained as a classifier of (true pose, scan) against (random pose, scan), so its logit
estimates ``log p(z | x) - log p(z)`` plus a constant: exactly what a Bayes filter needs, since
the weights are normalised over the particles.

Reading order: the world and its sensor; the exact (analytic) likelihood; the grid Bayes filter
(the serial reference: every cell, exact); the particle filter; the DMU network, its training,
its batched and looped evaluation; tracking error; ``bench``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from parlearn.core.bench import Row
from parlearn.core.checks import (
    check_callable,
    check_float,
    check_int,
    check_ints,
    check_seed,
    check_tensor,
)
from parlearn.core.timing import UNRELIABLE, compare

__all__ = ["World", "make_world", "expected_scans", "observe", "log_likelihood",
           "transition_matrix", "motion_step", "grid_filter", "measurement_update",
           "resample", "particle_filter", "posterior_histogram", "DMUNet", "train_dmu",
           "net_log_likelihood", "net_log_likelihood_looped", "simulate", "tracking_error",
           "throughput", "bench", "MOVES"]

# The commanded moves, in cells: stay, east, north, west, south.
MOVES = torch.tensor([[0, 0], [1, 0], [0, 1], [-1, 0], [0, -1]])


def _gen(seed: int | torch.Generator) -> torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    return torch.Generator().manual_seed(check_seed("seed", seed))


@dataclass(frozen=True)
class World:
    """A ``size x size`` grid: ``walls[x, y]`` is True for a wall; ``free`` lists the free
    cells as (x, y) rows; ``scans[i]`` is the noise-free depth scan from ``free[i]``'s centre."""

    walls: torch.Tensor
    free: torch.Tensor
    scans: torch.Tensor
    sigma: float
    max_range: float

    @property
    def size(self) -> int:
        return self.walls.shape[0]

    @property
    def rays(self) -> int:
        return self.scans.shape[1]

    def index(self, cells: torch.Tensor) -> torch.Tensor:
        """Index into ``free`` of each (x, y) row of ``cells`` (all must be free)."""
        lookup = torch.full((self.size, self.size), -1, dtype=torch.long)
        lookup[self.free[:, 0], self.free[:, 1]] = torch.arange(len(self.free))
        return lookup[cells[:, 0], cells[:, 1]]


def expected_scans(walls: torch.Tensor, cells: torch.Tensor, rays: int,
                   max_range: float, step: float = 0.02) -> torch.Tensor:
    """Noise-free depth from each cell centre along ``rays`` evenly spaced directions.

    Each ray is marched in steps of ``step`` cells; the depth is the first distance at which
    the point lies in a wall or outside the grid (``max_range`` if none). Shape (cells, rays).
    """
    walls = check_tensor("walls", walls, ndim=2, dtype=torch.bool)
    size = walls.shape[0]
    if walls.shape[1] != size:
        raise ValueError(f"walls must be square, got shape {tuple(walls.shape)}")
    check_tensor("cells", cells, shape=(None, 2), floating=False)
    if cells.numel() and (int(cells.min()) < 0 or int(cells.max()) >= size):
        raise ValueError(f"cells must be (x, y) rows in [0, {size - 1}], got values from "
                         f"{int(cells.min())} to {int(cells.max())}")
    rays = check_int("rays", rays, lo=1)
    max_range = check_float("max_range", max_range, lo=0, lo_open=True)
    step = check_float("step", step, lo=0, hi=max_range, lo_open=True)
    angles = torch.arange(rays, dtype=torch.float64) * (2 * math.pi / rays)
    dirs = torch.stack([torch.cos(angles), torch.sin(angles)], 1)            # (R, 2)
    ts = torch.arange(1, int(max_range / step) + 1, dtype=torch.float64) * step  # (S,)
    centre = cells.to(torch.float64) + 0.5                                   # (C, 2)
    pts = centre[:, None, None, :] + ts[None, None, :, None] * dirs[None, :, None, :]
    ij = torch.floor(pts).long()
    outside = ((ij < 0) | (ij >= size)).any(-1)
    hit = outside | walls[ij[..., 0].clamp(0, size - 1), ij[..., 1].clamp(0, size - 1)]
    # the first hit along each ray; argmax of a bool finds it, rays with none get max_range
    first = hit.to(torch.int8).argmax(-1)
    return torch.where(hit.any(-1), ts[first], torch.tensor(max_range, dtype=torch.float64))


def make_world(size: int = 12, *, density: float = 0.2, rays: int = 8, sigma: float = 0.3,
               max_range: float = 6.0, seed: int = 0) -> World:
    """A walled ``size x size`` grid with random interior wall cells (each with probability
    ``density``), and the expected scan of every free cell."""
    size = check_int("size", size, lo=3)
    density = check_float("density", density, lo=0, hi=0.6)
    rays = check_int("rays", rays, lo=1)
    sigma = check_float("sigma", sigma, lo=0, lo_open=True)
    max_range = check_float("max_range", max_range, lo=0, lo_open=True)
    g = _gen(seed)
    walls = torch.rand(size, size, generator=g) < density
    walls[0, :] = walls[-1, :] = walls[:, 0] = walls[:, -1] = True
    free = (~walls).nonzero()
    if len(free) < 2:
        raise ValueError(f"density={density} left fewer than 2 free cells; lower it")
    return World(walls, free, expected_scans(walls, free, rays, max_range), sigma, max_range)


def _check_world(world: World) -> World:
    if not isinstance(world, World):
        raise TypeError(f"world must be a filters.World (make_world), got {type(world).__name__}")
    return world


def _check_walk(world: World, moves: list[int], scans: torch.Tensor, p_slip: float) -> float:
    """``moves`` a list of moves (indices into MOVES), ``scans`` (len(moves), rays) floats."""
    _check_world(world)
    if not isinstance(moves, list | tuple) or not moves:
        raise TypeError(f"moves must be a non-empty list of ints in [0, {len(MOVES) - 1}], "
                        f"got {moves!r}")
    for m in moves:
        check_int("moves", m, lo=0, hi=len(MOVES) - 1)
    check_tensor("scans", scans, shape=(len(moves), world.rays), floating=True, finite=True)
    return check_float("p_slip", p_slip, lo=0, hi=1)


def _check_cells(world: World, cell_index: torch.Tensor, name: str = "cell_index") -> None:
    """``world`` a :class:`World`; ``cell_index`` 1-D integer indices into ``world.free``
    (a negative one would wrap to the last free cell)."""
    _check_world(world)
    check_tensor(name, cell_index, ndim=1, floating=False)
    n = len(world.free)
    if cell_index.numel() and (int(cell_index.min()) < 0 or int(cell_index.max()) >= n):
        raise ValueError(f"{name} must index the {n} free cells, [0, {n - 1}], got values from "
                         f"{int(cell_index.min())} to {int(cell_index.max())}")


def observe(world: World, cell_index: torch.Tensor, seed: int | torch.Generator) -> torch.Tensor:
    """Noisy scans from the free cells ``cell_index``: expected scan + N(0, sigma^2) per ray."""
    _check_cells(world, cell_index)
    g = _gen(seed)
    clean = world.scans[cell_index]
    return clean + world.sigma * torch.randn(clean.shape, generator=g, dtype=clean.dtype)


def log_likelihood(world: World, z: torch.Tensor, cell_index: torch.Tensor) -> torch.Tensor:
    """The exact ``log p(z | x)`` of scan ``z`` (rays,) at each free cell in ``cell_index``:
    independent Gaussian rays around the expected scan."""
    _check_cells(world, cell_index)
    z = check_tensor("z", z, shape=(world.rays,), floating=True)
    d = world.scans[cell_index] - z.to(world.scans.dtype)
    return (-0.5 * (d / world.sigma) ** 2).sum(-1) - world.rays * math.log(
        world.sigma * math.sqrt(2 * math.pi))


# -- motion: a commanded move that slips to a neighbour; into a wall it stays put ------------
def _slips(p_slip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The displacement noise: none with 1 - p_slip, each of the 4 neighbours p_slip / 4."""
    probs = torch.tensor([1 - p_slip] + [p_slip / 4] * 4, dtype=torch.float64)
    return MOVES, probs


def _landing(world: World, cells: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    target = (cells + shift).clamp(0, world.size - 1)
    blocked = world.walls[target[:, 0], target[:, 1]]
    return torch.where(blocked[:, None], cells, target)


def transition_matrix(world: World, move: int, p_slip: float) -> torch.Tensor:
    """``T[i, j] = P(next = free[j] | now = free[i], move)``, float64 (rows sum to 1)."""
    if not isinstance(world, World):
        raise TypeError(f"world must be a filters.World (make_world), got {type(world).__name__}")
    p_slip = check_float("p_slip", p_slip, lo=0, hi=1)
    check_int("move", move, lo=0, hi=len(MOVES) - 1)
    noise, probs = _slips(p_slip)
    n = len(world.free)
    t = torch.zeros(n, n, dtype=torch.float64)
    for shift, p in zip(noise, probs, strict=True):
        dest = world.index(_landing(world, world.free, MOVES[move] + shift))
        t.index_put_((torch.arange(n), dest), p.expand(n), accumulate=True)
    return t


def motion_step(world: World, cell_index: torch.Tensor, move: int, p_slip: float,
                seed: int | torch.Generator) -> torch.Tensor:
    """Sample the next free cell of every particle (the same law as ``transition_matrix``)."""
    _check_cells(world, cell_index)
    check_int("move", move, lo=0, hi=len(MOVES) - 1)
    noise, probs = _slips(check_float("p_slip", p_slip, lo=0, hi=1))
    pick = torch.multinomial(probs, len(cell_index), replacement=True, generator=_gen(seed))
    return world.index(_landing(world, world.free[cell_index], MOVES[move] + noise[pick]))


# -- the serial reference: the exact Bayes filter over every free cell --------------------
def grid_filter(world: World, moves: list[int], scans: torch.Tensor, p_slip: float,
                prior: torch.Tensor | None = None) -> torch.Tensor:
    """Exact posteriors over the free cells after each (move, scan): predict with the
    transition matrix, multiply by the likelihood, normalise. Shape (steps, free cells)."""
    p_slip = _check_walk(world, moves, scans, p_slip)
    n = len(world.free)
    if prior is not None:
        check_tensor("prior", prior, shape=(n,), floating=True, finite=True)
        if bool((prior < 0).any()) or not float(prior.sum()) > 0:
            raise ValueError("prior must be weights >= 0 over the free cells, not all zero")
    belief = torch.full((n,), 1.0 / n, dtype=torch.float64) if prior is None else prior.clone()
    out = []
    for move, z in zip(moves, scans, strict=True):
        belief = belief @ transition_matrix(world, move, p_slip)
        belief = belief * torch.exp(log_likelihood(world, z, torch.arange(n)))
        belief = belief / belief.sum()
        out.append(belief)
    return torch.stack(out)


# -- the particle filter ---------------------------------------------------------------------
def measurement_update(log_w: torch.Tensor, log_lik: torch.Tensor) -> torch.Tensor:
    """Bayes' rule on weights: ``log w + log p(z|x)``, normalised (log-sum-exp) to sum to 1.
    ``log_w`` and ``log_lik`` are (N,) per particle; -inf (weight 0) is allowed, NaN not."""
    log_w = check_tensor("log_w", log_w, ndim=1, floating=True)
    log_lik = check_tensor("log_lik", log_lik, shape=tuple(log_w.shape), floating=True)
    for name, t in (("log_w", log_w), ("log_lik", log_lik)):
        if bool(t.isnan().any()):
            raise ValueError(f"{name} must not contain NaN")
    new = log_w + log_lik
    return new - torch.logsumexp(new, 0)


def resample(cell_index: torch.Tensor, log_w: torch.Tensor,
             seed: int | torch.Generator) -> torch.Tensor:
    """Systematic resampling: one uniform offset, N evenly spaced points on the weights' CDF.
    ``log_w`` must be normalised (log-sum-exp 0, as :func:`measurement_update` returns):
    the CDF's last point is set to 1, which would silently rescale other weights."""
    check_tensor("cell_index", cell_index, ndim=1, floating=False)
    n = len(cell_index)
    if n == 0:
        raise ValueError("cell_index must hold at least one particle, got 0")
    log_w = check_tensor("log_w", log_w, ndim=1, floating=True)
    if log_w.shape[0] != n:
        raise ValueError(f"log_w must hold one weight per entry of cell_index ({n}), got "
                         f"{log_w.shape[0]}")
    if bool(log_w.isnan().any()):
        raise ValueError("log_w must not contain NaN")
    total = float(torch.logsumexp(log_w.to(torch.float64), 0))
    if not abs(total) <= 1e-6:
        raise ValueError(f"log_w must be normalised (log-sum-exp 0), got {total:.3g}")
    u = (torch.rand((), generator=_gen(seed), dtype=torch.float64)
         + torch.arange(n, dtype=torch.float64)) / n
    cdf = torch.cumsum(torch.exp(log_w.to(torch.float64)), 0)
    cdf[-1] = 1.0  # round-off must not push the last point past the end
    return cell_index[torch.searchsorted(cdf, u)]


def particle_filter(world: World, moves: list[int], scans: torch.Tensor, p_slip: float, *,
                    particles: int, likelihood=None, seed: int = 0) -> dict:
    """Bootstrap particle filter: sample the motion, weight by the likelihood of all
    particles in one call, resample every step.

    ``likelihood(z, cell_index) -> log p(z|x)`` per particle; default the exact
    :func:`log_likelihood`. Returns ``{"cells": (steps, N) free-cell indices before
    resampling, "log_w": (steps, N) normalised log-weights, "mean": (steps, 2) weighted
    mean position}``.
    """
    p_slip = _check_walk(world, moves, scans, p_slip)
    n = check_int("particles", particles, lo=1)
    if likelihood is not None:
        check_callable("likelihood", likelihood)
    g = _gen(seed)
    lik = partial(log_likelihood, world) if likelihood is None else likelihood
    cells = torch.randint(len(world.free), (n,), generator=g)  # the uniform prior
    log_w = torch.full((n,), -math.log(n), dtype=torch.float64)
    out: dict = {"cells": [], "log_w": [], "mean": []}
    for move, z in zip(moves, scans, strict=True):
        cells = motion_step(world, cells, move, p_slip, g)
        log_w = measurement_update(torch.full((n,), -math.log(n), dtype=torch.float64),
                                   lik(z, cells).to(torch.float64))
        pos = world.free[cells].to(torch.float64) + 0.5
        out["cells"].append(cells)
        out["log_w"].append(log_w)
        out["mean"].append((torch.exp(log_w)[:, None] * pos).sum(0))
        cells = resample(cells, log_w, g)
    return {k: torch.stack(v) for k, v in out.items()}


def posterior_histogram(world: World, cells: torch.Tensor, log_w: torch.Tensor) -> torch.Tensor:
    """The particles' weights summed per free cell: the particle posterior on the grid."""
    _check_cells(world, cells, "cells")
    log_w = check_tensor("log_w", log_w, ndim=1, floating=True)
    if log_w.shape[0] != cells.shape[0]:
        raise ValueError(f"log_w must hold one weight per entry of cells ({cells.shape[0]}), "
                         f"got {log_w.shape[0]}")
    return torch.zeros(len(world.free), dtype=torch.float64).index_add_(
        0, cells, torch.exp(log_w.to(torch.float64)))


# -- the deep measurement update ---------------------------------------------------------
class DMUNet(nn.Module):
    """Conditional encoder-decoder: ``encode(z)`` embeds a scan once; ``decode(code, pos)``
    scores every particle position against it; the score is a log-likelihood up to a
    constant in the position (see the module docstring)."""

    def __init__(self, rays: int, world_size: int, hidden: int = 64, code: int = 32,
                 freqs: int = 4) -> None:
        for name, v in (("rays", rays), ("world_size", world_size), ("hidden", hidden),
                        ("code", code), ("freqs", freqs)):
            check_int(name, v, lo=1)
        super().__init__()
        self.world_size, self.freqs = world_size, freqs
        self.encoder = nn.Sequential(nn.Linear(rays, hidden), nn.ReLU(), nn.Linear(hidden, code))
        self.decoder = nn.Sequential(nn.Linear(code + 4 * freqs, hidden), nn.ReLU(),
                                     nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def features(self, pos: torch.Tensor) -> torch.Tensor:
        """Sines and cosines of the position at ``freqs`` scales: a network on raw (x, y)
        is too smooth to tell neighbouring cells apart."""
        x = pos / self.world_size * math.pi
        k = 2.0 ** torch.arange(self.freqs, dtype=pos.dtype)
        a = (x[..., None] * k).flatten(-2)
        return torch.cat([torch.sin(a), torch.cos(a)], -1)

    def encode(self, z: torch.Tensor) -> torch.Tensor:
        return self.encoder(z / self.world_size)

    def decode(self, code: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        code = code.expand(pos.shape[0], -1) if code.dim() == 1 else code
        return self.decoder(torch.cat([code, self.features(pos)], -1)).squeeze(-1)

    def forward(self, z: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(z), pos)


def train_dmu(world: World, *, steps: int = 1500, batch: int = 256, lr: float = 3e-3,
              hidden: int = 64, seed: int = 0) -> tuple[DMUNet, list[float]]:
    """Train a :class:`DMUNet` on synthetic scans only: each batch holds (true cell, its noisy
    scan) pairs labelled 1 and (random cell, the same scan) labelled 0; binary cross-entropy.
    Returns the network (float32, eval mode) and the loss per step."""
    _check_world(world)
    steps = check_int("steps", steps, lo=1)
    batch = check_int("batch", batch, lo=2)
    lr = check_float("lr", lr, lo=0, lo_open=True)
    hidden = check_int("hidden", hidden, lo=1)
    g = _gen(seed)
    with torch.random.fork_rng(devices=[]):  # init from our seed, the user's RNG untouched
        torch.manual_seed(int(torch.randint(2**31, (), generator=g)))
        net = DMUNet(world.rays, world.size, hidden=hidden)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    pos = world.free.to(torch.float32) + 0.5
    labels = torch.cat([torch.ones(batch), torch.zeros(batch)])
    losses = []
    for _ in range(steps):
        true = torch.randint(len(world.free), (batch,), generator=g)
        other = torch.randint(len(world.free), (batch,), generator=g)
        z = observe(world, true, g).to(torch.float32)
        code = net.encode(z)
        logits = torch.cat([net.decode(code, pos[true]), net.decode(code, pos[other])])
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return net.eval(), losses


def _check_net(net: DMUNet, world: World, z: torch.Tensor, cell_index: torch.Tensor) -> None:
    if not isinstance(net, DMUNet):
        raise TypeError(f"net must be a filters.DMUNet, got {type(net).__name__}")
    _check_cells(world, cell_index)
    check_tensor("z", z, shape=(world.rays,), floating=True)


def net_log_likelihood(net: DMUNet, world: World, z: torch.Tensor,
                       cell_index: torch.Tensor) -> torch.Tensor:
    """The network's score of every particle, batched: one encoding, one decoder call."""
    _check_net(net, world, z, cell_index)
    pos = world.free[cell_index].to(torch.float32) + 0.5
    with torch.no_grad():
        return net.decode(net.encode(z.to(torch.float32)), pos)


def net_log_likelihood_looped(net: DMUNet, world: World, z: torch.Tensor,
                              cell_index: torch.Tensor) -> torch.Tensor:
    """The same scores one particle at a time (the serial reference and the bench's loop)."""
    _check_net(net, world, z, cell_index)
    pos = world.free[cell_index].to(torch.float32) + 0.5
    with torch.no_grad():
        return torch.stack([net(z.to(torch.float32), p[None])[0] for p in pos])


def simulate(world: World, steps: int, p_slip: float, seed: int = 0) -> dict:
    """A random walk of the robot and its noisy scans: ``{"moves", "cells", "scans"}``."""
    _check_world(world)
    steps = check_int("steps", steps, lo=1)
    check_float("p_slip", p_slip, lo=0, hi=1)
    g = _gen(seed)
    cell = torch.randint(len(world.free), (1,), generator=g)
    moves, cells, scans = [], [], []
    for _ in range(steps):
        move = int(torch.randint(len(MOVES), (), generator=g))
        cell = motion_step(world, cell, move, p_slip, g)
        moves.append(move)
        cells.append(int(cell))
        scans.append(observe(world, cell, g)[0])
    return {"moves": moves, "cells": torch.tensor(cells), "scans": torch.stack(scans)}


def tracking_error(world: World, particles: int, *, likelihood=None, steps: int = 20,
                   runs: int = 4, p_slip: float = 0.2, seed: int = 0) -> float:
    """Mean distance (cells) from the filter's weighted-mean position to the true one, over
    the second half of ``runs`` simulated walks of ``steps`` steps."""
    _check_world(world)
    check_int("particles", particles, lo=1)
    if likelihood is not None:
        check_callable("likelihood", likelihood)
    check_int("steps", steps, lo=1)
    check_float("p_slip", p_slip, lo=0, hi=1)
    check_seed("seed", seed)
    errs = []
    for r in range(check_int("runs", runs, lo=1)):
        sim = simulate(world, steps, p_slip, seed=seed + r)
        pf = particle_filter(world, sim["moves"], sim["scans"], p_slip, particles=particles,
                             likelihood=likelihood, seed=seed + 1000 + r)
        true = world.free[sim["cells"]].to(torch.float64) + 0.5
        errs.append((pf["mean"] - true).norm(dim=1)[steps // 2:])
    return float(torch.cat(errs).mean())


def throughput(net: DMUNet, world: World, sizes: list[int], *, loop_max: int = 256,
               repeat: int = 3, seed: int = 0) -> dict:
    """Particles per second of the DMU update, batched and looped, measured interleaved on
    the CPU with one thread. The loop is timed only for N <= ``loop_max`` (it is linear in N).
    Returns ``{"sizes", "batched": [...], "loop": [... or None], "spread", "threads",
    "reliable"}``."""
    _check_net(net, _check_world(world), world.scans[0], torch.tensor([0]))
    sizes = check_ints("sizes", sizes, lo=1)
    loop_max = check_int("loop_max", loop_max, lo=0)
    repeat = check_int("repeat", repeat, lo=1)
    z = observe(world, torch.tensor([0]), seed)[0]
    out: dict = {"sizes": list(sizes), "batched": [], "loop": [], "spread": [],
                 "threads": 1, "reliable": True}
    for n in sizes:
        cells = torch.randint(len(world.free), (n,),
                              generator=_gen(seed))
        cands = {"batched": partial(net_log_likelihood, net, world, z, cells)}
        if n <= loop_max:
            cands["loop"] = partial(net_log_likelihood_looped, net, world, z, cells)
        cmp = compare(cands, warmup=1, repeat=repeat, threads=1)
        out["batched"].append(n / cmp.timings["batched"].median)
        out["loop"].append(n / cmp.timings["loop"].median if "loop" in cands else None)
        out["spread"].append(max(t.spread for t in cmp.timings.values()))
        out["reliable"] = out["reliable"] and cmp.reliable
    return out


def bench(device: torch.device, quick: bool) -> list[Row]:
    """The DMU measurement update of N particles: one batched decoder call vs a Python loop
    of single-particle forwards (the network untrained: the time does not depend on it)."""
    world = make_world(12, seed=0)
    with torch.random.fork_rng(devices=[]):  # the user's RNG untouched
        torch.manual_seed(0)
        net = DMUNet(world.rays, world.size).eval()
    z = observe(world, torch.tensor([0]), 0)[0]
    rows = []
    for n in (256,) if quick else (256, 2048):
        cells = torch.randint(len(world.free), (n,), generator=_gen(1))
        cmp = compare({"loop": partial(net_log_likelihood_looped, net, world, z, cells),
                       "batched": partial(net_log_likelihood, net, world, z, cells)},
                      warmup=1, repeat=3 if quick else 7, threads=1)
        lo, hi = cmp.speedup_range("batched")
        rate = n / cmp.timings["batched"].median
        detail = f"{cmp.threads} thread(s); IQR {lo:.2f}-{hi:.2f}; batched {rate:.3g} particles/s"
        rows.append(Row(f"filters DMU update N={n}", "loop over particles", "one batched call",
                        cmp.speedup("batched"), "cpu", "", None,
                        detail if cmp.reliable else f"{detail}; WARNING: {UNRELIABLE}"))
    return rows
