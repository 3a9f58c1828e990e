"""Shared test set-up: float64 exactness helpers and a fixed torch state."""

from __future__ import annotations

import os
import re
import subprocess
import sys

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


# ---- tests that start JAX run in a fresh interpreter -------------------------------------
# JAX starts threads, and every later os.fork() of a process with JAX's threads warns (an
# error under our filterwarnings; a forked multithreaded JAX can deadlock), while many test
# files fork gloo ranks. So a module whose tests start JAX is marked
#     pytestmark = pytest.mark.fresh_process                      (or a test alone)
#     pytestmark = pytest.mark.fresh_process(env={"JAX_NUM_CPU_DEVICES": "8"})
# and its marked tests run in one child pytest per module (and env), which this process
# sees as one test, "[fresh process]": it passes when every test it ran passed or was
# skipped. `env` adds variables to the child (a value None removes one). Running such a
# file alone works the same way; -k and node ids select the tests the child runs. The
# module itself is still imported here, to collect it: its top level must not start JAX
# nor change this process's environment.
IN_FRESH_PROCESS = os.environ.get("PARLEARN_FRESH_PROCESS") == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "fresh_process(env=None): run in a child pytest (tests that start JAX)")


class FreshProcess(pytest.Item):
    """The marked tests of one module, run by a child pytest in a fresh interpreter."""

    def __init__(self, *, nodeids: list[str], env: dict, **kwargs):
        super().__init__(**kwargs)
        self.nodeids, self.env = nodeids, env

    def runtest(self) -> None:
        env = {**os.environ, "PARLEARN_FRESH_PROCESS": "1"}
        for key, value in self.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p",
                               "no:cacheprovider", *self.nodeids], cwd=self.config.rootpath,
                              env=env, capture_output=True, text=True, timeout=1200)
        tail = done.stdout[-6000:] + done.stderr[-3000:]
        if done.returncode != 0:
            raise FreshProcessFailed(f"child pytest exited with {done.returncode}:\n{tail}")
        counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|xfailed)",
                                                   done.stdout.splitlines()[-1])}
        if sum(counts.values()) != len(self.nodeids):
            raise FreshProcessFailed(f"the child ran {counts}, not the {len(self.nodeids)} "
                                     f"tests asked for:\n{tail}")
        print(done.stdout[-3000:])

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, FreshProcessFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.name}: {len(self.nodeids)} tests in a child pytest"


class FreshProcessFailed(Exception):
    pass


@pytest.hookimpl(trylast=True)      # after -k and -m have deselected
def pytest_collection_modifyitems(session, config, items):
    if IN_FRESH_PROCESS:
        return
    kept, groups = [], {}
    for item in items:
        mark = item.get_closest_marker("fresh_process")
        if mark is None:
            kept.append(item)
            continue
        env = dict(mark.kwargs.get("env") or {})
        module = item.getparent(pytest.Module)
        key = (module.nodeid, tuple(sorted(env.items())))
        if key not in groups:
            groups[key] = FreshProcess.from_parent(module, name="[fresh process]", nodeids=[],
                                                   env=env)
            kept.append(groups[key])
        groups[key].nodeids.append(item.nodeid)
    items[:] = kept
