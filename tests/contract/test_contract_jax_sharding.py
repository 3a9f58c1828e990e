"""The argument contract of weight-update sharding in JAX (see harness.py).

Every refusal comes before JAX starts, but a value the function wrongly accepted would start
it in this process (and a later fork of gloo ranks would then warn or deadlock), so these run
in a child pytest (``fresh_process``, tests/conftest.py), as test_contract_jax.py does.
"""

from __future__ import annotations

import pytest
from harness import Case, contract_tests

pytestmark = pytest.mark.fresh_process

J = "parlearn.multi_device.sharding.jax_update."
SIZES = {"n_devices": (1, None), "n_in": (1, None), "n_out": (1, None), "batch": (1, None),
         "steps": (1, None), "seed": (0, None)}

CASES: list[Case] = [
    # An XLA compile per call, and the device count is fixed when JAX starts: refusals only.
    Case(J + "jax_sharded_adam",
         lambda: dict(n_devices=1, n_in=3, n_out=2, batch=2, steps=1, lr=0.01, seed=0),
         ranges=SIZES, bad={"lr": [0.0, -1.0]}, run_good=False),
    # Each refusal comes before the child interpreter starts.
    Case(J + "jax_sharded_adam_subprocess",
         lambda: dict(n_devices=2, timeout=60.0, n_in=3, n_out=2, batch=2, steps=1, lr=0.01,
                      seed=0),
         ranges=SIZES, bad={"lr": [0.0, -1.0], "timeout": [0.0, -1.0]}, run_good=False),
]

test_refuses, test_accepts, test_accepts_range = contract_tests(CASES)
