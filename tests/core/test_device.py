import subprocess
import sys

import pytest
import torch

from parlearn.core import device


def test_pick_device_default_and_cpu():
    assert device.pick_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else None
    if expected:
        assert device.pick_device().type == "cuda"
    assert device.pick_device().type in ("cuda", "mps", "cpu")


@pytest.mark.parametrize("bad", ["tpu", "gpu0", 3.5])
def test_pick_device_rejects_unknown(bad):
    with pytest.raises(ValueError, match="prefer"):
        device.pick_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_pick_device_refuses_missing_cuda():
    with pytest.raises(ValueError, match="not available"):
        device.pick_device("cuda")


def test_describe_has_versions():
    d = device.describe("cpu")
    assert d["device"] == "cpu" and d["torch"] == torch.__version__ and d["cores"] >= 1
    assert "torch" in device.describe_str("cpu")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_fake_jax_devices_before_start():
    code = ("import parlearn, parlearn.core.device as d; d.fake_jax_cpu_devices(4); import jax; "
            "print(len(jax.devices('cpu')))")
    res = _run(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "4"


def test_fake_jax_devices_refused_after_start():
    code = ("import jax; jax.devices(); import parlearn.core.device as d\n"
            "try:\n d.fake_jax_cpu_devices(8)\nexcept RuntimeError as e: print('refused', e)")
    res = _run(code)
    assert res.returncode == 0, res.stderr
    assert "refused" in res.stdout and "before the first JAX computation" in res.stdout


def test_import_parlearn_does_not_start_jax():
    res = _run("import sys, parlearn, parlearn.bench; print('jax' in sys.modules)")
    assert res.stdout.strip() == "False", res.stderr


def test_fake_jax_devices_rejects_bad_n():
    with pytest.raises(ValueError, match="n must be"):
        device.fake_jax_cpu_devices(0)
