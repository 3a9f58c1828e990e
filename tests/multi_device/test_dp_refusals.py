"""Bad arguments to data parallel's and batching's functions on ranks: refused on every rank,
before any message, naming the argument (never a hang, never one rank alone)."""

from __future__ import annotations

import pytest
import torch
from ranks import assert_refused_on_every_rank

from parlearn.multi_device.batching import halves as H
from parlearn.multi_device.data_parallel import compression as C
from parlearn.multi_device.data_parallel import stragglers as S
from parlearn.multi_device.data_parallel import workers as W


def _x(n: int = 6) -> torch.Tensor:
    return torch.linspace(-1, 1, n)


def _compressed(rank: int, world_size: int, which: str):
    x, kw = _x(), {}
    if which == "x-string":
        x = "x"
    elif which == "x-int":
        x = torch.arange(6)
    elif which == "x-nan":
        x = _x().clone()
        x[rank] = float("nan")          # a NaN on every rank
    elif which == "x-inf":
        x = _x().clone()
        x[-1] = float("inf")
    elif which == "average":
        kw["average"] = 1
    elif which == "reference_coding":
        kw["reference_coding"] = "yes"
    elif which == "error_feedback":
        kw["error_feedback"] = {}
    elif which == "key":
        kw.update(error_feedback=C.ErrorFeedback(), key=["not", "hashable"])
    elif which == "group":
        kw["group"] = "world"
    elif which == "out-shape":
        kw["out"] = torch.empty(5)
    elif which == "out-dtype":
        kw["out"] = torch.empty(6, dtype=torch.float64)
    return C.compressed_all_reduce(x, **kw)


COMPRESSED = [("x-string", "x"), ("x-int", "x"), ("x-nan", "x"), ("x-inf", "x"),
              ("average", "average"), ("reference_coding", "reference_coding"),
              ("error_feedback", "error_feedback"), ("key", "key"), ("group", "group"),
              ("out-shape", "out"), ("out-dtype", "out")]


@pytest.mark.parametrize("which,name", COMPRESSED, ids=[w for w, _ in COMPRESSED])
def test_compressed_all_reduce_refuses_on_every_rank(which, name):
    assert_refused_on_every_rank(_compressed, (which,), name=name)


def test_dettmers8_hook_refuses():
    """Checked before the bucket is read: no process group is needed to refuse."""
    for state in ("state", None, 3, C.ErrorFeedback()):
        with pytest.raises(TypeError, match="state"):
            C.dettmers8_hook(state, None)
    for bucket in ("bucket", None, torch.zeros(3)):
        with pytest.raises(TypeError, match="bucket"):
            C.dettmers8_hook(C.Dettmers8HookState(), bucket)


def _labels(*shape):
    return torch.zeros(*shape, dtype=torch.int64)


# (worker, args after rank and world_size, the argument named): each refused on both ranks.
WORKERS = [
    (H.half_groups, (), "world_size=4 differs"),      # run with 2 ranks, asked for 4
    (H.worker_half_gradients, (torch.nn.Linear(3, 2), torch.zeros(7, 3), _labels(7)), "x"),
    (H.worker_half_gradients, (torch.nn.Linear(3, 2), torch.zeros(8, 3), _labels(8), 3),
     "accum"),
    (S.worker_backup_sgd, (torch.nn.Linear(3, 2), [torch.zeros(2, 2, 3)], [_labels(2, 2)], 1,
                           S.DelayModel(), 0.1, 2), "b"),
    (S.worker_backup_sgd, (torch.nn.Linear(3, 2), [torch.zeros(1, 2, 3)], [_labels(1, 2)], 0,
                           S.DelayModel(), 0.1, 2), "steps"),
    (W.worker_step_time, (("local", "naive"), [4, 8, 2], 4, 1, 1024, 0, (1e-4, 0.0)), "link"),
    (W.worker_step_time, (("naive", "naive"), [4, 8, 2], 4, 1), "kinds"),
    (W.worker_slow_link, ([8, 64, 4], 8, 3, (1e-4, 1e-9), 0.0, 1.0), "factor"),
    (W.worker_slow_link, ([8, 64, 4], 8, 3, (1e-4, 1e-9), 0.0, 4.0, (1e-8,)), "coding"),
]


def _half_groups_of_four(rank: int, world_size: int):
    return H.half_groups(4)


@pytest.mark.parametrize("worker,args,name", WORKERS,
                         ids=[f"{w.__name__}-{n}-{i}" for i, (w, _, n) in enumerate(WORKERS)])
def test_workers_refuse_bad_arguments_on_every_rank(worker, args, name):
    if worker is H.half_groups:
        worker = _half_groups_of_four
    assert_refused_on_every_rank(worker, args, name=name)


class _NoDraws:
    """A task that fails the test if anything is trained on it."""

    loss_fn = eval_loss = staticmethod(lambda *a: 0.0)

    def draw(self, step, n):
        raise AssertionError("batch_sweep trained before refusing its arguments")


@pytest.mark.parametrize("kw,name", [({"target_loss": None}, "target_loss"),
                                     ({"target_loss": float("nan")}, "target_loss"),
                                     ({"steps": 0}, "steps"), ({"progress": 3}, "progress")])
def test_batch_sweep_refuses_before_training(kw, name):
    from parlearn.multi_device.batching import batch_sweep

    args = {"target_loss": 0.1, **kw}
    with pytest.raises((TypeError, ValueError), match=name):
        batch_sweep(torch.nn.Linear(2, 1), _NoDraws(), [2, 4], [0.1], **args)
