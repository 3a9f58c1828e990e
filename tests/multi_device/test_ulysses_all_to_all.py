"""Ulysses' AllToAll checks its sizes on every rank before the exchange.

Rank i's block for rank j must have the shape j expects from i; a bad or inconsistent size
would abort or hang inside ``all_to_all_single``. Each case must fail on every rank naming
the argument. The exchange itself is checked by tests/multi_device/test_context_parallel.py
(Ulysses attention equals full attention).
"""

from __future__ import annotations

import pytest
import torch
from ranks import assert_refused_on_every_rank

from parlearn.multi_device.context_parallel.ulysses import AllToAll


def _bad(rank: int, world_size: int, which: str) -> None:
    # (batch, heads, seq shard, head_dim): heads split in two, the sequence gathered.
    x = torch.zeros(1, 4, 2, 3, dtype=torch.float64)
    if which == "mismatch":      # rank 1 expects 3 positions from rank 0, which holds 2
        AllToAll.apply(x, 1, [2, 2], 2, [2, 2] if rank == 0 else [3, 2])
    elif which == "send_sizes":  # the heads do not add up to x's
        AllToAll.apply(x, 1, [2, 1], 2, [2, 2])
    elif which == "recv_sizes":  # one size per rank: rank 0 gives three
        AllToAll.apply(x, 1, [2, 2], 2, [2, 2, 2] if rank == 0 else [2, 2])
    elif which == "split_dim":
        AllToAll.apply(x, 4, [2, 2], 2, [2, 2])
    elif which == "x.dtype":
        AllToAll.apply(x if rank == 0 else x.float(), 1, [2, 2], 2, [2, 2])


@pytest.mark.parametrize("which, name", [
    ("mismatch", "send_sizes and recv_sizes must match"), ("send_sizes", "send_sizes"),
    ("recv_sizes", "recv_sizes"), ("split_dim", "split_dim"), ("x.dtype", "x.dtype")])
def test_bad_sizes_fail_on_every_rank_naming_them(which, name):
    assert_refused_on_every_rank(_bad, (which,), name=name)
