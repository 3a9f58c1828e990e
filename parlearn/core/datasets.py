"""Small bundled data: scikit-learn's digits, with a fixed split. No downloads."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from parlearn.core.checks import check_float, check_int

__all__ = ["Split", "digits", "DIGITS_CLASSES", "DIGITS_SIZE"]

DIGITS_CLASSES = 10  # the digits 0-9
DIGITS_SIZE = 1797  # images in scikit-learn's copy of the UCI data


@dataclass(frozen=True)
class Split:
    """A train/test split as float tensors (features) and int64 tensors (labels).

    ``n_classes`` is the dataset's number of classes, not the number that happen to
    occur in a (possibly tiny) training subset.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    n_classes: int

    def __post_init__(self) -> None:
        check_int("n_classes", self.n_classes, lo=1)
        for name in ("y_train", "y_test"):
            y = getattr(self, name)
            if y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.n_classes):
                raise ValueError(f"{name} must hold labels in [0, {self.n_classes}), got "
                                 f"[{int(y.min())}, {int(y.max())}]")

    @property
    def n_features(self) -> int:
        return self.x_train.shape[1]


def digits(*, test_fraction: float = 0.25, seed: int = 0, n_train: int | None = None,
           dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Split:
    """scikit-learn's 1797 8x8 digit images (shipped with the package), scaled to [0, 1].

    The split is stratified and fixed by ``seed`` (an int, scikit-learn's
    ``random_state``; the global RNG is not used). ``test_fraction`` must leave at least
    one example of each of the 10 classes on both sides. ``n_train`` keeps only the first
    ``n_train`` training examples (for FAST mode or to make overfitting visible); a
    subset that small may miss some classes, but ``n_classes`` stays 10.
    """
    test_fraction = check_float("test_fraction", test_fraction, lo=0, hi=1, lo_open=True,
                                hi_open=True)
    n_test = math.ceil(test_fraction * DIGITS_SIZE)
    if not DIGITS_CLASSES <= n_test <= DIGITS_SIZE - DIGITS_CLASSES:
        lo, hi = DIGITS_CLASSES / DIGITS_SIZE, 1 - DIGITS_CLASSES / DIGITS_SIZE
        raise ValueError(f"test_fraction={test_fraction} leaves {n_test} of {DIGITS_SIZE} "
                         f"examples for testing; a stratified split over {DIGITS_CLASSES} "
                         f"classes needs at least {DIGITS_CLASSES} on each side "
                         f"(test_fraction in about [{lo:.4f}, {hi:.4f}])")
    seed = check_int("seed", seed, lo=0, hi=2**32 - 1)
    n_avail = DIGITS_SIZE - n_test
    if n_train is not None:
        n_train = check_int("n_train", n_train, lo=1, hi=n_avail)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    device = torch.device(device)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float64)
    xtr, xte, ytr, yte = train_test_split(x, data.target, test_size=n_test, random_state=seed,
                                          stratify=data.target)
    if n_train is not None:
        xtr, ytr = xtr[:n_train], ytr[:n_train]

    def t(a, dt):
        return torch.as_tensor(a, dtype=dt, device=device)

    return Split(t(xtr, dtype), t(ytr, torch.int64), t(xte, dtype), t(yte, torch.int64),
                 n_classes=len(data.target_names))
