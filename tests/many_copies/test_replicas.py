import copy

import pytest
import torch
import zoo

from parlearn.core import datasets, device
from parlearn.many_copies import replicas as rp


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny ops: one intra-op thread keeps these tests fast on a busy machine."""
    with device.threads(1):
        yield


@pytest.fixture(scope="module")
def data():
    return datasets.digits(dtype=torch.float64, n_train=256)


def _models(r=4, shared=False, hidden=16):
    return rp.make_replicas(64, hidden, 10, r, seed=3, shared_init=shared, dtype=torch.float64)


# --- exactness: one batched program equals the loop over R models -------------------------


@pytest.mark.parametrize("per_replica", [False, True])
def test_batched_equals_looped_step_by_step(data, per_replica):
    models = _models()
    params, buffers = rp.stack(models)
    base = copy.deepcopy(models[0])
    if per_replica:
        x, y = rp.convolutional_bootstrap(data.x_train, data.y_train, 4, seed=1)
    else:
        x, y = data.x_train, data.y_train
    for step in range(5):
        idx = torch.arange(step * 32, (step + 1) * 32)
        params = rp.sgd_step_batched(base, params, buffers, x[..., idx, :], y[..., idx], 0.3)
        rp.sgd_step_looped(models, x[..., idx, :], y[..., idx], 0.3)
        ref, _ = rp.stack(models)
        for k in ref:
            torch.testing.assert_close(params[k], ref[k], rtol=0, atol=1e-13)


def test_train_batched_equals_train_looped(data):
    models = _models(3)
    params, buffers = rp.stack(models)
    out = rp.train_batched(models[0], params, buffers, data.x_train, data.y_train, epochs=2,
                           lr=0.2, batch_size=50, seed=7)
    rp.train_looped(models, data.x_train, data.y_train, epochs=2, lr=0.2, batch_size=50,
                    seed=7)
    ref, _ = rp.stack(models)
    assert any((out[k] != params[k]).any() for k in out)  # it did train
    for k in ref:
        torch.testing.assert_close(out[k], ref[k], rtol=0, atol=1e-12)


@pytest.mark.parametrize("bootstrap", ["none", "convolutional"])
def test_instant_learning_looped_equals_batched(bootstrap):
    split = datasets.digits(dtype=torch.float64, n_train=120)
    kw = dict(epochs=1, hidden=8, bootstrap=bootstrap, seed=2)
    a = rp.instant_learning(split, (3,), **kw)["runs"][0]
    b = rp.instant_learning(split, (3,), looped=True, **kw)["runs"][0]
    assert a["replicas"] == b["replicas"] and a["averaged"] == b["averaged"]
    assert a["ensemble_nll"] == pytest.approx(b["ensemble_nll"], rel=1e-10)


def test_steps_leave_grad_and_global_rng_alone(data):
    models = _models(2)
    state = torch.get_rng_state()
    rp.sgd_step_looped(models, data.x_train[:8], data.y_train[:8], 0.1)
    rp.convolutional_bootstrap(data.x_train, data.y_train, 2, seed=0)
    assert all(p.grad is None for m in models for p in m.parameters())
    assert torch.equal(torch.get_rng_state(), state)


# --- pooling --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_ensemble_nll_never_above_mean_replica_nll(seed):
    """Jensen: -log of the mean probability <= the mean of -log p, for any logits."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(7, 40, 10, generator=g, dtype=torch.float64) * 3
    y = torch.randint(10, (40,), generator=g)
    ens, mean = rp.ensemble_nll(logits, y), rp.mean_replica_nll(logits, y)
    assert ens <= mean + 1e-12
    # each value is what it says: -log of the averaged probabilities (not of averaged
    # logits), and the average of the per-replica cross-entropies
    by_hand = -torch.log(torch.stack([lg.softmax(-1) for lg in logits]).mean(0)[
        torch.arange(40), y]).mean().item()
    assert ens == pytest.approx(by_hand, rel=1e-12)
    each = [torch.nn.functional.cross_entropy(lg, y).item() for lg in logits]
    assert mean == pytest.approx(sum(each) / len(each), rel=1e-12)


def test_one_replica_ensemble_is_that_replica():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 30, 10, generator=g, dtype=torch.float64)
    y = torch.randint(10, (30,), generator=g)
    assert rp.ensemble_nll(logits, y) == pytest.approx(rp.mean_replica_nll(logits, y),
                                                       rel=1e-12)
    acc = rp.accuracies(logits, y)
    assert acc["ensemble"] == acc["mean_replica"] == acc["replicas"][0]


def test_seeded_run_ensemble_beats_mean_replica(data):
    """A measured fact on this seeded case (not a theorem for accuracy), and Jensen for CE."""
    split = datasets.digits(dtype=torch.float64, n_train=400, seed=0)
    res = rp.instant_learning(split, (8,), epochs=1, hidden=16, bootstrap="resample", seed=0)
    run = res["runs"][0]
    assert run["ensemble"] >= run["mean_replica"]
    assert run["ensemble_nll"] <= run["mean_replica_nll"]
    assert run["first_k"][0] == run["replicas"][0]
    assert run["first_k"][-1] == run["ensemble"]
    assert run["first_k_vote"][0] == run["replicas"][0]  # one voter: its own argmax


def test_plurality_vote_by_hand():
    # 3 replicas, 1 example, 4 classes: argmaxes 2, 1, 1 -> votes after k = 1, 2, 3.
    logits = torch.tensor([[[0., 0., 5., 0.]], [[0., 5., 0., 0.]], [[0., 5., 0., 0.]]])
    assert rp.plurality_votes(logits)[:, 0].tolist() == [2, 1, 1]  # k=2 ties 1-1: lowest class
    # A plurality can win with far fewer than half the votes when errors spread over classes.
    logits = torch.full((5, 1, 10), 0.0)
    for r, c in enumerate([3, 3, 0, 1, 2]):
        logits[r, 0, c] = 1.0
    assert rp.plurality_votes(logits)[-1, 0].item() == 3  # 2 of 5 votes


def test_permuting_hidden_units_keeps_the_function_but_breaks_averaging(data):
    model = _models(1)[0]
    params, buffers = rp.stack([model])
    one = {k: v[0] for k, v in params.items()}
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    permuted = rp.permute_hidden(one, perm)
    both = {k: torch.stack([one[k], permuted[k]]) for k in one}
    out = rp.predict(model, both, buffers, data.x_test)
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=1e-12)
    avg = {k: v[None] for k, v in rp.average_weights(both).items()}
    mixed = rp.predict(model, avg, buffers, data.x_test)[0]
    assert (mixed - out[0]).abs().max() > 1e-2


def test_average_of_identical_replicas_is_that_replica(data):
    models = _models(3, shared=True)
    params, buffers = rp.stack(models)
    avg = {k: v[None] for k, v in rp.average_weights(params).items()}
    torch.testing.assert_close(rp.predict(models[0], avg, buffers, data.x_test)[0],
                               rp.predict(models[0], params, buffers, data.x_test)[0],
                               rtol=0, atol=1e-13)


# --- convolutional bootstrapping (reconstruction) ---------------------------------------------


def _shifted(images, dy, dx):
    """images (n, 64) moved by (dy, dx) pixels on the 8x8 grid, zero fill: written by hand."""
    src, out = images.view(-1, 8, 8), torch.zeros(images.shape[0], 8, 8, dtype=images.dtype)
    for i in range(8):
        for j in range(8):
            if 0 <= i - dy < 8 and 0 <= j - dx < 8:
                out[:, i, j] = src[:, i - dy, j - dx]
    return out.view(-1, 64)


def test_convolutional_bootstrap_parts(data):
    x, y = rp.convolutional_bootstrap(data.x_train, data.y_train, 5, seed=2)
    assert x.shape == (5, 256, 64) and y.shape == (5, 256)
    plain, py = rp.convolutional_bootstrap(data.x_train, data.y_train, 5, seed=2, shift=False,
                                           resample=False)
    assert torch.equal(plain, data.x_train.expand(5, -1, -1))
    assert torch.equal(py, data.y_train.expand(5, -1))
    # shift only: replica r is the whole training set moved by one (dy, dx) in {-1, 0, 1}^2
    shifted, sy = rp.convolutional_bootstrap(data.x_train, data.y_train, 9, seed=2,
                                             resample=False)
    assert torch.equal(sy, data.y_train.expand(9, -1))
    moves = {(dy, dx): _shifted(data.x_train, dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)}
    seen = set()
    for r in range(9):
        match = [m for m, ref in moves.items() if torch.equal(shifted[r], ref)]
        assert len(match) == 1, f"replica {r} is not one shift of the images"
        seen |= set(match)
    assert len(seen) > 1  # the replicas' kernels differ
    # resample only: every row is an original row, with its own label, drawn with replacement
    boot, by = rp.convolutional_bootstrap(data.x_train, data.y_train, 3, seed=2, shift=False)
    for r in range(3):
        d = torch.cdist(boot[r], data.x_train)
        src = d.argmin(1)
        assert torch.equal(boot[r], data.x_train[src])
        assert torch.equal(by[r], data.y_train[src])
        assert len(set(src.tolist())) < 256  # with replacement: some rows repeat


def test_convolutional_bootstrap_is_seeded(data):
    a = rp.convolutional_bootstrap(data.x_train, data.y_train, 3, seed=4)
    b = rp.convolutional_bootstrap(data.x_train, data.y_train, 3, seed=4)
    c = rp.convolutional_bootstrap(data.x_train, data.y_train, 3, seed=5)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


# --- bad input ----------------------------------------------------------------------------------


def test_bad_input_refused(data):
    with pytest.raises(ValueError, match="replicas"):
        rp.make_replicas(64, 8, 10, 0)
    with pytest.raises(TypeError, match="replicas"):
        rp.make_replicas(64, 8, 10, 2.0)
    with pytest.raises(ValueError, match="replicas"):
        rp.convolutional_bootstrap(data.x_train, data.y_train, 0)
    with pytest.raises(ValueError, match="replicas_list"):
        rp.instant_learning(data, (0,))
    with pytest.raises(ValueError, match="bootstrap"):
        rp.instant_learning(data, (2,), bootstrap="yes")
    with pytest.raises(TypeError, match="models"):
        rp.stack([])
    with pytest.raises(ValueError, match=r"models\[1\]"):
        rp.stack([_models(1)[0], rp.make_replicas(64, 9, 10, 1)[0].double()])
    models = _models(3)
    params, buffers = rp.stack(models)
    bad = dict(params, **{"0.bias": params["0.bias"][:2]})
    with pytest.raises(ValueError, match="replica counts"):
        rp.sgd_step_batched(models[0], bad, buffers, data.x_train[:4], data.y_train[:4], 0.1)
    bad = dict(params, **{"0.weight": params["0.weight"][:, :, :5]})
    with pytest.raises(ValueError, match="0.weight"):
        rp.predict(models[0], bad, buffers, data.x_test)
    with pytest.raises(ValueError, match="entries"):
        rp.predict(models[0], {"0.weight": params["0.weight"]}, buffers, data.x_test)
    with pytest.raises(ValueError, match="per-replica"):
        rp.sgd_step_batched(models[0], params, buffers, data.x_train[:4].expand(2, -1, -1),
                            data.y_train[:4], 0.1)
    with pytest.raises(ValueError, match="lr"):
        rp.sgd_step_looped(models, data.x_train[:4], data.y_train[:4], -0.1)
    with pytest.raises(ValueError, match="perm"):
        rp.permute_hidden({k: v[0] for k, v in params.items()}, torch.zeros(16, dtype=int))
    with pytest.raises(ValueError, match="images"):
        rp.convolutional_bootstrap(data.x_train[:, :60], data.y_train, 2)


def test_bench_rows(data):
    rows = rp.bench(torch.device("cpu"), True)
    assert [r.benchmark for r in rows] == ["replicas R=8", "replicas R=64"]
    assert all(r.ratio > 0 for r in rows)


# --- the users' model zoo ---------------------------------------------------------------------

def _zoo_replicas(name: str, dtype: torch.dtype, r: int = 3) -> list[torch.nn.Module]:
    return [zoo.build(name, dtype, seed=s) for s in range(r)]


@pytest.mark.parametrize("name,dtype", zoo.cases(names=[n for n in zoo.ZOO if n != "batchnorm"]))
def test_zoo_batched_equals_looped_and_frozen_never_moves(name, dtype):
    """On every zoo model it accepts, the batched step equals the loop over models step by
    step (prime and one-example batches), a frozen parameter never moves in either, and the
    models' .grad, the global RNG and the thread count are left alone."""
    models = _zoo_replicas(name, dtype)
    base = copy.deepcopy(models[0])
    params, buffers = rp.stack(models)
    before = [zoo.frozen(m) for m in models]
    tol = dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    with zoo.kept_state(base, *models):
        for step, n in enumerate(zoo.BATCHES):
            x, y = zoo.batch(n, dtype, seed=step)
            new = rp.sgd_step_batched(base, params, buffers, x, y, 0.3)
            rp.sgd_step_looped(models, x, y, 0.3)
            assert any(not torch.equal(new[k], params[k]) for k in new)  # it did train
            params = new
            ref, _ = rp.stack(models)
            for k in ref:
                torch.testing.assert_close(params[k], ref[k], **tol)
    for m, b in zip(models, before, strict=True):
        zoo.assert_frozen_unmoved(m, b)
    stacked_before = {k: torch.stack([b[k] for b in before]) for k in before[0]}
    for k, v in stacked_before.items():
        assert torch.equal(params[k], v), f"batched step moved frozen {k}"


def test_zoo_batchnorm_refused_in_training_mode_and_equal_in_eval_mode():
    models = _zoo_replicas("batchnorm", torch.float64)
    base = copy.deepcopy(models[0])
    params, buffers = rp.stack(models)
    x, y = zoo.batch(7)
    with pytest.raises(ValueError, match="BatchNorm1d"):
        rp.sgd_step_batched(base, params, buffers, x, y, 0.1)
    with pytest.raises(ValueError, match="BatchNorm1d"):
        rp.sgd_step_looped(models, x, y, 0.1)
    for m in (base, *models):
        m.eval()
    params = rp.sgd_step_batched(base, params, buffers, x, y, 0.1)
    rp.sgd_step_looped(models, x, y, 0.1)
    ref, _ = rp.stack(models)
    for k in ref:
        torch.testing.assert_close(params[k], ref[k], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name,dtype", zoo.cases(names=[n for n in zoo.ZOO if n != "batchnorm"]))
def test_zoo_train_batched_equals_train_looped_and_predict_equals_each_model(name, dtype):
    """Whole runs on every zoo model it accepts: train_batched equals train_looped (13
    examples in minibatches of 5: a short last batch), and predict gives each replica's own
    logits; frozen parameters never move and the models' state is left alone."""
    models = _zoo_replicas(name, dtype)
    base = copy.deepcopy(models[0])
    params, buffers = rp.stack(models)
    before = [zoo.frozen(m) for m in models]
    x, y = zoo.batch(13, dtype, seed=5)
    tol = dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    with zoo.kept_state(base, *models):
        params = rp.train_batched(base, params, buffers, x, y, epochs=2, lr=0.2, batch_size=5)
        rp.train_looped(models, x, y, epochs=2, lr=0.2, batch_size=5)
        ref, _ = rp.stack(models)
        for k in ref:
            torch.testing.assert_close(params[k], ref[k], **tol)
        logits = rp.predict(base, params, buffers, x)
        with torch.no_grad():
            for i, m in enumerate(models):
                torch.testing.assert_close(logits[i], m(x), **tol)
    for m, b in zip(models, before, strict=True):
        zoo.assert_frozen_unmoved(m, b)
