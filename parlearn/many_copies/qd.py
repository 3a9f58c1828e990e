"""MAP-Elites from scratch in JAX: thousands of evaluations at once on one device.

Quality-diversity (QD) search keeps an *archive*: a grid over a descriptor space (for the
planar arm, where the hand ends up), holding in each cell the best solution ever seen
whose descriptor falls there. MAP-Elites (Mouret & Clune 2015) repeats one step:

1. **select** parents uniformly from the filled cells;
2. **vary** them with the iso+line operator (Vassiliades & Mouret 2018)
   ``x' = x1 + sigma_iso * N(0, I) + sigma_line * N(0, 1) * (x2 - x1)``;
3. **score** every child (here one ``jax.vmap`` call over the whole batch);
4. **insert**: each child goes to its cell if it beats the cell's elite, so a cell's
   fitness never goes down.

QDax (Lim et al. 2022, arXiv 2202.01258) runs step 3 for thousands of children at once on
one accelerator and reports that, at an equal number of evaluations, the batch size barely
changes the QD-score. This module measures both claims on the tasks it ships
(:func:`arm_task`, :func:`rastrigin_task`).

Serial references sit beside the parallel pieces: :func:`score_loop` (a Python loop over
the children) beside :func:`score_batch` (vmap), and :func:`insert_loop` (one child at a
time, in order) beside :func:`insert` (a scatter over the whole batch). They agree exactly.

JAX is imported inside the functions, so ``import parlearn.qd`` does not start it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from parlearn.core.checks import check_choice, check_float, check_int

__all__ = ["Task", "arm_task", "rastrigin_task", "Archive", "empty_archive", "cell_index",
           "score_batch", "score_loop", "insert", "insert_loop", "isoline_variation",
           "qd_metrics", "MapElitesResult", "map_elites", "qdax_map_elites",
           "evals_per_second", "bench"]


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

    cells_per_dim = check_int("cells_per_dim", cells_per_dim, lo=1)
    cells = cells_per_dim ** task.n_desc
    return Archive(jnp.full((cells,), -jnp.inf, jnp.float32),
                   jnp.zeros((cells, task.dim), jnp.float32),
                   jnp.zeros((cells, task.n_desc), jnp.float32))


def cell_index(descriptors, cells_per_dim: int):
    """Flat cell index of each descriptor row (first coordinate varies fastest, as in QDax)."""
    import jax.numpy as jnp

    idx = jnp.clip(jnp.floor(descriptors * cells_per_dim), 0, cells_per_dim - 1).astype(jnp.int32)
    strides = cells_per_dim ** jnp.arange(descriptors.shape[-1], dtype=jnp.int32)
    return jnp.sum(idx * strides, axis=-1)


# --- scoring: serial reference and vmap ---------------------------------------------------

def score_loop(task: Task, genotypes) -> tuple[Any, Any]:
    """Serial reference: score one genotype at a time in a Python loop of calls to
    ``jax.jit(task.score)`` (compiled once per task; eager ops cost ~10 ms a genotype)."""
    import jax.numpy as jnp

    single = _jit_score(task)
    out = [single(x) for x in genotypes]
    return jnp.stack([f for f, _ in out]), jnp.stack([d for _, d in out])


@functools.lru_cache(maxsize=16)
def _jit_score(task: Task) -> Callable:
    import jax

    return jax.jit(task.score)


def score_batch(task: Task, genotypes) -> tuple[Any, Any]:
    """Score the whole batch in one call: ``jax.vmap(task.score)``."""
    import jax

    return jax.vmap(task.score)(genotypes)


# --- insertion: serial reference and one scatter ------------------------------------------

def insert_loop(archive: Archive, genotypes, fitness, descriptors) -> Archive:
    """Serial reference: children one at a time, in order; each replaces a strictly worse elite."""
    import jax.numpy as jnp

    fit = np.array(archive.fitness)
    gen = np.array(archive.genotypes)
    desc = np.array(archive.descriptors)
    cells = np.asarray(cell_index(descriptors, archive.cells_per_dim))
    for i, c in enumerate(cells):
        if fitness[i] > fit[c]:
            fit[c], gen[c], desc[c] = fitness[i], genotypes[i], descriptors[i]
    return Archive(jnp.asarray(fit), jnp.asarray(gen), jnp.asarray(desc))


def insert(archive: Archive, genotypes, fitness, descriptors) -> Archive:
    """Insert a whole batch at once; equal to :func:`insert_loop`.

    Per cell, the batch's best child (the first one on ties, as in the loop) replaces the
    elite if strictly better. A cell's fitness can therefore never go down.
    """
    import jax
    import jax.numpy as jnp

    n_cells, batch = archive.fitness.shape[0], fitness.shape[0]
    cells = cell_index(descriptors, archive.cells_per_dim)
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
    """Iso+line: ``x1 + iso_sigma N(0, I) + line_sigma N(0, 1) (x2 - x1)``, clipped to [0, 1]."""
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
    first_batch, run_steps = _map_elites_programs(task, batch_size, cells_per_dim,
                                                  float(iso_sigma), float(line_sigma))
    archive, m = first_batch(key_init)
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


@functools.lru_cache(maxsize=16)
def _map_elites_programs(task, batch_size, cells_per_dim, iso_sigma, line_sigma):
    """The two jitted programs of a run, kept so that a rerun (another seed) skips compiling."""
    import jax

    def step(i, carry):
        archive, key = carry
        k_p1, k_p2, k_var = jax.random.split(jax.random.fold_in(key, i), 3)
        x1 = _sample_parents(k_p1, archive, batch_size)
        x2 = _sample_parents(k_p2, archive, batch_size)
        children = isoline_variation(k_var, x1, x2, iso_sigma, line_sigma)
        fitness, desc = score_batch(task, children)
        return insert(archive, children, fitness, desc), key

    def run_steps(archive, key, start, stop):
        archive, _ = jax.lax.fori_loop(start, stop, step, (archive, key))
        return archive, qd_metrics(archive, task.fitness_floor)

    def first_batch(key):
        x = jax.random.uniform(key, (batch_size, task.dim))
        fitness, desc = score_batch(task, x)
        archive = insert(empty_archive(task, cells_per_dim), x, fitness, desc)
        return archive, qd_metrics(archive, task.fitness_floor)

    return jax.jit(first_batch), jax.jit(run_steps)


def qdax_map_elites(task: Task, *, batch_size: int, budget: int, cells_per_dim: int = 32,
                    iso_sigma: float = 0.005, line_sigma: float = 0.05, seed: int = 0,
                    records: int = 20) -> MapElitesResult:
    """The same run with the ``qdax`` package's MAP-Elites (needs the ``[massive]`` extra).

    Same task, grid, operator and budget as :func:`map_elites`; its QD-score is computed
    with this module's :func:`qd_metrics`, so the two are directly comparable.
    """
    steps = _check_run(task, batch_size, budget, cells_per_dim, iso_sigma, line_sigma, seed,
                       records)
    try:
        from qdax.core.containers.mapelites_repertoire import compute_euclidean_centroids
        from qdax.core.emitters.mutation_operators import isoline_variation as qdax_isoline
        from qdax.core.emitters.standard_emitters import MixingEmitter
        from qdax.core.map_elites import MAPElites
    except ImportError as err:
        raise ImportError("qdax_map_elites needs qdax: pip install 'parlearn[massive]'") from err
    import jax
    import jax.numpy as jnp

    def scoring(genotypes, key):
        fitness, desc = score_batch(task, genotypes)
        return fitness, desc, {}

    def metrics(repertoire):
        return qd_metrics(Archive(repertoire.fitnesses.reshape(-1), repertoire.genotypes,
                                  repertoire.descriptors), task.fitness_floor)

    variation = functools.partial(qdax_isoline, iso_sigma=iso_sigma, line_sigma=line_sigma,
                                  minval=0.0, maxval=1.0)
    emitter = MixingEmitter(mutation_fn=None, variation_fn=variation, variation_percentage=1.0,
                            batch_size=batch_size)
    algo = MAPElites(scoring_function=scoring, emitter=emitter, metrics_function=metrics)
    centroids = compute_euclidean_centroids((cells_per_dim,) * task.n_desc, 0.0, 1.0)
    key = jax.random.key(seed)
    key, k_init, k_algo = jax.random.split(key, 3)
    x0 = jax.random.uniform(k_init, (batch_size, task.dim))
    repertoire, emitter_state, _ = algo.init(x0, centroids, k_algo)

    def run_steps(repertoire, emitter_state, key, n):
        def body(_, carry):
            rep, es, k = carry
            k, sub = jax.random.split(k)
            rep, es, _ = algo.update(rep, es, sub)
            return rep, es, k
        repertoire, emitter_state, key = jax.lax.fori_loop(
            0, n, body, (repertoire, emitter_state, key))
        return repertoire, emitter_state, key, metrics(repertoire)

    t0 = time.perf_counter()
    compiled = jax.jit(run_steps).lower(repertoire, emitter_state, key, 1).compile()
    compile_s = time.perf_counter() - t0
    bounds = np.linspace(0, steps, min(records, steps) + 1).round().astype(int)
    m = metrics(repertoire)
    evals, qd, cov, wall = [batch_size], [float(m["qd_score"])], [float(m["coverage"])], [0.0]
    t0 = time.perf_counter()
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        repertoire, emitter_state, key, m = compiled(repertoire, emitter_state, key,
                                                     int(stop - start))
        qd.append(float(m["qd_score"]))
        wall.append(time.perf_counter() - t0)
        cov.append(float(m["coverage"]))
        evals.append(batch_size * (1 + int(stop)))
    archive = Archive(jnp.asarray(repertoire.fitnesses).reshape(-1), repertoire.genotypes,
                      repertoire.descriptors)
    return MapElitesResult(archive, np.array(evals), np.array(qd), np.array(cov),
                           np.array(wall), compile_s, batch_size, str(jax.devices()[0]),
                           engine="qdax")


# --- throughput: the vmap curve -----------------------------------------------------------

def evals_per_second(task: Task, batch_sizes, *, repeat: int = 5, seed: int = 0,
                     mode: str = "vmap") -> dict:
    """Measured evaluations per second of scoring a batch, for each batch size.

    ``mode="vmap"``: one jitted ``vmap`` call per batch; ``mode="loop"``: a jitted single
    evaluation called once per genotype from Python (what a serial user writes).
    Compile time is excluded and reported (``compile_s``). Returns ``{"batch_sizes",
    "evals_per_s", "spread", "compile_s", "device", "mode"}``.
    """
    import jax

    from parlearn.core.timing import measure

    mode = check_choice("mode", mode, ("vmap", "loop"))
    check_int("repeat", repeat, lo=1)
    sizes = [check_int("batch_sizes[i]", b, lo=1) for b in batch_sizes]
    if not sizes:
        raise ValueError("batch_sizes must hold at least one batch size")
    batched = jax.jit(lambda x: score_batch(task, x))
    single = jax.jit(task.score)
    out: dict = {"batch_sizes": sizes, "evals_per_s": [], "spread": [], "compile_s": [],
                 "device": str(jax.devices()[0]), "mode": mode}
    for i, b in enumerate(sizes):
        x = jax.random.uniform(jax.random.key(seed + i), (b, task.dim))
        t0 = time.perf_counter()
        if mode == "vmap":
            fn = batched.lower(x).compile()
            call = lambda fn=fn, x=x: jax.block_until_ready(fn(x))  # noqa: E731
        else:
            fn = single.lower(x[0]).compile()
            rows = list(x)
            call = lambda fn=fn, rows=rows: jax.block_until_ready([fn(r) for r in rows])  # noqa: E731
        out["compile_s"].append(time.perf_counter() - t0)
        t = measure(call, warmup=1, repeat=repeat)
        out["evals_per_s"].append(b / t.median)
        out["spread"].append(t.spread)
    return out


def _bench_rows(quick: bool) -> list:
    """Arm scoring of ``big`` genotypes: one vmap call vs a Python loop of jitted single
    evaluations (timed interleaved); MAP-Elites QD-score at batch 64 vs 4096, same budget.

    Runs in a fresh interpreter through :func:`bench`.
    """
    import jax

    from parlearn.core.bench import Row
    from parlearn.core.timing import compare

    task, big = arm_task(8), (1024 if quick else 4096)
    x = jax.random.uniform(jax.random.key(0), (big, task.dim))
    rows_x = list(x)
    t0 = time.perf_counter()
    single = jax.jit(task.score).lower(x[0]).compile()
    batched = jax.jit(lambda x: score_batch(task, x)).lower(x).compile()
    compile_s = time.perf_counter() - t0
    cmp = compare({"loop": lambda: jax.block_until_ready([single(r) for r in rows_x]),
                   "vmap": lambda: jax.block_until_ready(batched(x))},
                  repeat=3 if quick else 7)
    lo, hi = cmp.speedup_range("vmap")
    dev = str(jax.devices()[0])
    rows = [Row("qd", f"arm scoring, loop of {big} jit calls", f"one vmap call of {big}",
                cmp.speedup("vmap"), dev,
                detail=(f"{big / cmp.timings['loop'].median:.3g} vs "
                        f"{big / cmp.timings['vmap'].median:.3g} evals/s; IQR {lo:.1f}-{hi:.1f}x; "
                        f"compile {compile_s:.2f} s excluded"
                        + ("" if cmp.reliable else "; UNRELIABLE: busy cores")))]
    budget = 4096 * (12 if quick else 100)
    small = map_elites(task, batch_size=64, budget=budget, seed=0)
    large = map_elites(task, batch_size=4096, budget=budget, seed=0)
    rel = large.qd_score[-1] / small.qd_score[-1]
    rows.append(Row("qd", "MAP-Elites batch 64", "batch 4096, same budget", float(rel), dev,
                    target="QD-score ratio within 10% (QDax)", met=bool(abs(rel - 1) <= 0.10),
                    detail=(f"ratio of QD-scores, not times; {budget} evaluations: "
                            f"{small.qd_score[-1]:.1f} vs {large.qd_score[-1]:.1f}; "
                            f"wall {small.wall_s[-1]:.2f} s vs {large.wall_s[-1]:.2f} s "
                            "(compile excluded)")))
    return rows


def bench(device, quick: bool) -> list:
    """The rows of :func:`_bench_rows`, measured in a fresh Python process (JAX must not
    start in the process that forks gloo ranks for other entries), on JAX's default
    device; ``device`` names the torch device of the other benches and is not used."""
    from parlearn.core.bench import rows_in_fresh_process

    return rows_in_fresh_process(__name__, quick)
