"""The trainer: under torchrun on CPU ranks, killed and restarted, resumed on another mesh."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from parlearn.at_scale import checkpoint as ckpt
from parlearn.at_scale import train

SMALL = dict(batch=8, seq=16, d_model=32)
FLAGS = ["--batch", "8", "--seq", "16", "--d-model", "32"]


def _torchrun(nproc: int, *args: str, restarts: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(nproc), "--max-restarts", str(restarts),
           "-m", "parlearn.train", *FLAGS, *args]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def _undisturbed(steps: int, **mesh) -> dict[str, torch.Tensor]:
    from parlearn.mesh import assemble

    spec = train.TrainSpec(steps=steps, log=False, **mesh, **SMALL)
    return assemble(train.train(spec), spec.shape)


def test_a_rank_killed_under_torchrun_restarts_resumes_and_ends_where_the_undisturbed_run_ends(
        tmp_path):
    out = _torchrun(2, "--dp", "2", "--steps", "6", "--ckpt", str(tmp_path), "--every", "2",
                    "--fail-at", "3", "--fail-rank", "1", restarts=1)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    log = out.stdout
    assert "after 3 steps: injected failure, SIGKILL to rank 1" in log
    assert "attempt 1, resumed from step 2" in log          # the last save before the kill
    assert log.count("step     3/6") == 2                   # step 3 ran twice: the work lost
    final = ckpt.load_full(ckpt.step_dir(tmp_path, 6))
    assert final["step"] == 6
    want = _undisturbed(6, dp=2)
    assert max((final["params"][n] - t).abs().max().item() for n, t in want.items()) < 1e-12


def test_without_restarts_the_killed_job_fails_and_leaves_its_last_checkpoint(tmp_path):
    out = _torchrun(2, "--dp", "2", "--steps", "4", "--ckpt", str(tmp_path), "--every", "2",
                    "--fail-at", "3", "--fail-rank", "0", restarts=0)
    assert out.returncode != 0
    assert ckpt.latest(tmp_path) == (2, ckpt.step_dir(tmp_path, 2))


def test_torchrun_resumes_a_run_of_the_whole_recipe_on_another_mesh(tmp_path):
    """AdamW with decay groups, the clip and the schedule over 4 steps, ZeRO-2 over dp=2,
    stopped after 2; resumed under TP: equal to the uninterrupted recipe run."""
    first = _torchrun(2, "--dp", "2", "--steps", "4", "--stop-at", "2", "--recipe", "1",
                      "--zero", "2", "--ckpt", str(tmp_path),
                      "--trace", str(tmp_path / "traces"), "--trace-steps", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    # The first run also traced its last step, one Chrome trace per torchrun rank.
    from parlearn.at_scale import critical, traces

    assert "steps 2-2 under torch.profiler" in first.stdout
    paths = [str(tmp_path / "traces" / f"rank{r}.json") for r in range(2)]
    for path in paths:
        b = traces.breakdown(path, window=traces.step_windows(path, "step", "step")[0])
        assert b["compute"] > 0 and b["comm"] > 0
        assert b["compute"] + b["exposed"] + b["idle"] == pytest.approx(b["step"])
    cp = critical.critical_path(paths, labels=("step", "step"))
    assert sum(b - a for *_, a, b in cp["segments"]) == pytest.approx(cp["step"], abs=1e-9)
    assert cp["comm"] > 0 and len(cp["calls"]) >= 2   # ZeRO-1: a reduce-scatter, an all-gather
    second = _torchrun(2, "--tp", "2", "--steps", "4", "--recipe", "1", "--ckpt",
                       str(tmp_path))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "dp=1 x tp=2 x pp=1 on 2 ranks, attempt 0, resumed from step 2" in second.stdout
    assert "tokens/s" in second.stdout and "GFLOP/s (model)" in second.stdout
    final = ckpt.load_full(ckpt.step_dir(tmp_path, 4))
    want = _undisturbed(4, recipe=True)
    assert max((final["params"][n] - t).abs().max().item() for n, t in want.items()) < 1e-12


def test_the_notebook_path_runs_the_same_worker_and_logs_mfu_against_a_given_peak(capfd):
    ranks = train.train(train.TrainSpec(dp=2, steps=2, peak_tflops=1.0, **SMALL))
    lines = ranks[0]["lines"]
    assert lines[0].startswith("parlearn.train: dp=2 x tp=1 x pp=1 on 2 ranks")
    assert "MFU" in lines[1] and "%" in lines[1]
    assert ranks[1]["lines"] == [lines[0]]       # only the last stage's first rank logs steps
    assert sorted(ranks[0]["loss"]) == [0, 1]


def test_the_command_line_refuses_nccl_and_bad_flags():
    with pytest.raises(SystemExit, match="gloo"):
        train.main(["--backend", "nccl"])
    with pytest.raises(ValueError, match="tp"):
        train.main(["--tp", "3", "--steps", "1"])


@pytest.mark.parametrize("kw, name", [
    (dict(every=2), "every"), (dict(fail_at=20), "fail_at"), (dict(fail_rank=2, dp=2), "fail_rank"),
    (dict(ckpt=""), "ckpt"), (dict(tp=3), "tp"), (dict(sp=1), "sp"), (dict(zero=2), "zero"),
    (dict(peak_tflops=0.0), "peak_tflops"), (dict(log="yes"), "log"), (dict(dp=True), "dp"),
    (dict(trace=""), "trace"), (dict(trace="t", trace_steps=21), "trace_steps"),
    (dict(stop_at=0), "stop_at"), (dict(stop_at=21), "stop_at"), (dict(recipe=1), "recipe"),
    (dict(trace_steps=0), "trace_steps"),
])
def test_a_spec_is_checked_when_built(kw, name):
    with pytest.raises((ValueError, TypeError), match=name):
        train.TrainSpec(**kw)
