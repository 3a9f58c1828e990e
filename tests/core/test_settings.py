import os
import subprocess
import sys

import pytest

from parlearn.core import settings


def test_size_follows_env(monkeypatch):
    monkeypatch.setenv("PARLEARN_FAST", "1")
    assert settings.is_fast() and settings.size(full=100, fast=3) == 3
    monkeypatch.setenv("PARLEARN_FAST", "0")
    assert not settings.is_fast() and settings.size(full=100, fast=3) == 100
    assert "off" in settings.banner()


def test_bad_env_value_is_refused(monkeypatch):
    monkeypatch.setenv("PARLEARN_FAST", "yes")
    with pytest.raises(ValueError, match="PARLEARN_FAST"):
        settings.is_fast()


def test_canary_fast_mode_reaches_lesson_kernels():
    """nbval kernels are child processes: they must see FAST mode, or lessons run full size."""
    assert os.environ.get("PARLEARN_FAST") == "1"
    code = "import parlearn.core.settings as s; print(s.is_fast())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    out = res.stdout.strip()
    assert out == "True"
