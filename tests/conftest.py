"""Shared test set-up: float64 exactness helpers and a fixed torch state."""

from __future__ import annotations

import os

import pytest
import torch

# Every test process, and every lesson kernel nbval starts from it, runs in FAST mode
# unless told otherwise; tests/test_settings.py checks that kernels really inherit it.
os.environ.setdefault("PARLEARN_FAST", "1")

torch.use_deterministic_algorithms(True, warn_only=False)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
