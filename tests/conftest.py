"""Shared test set-up: float64 exactness helpers and a fixed torch state."""

from __future__ import annotations

import os

import pytest
import torch

# Every test process, and every lesson kernel nbval starts from it, runs in FAST mode
# unless told otherwise; tests/core/test_settings.py checks that kernels really inherit it.
os.environ.setdefault("PARLEARN_FAST", "1")

# Deterministic cuBLAS needs a fixed workspace, set before CUDA starts (else matmuls raise
# under use_deterministic_algorithms on a GPU).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
torch.use_deterministic_algorithms(True, warn_only=False)

# Devices every exactness test runs on: CUDA is added only where it exists (as minitorch
# does), so the suite passes everywhere and tests more where it can. `make gpu-check` runs
# the tests that use this fixture.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def any_device(request) -> torch.device:
    """Each available device in turn: use it in every parallel-equals-serial test."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
