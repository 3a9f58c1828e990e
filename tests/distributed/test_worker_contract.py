"""Every lesson-10 worker checks its arguments before its first message, on every rank: a bad
value is a RankError that names the argument on each rank, never a hang or a gloo abort."""

from __future__ import annotations

import pytest
from ranks import assert_refused_on_every_rank

from parlearn import dist
from parlearn.distributed import collectives

BAD = [
    (collectives.ring_check, (0,), "numel"),
    (collectives.ring_check, (True,), "numel"),
    (collectives.ring_trace, (2.5,), "numel"),
    (collectives.ring_ledger, (-1,), "numel"),
    (collectives.ring_vs_torch, (0,), "numel"),
    (collectives.ring_vs_torch, (8, -1), "seed"),
    (collectives.collectives_demo, (True,), "per_rank"),
    (collectives.collectives_demo, (5,), "per_rank"),
    (collectives.time_collectives, (("all_reduce",), (64,), 0), "repeat"),
    (collectives.time_collectives, (("allreduce",), (64,)), "kinds"),
    (collectives.time_collectives, (("all_reduce",), ()), "sizes"),
    (collectives.time_collectives, (("all_reduce",), (64,), 2, True), "warmup"),
    (collectives.ring_vs_gloo_times, ((64,), 0), "repeat"),
    (collectives.ring_vs_gloo_times, ((2,), 1), "sizes"),
    (collectives.ring_vs_gloo_times, ("64", 1), "sizes"),
]


@pytest.mark.parametrize("worker, args, name", BAD,
                         ids=[f"{w.__name__}-{n}-{i}" for i, (w, _, n) in enumerate(BAD)])
def test_workers_refuse_bad_arguments_on_every_rank(worker, args, name):
    assert_refused_on_every_rank(worker, args, name=name)


def _ring_on_a_list(rank: int, world_size: int, which: str):
    getattr(collectives, which)([1.0, 2.0])


@pytest.mark.parametrize("which", ["ring_all_reduce", "ring_reduce_scatter", "ring_all_gather"])
def test_ring_collectives_refuse_non_tensors(which):
    with pytest.raises(dist.RankError) as info:
        dist.run(_ring_on_a_list, 2, args=(which,), timeout=20, start="fork")
    assert set(info.value.failures) == {0, 1}
    assert all("tensor must be a torch.Tensor" in t for t in info.value.failures.values())
