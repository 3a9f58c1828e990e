"""The noise scale, the halves' cosine and AdaScale's gain: closed forms and estimates.

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

**AdaScale** (Johnson et al. 2020) keeps the batch at ``S`` times a base batch ``b0`` and
multiplies the learning rate by the gain ``r = (s^2 + |G|^2) / (s^2 / S + |G|^2)`` with
``s^2 = tr(Sigma) / b0`` the base batch's gradient variance (:func:`adascale_gain`);
``1 <= r <= S``. In noise-scale terms ``r = (1 + B_simple / b0) / (1 + B_simple / B)``, which
is exactly the ratio of McCandlish's optimal learning rates ``eps_max / (1 + B_noise / B)``
at batch ``B`` and ``b0``: AdaScale's gain is the noise scale's learning-rate rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from parlearn.core.checks import check_float, check_int, check_module, check_tensor
from parlearn.multi_device.batching.halves import half_gradients
from parlearn.multi_device.batching.tasks import LinearRegressionProblem

__all__ = ["expected_cosine", "controller_fixed_point", "adascale_gain",
           "adascale_gain_from_b_simple", "steps_samples_model", "critical_batch_fit",
           "HalfStats", "two_half_stats", "monte_carlo_halves", "measure_noise_scale",
           "NoiseScale"]


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
    # Each entry checked as given: float(True) would pass for a batch of 1.
    raw = batch.tolist() if isinstance(batch, torch.Tensor) else batch
    bs = [check_float("batch", b, lo=0, lo_open=True) for b in (raw if many else [raw])]
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

    def __post_init__(self) -> None:
        # cos is a computed ratio: finite, but a rounding hair past +-1 is not refused
        check_float("cos", self.cos)
        check_float("g2", self.g2)
        check_float("trace", self.trace, lo=0)
        _check_even_batch(self.batch)

    @property
    def b_simple(self) -> float:
        return self.trace / self.g2 if self.g2 != 0 else math.inf


def _check_even_batch(batch: int) -> int:
    batch = check_int("batch", batch, lo=2)
    if batch % 2:
        raise ValueError(f"batch must be even (two equal halves), got {batch}")
    return batch


def two_half_stats(a: torch.Tensor, b: torch.Tensor, batch: int) -> HalfStats:
    """:class:`HalfStats` of the half-batch mean gradients ``a`` and ``b`` (flat vectors,
    each the mean over ``batch / 2`` examples)."""
    check_tensor("a", a, ndim=1, floating=True)
    check_tensor("b", b, shape=(a.shape[0],), floating=True)
    batch = _check_even_batch(batch)
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
    if not isinstance(problem, LinearRegressionProblem):
        raise TypeError(f"problem must be a LinearRegressionProblem, got "
                        f"{type(problem).__name__}")
    batch = _check_even_batch(batch)
    reps = check_int("reps", reps, lo=1)
    check_int("chunk", chunk, lo=1)
    w = check_tensor("w", w, shape=(problem.d,), floating=True, finite=True).to(torch.float64)
    gen = torch.Generator().manual_seed(check_int("seed", seed, lo=0))
    out = []
    for start in range(0, reps, chunk):
        r = min(chunk, reps - start)
        x, y = problem.sample(r * batch, gen)
        g = (x * (x @ w - y)[:, None]).reshape(r, batch, problem.d)
        a, b = g[:, :batch // 2].mean(1), g[:, batch // 2:].mean(1)
        out += [two_half_stats(a[i], b[i], batch) for i in range(r)]
    return out


def _hvp(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor
         ) -> torch.Tensor:
    """``H v`` for the Hessian ``H`` of the mean loss over ``(x, y)`` (double backward; the
    model's ``.grad`` is not touched)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss_fn(model(x), y), params, create_graph=True)
    flat = torch.cat([g.reshape(-1) for g in grads])
    return torch.cat([h.reshape(-1) for h in torch.autograd.grad(flat @ v, params)])


def measure_noise_scale(model: nn.Module, task, batch: int, reps: int, *,
                        first_draw: int = 1_000_000,
                        hessian_data: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """``B_simple`` of ``model`` on ``task`` at its current parameters, from ``reps``
    batches of ``batch`` (draws ``first_draw``, ``first_draw + 1``, ...: apart from the
    training draws): the ratio of the mean ``tr Sigma`` and ``|G|^2`` estimates, with the
    mean cosine of the halves. The model is not changed.

    With ``hessian_data = (x, y)``, also McCandlish's ``B_noise = tr(H Sigma) / G^T H G``
    for ``H`` the Hessian of the mean loss over those examples (the training split, for a
    task that draws from it), from the same halves: ``E[(a-b)^T H (a-b)] = 4 tr(H Sigma)/B``
    and ``E[a^T H b] = G^T H G`` (independent halves), two Hessian-vector products a batch;
    the result's ``"b_noise"`` is the ratio of the two means, as for ``B_simple``."""
    check_module("model", model)
    for attr in ("draw", "loss_fn"):
        if not callable(getattr(task, attr, None)):
            raise TypeError(f"task must have a draw(step, n) and a loss_fn(out, y) method (a "
                            f"RegressionTask, a DigitsTask), got {type(task).__name__}")
    batch = _check_even_batch(batch)
    reps = check_int("reps", reps, lo=1)
    first_draw = check_int("first_draw", first_draw, lo=0)
    if hessian_data is not None:
        if not isinstance(hessian_data, tuple | list) or len(hessian_data) != 2:
            raise TypeError(f"hessian_data must be None or a pair (x, y) of tensors, got "
                            f"{hessian_data!r}")
        hx = check_tensor("hessian_data x", hessian_data[0], finite=True)
        hy = check_tensor("hessian_data y", hessian_data[1], finite=True)
        if hx.dim() == 0 or hy.dim() == 0 or hx.shape[0] != hy.shape[0] or hx.shape[0] == 0:
            raise ValueError(f"hessian_data must hold as many targets as examples, got shapes "
                             f"{tuple(hx.shape)} and {tuple(hy.shape)}")
    g2 = trace = cos = hg = htrace = 0.0
    for r in range(reps):
        x, y = task.draw(first_draw + r, batch)
        a, b = half_gradients(model, task.loss_fn, x, y)
        s = two_half_stats(a, b, batch)
        g2, trace, cos = g2 + s.g2 / reps, trace + s.trace / reps, cos + s.cos / reps
        if hessian_data is not None:
            ha = _hvp(model, task.loss_fn, *hessian_data, a)
            hb = _hvp(model, task.loss_fn, *hessian_data, b)
            hg += float(a @ hb) / reps
            htrace += batch * float((a - b) @ (ha - hb)) / 4 / reps
    out = {"b_simple": trace / g2 if g2 > 0 else math.inf, "g2": g2, "trace": trace,
           "cos": cos}
    if hessian_data is not None:
        out.update(b_noise=htrace / hg if hg > 0 else math.inf, gHg=hg, trace_h=htrace)
    return out


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
