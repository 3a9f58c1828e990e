"""The argument contract, tested the same way for every public function.

A contract file (``tests/contract/test_contract_<part>.py``) lists, for each public callable:

- a :class:`Case`: one legal call (``good`` builds its keyword arguments afresh each time) and
  what each argument allows. From the good value's type the harness derives values that every
  argument of that type must refuse (a bool for a number, NaN for a float, a string for a
  tensor...), Hypothesis draws values outside each declared range, and each must raise
  ``ValueError``/``TypeError`` whose message names the argument. Values inside the declared
  ranges must be accepted (the call runs), where the call is cheap enough (``run_good``);
- or an entry of ``COVERED_ELSEWHERE``: ``name -> "tests/path.py::test_name"``, a dedicated
  test (functions on ranks, models, anything the generic harness cannot build);
- or an entry of ``EXEMPT``: ``name -> why`` it takes nothing a user can get wrong.

``tests/contract/test_completeness.py`` fails when a public callable has none of the three.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import parlearn

# CI runs each property a few times per argument: enough to hit every kind of bad value (the
# strategies below are small unions), cheap enough for ~600 functions on 2 cores.
settings.register_profile("parlearn", max_examples=12, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.function_scoped_fixture])
settings.load_profile("parlearn")

REFUSALS = (ValueError, TypeError)
# Put in ``Case.legal[arg]`` where a tensor argument may hold NaN (it propagates, as in torch).
NAN_TENSOR = "a tensor holding NaN"


@dataclass
class Case:
    """One public callable and a legal call of it.

    ``name``: the import path a user types (``"parlearn.moe.capacity"``).
    ``good``: () -> kwargs of a legal call (positional-only callables: use ``args``).
    ``ranges``: argument -> (lo, hi), the legal numeric range (None: unbounded on that side;
        ints keep ints). Hypothesis draws values just and far outside, each must be refused,
        and values inside (up to lo + 8 for an int with no upper bound), each accepted.
    ``bad``: argument -> further values it must refuse (modes, shapes, dtypes).
    ``legal``: argument -> values the generic refusals list that this argument does accept
        (None where None means "default", inf where infinity has a meaning).
    ``skip``: argument -> why the generic values do not apply (e.g. it accepts any object).
    ``run_good``: also run the legal call (and the legal draws inside ``ranges``).
    ``check``: (result, kwargs) -> None, asserting the function's stated invariant on the
        legal calls (e.g. a closed form in exact arithmetic).
    """

    name: str
    good: Callable[[], dict[str, Any]]
    ranges: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    bad: dict[str, list[Any]] = field(default_factory=dict)
    legal: dict[str, list[Any]] = field(default_factory=dict)
    skip: dict[str, str] = field(default_factory=dict)
    run_good: bool = True
    check: Callable[[Any, dict[str, Any]], None] | None = None
    args: Callable[[], tuple] | None = None

    def __post_init__(self):
        unknown = (set(self.ranges) | set(self.bad) | set(self.legal) | set(self.skip)) - set(
            self.good())
        assert not unknown, f"{self.name}: arguments not in good(): {sorted(unknown)}"

    @property
    def id(self) -> str:
        return self.name.removeprefix("parlearn.")

    def func(self) -> Callable:
        return resolve(self.name)


def resolve(name: str) -> Any:
    """The object at an import path: the longest importable module, then attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


# ---- the values every argument of a type must refuse --------------------------------------

class _Opaque:
    """An object of no type a function expects."""

    def __repr__(self):
        return "<opaque object>"


def generic_bad(value: Any, nan_ok: bool = False) -> list[Any]:
    """Values an argument whose legal value is ``value`` must refuse, by the value's type."""
    if isinstance(value, bool):
        return [0, 1, "yes", _Opaque()]
    if isinstance(value, numbers.Integral):
        return [True, False, float(value) + 0.5, str(value), _Opaque()]
    if isinstance(value, numbers.Real):
        return [True, math.nan, math.inf, -math.inf, str(value), _Opaque()]
    if isinstance(value, str):
        return ["no such " + value if value else "x", 3, _Opaque()]
    if isinstance(value, torch.Tensor):
        out: list[Any] = ["a string", _Opaque()]
        if value.is_floating_point() and value.numel() and not nan_ok:
            nan = value.clone()
            nan.view(-1)[0] = math.nan
            out.append(nan)
        return out
    if isinstance(value, np.ndarray):
        return ["a string", _Opaque()]
    if isinstance(value, torch.nn.Module):
        return ["a string", _Opaque()]
    if isinstance(value, torch.dtype):
        return ["float32", _Opaque()]
    if isinstance(value, torch.device):
        return [_Opaque()]
    return []


def _outside(lo: Any, hi: Any, integral: bool) -> st.SearchStrategy:
    """Numbers just and far outside [lo, hi]."""
    parts = []
    if lo is not None:
        if integral:
            parts.append(st.integers(max_value=int(lo) - 1, min_value=int(lo) - 10**6))
        else:
            parts.append(st.floats(max_value=float(lo), exclude_max=True,
                                   min_value=-1e12, allow_nan=False))
    if hi is not None:
        if integral:
            parts.append(st.integers(min_value=int(hi) + 1, max_value=int(hi) + 10**6))
        else:
            parts.append(st.floats(min_value=float(hi), exclude_min=True,
                                   max_value=1e12, allow_nan=False))
    return st.one_of(*parts) if parts else st.nothing()


def _inside(lo: Any, hi: Any, integral: bool) -> st.SearchStrategy:
    if integral:
        lo_i = int(lo) if lo is not None else -(10**3)
        hi_i = int(hi) if hi is not None else lo_i + 8  # legal, and small enough to run
        return st.integers(min_value=lo_i, max_value=hi_i)
    lo_f = float(lo) if lo is not None else -1e3
    hi_f = float(hi) if hi is not None else lo_f + 1e3
    return st.floats(min_value=lo_f, max_value=hi_f, allow_nan=False)


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, torch.Tensor | np.ndarray):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


def refusals(case: Case, arg: str) -> st.SearchStrategy:
    """Every value ``arg`` must refuse: the generic ones, out of range, and the case's own."""
    good = case.good()[arg]
    legal = case.legal.get(arg, [])
    fixed = [v for v in generic_bad(good, NAN_TENSOR in legal) + case.bad.get(arg, [])
             if not any(_same(v, ok) for ok in case.legal.get(arg, []))]
    parts = [st.sampled_from(fixed)] if fixed else []
    if arg in case.ranges:
        lo, hi = case.ranges[arg]
        parts.append(_outside(lo, hi, isinstance(good, numbers.Integral)))
    return st.one_of(*parts) if parts else st.nothing()


def call(case: Case, kwargs: dict[str, Any]) -> Any:
    fn = case.func()
    return fn(*case.args(), **kwargs) if case.args else fn(**kwargs)


def assert_refused(case: Case, arg: str, value: Any) -> None:
    kwargs = case.good()
    kwargs[arg] = value
    with pytest.raises(REFUSALS) as info:
        call(case, kwargs)
    assert arg in str(info.value), (
        f"{case.name}({arg}={value!r}) raised {type(info.value).__name__} without naming "
        f"{arg!r}: {info.value}")


def assert_accepted(case: Case, arg: str | None = None, value: Any = None) -> None:
    kwargs = case.good()
    if arg is not None:
        kwargs[arg] = value
    result = call(case, kwargs)
    if case.check is not None:
        verdict = case.check(result, kwargs)
        # A check may assert, or return a bool: a returned False must fail, not vanish.
        assert verdict is None or bool(verdict), (
            f"{case.name}: check returned {verdict!r} for {kwargs}")


def checked_args(case: Case) -> list[str]:
    """The arguments the generic refusals apply to."""
    good = case.good()
    return [a for a in good if a not in case.skip
            and (generic_bad(good[a]) or a in case.bad or a in case.ranges)]


def inside(case: Case, arg: str) -> st.SearchStrategy:
    lo, hi = case.ranges[arg]
    return _inside(lo, hi, isinstance(case.good()[arg], numbers.Integral))


# ---- what "public" means -------------------------------------------------------------------

def public_callables() -> dict[int, str]:
    """id(object) -> home path of every callable that some parlearn module lists in
    ``__all__`` (each object once, under the module that defines it)."""
    out: dict[int, str] = {}
    for info in pkgutil.walk_packages(parlearn.__path__, "parlearn."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name, None)
            if not callable(obj) or not getattr(obj, "__module__", "").startswith("parlearn"):
                continue
            home = f"{obj.__module__}.{getattr(obj, '__qualname__', name)}"
            out.setdefault(id(obj), home)
    return out


def signature_names(fn: Callable) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


# ---- the tests a contract file gets ---------------------------------------------------------

def contract_tests(cases: list[Case]) -> tuple[Callable, Callable, Callable]:
    """Three parametrized tests over ``cases``: bad values refused naming the argument, the legal
    call accepted (and its ``check`` holding), legal draws inside every range accepted.

        test_refuses, test_accepts, test_accepts_range = contract_tests(CASES)
    """
    from hypothesis import given

    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "a callable listed twice"
    refuse = [pytest.param(c, a, id=f"{c.id}:{a}") for c in cases for a in checked_args(c)]
    good = [pytest.param(c, id=c.id) for c in cases if c.run_good]
    ranged = [pytest.param(c, a, id=f"{c.id}:{a}") for c in cases if c.run_good
              for a in c.ranges]

    @pytest.mark.parametrize("case,arg", refuse)
    @given(data=st.data())
    def test_refuses(case: Case, arg: str, data) -> None:
        assert_refused(case, arg, data.draw(refusals(case, arg), label=arg))

    @pytest.mark.parametrize("case", good)
    def test_accepts(case: Case) -> None:
        assert_accepted(case)

    @pytest.mark.parametrize("case,arg", ranged)
    @given(data=st.data())
    def test_accepts_range(case: Case, arg: str, data) -> None:
        assert_accepted(case, arg, data.draw(inside(case, arg), label=arg))

    return test_refuses, test_accepts, test_accepts_range
