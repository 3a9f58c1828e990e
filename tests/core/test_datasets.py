import pytest
import torch

from parlearn.core import datasets


def test_default_split():
    d = datasets.digits()
    assert d.x_train.shape == (1347, 64) and d.x_test.shape == (450, 64)
    assert d.n_classes == 10 and d.n_features == 64
    assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64
    assert 0 <= float(d.x_train.min()) and float(d.x_train.max()) <= 1
    # stratified: every class on both sides, in about the same proportion
    counts = torch.bincount(d.y_test, minlength=10)
    assert counts.min() >= 40 and counts.max() <= 50


def test_tiny_training_set_keeps_the_true_class_count():
    d = datasets.digits(n_train=5)
    assert len(d.y_train) == 5
    assert len(torch.unique(d.y_train)) < 10  # the subset misses classes...
    assert d.n_classes == 10  # ...but the dataset has ten
    # training on it works: a model sized by n_classes accepts every test label
    model = torch.nn.Linear(d.n_features, d.n_classes)
    loss = torch.nn.functional.cross_entropy(model(d.x_test), d.y_test)
    assert torch.isfinite(loss)


def test_seed_fixes_the_split_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = datasets.digits(seed=1), datasets.digits(seed=1), datasets.digits(seed=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.y_train, b.y_train) and not torch.equal(a.y_train, c.y_train)


def test_dtype_and_prefix():
    full = datasets.digits(dtype=torch.float64)
    part = datasets.digits(dtype=torch.float64, n_train=100)
    assert part.x_train.dtype == torch.float64
    assert torch.equal(part.x_train, full.x_train[:100])
    assert torch.equal(part.x_test, full.x_test)


def test_split_refuses_labels_beyond_n_classes():
    x, y = torch.zeros(2, 3), torch.tensor([0, 4])
    with pytest.raises(ValueError, match="y_train"):
        datasets.Split(x, y, x, torch.tensor([0, 1]), n_classes=4)


BAD_CALLS = {
    "n_train=0": (dict(n_train=0), ValueError, "n_train"),
    "n_train too big": (dict(n_train=1348), ValueError, "n_train"),
    "n_train=5.0": (dict(n_train=5.0), TypeError, "n_train"),
    "n_train=True": (dict(n_train=True), TypeError, "n_train"),
    "test_fraction=0": (dict(test_fraction=0.0), ValueError, "test_fraction"),
    "test_fraction=1": (dict(test_fraction=1.0), ValueError, "test_fraction"),
    "test_fraction tiny": (dict(test_fraction=0.001), ValueError, "at least 10"),
    "test_fraction huge": (dict(test_fraction=0.999), ValueError, "at least 10"),
    "test_fraction nan": (dict(test_fraction=float("nan")), ValueError, "test_fraction"),
    "test_fraction str": (dict(test_fraction="0.2"), TypeError, "test_fraction"),
    "n_train beyond a smaller train set": (dict(test_fraction=0.5, n_train=1000), ValueError,
                                           "n_train"),
    "seed=-1": (dict(seed=-1), ValueError, "seed"),
    "seed=1.5": (dict(seed=1.5), TypeError, "seed"),
    "dtype int": (dict(dtype=torch.int64), TypeError, "dtype"),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_calls_are_refused_clearly(name):
    kwargs, exc, match = BAD_CALLS[name]
    with pytest.raises(exc, match=match):
        datasets.digits(**kwargs)
