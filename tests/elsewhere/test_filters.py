"""The particle filter against the exact grid Bayes filter; the DMU network batched = looped."""

import math

import pytest
import torch

from parlearn.core import device
from parlearn.elsewhere import filters as fl


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny ops: one intra-op thread keeps these tests fast on a busy machine."""
    with device.threads(1):
        yield


def _small(sigma=1.0):
    # a broad likelihood, so that the posterior spreads over many cells and the
    # comparison with the grid filter has something to compare
    return fl.make_world(6, density=0.1, rays=4, sigma=sigma, max_range=5.0, seed=3)


def test_world_scans_are_ray_cast_distances():
    walls = torch.ones(5, 5, dtype=torch.bool)
    walls[1:4, 1:4] = False  # an empty 3 x 3 room
    d = fl.expected_scans(walls, torch.tensor([[1, 2]]), rays=4, max_range=9.0, step=0.01)
    # from the centre (1.5, 2.5): east wall at x=4, north at y=4, west at x=1, south at y=1
    assert torch.allclose(d[0], torch.tensor([2.5, 1.5, 0.5, 1.5], dtype=torch.float64),
                          atol=0.011)


def test_transition_rows_sum_to_one_and_sampling_follows_them():
    world = _small()
    t = fl.transition_matrix(world, move=1, p_slip=0.3)
    assert torch.allclose(t.sum(1), torch.ones(len(world.free), dtype=torch.float64))
    start = torch.full((200_000,), 2)
    nxt = fl.motion_step(world, start, 1, 0.3, seed=0)
    freq = torch.bincount(nxt, minlength=len(world.free)).double() / len(start)
    assert (freq - t[2]).abs().max() < 0.005


def test_measurement_update_on_every_cell_is_the_grid_bayes_update():
    """Particles on every free cell, weighted by the grid filter's predicted belief: one
    measurement update gives the grid filter's posterior exactly (float64)."""
    world = _small()
    sim = fl.simulate(world, 5, p_slip=0.2, seed=1)
    grid = fl.grid_filter(world, sim["moves"], sim["scans"], 0.2)
    predicted = grid[3] @ fl.transition_matrix(world, sim["moves"][4], 0.2)
    cells = torch.arange(len(world.free))
    log_w = fl.measurement_update(torch.log(predicted),
                                  fl.log_likelihood(world, sim["scans"][4], cells))
    assert torch.allclose(torch.exp(log_w), grid[4], rtol=0, atol=1e-14)
    assert grid[4].max() < 0.9  # the posterior is spread: the check is not trivial


def test_log_likelihood_is_the_gaussian_density():
    world = _small(sigma=0.7)
    z = world.scans[1] + 0.1
    normal = torch.distributions.Normal(world.scans[4], 0.7)
    assert math.isclose(float(fl.log_likelihood(world, z, torch.tensor([4]))[0]),
                        float(normal.log_prob(z).sum()), rel_tol=1e-12)


def test_particle_filter_converges_to_the_grid_filter():
    """With the exact likelihood and many particles, the particle posterior is the grid
    posterior up to Monte Carlo error (total variation ~ sqrt(cells / N))."""
    world = _small(sigma=2.5)
    sim = fl.simulate(world, 6, p_slip=0.2, seed=2)
    grid = fl.grid_filter(world, sim["moves"], sim["scans"], 0.2)
    pf = fl.particle_filter(world, sim["moves"], sim["scans"], 0.2, particles=200_000, seed=0)
    for t in range(6):
        hist = fl.posterior_histogram(world, pf["cells"][t], pf["log_w"][t])
        tv = 0.5 * float((hist - grid[t]).abs().sum())
        assert tv < 0.02, f"step {t}: total variation {tv:.3f}"
    assert (grid.max(1).values < 0.8).sum() >= 4  # spread posteriors: not a trivial check


def test_systematic_resampling_copies_each_particle_floor_or_ceil_of_n_w():
    """One shared offset: particle i is copied floor(N w_i) or ceil(N w_i) times, always
    (independent or stratified draws break this)."""
    g = torch.Generator().manual_seed(0)
    for seed in range(30):
        w = torch.rand(50, generator=g, dtype=torch.float64) ** 3
        w = w / w.sum()
        counts = torch.bincount(fl.resample(torch.arange(50), torch.log(w), seed=seed),
                                minlength=50).double()
        assert counts.sum() == 50
        assert (counts >= torch.floor(50 * w)).all() and (counts <= torch.ceil(50 * w)).all()


def test_net_batched_equals_looped():
    world = fl.make_world(8, seed=1)
    net, _ = fl.train_dmu(world, steps=5, batch=16, seed=0)
    z = fl.observe(world, torch.tensor([3]), seed=0)[0]
    cells = torch.randint(len(world.free), (300,), generator=torch.Generator().manual_seed(0))
    batched = fl.net_log_likelihood(net, world, z, cells)
    looped = fl.net_log_likelihood_looped(net, world, z, cells)
    assert batched.shape == (300,)
    assert torch.allclose(batched, looped, rtol=0, atol=1e-5)
    assert batched.std() > 0  # the scores depend on the particle


def test_trained_network_tracks_the_robot():
    """Trained on synthetic scans only, the network's filter tracks far better than a filter
    with no measurement update (a flat likelihood), and its weights leave the user's RNG."""
    world = fl.make_world(10, seed=0)
    state = torch.random.get_rng_state()
    net, losses = fl.train_dmu(world, steps=600, batch=128, seed=0)
    assert torch.equal(state, torch.random.get_rng_state())
    assert sum(losses[-50:]) / 50 < 0.6 * math.log(2)  # well under chance (ln 2)

    def flat(z, cells):
        return torch.zeros(len(cells), dtype=torch.float64)

    kw = {"steps": 16, "runs": 3, "seed": 0}
    err_net = fl.tracking_error(world, 500, likelihood=lambda z, c: fl.net_log_likelihood(
        net, world, z, c), **kw)
    err_flat = fl.tracking_error(world, 500, likelihood=flat, **kw)
    err_exact = fl.tracking_error(world, 500, **kw)
    assert err_net < 0.5 * err_flat, (err_net, err_flat)
    assert err_exact < 0.5 * err_flat


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="size"):
        fl.make_world(2)
    with pytest.raises(TypeError, match="rays"):
        fl.make_world(6, rays=2.0)
    world = _small()
    with pytest.raises(ValueError, match="particles"):
        fl.particle_filter(world, [0], world.scans[:1], 0.1, particles=0)
    with pytest.raises(ValueError, match="z"):
        fl.log_likelihood(world, torch.zeros(3, dtype=torch.float64), torch.tensor([0]))
    with pytest.raises(ValueError, match="p_slip"):
        fl.transition_matrix(world, 0, 1.5)
