import numpy as np
import pytest
import torch

from parlearn import basics


def test_batched_equals_looped_float64():
    a, b = basics.random_batch(7, 5)
    a, b = a.double(), b.double()
    torch.testing.assert_close(basics.batched_matmul(a, b), basics.looped_matmul(a, b),
                               rtol=0, atol=1e-12)


def test_amdahl_limits():
    assert basics.amdahl(0.0, 8) == pytest.approx(8.0)
    assert basics.amdahl(1.0, 8) == pytest.approx(1.0)
    s = basics.amdahl(0.1, np.array([1, 10, 1e9]))
    assert s[0] == pytest.approx(1) and s[-1] == pytest.approx(10, rel=1e-6)


def test_brent_bounds():
    lo, hi = basics.brent_bounds(100, 10, 4)
    assert lo == 25 and hi == 35


@pytest.mark.parametrize("call,match", [
    (lambda: basics.amdahl(1.5, 2), "serial_fraction"),
    (lambda: basics.amdahl(0.5, 0), "workers"),
    (lambda: basics.batched_matmul(torch.zeros(2, 3, 4), torch.zeros(3, 4, 2)), "a and b"),
    (lambda: basics.random_batch(0, 3), "n and size"),
    (lambda: basics.brent_bounds(1, 5, 2), "work"),
])
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()
