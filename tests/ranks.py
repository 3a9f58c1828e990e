"""Test helpers for functions that run on ranks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from parlearn import dist


def assert_refused_on_every_rank(worker: Callable, args: Sequence = (), *, name: str,
                                 world_size: int = 2, timeout: float = 20) -> None:
    """``worker`` run on ``world_size`` ranks fails on every one of them (not a hang, not one
    rank alone), each rank's error naming ``name`` in its last line."""
    with pytest.raises(dist.RankError) as info:
        dist.run(worker, world_size, args=tuple(args), timeout=timeout)
    assert set(info.value.failures) == set(range(world_size)), info.value
    for rank, text in info.value.failures.items():
        assert name in text.strip().splitlines()[-1], f"rank {rank}: {text}"
