"""The expert-parallel AllToAll checks its split sizes on every rank before the exchange.

A bad or inconsistent split (rank i sends rank j a number of rows that j does not expect)
would abort or hang inside ``all_to_all_single``; each must fail on every rank naming
the argument. The exchange itself is checked by tests/multi_device/test_moe.py (the
expert-parallel layer equals the single-process one).
"""

from __future__ import annotations

import pytest
import torch
from ranks import assert_refused_on_every_rank

from parlearn import dist
from parlearn.multi_device.moe.parallel import AllToAll


def _bad(rank: int, world_size: int, which: str) -> None:
    x = torch.zeros(3, 2, dtype=torch.float64)
    if which == "mismatch":      # rank 0 sends rank 1 two rows; rank 1 expects one
        AllToAll.apply(x if rank == 0 else x[:2], [1, 1], [1, 2] if rank == 0 else [1, 1],
                       None)
    elif which == "in_splits":   # the rows do not add up to x's, on rank 1 only
        AllToAll.apply(x, [1, 2], [1, 2] if rank == 0 else [1, 1], None)
    elif which == "out_splits":  # one count per rank: rank 0 gives three
        AllToAll.apply(x, [1, 1, 1] if rank == 0 else [1, 2], [1, 2], None)
    elif which == "x":
        AllToAll.apply(x if rank == 0 else "rows", [1, 2], [1, 2], None)
    elif which == "x.dtype":
        AllToAll.apply(x if rank == 0 else x.float(), [1, 2], [1, 2], None)


@pytest.mark.parametrize("which, name", [("mismatch", "in_splits and out_splits must match"),
                                         ("in_splits", "in_splits"),
                                         ("out_splits", "out_splits"), ("x", "x"),
                                         ("x.dtype", "x.dtype")])
def test_bad_splits_fail_on_every_rank_naming_them(which, name):
    assert_refused_on_every_rank(_bad, (which,), name=name)


def _exchange(rank: int, world_size: int) -> tuple:
    # Rank r holds rows r*10 + (0, 1, 2); it keeps in_splits[r] and sends the rest.
    x = (rank * 10 + torch.arange(3, dtype=torch.float64)).unsqueeze(1).requires_grad_(True)
    in_splits = [1, 2] if rank == 0 else [2, 1]
    out_splits = [1, 2] if rank == 0 else [2, 1]
    y = AllToAll.apply(x, out_splits, in_splits, None)
    (y * (1 + torch.arange(len(y), dtype=torch.float64)).unsqueeze(1)).sum().backward()
    return y.detach().flatten().tolist(), x.grad.flatten().tolist()


def test_all_to_all_moves_the_rows_and_sends_their_gradients_back():
    (y0, g0), (y1, g1) = dist.run(_exchange, 2, backend="gloo", timeout=30)
    assert y0 == [0.0, 10.0, 11.0] and y1 == [1.0, 2.0, 12.0]
    # Row i of y has gradient i + 1; each x row gets the gradient of where it went.
    assert g0 == [1.0, 1.0, 2.0] and g1 == [2.0, 3.0, 3.0]
