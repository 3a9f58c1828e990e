"""The argument contract of the Parts 2-4 functions that start JAX (or live beside them):
qd, rl, eigengame, and decoding's mean-field kernel (see harness.py).

Starting JAX starts threads, and a later fork of this process (gloo ranks) would then warn
or deadlock, so every test here runs in a child pytest (``fresh_process``, tests/conftest.py).
This module's top level is still imported by the main process to collect it (and by
test_completeness.py): it imports no JAX, and its ``good()`` builders make NumPy arrays and
Python numbers only, never JAX arrays.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from harness import Case, contract_tests

pytestmark = pytest.mark.fresh_process


def _x(n=8, d=3, seed=0):
    """A seeded float64 data matrix (n, d)."""
    return np.random.default_rng(seed).standard_normal((n, d))


def _v(d=3, k=2, seed=1):
    return np.random.default_rng(seed).standard_normal((d, k))


def _nan(a):
    a = a.copy()
    a.flat[0] = math.nan
    return a


def _dense_coupling():
    from parlearn.many_copies.decoding.mean_field import overlap_coupling_dense
    return overlap_coupling_dense


def _dqn_config():
    from parlearn.elsewhere.value.dqn import DQNConfig
    return DQNConfig(env_steps=40, num_envs=2, max_steps=10, hidden=4, batch=4, learn_start=8)


def _phrase():
    from parlearn.many_copies.diffusion import PairedPhrase
    return PairedPhrase(slots=2, m=2)


def _rastrigin():
    from parlearn.many_copies.qd.search import rastrigin_task
    return rastrigin_task(2)


def _archive():
    """Four cells, two filled (fitness 0.5 and 2.0), as NumPy arrays."""
    from parlearn.many_copies.qd.search import Archive
    fit = np.array([0.5, -np.inf, 2.0, -np.inf], dtype=np.float32)
    return Archive(fit, np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32))


def _ppo_result():
    """Returns 1 then 5 at 10 and 20 env steps (0.1 s and 0.2 s), no evaluations."""
    from parlearn.many_copies.rl.ppo import PPOConfig, PPOResult
    return PPOResult({}, np.array([10, 20]), np.array([1.0, 5.0]), np.array([np.nan, np.nan]),
                     np.array([0.1, 0.2]), 0.0, PPOConfig(), "cartpole", "cpu")


def _cosines_in_unit(result, kw):
    assert result.shape == kw["v"].shape[-1:] and np.all((result >= 0) & (result <= 1 + 1e-12))


def _orthonormal_top(result, kw):
    """The eigenvectors are orthonormal, decreasing, and satisfy M u = lambda u."""
    lam, u = result
    m = kw["x"].T @ kw["x"] / kw["x"].shape[0]
    np.testing.assert_allclose(u.T @ u, np.eye(kw["k"]), atol=1e-12)
    np.testing.assert_allclose(m @ u, u * lam, atol=1e-12)
    assert np.all(np.diff(lam) <= 0)


def _probs(b=2, length=3, v=4, seed=0):
    """(b, length, v) float64 softmax distributions (none sure enough to be decoupled)."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(b, length, v, generator=g, dtype=torch.float64), -1)


def _mask():
    """(2, 3) with one unmasked position."""
    m = torch.ones(2, 3, dtype=torch.bool)
    m[1, 0] = False
    return m


def _conf():
    return torch.rand(2, 3, generator=torch.Generator().manual_seed(3),
                      dtype=torch.float64) * 0.8 + 0.1


def _overlap_ok(result, kw, symmetric=True):
    """Values in [0, 1], 1 on the diagonal (JSD(p, p) = 0), symmetric when nothing is cut."""
    b, length, _ = kw["probs"].shape
    assert result.shape == (b, length, length) and bool(((result >= 0) & (result <= 1)).all())
    torch.testing.assert_close(result.diagonal(dim1=1, dim2=2),
                               torch.ones(b, length, dtype=result.dtype), atol=1e-9, rtol=0)
    if symmetric:
        torch.testing.assert_close(result, result.transpose(1, 2), atol=1e-12, rtol=0)


def _top_k_overlap(result, kw):
    """Cut or not, an overlap; with nothing cut (top_k >= V), the dense form."""
    from parlearn.many_copies.decoding.mean_field import overlap_coupling_dense
    _overlap_ok(result, kw, symmetric=False)
    if kw["top_k"] >= kw["probs"].shape[-1]:
        torch.testing.assert_close(result, overlap_coupling_dense(kw["probs"], kw["masked"]),
                                   atol=1e-9, rtol=0)


def _coupling(result, kw):
    """lam * overlap * exp(-|i - j| / length_scale) (no position here is sure)."""
    pos = torch.arange(3, dtype=torch.float64)
    kernel = torch.exp(-(pos[:, None] - pos[None, :]).abs() / kw["length_scale"])
    want = kw["lam"] * kw["coupling"](kw["probs"], kw["masked"]) * kernel
    torch.testing.assert_close(result, want, atol=1e-12, rtol=0)


def _auto_tau(result, kw):
    """logit(tau) = logit(min c over the masked positions of the row) - 1."""
    c = kw["conf"].masked_fill(~kw["masked"], 2.0).min(-1).values
    torch.testing.assert_close(result, torch.sigmoid(torch.logit(c) - 1), atol=1e-12, rtol=0)


def _uncoupled(result, kw):
    """J = 0: q = sigmoid(beta (logit c - logit tau)) on the mask, 0 off it: c > tau commits."""
    commit, q, _, _ = result
    c, m, tau = kw["conf"], kw["masked"], kw["tau"]
    want = torch.sigmoid(kw["beta"] * (torch.logit(c) - math.log(tau / (1 - tau)))) * m
    torch.testing.assert_close(q, want, atol=1e-12, rtol=0)
    assert torch.equal(commit, (c > tau) & m)


def _same_data(result, kw):
    from parlearn.many_copies.eigengame.inputs import synthetic_data
    np.testing.assert_array_equal(result, synthetic_data(kw["n"], kw["d"]))


OPEN_BOTH = [0.0, 1.0, -0.5, 1.5]
POSITIVE = [0.0, -1.0]
BAD_X = [np.zeros((8, 3), dtype=np.int64), _nan(_x()), _x()[0], np.zeros((0, 3))]
BAD_PROBS = [_probs()[0], torch.zeros(2, 3, 4, dtype=torch.int64), _probs() * 2, -_probs(),
             torch.zeros(2, 3, 0, dtype=torch.float64),
             torch.tensor([1.5, -0.5, 0, 0], dtype=torch.float64).expand(2, 3, 4)]  # sums 1
BAD_MASK = [torch.ones(2, 3), torch.ones(2, 4, dtype=torch.bool), torch.ones(3, dtype=torch.bool)]
BAD_MESH = [(1,), (0, 1), (1, True), 1, "11", (3, 1), (1, 3)]

CASES: list[Case] = [
    Case("parlearn.many_copies.eigengame.inputs.synthetic_data",
         lambda: dict(n=8, d=3, decay=0.7, seed=0),
         ranges={"n": (2, None), "d": (1, None), "seed": (0, None)},
         bad={"decay": OPEN_BOTH}),
    Case("parlearn.many_copies.eigengame.inputs.init_vectors",
         lambda: dict(d=3, k=2, seed=0),
         ranges={"d": (2, None), "k": (1, 3), "seed": (0, None)},
         check=lambda r, kw: np.testing.assert_allclose(np.linalg.norm(r, axis=0), 1.0)),
    Case("parlearn.many_copies.eigengame.inputs.top_eigenvectors",
         lambda: dict(x=_x(), k=2), ranges={"k": (1, 3)}, bad={"x": BAD_X},
         check=_orthonormal_top),
    Case("parlearn.many_copies.eigengame.inputs.abs_cosines",
         lambda: dict(v=_v(), u=_v(seed=2)),
         bad={"v": [_v(4, 2), _v()[0], _nan(_v()), np.zeros((3, 2), dtype=np.int64)],
              "u": [_v(3, 3), _nan(_v())]},
         check=_cosines_in_unit),
    Case("parlearn.many_copies.eigengame.inputs.longest_streak",
         lambda: dict(v=_v(), u=_v(seed=2), angle=0.3),
         bad={"v": [_v(4, 2), _nan(_v())], "u": [_v(3, 3)],
              "angle": [0.0, -0.1, math.pi / 2 + 1e-9, 10.0]}),

    # DQN steps parlearn.rl's cart-pole, a JAX environment: runs too long for run_good,
    # but every refusal comes before JAX starts.
    Case("parlearn.elsewhere.value.dqn.train",
         lambda: dict(config=_dqn_config(), seed=0, progress=None, threads=1),
         ranges={"seed": (0, None), "threads": (1, None)},
         bad={"config": ["dqn", None], "progress": [3]},
         legal={"progress": [None], "threads": [None]}, run_good=False),
    Case("parlearn.elsewhere.value.dqn.compare_variants",
         lambda: dict(variants=["dqn"], seeds=[0], config=_dqn_config(), progress=None,
                      threads=1),
         ranges={"threads": (1, None)},
         bad={"variants": [[], ["nope"], "dqn", [True]], "seeds": [[], [-1], [True], 0],
              "config": ["dqn"], "progress": [3]},
         legal={"config": [None], "progress": [None], "threads": [None]}, run_good=False),

    # mean field runs its JAX kernel: refusals only (each comes before any decoding)
    Case("parlearn.many_copies.decoding.measure.family_table",
         lambda: dict(languages=[_phrase()], batch=2, seed=0, target=0.95, taus=(0.5,)),
         ranges={"batch": (1, None), "seed": (0, None), "target": (0.0, 1.0)},
         bad={"languages": [[], "l", [3]], "taus": [(), (0.0,), (1.0,), (True,), 0.5]},
         run_good=False),
    Case("parlearn.many_copies.rl.ppo.PPOConfig",
         lambda: dict(num_envs=4, num_steps=4, updates=1, epochs=1, minibatches=2, gamma=0.99,
                      lam=0.95, clip=0.2, lr=2.5e-3, ent_coef=0.01, vf_coef=0.5,
                      max_grad_norm=0.5, hidden=4),
         ranges={"num_envs": (1, None), "num_steps": (1, None), "updates": (1, None),
                 "epochs": (1, None), "gamma": (0.0, 1.0), "lam": (0.0, 1.0),
                 "ent_coef": (0.0, None), "vf_coef": (0.0, None), "hidden": (1, None)},
         bad={"minibatches": [0, 3, 32], "clip": POSITIVE, "lr": POSITIVE,
              "max_grad_norm": POSITIVE},
         legal={}),
    Case("parlearn.many_copies.eigengame.game.direction",
         lambda: dict(v=_v(), x=_x(), method="mu"),
         bad={"v": [_v(4, 2), _nan(_v()), _v(3, 4)], "x": BAD_X, "method": ["oja"]}),
    Case("parlearn.many_copies.eigengame.game.update",
         lambda: dict(v=_v(), x=_x(), lr=0.1, method="mu"),
         bad={"v": [_v(4, 2), _nan(_v())], "x": BAD_X, "lr": POSITIVE},
         check=lambda r, kw: np.testing.assert_allclose(np.linalg.norm(r, axis=0), 1.0)),
    Case("parlearn.many_copies.eigengame.game.minibatch_bias",
         lambda: dict(v=_v(), x=_x(), batch=2, samples=8, method="mu", seed=0),
         ranges={"batch": (1, None), "samples": (2, None), "seed": (0, None)},
         bad={"v": [_v(4, 2)], "x": BAD_X, "method": ["oja"]}),
    Case("parlearn.many_copies.qd.search.arm_task", lambda: dict(dofs=3),
         ranges={"dofs": (1, None)}),
    Case("parlearn.many_copies.qd.search.rastrigin_task", lambda: dict(dim=3),
         ranges={"dim": (2, None)}),
    Case("parlearn.many_copies.qd.search.empty_archive",
         lambda: dict(task=_rastrigin(), cells_per_dim=4),
         ranges={"cells_per_dim": (1, None)}, bad={"task": ["task", 3]},
         check=lambda r, kw: None if r.fitness.shape == (kw["cells_per_dim"] ** 2,)
         else pytest.fail(f"{r.fitness.shape}")),
    Case("parlearn.many_copies.eigengame.devices.collective_bytes",
         lambda: dict(x=_x(), k=2, mesh_shape=(1, 1), batch=4, method="mu"),
         ranges={"k": (1, 3), "batch": (1, 8)},
         bad={"x": BAD_X, "mesh_shape": [(1,), (1, 1, 1), 1, (0, 1), (1, True)],
              "method": ["oja"]},
         run_good=False),  # an XLA compile per call
    Case("parlearn.many_copies.eigengame.training.fit",
         lambda: dict(x=_x(), k=2, method="mu", batch=None, lr=0.1, steps=2, record_every=None,
                      seed=0, v0=None),
         ranges={"k": (1, 3), "batch": (1, 8), "steps": (1, None), "seed": (0, None)},
         bad={"x": BAD_X, "method": ["oja"], "lr": POSITIVE, "record_every": [0, 3],
              "v0": [_v(4, 2), _v(3, 3), _nan(_v())]},
         legal={"batch": [None], "record_every": [None], "v0": [None]},
         run_good=False),  # an XLA compile per call
    Case("parlearn.many_copies.rl.envs.cartpole", lambda: dict(max_steps=10),
         ranges={"max_steps": (1, None)}),
    Case("parlearn.many_copies.qd.search.qd_metrics",
         lambda: dict(archive=_archive(), fitness_floor=-1.0),
         bad={"archive": ["a", (np.zeros(3),)]},
         check=lambda r, kw: np.testing.assert_allclose(
             [float(r["qd_score"]), float(r["coverage"]), float(r["max_fitness"])],
             [(0.5 - kw["fitness_floor"]) + (2.0 - kw["fitness_floor"]), 0.5, 2.0], rtol=1e-6)),
    Case("parlearn.many_copies.rl.ppo.time_to_target",
         lambda: dict(result=_ppo_result(), target=3.0),
         bad={"result": ["r", None]},
         check=lambda r, kw: None if r == (0.2, 20) else pytest.fail(f"{r}")),
]

CASES += [
    # decoding's mean field: the couplings (torch) and the fixed point (a JAX kernel on CPU)
    Case("parlearn.many_copies.decoding.mean_field.overlap_coupling_dense",
         lambda: dict(probs=_probs(), masked=_mask()),
         bad={"probs": BAD_PROBS, "masked": BAD_MASK}, check=_overlap_ok),
    Case("parlearn.many_copies.decoding.mean_field.overlap_coupling",
         lambda: dict(probs=_probs(), masked=_mask(), top_k=4),
         ranges={"top_k": (1, None)}, bad={"probs": BAD_PROBS, "masked": BAD_MASK},
         check=_top_k_overlap),
    Case("parlearn.many_copies.decoding.mean_field.coupling_matrix",
         lambda: dict(probs=_probs(), masked=_mask(), lam=2.0, coupling=_dense_coupling(),
                      length_scale=1.5),
         ranges={"lam": (0.0, None)},
         bad={"probs": BAD_PROBS, "masked": BAD_MASK, "length_scale": POSITIVE,
              "coupling": ["overlap", 3, lambda p, m: torch.ones(1),
                           lambda p, m: -torch.ones(2, 3, 3)]},
         legal={"length_scale": [None]}, check=_coupling),
    Case("parlearn.many_copies.decoding.mean_field.auto_tau",
         lambda: dict(conf=_conf(), masked=_mask()),
         bad={"conf": [_conf()[0], _conf() + 1, -_conf(), torch.ones(2, 3, dtype=torch.int64),
                       torch.rand(2, 4, dtype=torch.float64)], "masked": BAD_MASK},
         check=_auto_tau),
    Case("parlearn.many_copies.decoding.mean_field.mean_field_commit",
         lambda: dict(conf=_conf(), J=torch.zeros(2, 3, 3, dtype=torch.float64), masked=_mask(),
                      tau=0.5, beta=8.0, eta=0.5, tol=1e-7, max_iter=200),
         ranges={"max_iter": (1, None)},
         bad={"conf": [_conf() + 1, _conf()[0]], "masked": BAD_MASK,
              "J": [torch.zeros(2, 3, 3), torch.zeros(2, 3, 4, dtype=torch.float64),
                    -torch.ones(2, 3, 3, dtype=torch.float64)],
              "tau": [0.0, 1.0, -0.1, 1.5, torch.tensor([0.5], dtype=torch.float64),
                      torch.tensor([0.0, 0.5], dtype=torch.float64)],
              "beta": POSITIVE, "eta": [0.0, -0.1, 1.5], "tol": POSITIVE},
         check=_uncoupled),

    # eigengame on a mesh: compiles XLA, or starts a child Python
    Case("parlearn.many_copies.eigengame.training.fit_sharded",
         lambda: dict(x=_x(), k=2, mesh_shape=(1, 1), method="mu", batch=None, lr=0.1, steps=2,
                      record_every=None, seed=0, v0=None),
         ranges={"k": (1, 3), "batch": (1, 8), "steps": (1, None), "seed": (0, None)},
         bad={"x": BAD_X, "mesh_shape": BAD_MESH, "method": ["oja"], "lr": POSITIVE,
              "record_every": [0, 3], "v0": [_v(4, 2), _v(3, 3), _nan(_v())]},
         legal={"batch": [None], "record_every": [None], "v0": [None]},
         run_good=False),  # an XLA compile per call
    Case("parlearn.many_copies.eigengame.devices.compare_sharded",
         lambda: dict(x=_x(), k=2, mesh_shapes=[(1, 1)], method="mu", lr=0.1, steps=2),
         ranges={"k": (1, 3)},
         bad={"x": BAD_X, "mesh_shapes": [[], (1, 1), "1x1", [(1,)], [(0, 1)], [(3, 1)],
                                          [(1, True)]],
              "method": ["oja"], "lr": POSITIVE, "steps": [0, -1]},
         check=lambda r, kw: None if r["max_abs_diff"]["1x1"] <= 1e-12
         else pytest.fail(f"{r['max_abs_diff']}")),
    Case("parlearn.many_copies.eigengame.devices.run_with_devices",
         lambda: dict(n_devices=1, function="synthetic_data", timeout=120.0, n=8, d=3),
         bad={"n_devices": [0, -1], "function": ["bench", "run_with_devices", "os.system"],
              "timeout": POSITIVE},
         skip={"n": "passed on to the child's function, whose own contract checks it",
               "d": "passed on to the child's function, whose own contract checks it"},
         check=_same_data),  # one child Python (no JAX needed by synthetic_data)
    Case("parlearn.many_copies.eigengame.speed.throughput",
         lambda: dict(x=_x(), k=2, batch_sizes=[1, 2], samples=4, method="mu", lr=0.1,
                      repeat=1, dtype="float64", seed=0),
         ranges={"k": (1, 3), "samples": (1, 8), "repeat": (1, None), "seed": (0, None)},
         bad={"x": BAD_X, "batch_sizes": [[], [0], [9], 3, "12", [True]], "samples": [3],
              "method": ["oja"], "lr": POSITIVE, "dtype": ["float16"]},
         run_good=False),  # measures, after an XLA compile
    Case("parlearn.many_copies.eigengame.speed.sharded_throughput",
         lambda: dict(x=_x(), k=2, mesh_shapes=[(1, 1)], batch=4, steps=2, method="mu",
                      lr=0.1, repeat=1, dtype="float64", seed=0),
         ranges={"k": (1, 3), "batch": (1, 8), "steps": (1, None), "repeat": (1, None),
                 "seed": (0, None)},
         bad={"x": BAD_X, "mesh_shapes": [(1, 1), "1x1", [(1,)], [(0, 1)], [(3, 1)]],
              "method": ["oja"], "lr": POSITIVE, "dtype": ["float16"]},
         run_good=False),  # measures, after an XLA compile
]

test_refuses, test_accepts, test_accepts_range = contract_tests(CASES)

COVERED_ELSEWHERE: dict[str, str | list[str]] = {}
EXEMPT: dict[str, str] = {
    "parlearn.many_copies.qd.search.MapElitesResult":
        "a record map_elites() returns; users only read its fields",
    "parlearn.many_copies.rl.ppo.PPOResult":
        "a record train_ppo() returns; users only read its fields",
    "parlearn.many_copies.qd.search.Archive":
        "the archive that empty_archive() and insert() build; users only read it",
    "parlearn.many_copies.qd.search.Task":
        "a record that arm_task() and rastrigin_task() build; the searches take it as built",
    "parlearn.many_copies.rl.envs.Env":
        "a record that cartpole() and gymnax_env() build; the rollouts take it as built",
}

# Public callables whose contract test is still to be written (test_completeness: only shrinks).
PENDING: list[str] = []
