import math

import pytest
import torch

from parlearn.core import checks


@pytest.mark.parametrize("value", [True, 4.0, "4", None])
def test_int_refuses_non_ints(value):
    with pytest.raises(TypeError, match="workers"):
        checks.check_int("workers", value, lo=1)


def test_int_range():
    assert checks.check_int("n", 3, lo=1, hi=3) == 3
    with pytest.raises(ValueError, match=r"n must be an int >= 1 and <= 3, got 4"):
        checks.check_int("n", 4, lo=1, hi=3)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_float_refuses_non_finite(value):
    with pytest.raises(ValueError, match="lr"):
        checks.check_float("lr", value)


def test_float_open_bounds_and_bools():
    assert checks.check_float("tau", 1, lo=0, hi=1, lo_open=True) == 1.0
    with pytest.raises(ValueError, match="tau must be > 0"):
        checks.check_float("tau", 0.0, lo=0, lo_open=True)
    with pytest.raises(TypeError, match="scale"):
        checks.check_float("scale", False)


def test_choice_bool_callable_module():
    assert checks.check_choice("mode", "a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"mode must be one of \['a', 'b'\], got 'c'"):
        checks.check_choice("mode", "c", ("a", "b"))
    with pytest.raises(TypeError, match="record"):
        checks.check_bool("record", 1)
    with pytest.raises(TypeError, match="loss_fn"):
        checks.check_callable("loss_fn", 3)
    with pytest.raises(TypeError, match="model"):
        checks.check_module("model", lambda x: x)


@pytest.mark.parametrize("value", [True, False, 1.0, 0.0, "1", None])
def test_choice_keeps_bools_and_floats_apart_from_ints(value):
    # True == 1 and 1.0 == 1 in Python: `zero=True` once ran ZeRO-1.
    with pytest.raises(ValueError, match="stage"):
        checks.check_choice("stage", value, (0, 1, 2, 3))
    assert checks.check_choice("flag", True, (True, False)) is True
    assert checks.check_choice("stage", 1, (0, 1, 2, 3)) == 1


def test_tensor_checks():
    x = torch.zeros(2, 3)
    assert checks.check_tensor("x", x, ndim=2, shape=(None, 3), floating=True) is x
    with pytest.raises(ValueError, match=r"x must have shape \(\*, 4\)"):
        checks.check_tensor("x", x, shape=(None, 4))
    with pytest.raises(ValueError, match="x must have 3 dimensions"):
        checks.check_tensor("x", x, ndim=3)
    with pytest.raises(TypeError, match="integer tensor"):
        checks.check_tensor("x", x, floating=False)
    with pytest.raises(TypeError, match="floating-point"):
        checks.check_tensor("t", torch.zeros(2, dtype=torch.long), floating=True)
    with pytest.raises(ValueError, match="NaN"):
        checks.check_tensor("x", torch.tensor([math.nan]), finite=True)
    with pytest.raises(TypeError, match="torch.Tensor"):
        checks.check_tensor("x", [1.0])


def test_seed():
    g = torch.Generator()
    assert checks.check_seed("seed", g) is g and checks.check_seed("seed", 0) == 0
    with pytest.raises(ValueError, match="seed"):
        checks.check_seed("seed", -1)


def test_device_and_str():
    assert checks.check_device("device", "cpu") == torch.device("cpu")
    assert checks.check_device("device", torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="device must name a device"):
        checks.check_device("device", "tpu:x")
    with pytest.raises(TypeError, match="device"):
        checks.check_device("device", 1.5)
    assert checks.check_str("label", "x") == "x"
    with pytest.raises(TypeError, match="label must be a str"):
        checks.check_str("label", 3)
