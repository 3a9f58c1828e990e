"""What to train on: linear regression with a known gradient covariance, and digits.

Everything is tested against exact values on :class:`LinearRegressionProblem`, whose
gradient mean and covariance are known in closed form at every point.
:class:`RegressionTask` draws fresh examples of it each step; :class:`DigitsTask` draws
from a ``datasets.digits()`` split. Both draw from their seed and the step alone, so every
rank of a run draws the same batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from parlearn.core.checks import check_float, check_int, check_tensor
from parlearn.core.datasets import Split

__all__ = ["LinearRegressionProblem", "RegressionTask", "DigitsTask"]


# ---------------------------------------------------------------------------------------
# A problem with a known gradient covariance: linear regression with Gaussian inputs.

class LinearRegressionProblem:
    """``y = x . w* + noise``, ``x ~ N(0, diag(h))``, ``noise ~ N(0, sigma^2)``; per-example
    loss ``l = (x . w - y)^2 / 2``. With ``u = w - w*`` (Isserlis' theorem for the
    fourth moments of a Gaussian)::

        L(w)  = (u' H u + sigma^2) / 2
        G(w)  = H u
        Sigma = (u' H u + sigma^2) H + H u u' H      (covariance of one example's gradient)
        tr Sigma = (u' H u + sigma^2) tr H + |H u|^2

    so ``B_simple = tr Sigma / |G|^2`` is exact at every ``w``. With ``h = 1`` and
    ``sigma = 0`` it is ``d + 1`` everywhere. ``w*`` is drawn from ``seed``."""

    def __init__(self, d: int = 64, *, h: Sequence[float] | torch.Tensor | None = None,
                 noise: float = 0.0, seed: int = 0) -> None:
        self.d = check_int("d", d, lo=1)
        if h is None:
            h = torch.ones(d, dtype=torch.float64)
        h = torch.as_tensor(h, dtype=torch.float64)
        check_tensor("h", h, shape=(d,))
        if not bool((h > 0).all()):
            raise ValueError("h (the input variances) must all be > 0")
        self.h = h
        self.noise = check_float("noise", noise, lo=0)
        seed = check_int("seed", seed, lo=0)
        self.w_star = torch.randn(d, generator=torch.Generator().manual_seed(seed),
                                  dtype=torch.float64)

    def _u(self, w: torch.Tensor) -> torch.Tensor:
        return check_tensor("w", w, shape=(self.d,), floating=True).to(torch.float64) - self.w_star

    def loss(self, w: torch.Tensor) -> float:
        """Population loss ``L(w)``."""
        u = self._u(w)
        return float((u * self.h * u).sum() + self.noise**2) / 2

    def gradient(self, w: torch.Tensor) -> torch.Tensor:
        """True gradient ``G = H u``."""
        return self.h * self._u(w)

    def covariance(self, w: torch.Tensor) -> torch.Tensor:
        """One example's gradient covariance ``Sigma`` (d x d)."""
        u = self._u(w)
        hu = self.h * u
        return (float(u @ hu) + self.noise**2) * torch.diag(self.h) + torch.outer(hu, hu)

    def trace(self, w: torch.Tensor) -> float:
        """``tr Sigma`` without forming ``Sigma``."""
        u = self._u(w)
        hu = self.h * u
        return (float(u @ hu) + self.noise**2) * float(self.h.sum()) + float(hu @ hu)

    def b_simple(self, w: torch.Tensor) -> float:
        """Exact noise scale ``tr Sigma / |G|^2`` at ``w``."""
        g = self.gradient(w)
        return self.trace(w) / float(g @ g)

    def b_simple_from_loss(self, loss: float) -> float:
        """Exact noise scale at any ``w`` whose population loss is ``loss``; isotropic
        problems only (``h`` all equal), where everything depends on ``|u|`` alone:
        ``B_simple = d (1 + sigma^2 / (h |u|^2)) + 1`` with ``h |u|^2 = 2 loss - sigma^2``."""
        if not bool((self.h == self.h[0]).all()):
            raise ValueError("b_simple_from_loss needs an isotropic problem (all h equal)")
        hu2 = 2 * check_float("loss", loss) - self.noise**2
        if hu2 <= 0:
            raise ValueError(f"loss={loss} is at or below the noise floor {self.noise**2 / 2}")
        return self.d * (1 + self.noise**2 / hu2) + 1

    def sample(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` fresh examples ``(x, y)`` (float64) drawn with ``generator``."""
        n = check_int("n", n, lo=1)
        x = torch.randn(n, self.d, generator=generator, dtype=torch.float64) * self.h.sqrt()
        y = x @ self.w_star + self.noise * torch.randn(n, generator=generator,
                                                       dtype=torch.float64)
        return x, y

    def model(self, w0: torch.Tensor | None = None) -> nn.Linear:
        """``nn.Linear(d, 1, bias=False)`` in float64 holding ``w0`` (zeros by default)."""
        lin = nn.Linear(self.d, 1, bias=False, dtype=torch.float64)
        with torch.no_grad():
            lin.weight.copy_(torch.zeros(self.d, dtype=torch.float64) if w0 is None
                             else check_tensor("w0", w0, shape=(self.d,)))
        return lin


def _half_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (out.reshape(-1) - y).square().mean()


@dataclass
class RegressionTask:
    """Training data for :func:`train`: fresh examples from ``problem`` each step (drawn
    from ``seed`` and the step, identically on every rank); the evaluated loss is the
    exact population loss."""

    problem: LinearRegressionProblem
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.problem, LinearRegressionProblem):
            raise TypeError(f"problem must be a LinearRegressionProblem, got "
                            f"{type(self.problem).__name__}")
        check_int("seed", self.seed, lo=0)

    def draw(self, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.problem.sample(n, torch.Generator().manual_seed(self.seed * 1_000_003 + step))

    def loss_fn(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _half_mse(out, y)

    def eval_loss(self, model: nn.Module) -> float:
        return self.problem.loss(next(model.parameters()).detach().reshape(-1))


@dataclass
class DigitsTask:
    """Training data for :func:`train`: ``batch`` examples of a ``datasets.digits()`` split
    drawn with replacement (from ``seed`` and the step, identically on every rank);
    cross-entropy; the evaluated loss is the mean over the whole training split."""

    split: Split
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.split, Split):
            raise TypeError(f"split must be a parlearn.datasets Split (e.g. digits()), got "
                            f"{type(self.split).__name__}")
        if self.split.x_train.shape[0] == 0:
            raise ValueError("split must hold at least one training example")
        check_int("seed", self.seed, lo=0)

    def draw(self, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        idx = torch.randint(0, self.split.x_train.shape[0], (n,), generator=gen)
        return self.split.x_train[idx], self.split.y_train[idx]

    def loss_fn(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)

    def eval_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            return float(self.loss_fn(model(self.split.x_train), self.split.y_train))
