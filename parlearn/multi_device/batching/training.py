"""Batches that adapt: two-half gradient similarity (SimiGrad), the gradient noise scale, AdaScale.

Data parallelism (lesson 11) makes a larger batch cost no more wall time per step, as long
as there are ranks to spread it over. Whether a larger batch saves *steps* depends on how
noisy the gradient is. Per-example gradients ``g_i = G + e_i`` with mean ``G`` (the true
gradient) and covariance ``Sigma``; the mean of ``B`` of them has covariance ``Sigma / B``.

**Noise scale** (McCandlish et al. 2018). ``B_simple = tr(Sigma) / |G|^2``: below it a
step's gradient is mostly noise and doubling the batch nearly halves the steps; far above
it the batch is nearly exact and more examples per step buy nothing. With the loss's
Hessian proportional to the identity, ``B_simple`` equals their ``B_noise``, and training to
a fixed loss takes, with the best learning rate at each batch size,
``S = S_min (1 + B_noise / B)`` steps and ``E = E_min (1 + B / B_noise)`` examples
(:func:`steps_samples_model`); the critical batch ``B_crit = E_min / S_min`` is ``B_noise``
when the noise scale stays constant over the run.

**Two halves as a probe.** Split the batch's ranks into two halves; each half all-reduces
on its own process group (:func:`half_groups`), so every rank gets both half-batch means
``a = G + xi_a`` and ``b = G + xi_b`` with ``Cov xi = 2 Sigma / B``, independent, and the
full-batch gradient is ``(a + b) / 2``. From ``a`` and ``b`` alone (:func:`two_half_stats`):

* ``a . b`` is an unbiased estimate of ``|G|^2`` (the cross terms have mean zero),
* ``B |a - b|^2 / 4`` an unbiased estimate of ``tr(Sigma)`` (``E|a - b|^2 = 4 tr(Sigma) / B``),

which is McCandlish's two-batch-size estimator with ``B_small = B/2``, ``B_big = B``:
``(B_big |g_big|^2 - B_small |g_small|^2) / (B_big - B_small) = a . b`` and
``(|g_small|^2 - |g_big|^2) / (1/B_small - 1/B_big) = B |a - b|^2 / 4`` once ``g_big = (a+b)/2``
and ``|g_small|^2`` is averaged over the two halves. A ratio of their running averages is
the noise-scale estimate (:class:`NoiseScale`).

**Cosine similarity** (SimiGrad's probe). ``cos = a . b / (|a| |b|)``. To leading order,
replacing the mean of the ratio by the ratio of the means (``E a.b = |G|^2``,
``E|a|^2 = E|b|^2 = |G|^2 + 2 tr(Sigma) / B``)::

    E[cos] ~ |G|^2 / (|G|^2 + 2 tr(Sigma)/B) = 1 / (1 + 2 B_simple / B)     (expected_cosine)

The approximation needs ``|a|^2`` and ``|b|^2`` to concentrate around their means: their
relative fluctuation is of order ``sqrt(2 tr(C^2)) / tr(C)`` for ``C = 2 Sigma / B``, i.e.
``1 / sqrt(effective dimension)``, so it is good for the many-parameter gradients of
training and poor in a handful of dimensions. The same relation drops out of the
estimators: when ``|a| ~ |b|``, ``|a - b|^2 ~ 2 |a||b| (1 - cos)``, so the estimated
``B_simple = B |a-b|^2 / (4 a.b) ~ B (1 - cos) / (2 cos)``, which inverts to the formula.

**SimiGrad's controller** (Qin et al. 2021) grows the batch when the two halves disagree
(``cos`` below a target ``s``) and shrinks it when they agree, every step; it settles where
``E[cos] = s``, i.e. at ``B* = 2 B_simple s / (1 - s)`` (:func:`controller_fixed_point`).
*A reconstruction*: we could read the paper's abstract and general description only. The
multiplicative step (``B <- B (1 + step)`` up, ``B <- B / (1 + step)`` down, so up and down
cancel in ``log B``), the per-step decision on the raw cosine, and scaling the learning rate
with the batch (``linear``, ``sqrt``, or AdaScale's ``gain``) are our choices. A larger batch
is realised by gradient accumulation: ``B = ranks x micro x accum``.

**AdaScale** (Johnson et al. 2020) keeps the batch at ``S`` times a base batch ``b0`` and
multiplies the learning rate by the gain ``r = (s^2 + |G|^2) / (s^2 / S + |G|^2)`` with
``s^2 = tr(Sigma) / b0`` the base batch's gradient variance (:func:`adascale_gain`);
``1 <= r <= S``. In noise-scale terms ``r = (1 + B_simple / b0) / (1 + B_simple / B)``, which
is exactly the ratio of McCandlish's optimal learning rates ``eps_max / (1 + B_noise / B)``
at batch ``B`` and ``b0``: AdaScale's gain is the noise scale's learning-rate rule.

**What adapting buys** (modeled, :func:`tradeoff_model`). If the noise scale changes over a
run and each piece of the run costs McCandlish's ``1 + b / B`` steps, holding ``B = k b``
(SimiGrad at its fixed point) lands exactly on the fixed-batch trade-off curve, at the fixed
batch ``k mean(b)``; the schedule that beats every fixed batch is ``B ~ sqrt(b)``. The
controller's value is finding a sensible batch without a sweep, not beating the best fixed
one; measured on digits, :func:`bench` puts it beside the measured fixed-batch frontier.

Everything is tested against exact values on :class:`LinearRegressionProblem`, whose
gradient mean and covariance are known in closed form at every point.

Serial references and their parallel versions side by side: :func:`half_gradients` (one
process) vs :func:`worker_half_gradients` (sub-groups on real ranks); :func:`train` (one
process) vs :func:`worker_train` (real ranks, the same sampling), equal to round-off.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist
from torch import nn

from parlearn.core.checks import check_choice, check_float, check_int, check_module, check_tensor
from parlearn.core.datasets import Split

__all__ = ["expected_cosine", "controller_fixed_point", "adascale_gain",
           "adascale_gain_from_b_simple", "steps_samples_model", "critical_batch_fit",
           "HalfStats", "two_half_stats", "NoiseScale", "SimiGradController",
           "LinearRegressionProblem", "RegressionTask", "DigitsTask", "half_gradients",
           "half_groups", "worker_half_gradients", "METHODS", "LR_SCALINGS", "History",
           "train", "worker_train", "probe_bytes", "samples_to_target", "monte_carlo_halves",
           "measure_noise_scale", "batch_sweep", "tradeoff_model", "frontier_samples", "bench"]


# ---------------------------------------------------------------------------------------
# Closed forms: the relations between the cosine, the noise scale and AdaScale's gain.

def expected_cosine(b_simple: float, batch: float) -> float:
    """Leading-order ``E[cos]`` of the two half-batch gradients of a batch of ``batch``:
    ``1 / (1 + 2 B_simple / B)`` (module docstring: ratio of means, good when the half
    gradients' squared norms concentrate)."""
    b_simple = check_float("b_simple", b_simple, lo=0)
    batch = check_float("batch", batch, lo=0, lo_open=True)
    return 1.0 / (1.0 + 2.0 * b_simple / batch)


def controller_fixed_point(b_simple: float, target: float) -> float:
    """The batch at which ``expected_cosine(b_simple, B) == target``:
    ``B* = 2 B_simple target / (1 - target)``."""
    b_simple = check_float("b_simple", b_simple, lo=0)
    target = check_float("target", target, lo=0, hi=1, lo_open=True, hi_open=True)
    return 2.0 * b_simple * target / (1.0 - target)


def adascale_gain(sigma2: float, g2: float, scale: float) -> float:
    """AdaScale's gain ``r = (s^2 + |G|^2) / (s^2 / S + |G|^2)`` for the base batch's
    gradient variance ``sigma2 = s^2`` (``tr Sigma / b0``), ``g2 = |G|^2`` and scale ``S``."""
    sigma2 = check_float("sigma2", sigma2, lo=0)
    g2 = check_float("g2", g2, lo=0)
    scale = check_float("scale", scale, lo=1)
    if sigma2 == 0 and g2 == 0:
        raise ValueError("sigma2 and g2 are both 0: the gain is undefined")
    return (sigma2 + g2) / (sigma2 / scale + g2)


def adascale_gain_from_b_simple(b_simple: float, base_batch: float, batch: float) -> float:
    """The same gain in noise-scale terms: ``(1 + B_simple/b0) / (1 + B_simple/B)``."""
    b_simple = check_float("b_simple", b_simple, lo=0)
    base_batch = check_float("base_batch", base_batch, lo=0, lo_open=True)
    batch = check_float("batch", batch, lo=base_batch)
    return (1.0 + b_simple / base_batch) / (1.0 + b_simple / batch)


def steps_samples_model(batch, b_noise: float, s_min: float) -> dict:
    """McCandlish et al.'s trade-off (modeled): to reach a fixed loss with batch ``B``
    takes ``S = S_min (1 + B_noise / B)`` steps and ``E = B S = E_min (1 + B / B_noise)``
    examples, ``E_min = S_min B_noise``. ``batch`` may be a number or a sequence."""
    b_noise = check_float("b_noise", b_noise, lo=0, lo_open=True)
    s_min = check_float("s_min", s_min, lo=0, lo_open=True)
    many = isinstance(batch, (Sequence, torch.Tensor)) or hasattr(batch, "__array__")
    bs = [float(b) for b in (batch if many else [batch])]
    for b in bs:
        check_float("batch", b, lo=0, lo_open=True)
    steps = [s_min * (1 + b_noise / b) for b in bs]
    samples = [s * b for s, b in zip(steps, bs, strict=True)]
    out = {"batch": bs, "steps": steps, "samples": samples, "e_min": s_min * b_noise}
    if not many:
        out = {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}
    return out


def critical_batch_fit(batches: Sequence[float], steps: Sequence[float]) -> dict:
    """Fit ``S = S_min (1 + B_crit / B)`` to measured ``(batch, steps)`` pairs: least
    squares of ``S`` on ``1/B`` (linear: ``S = S_min + S_min B_crit / B``). Returns
    ``{"s_min", "b_crit", "e_min"}``."""
    if len(batches) != len(steps) or len(batches) < 2:
        raise ValueError(f"batches and steps need the same length >= 2, got {len(batches)} "
                         f"and {len(steps)}")
    x = torch.tensor([1.0 / check_float("batches[i]", b, lo=0, lo_open=True) for b in batches],
                     dtype=torch.float64)
    y = torch.tensor([check_float("steps[i]", s, lo=0, lo_open=True) for s in steps],
                     dtype=torch.float64)
    if float(x.max() - x.min()) == 0:
        raise ValueError("batches must hold at least two different sizes")
    a = torch.stack([torch.ones_like(x), x], 1)
    s_min, slope = (float(v) for v in torch.linalg.lstsq(a, y[:, None]).solution[:, 0])
    if s_min <= 0:
        raise ValueError(f"the fit gives S_min = {s_min:.3g} <= 0: the sweep does not reach "
                         "the large-batch regime; add larger batches")
    return {"s_min": s_min, "b_crit": slope / s_min, "e_min": slope}


# ---------------------------------------------------------------------------------------
# Estimates from the two half-batch gradients.

@dataclass(frozen=True)
class HalfStats:
    """What one step's two half-batch means ``a``, ``b`` (full batch ``batch``) tell:
    ``cos``, ``g2`` (unbiased ``|G|^2``: ``a . b``), ``trace`` (unbiased ``tr Sigma``:
    ``B |a-b|^2 / 4``) and ``b_simple`` (their ratio, for one step: noisy, may be < 0)."""

    cos: float
    g2: float
    trace: float
    batch: int

    @property
    def b_simple(self) -> float:
        return self.trace / self.g2 if self.g2 != 0 else math.inf


def two_half_stats(a: torch.Tensor, b: torch.Tensor, batch: int) -> HalfStats:
    """:class:`HalfStats` of the half-batch mean gradients ``a`` and ``b`` (flat vectors,
    each the mean over ``batch / 2`` examples)."""
    check_tensor("a", a, ndim=1, floating=True)
    check_tensor("b", b, shape=(a.shape[0],), floating=True)
    batch = check_int("batch", batch, lo=2)
    dot = float(a @ b)
    na, nb = float(a.norm()), float(b.norm())
    cos = dot / (na * nb) if na > 0 and nb > 0 else 0.0
    return HalfStats(cos=cos, g2=dot, trace=batch * float((a - b).square().sum()) / 4,
                     batch=batch)


def monte_carlo_halves(problem: LinearRegressionProblem, w: torch.Tensor, batch: int,
                       reps: int, *, seed: int = 0, chunk: int = 250) -> list[HalfStats]:
    """``reps`` independent batches of ``batch`` fresh examples of ``problem`` at ``w``:
    each batch's :class:`HalfStats`, from the per-example gradients ``x (x . w - y)``
    (vectorised, ``chunk`` batches at a time)."""
    batch = check_int("batch", batch, lo=2)
    if batch % 2:
        raise ValueError(f"batch must be even (two halves), got {batch}")
    reps = check_int("reps", reps, lo=1)
    check_int("chunk", chunk, lo=1)
    w = check_tensor("w", w, shape=(problem.d,), floating=True).to(torch.float64)
    gen = torch.Generator().manual_seed(check_int("seed", seed, lo=0))
    out = []
    for start in range(0, reps, chunk):
        r = min(chunk, reps - start)
        x, y = problem.sample(r * batch, gen)
        g = (x * (x @ w - y)[:, None]).reshape(r, batch, problem.d)
        a, b = g[:, :batch // 2].mean(1), g[:, batch // 2:].mean(1)
        out += [two_half_stats(a[i], b[i], batch) for i in range(r)]
    return out


def measure_noise_scale(model: nn.Module, task, batch: int, reps: int, *,
                        first_draw: int = 1_000_000) -> dict:
    """``B_simple`` of ``model`` on ``task`` at its current parameters, from ``reps``
    batches of ``batch`` (draws ``first_draw``, ``first_draw + 1``, ...: apart from the
    training draws): the ratio of the mean ``tr Sigma`` and ``|G|^2`` estimates, with the
    mean cosine of the halves. The model is not changed."""
    check_module("model", model)
    batch = check_int("batch", batch, lo=2)
    reps = check_int("reps", reps, lo=1)
    g2 = trace = cos = 0.0
    for r in range(reps):
        x, y = task.draw(first_draw + r, batch)
        s = two_half_stats(*half_gradients(model, task.loss_fn, x, y), batch)
        g2, trace, cos = g2 + s.g2 / reps, trace + s.trace / reps, cos + s.cos / reps
    return {"b_simple": trace / g2 if g2 > 0 else math.inf, "g2": g2, "trace": trace,
            "cos": cos}


class NoiseScale:
    """Running ``B_simple``: exponential moving averages of the unbiased ``|G|^2`` and
    ``tr Sigma`` estimates, and their ratio (averaging the ratio itself would be biased;
    McCandlish et al. Appendix A). ``decay`` is the averages' weight on the past. Both
    averages start at 0 and so carry the same start-up factor ``1 - decay^t``, which
    cancels in the ratio."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = check_float("decay", decay, lo=0, hi=1, hi_open=True)
        self.g2 = 0.0
        self.trace = 0.0

    def update(self, stats: HalfStats) -> float:
        """Fold in one step's estimates; return the current ``B_simple``."""
        d = self.decay
        self.g2 = d * self.g2 + (1 - d) * stats.g2
        self.trace = d * self.trace + (1 - d) * stats.trace
        return self.b_simple

    @property
    def b_simple(self) -> float:
        """``tr Sigma / |G|^2`` from the averages (``inf`` while ``|G|^2 <= 0``)."""
        return self.trace / self.g2 if self.g2 > 0 else math.inf


class SimiGradController:
    """Grow the batch when the halves' cosine is below ``target``, shrink it when above.

    The controller keeps a real-valued batch ``value``; each :meth:`update` multiplies it
    by ``1 + step`` (cosine below target) or divides by it (at or above), within
    ``[min_batch, max_batch]``. :meth:`batch` rounds it to a whole number of ``quantum``
    (ranks x micro-batch: the batch is realised by accumulation). A reconstruction of
    SimiGrad's controller (module docstring)."""

    def __init__(self, target: float = 0.5, *, step: float = 0.1, start: int = 32,
                 min_batch: int = 2, max_batch: int = 65536, quantum: int = 2) -> None:
        self.target = check_float("target", target, lo=0, hi=1, lo_open=True, hi_open=True)
        self.step = check_float("step", step, lo=0, hi=1, lo_open=True)
        self.quantum = check_int("quantum", quantum, lo=2)
        if quantum % 2:
            raise ValueError(f"quantum must be even (two halves), got {quantum}")
        self.min_batch = check_int("min_batch", min_batch, lo=quantum)
        self.max_batch = check_int("max_batch", max_batch, lo=self.min_batch)
        start = check_int("start", start, lo=self.min_batch, hi=self.max_batch)
        self.value = float(start)

    def update(self, cos: float) -> int:
        """One decision on this step's cosine; returns the next step's batch."""
        check_float("cos", cos, lo=-1 - 1e-9, hi=1 + 1e-9)
        f = 1.0 + self.step
        self.value = self.value * f if cos < self.target else self.value / f
        self.value = min(max(self.value, self.min_batch), self.max_batch)
        return self.batch()

    def batch(self) -> int:
        """``value`` rounded to a whole number of quanta (at least one)."""
        return self.quantum * max(1, round(self.value / self.quantum))


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

    def draw(self, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        idx = torch.randint(0, self.split.x_train.shape[0], (n,), generator=gen)
        return self.split.x_train[idx], self.split.y_train[idx]

    def loss_fn(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)

    def eval_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            return float(self.loss_fn(model(self.split.x_train), self.split.y_train))


# ---------------------------------------------------------------------------------------
# The two half-batch gradients: in one process, and on two sub-groups of real ranks.

def _flat_grad(params: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


def _mean_grad(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor,
               accum: int) -> torch.Tensor:
    """Gradient of the mean loss over ``x`` as ``accum`` equal micro-batches."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]   # the caller's .grad is put back afterwards
    try:
        for p in params:
            p.grad = None
        for xm, ym in zip(x.chunk(accum), y.chunk(accum), strict=True):
            (loss_fn(model(xm), ym) / accum).backward()
        return _flat_grad(params).detach().clone()
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g


def half_gradients(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, *,
                   world_size: int = 2, accum: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Serial reference: the mean gradients over the first and the second half of the
    batch, each half computed as the ranks do (``world_size / 2`` shards of ``accum``
    micro-batches, averaged). Returns flat vectors; ``model``'s ``.grad`` is left as it was."""
    check_module("model", model)
    world_size = _check_world(world_size)
    accum = check_int("accum", accum, lo=1)
    n = x.shape[0]
    if n % (world_size * accum):
        raise ValueError(f"batch of {n} does not split into {world_size} ranks x {accum} "
                         "micro-batches")
    per = n // world_size
    shards = [_mean_grad(model, loss_fn, x[r * per:(r + 1) * per], y[r * per:(r + 1) * per],
                         accum) for r in range(world_size)]
    h = world_size // 2
    return sum(shards[:h]) / h, sum(shards[h:]) / h


def _check_world(world_size: int) -> int:
    world_size = check_int("world_size", world_size, lo=2)
    if world_size % 2:
        raise ValueError(f"world_size must be even (two halves), got {world_size}")
    return world_size


def half_groups(world_size: int) -> tuple[object, object, int]:
    """Inside a worker: the process groups of ranks ``[0, W/2)`` and ``[W/2, W)``, and
    which half (0 or 1) this rank is in. Every rank calls ``new_group`` for both, in the
    same order, as torch.distributed requires."""
    world_size = _check_world(world_size)
    h = world_size // 2
    groups = (tdist.new_group(list(range(h))), tdist.new_group(list(range(h, world_size))))
    half = int(tdist.get_rank() >= h)
    return groups[0], groups[1], half


class _HalfProbe:
    """A rank's side of the two-half probe: :class:`parlearn.data_parallel.BucketedDP` on
    its half's group (accumulation under ``no_sync``) leaves the half mean in ``.grad``;
    one exchange with the partner rank in the other half (same position) gives both
    halves to both, bitwise the same on every rank, so every rank takes the same decisions."""

    def __init__(self, model: nn.Module, world_size: int, bucket_bytes: int = 2**20) -> None:
        from parlearn.multi_device.data_parallel import BucketedDP

        self.world_size = _check_world(world_size)
        g0, g1, self.half = half_groups(world_size)
        self.rank = tdist.get_rank()
        self.partner = (self.rank + world_size // 2) % world_size
        self.dp = BucketedDP(model, bucket_bytes=bucket_bytes,
                             group=(g0, g1)[self.half], record=False)
        self.params = [p for p in model.parameters() if p.requires_grad]

    def halves(self, loss_fn, x: torch.Tensor, y: torch.Tensor, accum: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shard of the batch ``x, y`` (the full batch, same on every rank)
        -> ``(a, b)``, the two halves' mean gradients."""
        from parlearn.multi_device.data_parallel import shard

        xs, ys = shard(x, self.rank, self.world_size), shard(y, self.rank, self.world_size)
        for p in self.params:
            p.grad = None
        for j, (xm, ym) in enumerate(zip(xs.chunk(accum), ys.chunk(accum), strict=True)):
            ctx = self.dp.no_sync() if j < accum - 1 else contextlib.nullcontext()
            with ctx:
                (loss_fn(self.dp(xm), ym) / accum).backward()
        mine = _flat_grad(self.params).detach().clone()
        theirs = torch.empty_like(mine)
        ops = [tdist.P2POp(tdist.isend, mine, self.partner),
               tdist.P2POp(tdist.irecv, theirs, self.partner)]
        for w in tdist.batch_isend_irecv(ops):
            w.wait()
        return (mine, theirs) if self.half == 0 else (theirs, mine)


def worker_half_gradients(rank: int, world_size: int, model: nn.Module, x: torch.Tensor,
                          y: torch.Tensor, accum: int = 1) -> dict:
    """A :func:`parlearn.dist.run` worker: the two halves' mean gradients of a
    cross-entropy loss over the batch ``x, y`` on real ranks (two sub-groups, then the
    partner exchange), and the payload bytes the ledger saw by kind of collective."""
    from parlearn.dist import ledger

    probe = _HalfProbe(model, world_size)
    with ledger() as led:
        a, b = probe.halves(nn.functional.cross_entropy, x, y, accum)
    return {"a": a, "b": b, "bytes": {k: v[1] for k, v in led.summary().items()}}


def probe_bytes(n_params: int, world_size: int, element_size: int = 4) -> dict:
    """Modeled wire bytes per rank per step: the two-half probe (ring all-reduce within a
    half of ``W/2`` ranks, ``2 (W/2 - 1)/(W/2) n``, plus ``n`` to the partner) against one
    plain ring all-reduce over all ``W`` ranks (``2 (W-1)/W n``); ``n`` in bytes."""
    n = check_int("n_params", n_params, lo=1) * check_int("element_size", element_size, lo=1)
    w = _check_world(world_size)
    h = w // 2
    probe = 2 * (h - 1) / h * n + n
    plain = 2 * (w - 1) / w * n
    return {"probe": probe, "plain": plain, "ratio": probe / plain}


# ---------------------------------------------------------------------------------------
# Training with a fixed batch, SimiGrad's controller, or AdaScale: one loop, two engines.

METHODS = ("fixed", "simigrad", "adascale")
LR_SCALINGS = ("linear", "sqrt", "gain")


@dataclass
class History:
    """Per step of a :func:`train` run: ``batch``, ``lr``, ``cos`` (of that step's halves),
    ``b_simple`` (running estimate), ``gain`` (AdaScale's, from the estimate), ``samples``
    (examples used so far, this step included) and ``loss`` (evaluated after the step;
    ``loss[0]`` is the starting loss, so ``loss`` has one more entry); ``params`` after the
    last step; ``bytes``: the ledger's payload bytes of the last step (real ranks only)."""

    method: str
    batch: list[int] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    cos: list[float] = field(default_factory=list)
    b_simple: list[float] = field(default_factory=list)
    gain: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    params: dict | None = None
    bytes: dict = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.batch)


def _check_train(method, steps, lr, batch, base_batch, target, step, lr_scaling, max_batch,
                 decay, micro, world_size, target_loss):
    check_choice("method", method, METHODS)
    check_int("steps", steps, lo=1)
    check_float("lr", lr, lo=0)
    world_size = _check_world(world_size)
    micro = check_int("micro", micro, lo=1)
    quantum = world_size * micro
    batch = check_int("batch", batch, lo=quantum)
    if batch % quantum:
        raise ValueError(f"batch={batch} must be a multiple of world_size x micro = {quantum}")
    check_int("base_batch", base_batch, lo=1, hi=batch)
    check_float("target", target, lo=0, hi=1, lo_open=True, hi_open=True)
    check_float("step", step, lo=0, hi=1, lo_open=True)
    check_choice("lr_scaling", lr_scaling, LR_SCALINGS)
    check_int("max_batch", max_batch, lo=batch)
    check_float("decay", decay, lo=0, hi=1, hi_open=True)
    if target_loss is not None:
        check_float("target_loss", target_loss)
    return quantum


def _lr_ratio(b_simple: float, b_from: int, b_to: int) -> float:
    """McCandlish's optimal learning rate at ``b_to`` over that at ``b_from``,
    ``(1 + B_simple/b_from) / (1 + B_simple/b_to)``: AdaScale's gain for ``S = b_to/b_from``.
    A negative estimate counts as 0 (no noise: ratio 1), an infinite one as pure noise
    (ratio ``b_to / b_from``)."""
    if not math.isfinite(b_simple):
        return b_to / b_from
    b_simple = max(b_simple, 0.0)
    return (1.0 + b_simple / b_from) / (1.0 + b_simple / b_to)


def _loop(model: nn.Module, task, halves_fn, *, method: str, steps: int, lr: float,
          batch: int, base_batch: int, target: float, step: float, lr_scaling: str,
          max_batch: int, decay: float, quantum: int, target_loss: float | None) -> History:
    """The training loop both engines share; ``halves_fn(x, y, accum) -> (a, b)``."""
    params = [p for p in model.parameters() if p.requires_grad]
    hist = History(method=method, loss=[task.eval_loss(model)])
    noise = NoiseScale(decay)
    ctl = SimiGradController(target, step=step, start=batch, min_batch=quantum,
                             max_batch=max_batch, quantum=quantum)
    b, seen = batch, 0
    for t in range(steps):
        x, y = task.draw(t, b)
        a, bb = halves_fn(x, y, b // quantum)
        stats = two_half_stats(a, bb, b)
        b_simple = noise.update(stats)
        gain = _lr_ratio(b_simple, base_batch, b)
        if method == "adascale":
            step_lr = lr * gain
        elif method == "simigrad":
            ratio = b / batch
            step_lr = lr * {"linear": ratio, "sqrt": ratio**0.5,
                            "gain": _lr_ratio(b_simple, batch, b)}[lr_scaling]
        else:
            step_lr = lr
        g = (a + bb) / 2
        with torch.no_grad():
            offset = 0
            for p in params:
                p -= step_lr * g[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        seen += b
        hist.batch.append(b)
        hist.lr.append(step_lr)
        hist.cos.append(stats.cos)
        hist.b_simple.append(b_simple)
        hist.gain.append(gain)
        hist.samples.append(seen)
        hist.loss.append(task.eval_loss(model))
        if target_loss is not None and hist.loss[-1] <= target_loss:
            break
        if not math.isfinite(hist.loss[-1]):   # diverged: nothing more to learn from it
            break
        if method == "simigrad":
            b = ctl.update(stats.cos)
    hist.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return hist


def train(model: nn.Module, task, *, method: str = "simigrad", steps: int = 100,
          lr: float = 0.1, batch: int = 32, base_batch: int | None = None,
          target: float = 0.5, step: float = 0.1, lr_scaling: str = "gain",
          max_batch: int = 4096, decay: float = 0.9, micro: int = 1, world_size: int = 2,
          target_loss: float | None = None) -> History:
    """Serial reference: train ``model`` in place with plain SGD on ``task``
    (:class:`RegressionTask` or :class:`DigitsTask`), computing each step's two half-batch
    mean gradients in this process (:func:`half_gradients`) and stepping on their mean.
    ``world_size`` and ``micro`` only set the batch quantum ``world_size x micro`` the
    real ranks of :func:`worker_train` need, so that both engines take the same batches.

    ``method``: ``"fixed"`` keeps ``batch`` and ``lr``; ``"simigrad"`` starts at ``batch``
    and lets :class:`SimiGradController` (``target``, ``step``, up to ``max_batch``) move it
    every step, the learning rate following ``lr_scaling`` from ``lr`` at ``batch``
    (``linear``: ``B/B_0``, ``sqrt``: ``sqrt(B/B_0)``, ``gain``: McCandlish's optimal-rate
    ratio from the running ``B_simple``); ``"adascale"`` keeps ``batch`` = ``S`` x
    ``base_batch`` and multiplies ``lr`` (tuned for ``base_batch``) by the running gain.
    Stops after ``steps`` steps, once the evaluated loss is at most ``target_loss``, or
    once it is not finite (diverged).
    """
    check_module("model", model)
    base_batch = batch if base_batch is None else base_batch
    quantum = _check_train(method, steps, lr, batch, base_batch, target, step, lr_scaling,
                           max_batch, decay, micro, world_size, target_loss)

    def halves(x, y, accum):
        # Each half's mean gradient in one pass: the accumulation over ranks and micro-batches
        # that worker_train does computes the same mean (to round-off) in pieces.
        return half_gradients(model, task.loss_fn, x, y)

    return _loop(model, task, halves, method=method, steps=steps, lr=lr, batch=batch,
                 base_batch=base_batch, target=target, step=step, lr_scaling=lr_scaling,
                 max_batch=max_batch, decay=decay, quantum=quantum, target_loss=target_loss)


def worker_train(rank: int, world_size: int, model: nn.Module, task, kwargs: dict) -> History:
    """A :func:`parlearn.dist.run` worker: :func:`train` (``kwargs`` as there, ``micro``
    included) on real ranks. Each rank draws the same batch, takes its shard, accumulates
    ``B / (W micro)`` micro-batches under ``no_sync``, its half's group all-reduces, the
    partners exchange halves; every rank then holds the same ``a``, ``b`` and takes the
    same step and the same controller decision. Returns the history (every rank's is the
    same), its ``bytes`` the ledger's payload bytes of the last step by kind of collective."""
    check_module("model", model)
    if "world_size" in kwargs and kwargs["world_size"] != world_size:
        raise ValueError(f"kwargs world_size={kwargs['world_size']} differs from the run's "
                         f"{world_size}")
    args = {k: p.default for k, p in inspect.signature(train).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and k != "world_size"}
    unknown = set(kwargs) - set(args) - {"world_size"}
    if unknown:
        raise ValueError(f"unknown train arguments {sorted(unknown)}; allowed {sorted(args)}")
    args.update({k: v for k, v in kwargs.items() if k != "world_size"})
    if args["base_batch"] is None:
        args["base_batch"] = args["batch"]
    quantum = _check_train(args["method"], args["steps"], args["lr"], args["batch"],
                           args["base_batch"], args["target"], args["step"],
                           args["lr_scaling"], args["max_batch"], args["decay"],
                           args["micro"], world_size, args["target_loss"])
    from parlearn.dist import ledger

    probe = _HalfProbe(model, world_size)
    last: dict = {}

    def halves(x, y, accum):
        with ledger() as led:
            out = probe.halves(task.loss_fn, x, y, accum)
        last.clear()
        last.update({k: v[1] for k, v in led.summary().items()})
        return out

    del args["micro"]
    hist = _loop(model, task, halves, quantum=quantum, **args)
    probe.dp.remove_hooks()
    hist.bytes = dict(last)
    return hist


def samples_to_target(hist: History, target_loss: float) -> tuple[int, int] | None:
    """``(steps, samples)`` at the first step whose evaluated loss is at most
    ``target_loss``, or None if the run never got there."""
    target_loss = check_float("target_loss", target_loss)
    for t, loss in enumerate(hist.loss[1:]):
        if loss <= target_loss:
            return t + 1, hist.samples[t]
    return None


def batch_sweep(model: nn.Module, task, batches: Sequence[int], lrs: Sequence[float],
                target_loss: float, *, steps: int = 2000, progress=None) -> dict:
    """Steps and examples to ``target_loss`` with a fixed batch, for each of ``batches``,
    each at its best learning rate of ``lrs`` (fewest steps), and the fit of
    ``S = S_min (1 + B_crit / B)`` to them (:func:`critical_batch_fit`). A batch that no
    rate brings to the target within ``steps`` is reported with ``steps=None`` and left
    out of the fit. ``progress(fraction, text)`` is called after each batch."""
    import copy

    check_module("model", model)
    batches = [check_int("batches[i]", b, lo=2) for b in batches]
    lrs = [check_float("lrs[i]", lr, lo=0, lo_open=True) for lr in lrs]
    if not batches or not lrs:
        raise ValueError("batches and lrs must not be empty")
    rows = []
    for i, b in enumerate(batches):
        best = None
        for lr in lrs:
            h = train(copy.deepcopy(model), task, method="fixed", batch=b, lr=lr, steps=steps,
                      target_loss=target_loss, max_batch=b)
            hit = samples_to_target(h, target_loss)
            if hit is not None and (best is None or hit[0] < best[1]):
                best = (lr, *hit)
        rows.append({"batch": b, "lr": best[0] if best else None,
                     "steps": best[1] if best else None, "samples": best[2] if best else None})
        if progress is not None:
            progress((i + 1) / len(batches), f"batch {b}")
    ok = [r for r in rows if r["steps"] is not None]
    fit = critical_batch_fit([r["batch"] for r in ok], [r["steps"] for r in ok])
    return {"rows": rows, "fit": fit, "target_loss": target_loss}


def tradeoff_model(b_noise: Sequence[float], *, batch: float | None = None,
                   factor: float | None = None, power: float = 1.0) -> dict:
    """Modeled steps and examples of a whole run whose noise scale changes: ``b_noise[i]``
    is the noise scale during the ``i``-th of ``len(b_noise)`` equal pieces of the run's
    ``S_min`` (each piece takes 1 step at infinite batch). A piece at noise scale ``b``
    with batch ``B`` takes ``1 + b / B`` steps of ``B`` examples (McCandlish's
    ``S = S_min (1 + B_noise / B)``, piece by piece). Either a fixed ``batch``, or an
    adaptive one ``B = factor x b^power``. ``power = 1`` is what a controller tracking the
    noise scale holds (SimiGrad's target ``s`` gives ``factor = 2 s / (1 - s)``).

    Two consequences, both exact in this model: tracking ``B = k b`` costs ``(1 + 1/k)
    S_min`` steps and ``(1 + k) E_min`` examples, *the same* as the fixed batch ``k`` x
    mean(``b``); and the schedule that minimises ``steps + lambda x examples`` is
    ``B ~ sqrt(b)`` (``d/dB [b/B + lambda B] = 0``), ``power = 0.5``, which beats every
    fixed batch when ``b`` varies. Returns ``{"steps", "samples", "batch": per piece}``."""
    bn = [check_float("b_noise[i]", b, lo=0, lo_open=True) for b in b_noise]
    if not bn:
        raise ValueError("b_noise must not be empty")
    if (batch is None) == (factor is None):
        raise ValueError("give exactly one of batch (fixed) and factor (adaptive)")
    power = check_float("power", power, lo=0, lo_open=True)
    if batch is not None:
        bs = [check_float("batch", batch, lo=0, lo_open=True)] * len(bn)
    else:
        f = check_float("factor", factor, lo=0, lo_open=True)
        bs = [f * b**power for b in bn]
    steps = [1 + b / big for b, big in zip(bn, bs, strict=True)]
    return {"steps": sum(steps), "samples": sum(s * big for s, big in zip(steps, bs,
                                                                           strict=True)),
            "batch": bs}


def frontier_samples(rows: Sequence[dict], steps: float) -> float | None:
    """Examples a fixed batch needs to reach the target in ``steps`` steps, interpolated
    (log-log, between neighbouring batches) on the measured rows of :func:`batch_sweep`;
    None when ``steps`` lies outside the swept range."""
    pts = sorted((r["steps"], r["samples"]) for r in rows if r["steps"] is not None)
    steps = check_float("steps", steps, lo=0, lo_open=True)
    for (s0, e0), (s1, e1) in zip(pts, pts[1:], strict=False):
        if s0 <= steps <= s1:
            if s1 == s0:
                return float(min(e0, e1))
            t = math.log(steps / s0) / math.log(s1 / s0)
            return math.exp(math.log(e0) + t * math.log(e1 / e0))
    return None


def bench(device: torch.device, quick: bool) -> list:
    """See :func:`_bench`; runs it with one torch thread (the caller's count is restored):
    the models are tiny, and extra threads only contend for shared cores."""
    from parlearn.core.device import threads

    with threads(1):
        return _bench(quick)


def _bench(quick: bool) -> list:
    """Rows for ``python -m parlearn.bench batching``: examples to a target training loss
    on digits (an MLP 64-64-10, plain SGD, every run at its best learning rate of a grid),
    SimiGrad (from batch 16) and AdaScale (16 x 16) against the fixed-batch frontier: the
    examples a fixed batch needs to reach the target in as many steps, interpolated on a
    measured sweep of fixed batches. Ratio = frontier examples / method's examples
    (counts, not times; > 1: the adaptive method beats every fixed batch); when the
    method took fewer steps than any fixed batch, the row compares steps instead. SimiGrad is
    repeated on 2 real gloo ranks to check it takes the same batches. ``device`` is not
    used: the counts do not depend on it."""
    import copy

    from parlearn.core.bench import Row
    from parlearn.core.datasets import digits
    from parlearn.core.models import mlp
    from parlearn.dist import run

    task = DigitsTask(digits(), seed=0)
    model = mlp([64, 64, 10], seed=0)
    target_loss = 0.15
    lrs = (0.4, 0.8, 1.2) if quick else (0.1, 0.2, 0.4, 0.8, 1.2)
    # Every best run here reaches the target within ~250 steps; the cap bounds the runs
    # whose rate never gets there (too small, or oscillating without diverging).
    max_steps = 400 if quick else 1500
    sweep = batch_sweep(model, task, (16, 32, 64, 128, 256) if quick
                        else (8, 16, 32, 64, 128, 256, 512), lrs, target_loss, steps=max_steps)
    methods = {"SimiGrad from 16": {"method": "simigrad", "batch": 16, "lr_scaling": "gain"},
               "AdaScale 16 x 16": {"method": "adascale", "batch": 256, "base_batch": 16}}
    rows, notes = [], []
    for label, kw in methods.items():
        best = None
        for lr in lrs:
            h = train(copy.deepcopy(model), task, lr=lr, steps=max_steps,
                      target_loss=target_loss, max_batch=1024, **kw)
            hit = samples_to_target(h, target_loss)
            if hit is not None and (best is None or hit[1] < best[2][1]):
                best = (lr, h, hit)
        if best is None:
            raise RuntimeError(f"{label} did not reach loss {target_loss} with lr in {lrs}")
        lr, h, (steps, samples) = best
        front = frontier_samples(sweep["rows"], steps)
        same = None
        if kw["method"] == "simigrad":
            ranks = run(worker_train, 2, args=(copy.deepcopy(model), task,
                                               {**kw, "lr": lr, "steps": h.steps,
                                                "max_batch": 1024, "target_loss": target_loss}),
                        timeout=120)[0]
            same = ranks.batch == h.batch
            notes.append(f"SimiGrad on 2 gloo ranks took {'the same' if same else 'DIFFERENT'}"
                         f" batches")
        notes.append(f"{label}: lr {lr}, {steps} steps, {samples} examples, batches "
                     f"{min(h.batch)}-{max(h.batch)}")
        dev = "counted (device-independent); digits MLP, SGD"
        fewest = min(r["steps"] for r in sweep["rows"] if r["steps"] is not None)
        if front is not None:
            rows.append(Row("batching", "fixed-batch frontier: examples at equal steps",
                            f"{label} (examples)", front / samples, dev,
                            target="> 1 beats every fixed batch",
                            met=front > samples and same is not False))
        else:   # outside the swept range: compare steps with the fewest any fixed batch took
            rows.append(Row("batching", "fixed batches: fewest steps to target",
                            f"{label} (steps)", fewest / steps, dev,
                            target="> 1 fewer steps than any fixed batch",
                            met=fewest > steps and same is not False))
    fixed = "; ".join(f"B={r['batch']}: {r['steps']} steps, {r['samples']} ex (lr {r['lr']})"
                      for r in sweep["rows"])
    rows[0].detail = (f"target training loss {target_loss}. Fixed batches (best lr): {fixed}; "
                      f"fit B_crit = {sweep['fit']['b_crit']:.0f}. " + "; ".join(notes) + ".")
    return rows
