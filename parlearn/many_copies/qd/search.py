"""MAP-Elites from scratch in JAX: tasks, the grid archive, scoring, insertion, variation and
the search loop, each parallel piece beside its serial reference (see :mod:`parlearn.qd`).

JAX is imported inside the functions, so importing this module does not start it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from parlearn.core.checks import check_float, check_int
from parlearn.many_copies.qd.arrays import _array, _check_key, _values

__all__ = ["Task", "arm_task", "rastrigin_task", "Archive", "empty_archive", "cell_index",
           "score_batch", "score_loop", "insert", "insert_loop", "isoline_variation",
           "qd_metrics", "MapElitesResult", "map_elites"]


# --- tasks ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Task:
    """A QD task: ``score(x) -> (fitness, descriptor)`` for one genotype ``x`` in [0, 1]^dim.

    Descriptors lie in [0, 1]^n_desc. ``fitness_floor`` is a lower bound on the fitness;
    the QD-score adds ``-fitness_floor`` per filled cell so that it only grows.
    """

    name: str
    dim: int
    n_desc: int
    score: Callable[[Any], tuple[Any, Any]] = field(repr=False)
    fitness_floor: float


def arm_task(dofs: int = 8) -> Task:
    """The planar arm of ``dofs`` equal links, total length 1/2, based at (1/2, 1/2).

    Genotype: normalised joint angles in [0, 1] (angle ``2 pi x - pi`` relative to the
    previous link). Fitness: minus the standard deviation of the genotype (smooth, even
    postures score best). Descriptor: the end effector's (x, y), in [0, 1]^2. The same
    definitions as QDax's ``qdax.tasks.arm.arm``, so their scores can be compared.
    """
    dofs = check_int("dofs", dofs, lo=1)

    def score(x):
        import jax.numpy as jnp

        x = jnp.clip(x, 0.0, 1.0)
        fitness = -jnp.std(x)
        angles = jnp.cumsum(2 * jnp.pi * x - jnp.pi)
        hand = jnp.stack([jnp.sum(jnp.cos(angles)), jnp.sum(jnp.sin(angles))]) / (2 * dofs)
        return fitness, hand + 0.5

    return Task(f"arm{dofs}", dofs, 2, score, fitness_floor=-0.5)


def rastrigin_task(dim: int = 10) -> Task:
    """Rastrigin on [-5.12, 5.12]^dim (genotype rescaled from [0, 1]), maximised as its negative.

    Descriptor: the means of the first and second halves of the genotype, in [0, 1]^2
    (a linear projection, as in the QD benchmarks of Cully 2021).
    """
    dim = check_int("dim", dim, lo=2)

    def score(x):
        import jax.numpy as jnp

        x = jnp.clip(x, 0.0, 1.0)
        z = 10.24 * x - 5.12
        fitness = -(10.0 * dim + jnp.sum(z * z - 10.0 * jnp.cos(2 * jnp.pi * z))) / dim
        half = dim // 2
        return fitness, jnp.stack([jnp.mean(x[:half]), jnp.mean(x[half:])])

    # z^2 - 10 cos(2 pi z) + 10 <= 5.12^2 + 20 per coordinate.
    return Task(f"rastrigin{dim}", dim, 2, score, fitness_floor=-(5.12**2 + 20.0))


# --- the archive -----------------------------------------------------------------------------

class Archive(NamedTuple):
    """A grid archive of ``cells_per_dim ** n_desc`` cells; empty cells have fitness -inf."""

    fitness: Any      # (cells,)
    genotypes: Any    # (cells, dim)
    descriptors: Any  # (cells, n_desc)

    @property
    def cells_per_dim(self) -> int:
        """Cells along each descriptor axis (from the shapes, so it stays static under jit)."""
        return round(self.fitness.shape[0] ** (1 / self.descriptors.shape[1]))


def empty_archive(task: Task, cells_per_dim: int = 32) -> Archive:
    """An archive with every cell empty."""
    import jax.numpy as jnp

    _check_task(task)
    cells_per_dim = check_int("cells_per_dim", cells_per_dim, lo=1)
    cells = cells_per_dim ** task.n_desc
    return Archive(jnp.full((cells,), -jnp.inf, jnp.float32),
                   jnp.zeros((cells, task.dim), jnp.float32),
                   jnp.zeros((cells, task.n_desc), jnp.float32))


def cell_index(descriptors, cells_per_dim: int):
    """Flat cell index of each descriptor row (first coordinate varies fastest, as in QDax).

    ``descriptors`` (..., n_desc) must lie in [0, 1]: each axis is cut into
    ``cells_per_dim`` equal cells, ``[i/c, (i+1)/c)``, the last one closed (a descriptor
    of exactly 1 is in cell ``c - 1``). Every :class:`Task` of this module provably keeps
    its descriptors there (the arm's hand is at most ``dofs`` links of ``1/(2 dofs)`` from
    the centre; Rastrigin's are means of genotypes clipped to [0, 1]), so a descriptor
    outside [0, 1], or NaN, is an error, refused here. (QDax instead clips, by looking up
    the nearest centroid; we refuse so that a task with the wrong scale is noticed.) Under
    ``jax.jit`` the values are tracers and cannot be checked: there the index is clamped
    into the grid, which only changes descriptors outside [0, 1] (the closed upper edge
    aside), i.e. only a call that would have been refused eagerly.
    """
    cells_per_dim = check_int("cells_per_dim", cells_per_dim, lo=1)
    _array("descriptors", descriptors, (None,) * max(1, len(getattr(descriptors, "shape", ()))))
    n_desc = descriptors.shape[-1]
    if n_desc < 1:
        raise ValueError(f"descriptors must have n_desc >= 1 columns, got shape "
                         f"{tuple(descriptors.shape)}")
    if cells_per_dim ** n_desc > 2**31 - 1:
        raise ValueError(f"cells_per_dim={cells_per_dim} gives {cells_per_dim}**{n_desc} "
                         "cells, more than an int32 index holds (2**31 - 1)")
    _values("descriptors", descriptors, unit=True)
    return _cell_index(descriptors, cells_per_dim)


def _cell_index(descriptors, cells_per_dim: int):
    """:func:`cell_index` without the checks (also traced, inside the jitted programs)."""
    import jax.numpy as jnp

    idx = jnp.clip(jnp.floor(descriptors * cells_per_dim), 0, cells_per_dim - 1).astype(jnp.int32)
    strides = cells_per_dim ** jnp.arange(descriptors.shape[-1], dtype=jnp.int32)
    return jnp.sum(idx * strides, axis=-1)


def _check_task(task: Any) -> Task:
    if not isinstance(task, Task):
        raise TypeError(f"task must be a qd Task (arm_task, rastrigin_task), got "
                        f"{type(task).__name__}")
    return task


def _genotypes(task: Task, genotypes: Any, name: str = "genotypes") -> Any:
    """A (batch, task.dim) array in [0, 1] (the genotype space of every Task)."""
    _array(name, genotypes, (None, task.dim))
    _values(name, genotypes, unit=True)
    return genotypes


# --- scoring: serial reference and vmap ---------------------------------------------------

def score_loop(task: Task, genotypes) -> tuple[Any, Any]:
    """Serial reference: score one genotype at a time in a Python loop of calls to
    ``jax.jit(task.score)`` (compiled once per task; eager ops cost ~10 ms a genotype).

    ``genotypes`` (batch, task.dim) must lie in [0, 1], the genotype space of every Task
    (NaN or values outside are refused, not clipped)."""
    import jax.numpy as jnp

    _genotypes(_check_task(task), genotypes)
    single = _jit_score(task)
    # Rows as NumPy and results stacked by NumPy: iterating over or stacking JAX arrays
    # eagerly compiles a small program per shape (seconds in all), for no gain here.
    out = [single(x) for x in np.asarray(genotypes)]
    return (jnp.asarray(np.stack([np.asarray(f) for f, _ in out])),
            jnp.asarray(np.stack([np.asarray(d) for _, d in out])))


@functools.lru_cache(maxsize=16)
def _jit_score(task: Task) -> Callable:
    import jax

    return jax.jit(task.score)


def score_batch(task: Task, genotypes) -> tuple[Any, Any]:
    """Score the whole batch in one call: ``jax.jit(jax.vmap(task.score))`` (compiled once
    per task and batch shape; inside another jitted function it is inlined).

    ``genotypes`` (batch, task.dim) must lie in [0, 1] (NaN or values outside are refused,
    not clipped; under ``jax.jit`` only the shape can be checked)."""
    _genotypes(_check_task(task), genotypes)
    return _jit_batch(task)(genotypes)


@functools.lru_cache(maxsize=16)
def _jit_batch(task: Task) -> Callable:
    import jax

    return jax.jit(jax.vmap(task.score))


# --- insertion: serial reference and one scatter ------------------------------------------

def _check_insert(archive: Any, genotypes: Any, fitness: Any, descriptors: Any) -> None:
    """A batch of ``b`` children for ``archive``: genotypes (b, dim), fitness (b,) without
    NaN or +inf (-inf: a child that never enters), descriptors (b, n_desc) in [0, 1]."""
    if not isinstance(archive, Archive):
        raise TypeError(f"archive must be a qd Archive (empty_archive, insert), got "
                        f"{type(archive).__name__}")
    cells = _array("archive.fitness", archive.fitness, (None,)).shape[0]
    dim = _array("archive.genotypes", archive.genotypes, (cells, None)).shape[1]
    n_desc = _array("archive.descriptors", archive.descriptors, (cells, None)).shape[1]
    if n_desc < 1 or archive.cells_per_dim ** n_desc != cells:
        raise ValueError(f"archive must hold cells_per_dim**n_desc cells (n_desc >= 1), got "
                         f"{cells} cells of {n_desc}-dimensional descriptors")
    _array("genotypes", genotypes, (None, dim))
    _array("fitness", fitness, (None,))
    _array("descriptors", descriptors, (None, n_desc))
    if not genotypes.shape[0] == fitness.shape[0] == descriptors.shape[0]:
        raise ValueError(f"genotypes, fitness and descriptors must hold one row per child, got "
                         f"{genotypes.shape[0]}, {fitness.shape[0]} and {descriptors.shape[0]}")
    _values("fitness", fitness, neg_inf=True)
    _values("genotypes", genotypes)
    _values("descriptors", descriptors, unit=True)


def insert_loop(archive: Archive, genotypes, fitness, descriptors) -> Archive:
    """Serial reference: children one at a time, in order; each replaces a strictly worse elite.

    Same arguments as :func:`insert`."""
    import jax.numpy as jnp

    _check_insert(archive, genotypes, fitness, descriptors)

    fit = np.array(archive.fitness)
    gen = np.array(archive.genotypes)
    desc = np.array(archive.descriptors)
    cells = np.asarray(_jit_cell_index(descriptors, archive.cells_per_dim))
    fitness, genotypes, descriptors = (np.asarray(a) for a in (fitness, genotypes, descriptors))
    for i, c in enumerate(cells):
        if fitness[i] > fit[c]:
            fit[c], gen[c], desc[c] = fitness[i], genotypes[i], descriptors[i]
    return Archive(jnp.asarray(fit), jnp.asarray(gen), jnp.asarray(desc))


def _jit_cell_index(descriptors, cells_per_dim: int):
    """:func:`cell_index` as one compiled program (eagerly it compiles one per operation)."""
    return _jitted()["cell_index"](descriptors, cells_per_dim)  # checked by the caller


@functools.cache
def _jitted() -> dict[str, Callable]:
    import jax

    return {"cell_index": jax.jit(_cell_index, static_argnums=1), "insert": jax.jit(_insert)}


def insert(archive: Archive, genotypes, fitness, descriptors) -> Archive:
    """Insert a whole batch at once; equal to :func:`insert_loop`.

    Per cell, the batch's best child (the first one on ties, as in the loop) replaces the
    elite if strictly better. A cell's fitness can therefore never go down. One jitted
    program per shape (inlined when called inside another jitted function).

    ``genotypes`` (b, dim), ``fitness`` (b,) and ``descriptors`` (b, n_desc) match the
    archive's shapes; fitness holds no NaN or +inf (a child of fitness -inf never enters:
    an empty cell has -inf), descriptors lie in [0, 1] (see :func:`cell_index`). Under
    ``jax.jit`` only the shapes can be checked.
    """
    _check_insert(archive, genotypes, fitness, descriptors)
    return _jitted()["insert"](archive, genotypes, fitness, descriptors)


def _insert(archive: Archive, genotypes, fitness, descriptors) -> Archive:
    import jax
    import jax.numpy as jnp

    n_cells, batch = archive.fitness.shape[0], fitness.shape[0]
    cells = _cell_index(descriptors, archive.cells_per_dim)
    best = jax.ops.segment_max(fitness, cells, num_segments=n_cells)
    winner_mask = (fitness == best[cells]) & (fitness > archive.fitness[cells])
    # Lowest batch index among the children that tie for their cell's best.
    order = jnp.where(winner_mask, jnp.arange(batch), batch)
    first = jax.ops.segment_min(order, cells, num_segments=n_cells)
    is_winner = winner_mask & (first[cells] == jnp.arange(batch))
    # Losers write to an out-of-range row, which mode="drop" discards.
    target = jnp.where(is_winner, cells, n_cells)
    return Archive(archive.fitness.at[target].set(fitness, mode="drop"),
                   archive.genotypes.at[target].set(genotypes, mode="drop"),
                   archive.descriptors.at[target].set(descriptors, mode="drop"))


# --- selection and variation --------------------------------------------------------------

def isoline_variation(key, x1, x2, iso_sigma: float, line_sigma: float):
    """Iso+line: ``x1 + iso_sigma N(0, I) + line_sigma N(0, 1) (x2 - x1)``, clipped to [0, 1].

    The clip is the operator's definition (QDax's ``isoline_variation`` with ``minval=0,
    maxval=1``): children stay in the genotype space. ``key``: one JAX PRNG key (a typed
    key, or a raw ``uint32`` pair); ``x1``, ``x2``: parents (batch, dim) in [0, 1], of the
    same shape; ``iso_sigma``, ``line_sigma`` >= 0.
    """
    _check_key("key", key)
    _array("x1", x1, (None, None))
    _array("x2", x2, tuple(x1.shape))
    _values("x1", x1, unit=True)
    _values("x2", x2, unit=True)
    iso_sigma = check_float("iso_sigma", iso_sigma, lo=0)
    line_sigma = check_float("line_sigma", line_sigma, lo=0)
    return _isoline_variation(key, x1, x2, iso_sigma, line_sigma)


def _isoline_variation(key, x1, x2, iso_sigma: float, line_sigma: float):
    """:func:`isoline_variation` without the checks (traced inside the MAP-Elites step)."""
    import jax
    import jax.numpy as jnp

    k_iso, k_line = jax.random.split(key)
    iso = iso_sigma * jax.random.normal(k_iso, x1.shape)
    line = line_sigma * jax.random.normal(k_line, (x1.shape[0], 1))
    return jnp.clip(x1 + iso + line * (x2 - x1), 0.0, 1.0)


def _sample_parents(key, archive: Archive, n: int):
    import jax
    import jax.numpy as jnp

    filled = jnp.isfinite(archive.fitness)
    idx = jax.random.choice(key, archive.fitness.shape[0], (n,), p=filled / filled.sum())
    return archive.genotypes[idx]


def qd_metrics(archive: Archive, fitness_floor: float) -> dict[str, Any]:
    """QD-score (sum over filled cells of ``fitness - fitness_floor``), coverage, best fitness."""
    import jax.numpy as jnp

    if not isinstance(archive, Archive):
        raise TypeError(f"archive must be a qd Archive (empty_archive, insert), got "
                        f"{type(archive).__name__}")
    fitness_floor = check_float("fitness_floor", fitness_floor)
    filled = jnp.isfinite(archive.fitness)
    return {"qd_score": jnp.sum(jnp.where(filled, archive.fitness - fitness_floor, 0.0)),
            "coverage": jnp.mean(filled),
            "max_fitness": jnp.max(archive.fitness)}


# --- the MAP-Elites loop --------------------------------------------------------------------

@dataclass
class MapElitesResult:
    """Archive and curves of one run. ``wall_s`` excludes compile time (``compile_s``)."""

    archive: Archive
    evaluations: np.ndarray
    qd_score: np.ndarray
    coverage: np.ndarray
    wall_s: np.ndarray
    compile_s: float
    batch_size: int
    device: str
    engine: str = "parlearn"

    @property
    def evals_per_s(self) -> float:
        """Evaluations per second after compilation (the initial batch excluded)."""
        return float((self.evaluations[-1] - self.evaluations[0]) / self.wall_s[-1])


def _check_run(task, batch_size, budget, cells_per_dim, iso_sigma, line_sigma, seed, records):
    if not isinstance(task, Task):
        raise TypeError(f"task must be a parlearn.qd.Task, got {type(task).__name__}")
    batch_size = check_int("batch_size", batch_size, lo=1)
    budget = check_int("budget", budget, lo=1)
    if budget < 2 * batch_size:
        raise ValueError(f"budget must be >= 2 * batch_size = {2 * batch_size} (one initial "
                         f"batch and one MAP-Elites step), got {budget}")
    check_int("cells_per_dim", cells_per_dim, lo=1)
    check_float("iso_sigma", iso_sigma, lo=0)
    check_float("line_sigma", line_sigma, lo=0)
    check_int("seed", seed, lo=0)
    check_int("records", records, lo=1)
    return (budget - batch_size) // batch_size


def map_elites(task: Task, *, batch_size: int, budget: int, cells_per_dim: int = 32,
               iso_sigma: float = 0.005, line_sigma: float = 0.05, seed: int = 0,
               records: int = 20) -> MapElitesResult:
    """Run MAP-Elites for ``budget`` evaluations, ``batch_size`` children per step.

    The first batch is uniform random; then ``(budget - batch_size) // batch_size`` steps
    of select / vary / score / insert, compiled with ``jax.jit`` and run in about
    ``records`` chunks (one ``lax.fori_loop`` each), timed after compilation. Returns the curves
    at the chunk boundaries. Seeded: the same arguments give the same archive.
    """
    import jax

    steps = _check_run(task, batch_size, budget, cells_per_dim, iso_sigma, line_sigma, seed,
                       records)
    key_init, key_run = jax.random.split(jax.random.key(seed))
    run_steps = _map_elites_programs(task, batch_size, cells_per_dim, float(iso_sigma),
                                     float(line_sigma))
    archive, m = _first_batch_program(task, cells_per_dim, _first_batch_pad(batch_size))(
        key_init, batch_size)
    _check_first_batch(task, archive)
    # Compile before the clock starts (one program for every chunk: the loop bounds are
    # traced; a call with no steps compiles it, or finds it in jit's cache): compile time
    # is reported apart, never mixed into the throughput.
    t0 = time.perf_counter()
    jax.block_until_ready(run_steps(archive, key_run, 0, 0))
    compile_s = time.perf_counter() - t0
    bounds = np.linspace(0, steps, min(records, steps) + 1).round().astype(int)
    evals, qd, cov, wall = [batch_size], [float(m["qd_score"])], [float(m["coverage"])], [0.0]
    t0 = time.perf_counter()
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        archive, m = run_steps(archive, key_run, int(start), int(stop))
        qd.append(float(m["qd_score"]))  # float() waits for the chunk to finish
        wall.append(time.perf_counter() - t0)
        cov.append(float(m["coverage"]))
        evals.append(batch_size * (1 + int(stop)))
    return MapElitesResult(archive, np.array(evals), np.array(qd), np.array(cov),
                           np.array(wall), compile_s, batch_size, str(jax.devices()[0]))


def _check_first_batch(task: Task, archive: Archive) -> None:
    """A Task of one's own must keep its word (the jitted steps cannot check values): after
    the first batch, some cell is filled, no fitness is +inf and every stored descriptor
    lies in [0, 1]. (arm_task and rastrigin_task always pass.)"""
    fit, desc = np.asarray(archive.fitness), np.asarray(archive.descriptors)
    filled = fit > -np.inf
    if not filled.any() or np.isposinf(fit).any():
        raise ValueError(f"task {task.name!r} must return finite fitness values: the first "
                         f"batch filled {int(np.isfinite(fit).sum())} cells (NaN never enters)")
    d = desc[filled]
    if np.isnan(d).any() or d.min() < 0 or d.max() > 1:
        raise ValueError(f"task {task.name!r} must return descriptors in [0, 1], got values "
                         f"from {np.nanmin(d)} to {np.nanmax(d)} in the first batch")


@functools.lru_cache(maxsize=16)
def _map_elites_programs(task, batch_size, cells_per_dim, iso_sigma, line_sigma):
    """The jitted MAP-Elites steps of a run, kept so that a rerun (another seed) skips compiling."""
    import jax

    def step(i, carry):
        archive, key = carry
        k_p1, k_p2, k_var = jax.random.split(jax.random.fold_in(key, i), 3)
        x1 = _sample_parents(k_p1, archive, batch_size)
        x2 = _sample_parents(k_p2, archive, batch_size)
        children = _isoline_variation(k_var, x1, x2, iso_sigma, line_sigma)
        fitness, desc = _jit_batch(task)(children)
        return _insert(archive, children, fitness, desc), key

    def run_steps(archive, key, start, stop):
        archive, _ = jax.lax.fori_loop(start, stop, step, (archive, key))
        return archive, qd_metrics(archive, task.fitness_floor)

    return jax.jit(run_steps)


def _first_batch_pad(batch_size: int) -> int:
    """Rows the first-batch program draws: at least 4096, so one program serves them all."""
    return max(4096, 1 << (batch_size - 1).bit_length())


@functools.lru_cache(maxsize=16)
def _first_batch_program(task, cells_per_dim, pad):
    """``first_batch(key, n)``: ``n`` uniform genotypes inserted into an empty archive.

    It draws ``pad`` rows and gives rows ``n`` onwards fitness -inf, which never enters a
    cell (insertion needs a strictly better fitness than an empty cell's -inf), so one
    compiled program serves every ``n <= pad``. With JAX's default partitionable threefry
    the first ``n`` rows of ``uniform(key, (pad, dim))`` are ``uniform(key, (n, dim))``, so
    the archive equals the unpadded one (the tests check it).
    """
    import jax
    import jax.numpy as jnp

    def first_batch(key, n):
        x = jax.random.uniform(key, (pad, task.dim))
        fitness, desc = _jit_batch(task)(x)
        fitness = jnp.where(jnp.arange(pad) < n, fitness, -jnp.inf)
        archive = _insert(empty_archive(task, cells_per_dim), x, fitness, desc)
        return archive, qd_metrics(archive, task.fitness_floor)

    return jax.jit(first_batch)
