"""Small bundled data: scikit-learn's digits, with a fixed split. No downloads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Split", "digits"]


@dataclass(frozen=True)
class Split:
    """A train/test split as float tensors (features) and int64 tensors (labels)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def n_features(self) -> int:
        return self.x_train.shape[1]

    @property
    def n_classes(self) -> int:
        return int(self.y_train.max()) + 1


def digits(*, test_fraction: float = 0.25, seed: int = 0, n_train: int | None = None,
           dtype: torch.dtype = torch.float32, device="cpu") -> Split:
    """scikit-learn's 1797 8x8 digit images (shipped with the package), scaled to [0, 1].

    The split is stratified and fixed by ``seed``; ``n_train`` keeps only the first
    ``n_train`` training examples (for FAST mode or to make overfitting visible).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float64)
    xtr, xte, ytr, yte = train_test_split(x, data.target, test_size=test_fraction,
                                          random_state=seed, stratify=data.target)
    if n_train is not None:
        if not 1 <= n_train <= len(xtr):
            raise ValueError(f"n_train must lie in [1, {len(xtr)}], got {n_train}")
        xtr, ytr = xtr[:n_train], ytr[:n_train]

    def t(a, dt):
        return torch.as_tensor(a, dtype=dt, device=device)

    return Split(t(xtr, dtype), t(ytr, torch.int64), t(xte, dtype), t(yte, torch.int64))
