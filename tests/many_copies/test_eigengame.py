"""parlearn.eigengame. Its JAX tests are in test_eigengame_jax.py, beside this file: they
run in a child pytest with 8 fake CPU devices (fresh_process in tests/conftest.py)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_eigengame_does_not_import_jax():
    code = "import sys, parlearn.many_copies.eigengame; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"

