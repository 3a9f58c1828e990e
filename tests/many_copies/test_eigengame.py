"""parlearn.eigengame. Its JAX tests (eigengame_cases.py, beside this file) run in a child
process with 8 fake CPU devices: JAX must not start in this process, because later tests
fork (dist.run) and JAX warns, rightly, that a forked multithreaded JAX can deadlock."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_eigengame_does_not_import_jax():
    code = "import sys, parlearn.many_copies.eigengame; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def test_jax_cases_on_eight_fake_devices():
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "many_copies" / "eigengame_cases.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 40, proc.stdout[-2000:]
