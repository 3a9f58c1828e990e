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


def test_ints_accepts_lists_tuples_and_1d_integer_arrays():
    import numpy as np
    assert checks.check_ints("sizes", (3, 4), lo=1) == [3, 4]
    assert checks.check_ints("sizes", np.arange(1, 4), lo=1) == [1, 2, 3]
    assert all(type(v) is int for v in checks.check_ints("sizes", np.arange(1, 4)))


@pytest.mark.parametrize("value, kind, text", [
    ("12", TypeError, r"sizes must be a sequence of ints, got '12'"),
    (5, TypeError, r"sizes must be a sequence of ints"),
    ({1, 2}, TypeError, r"sizes must be a sequence of ints"),
    (torch.tensor([1, 2]), TypeError, r"sizes must be a sequence of ints"),
    ([4, True], TypeError, r"sizes\[1\] must be an int, got True"),
    ([4, 2.0], TypeError, r"sizes\[1\] must be an int, got 2.0"),
    ([4, 0], ValueError, r"sizes\[1\] must be an int >= 1, got 0"),
    ([], ValueError, r"sizes must hold at least 1 int, got \[\]"),
    ([4], ValueError, r"sizes must hold at least 2 ints"),
])
def test_ints_refuses_and_names_the_argument(value, kind, text):
    import numpy as np
    min_len = 2 if value == [4] else 1
    with pytest.raises(kind, match=text):
        checks.check_ints("sizes", value, lo=1, min_len=min_len)
    with pytest.raises(TypeError, match="2-D array"):
        checks.check_ints("sizes", np.ones((2, 2), dtype=int))


def test_ints_matches_check_int_elementwise():
    # Property: check_ints accepts a list exactly when check_int accepts every element,
    # and returns the same values; a refusal names the first bad index.
    from hypothesis import given, settings
    from hypothesis import strategies as st

    elem = st.one_of(st.integers(-5, 5), st.booleans(), st.floats(-5, 5, allow_nan=False))

    @settings(max_examples=200, deadline=None)
    @given(st.lists(elem, max_size=6), st.integers(-3, 3))
    def prop(values, lo):
        def ok(v):
            try:
                checks.check_int("v", v, lo=lo)
                return True
            except (TypeError, ValueError):
                return False
        good = [ok(v) for v in values]
        if values and all(good):
            assert checks.check_ints("s", values, lo=lo) == [int(v) for v in values]
        elif values:
            first = good.index(False)
            with pytest.raises((TypeError, ValueError), match=rf"s\[{first}\]"):
                checks.check_ints("s", values, lo=lo)
        else:
            with pytest.raises(ValueError, match="at least 1"):
                checks.check_ints("s", values, lo=lo)
    prop()
