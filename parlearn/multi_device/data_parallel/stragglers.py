"""Stragglers: injected per-rank delays, synchronous SGD, and backup workers.

In synchronous data-parallel SGD every step waits for the slowest worker. Chen et al.,
"Revisiting Distributed Synchronous SGD" (2016), add ``b`` backup workers: of ``n``
workers the step uses the first ``n - b`` gradients to arrive and drops the rest.
Dutta et al., "Slow and Stale Gradients Can Win the Race" (AISTATS 2018), analyse the
trade-off: waiting for fewer workers shortens each step (an order statistic of the
delays) but averages fewer gradients (more noise per step). :func:`backup_tradeoff`
is that cost model; :func:`worker_backup_sgd` runs the protocol on real ranks.

The protocol, honestly: rank 0 is a parameter server (it computes nothing) and ranks
1..n are workers. Each step the server ``isend``\\ s the parameters to every worker and
posts an ``irecv`` for each worker's gradient (tag = step), each waited on by its own
thread that reports the worker's rank to a queue when the gradient is in; the server
takes the first ``n - b`` ranks from the queue (arrival order), averages their gradients
in rank order, takes an SGD step and moves on; the dropped receives complete later and
are discarded. A worker receives the parameters of each step in turn, computes its
gradient, *sleeps its injected delay* (the delay is simulated, the collectives are
real), and sends. A worker that falls behind keeps working on old steps, whose
gradients are dropped; the server drains them at the end. With ``b = 0`` this is
synchronous SGD.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch import nn

from parlearn.core.checks import check_choice, check_float, check_int, check_module, check_tensor

__all__ = ["DelayModel", "expected_order_statistic", "order_statistic_quantile",
           "backup_tradeoff", "worker_backup_sgd"]


@dataclass(frozen=True)
class DelayModel:
    """Seconds of extra delay of each worker at each step.

    ``kind``: ``"none"``; ``"exponential"`` (mean ``mean``); or ``"pareto"`` (heavy
    tailed: ``x_m U**(-1/shape)``, ``x_m`` chosen so that the mean is ``mean``; needs
    ``shape > 1``). ``slow`` adds a fixed delay to some ranks: ``((rank, seconds), ...)``.
    Each draw depends only on ``(seed, rank, step)``, so runs are reproducible and ranks
    need not share a generator.
    """

    kind: str = "exponential"
    mean: float = 0.01
    shape: float = 2.5
    seed: int = 0
    slow: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, ("none", "exponential", "pareto"))
        check_float("mean", self.mean, lo=0)
        check_float("shape", self.shape, lo=1, lo_open=True)
        check_int("seed", self.seed, lo=0)
        if not isinstance(self.slow, tuple) or not all(
                isinstance(e, tuple) and len(e) == 2 for e in self.slow):
            raise TypeError(f"slow must be a tuple of (rank, seconds) pairs, got {self.slow!r}")
        for r, s in self.slow:
            check_int("slow rank", r, lo=0)
            check_float("slow seconds", s, lo=0)

    def delay(self, rank: int, step: int) -> float:
        """The delay of ``rank`` at ``step`` (seconds)."""
        extra = sum(s for r, s in self.slow if r == rank)
        if self.kind == "none" or self.mean == 0:
            return extra
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + rank * 10_007 + step)
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        u = max(u, 1e-300)
        if self.kind == "exponential":
            return extra - self.mean * math.log(u)
        x_m = self.mean * (self.shape - 1) / self.shape
        return extra + x_m * u ** (-1 / self.shape)


def expected_order_statistic(k: int, n: int, delays: DelayModel) -> float:
    """``E[X_(k:n)]``, the expected k-th smallest of n independent delays (no ``slow``).

    Exponential with mean mu: ``mu (H_n - H_{n-k})`` with ``H_m = sum_{i<=m} 1/i``
    (the gaps between order statistics are independent exponentials, Renyi).
    Pareto with scale x_m and shape a: ``x_m Gamma(n+1) Gamma(n-k+1-1/a) /
    (Gamma(n-k+1) Gamma(n+1-1/a))`` (finite when ``n-k+1 > 1/a``). ``"none"``: 0.
    """
    k, n = _check_iid(k, n, delays)
    if delays.kind == "none":
        return 0.0
    if delays.kind == "exponential":
        return delays.mean * sum(1.0 / i for i in range(n - k + 1, n + 1))
    a = delays.shape
    x_m = delays.mean * (a - 1) / a
    return x_m * math.exp(math.lgamma(n + 1) + math.lgamma(n - k + 1 - 1 / a)
                          - math.lgamma(n - k + 1) - math.lgamma(n + 1 - 1 / a))


def _check_iid(k: int, n: int, delays: DelayModel) -> tuple[int, int]:
    n = check_int("n", n, lo=1)
    k = check_int("k", k, lo=1, hi=n)
    if not isinstance(delays, DelayModel):
        raise TypeError(f"delays must be a DelayModel, got {type(delays).__name__}")
    if delays.slow:
        raise ValueError("order statistics here model i.i.d. delays: delays.slow must be ()")
    return k, n


def order_statistic_quantile(k: int, n: int, delays: DelayModel, q: float = 0.5) -> float:
    """The ``q``-quantile of ``X_(k:n)``, the k-th smallest of n independent delays (no
    ``slow``); ``q = 0.5`` is its median, what a median of measured steps estimates (the
    mean, :func:`expected_order_statistic`, is larger: these order statistics are skewed
    right; for the largest of 3 exponentials the median is 1.58 mu, the mean 1.83 mu).

    ``P(X_(k:n) <= t) = sum_{j=k}^{n} C(n, j) F(t)^j (1 - F(t))^(n-j)`` with the delay's
    distribution ``F`` (exponential ``1 - exp(-t/mu)``; Pareto ``1 - (x_m/t)^a`` above
    ``x_m``), solved for ``t`` by bisection to 1e-12 relative. ``"none"``: 0.
    """
    k, n = _check_iid(k, n, delays)
    q = check_float("q", q, lo=0, hi=1, lo_open=True, hi_open=True)
    if delays.kind == "none" or delays.mean == 0:
        return 0.0
    a = delays.shape
    x_m = delays.mean * (a - 1) / a

    def cdf_of_k(t: float) -> float:
        if delays.kind == "exponential":
            f = -math.expm1(-t / delays.mean)
        else:
            f = 0.0 if t <= x_m else 1.0 - (x_m / t) ** a
        return sum(math.comb(n, j) * f**j * (1 - f) ** (n - j) for j in range(k, n + 1))

    lo, hi = 0.0, delays.mean
    while cdf_of_k(hi) < q:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf_of_k(mid) < q else (lo, mid)
    return (lo + hi) / 2


def backup_tradeoff(n: int, b: int, delays: DelayModel, *, compute_seconds: float,
                    sigma2: float = 1.0, batch: int = 1) -> dict[str, float]:
    """Dutta et al.'s trade-off for waiting on the fastest ``k = n - b`` of ``n`` workers.

    time per step  ``T(k) = compute_seconds + E[X_(k:n)]``  (:func:`expected_order_statistic`)
    error per step ``V(k) = sigma2 / (k * batch)``: the variance of the averaged gradient,
    i.i.d. per-example gradient noise ``sigma2``, ``batch`` examples per worker.
    Also returns ``rate = 1 / T`` (steps per second) and ``variance_x_time = V * T``:
    for SGD with a small fixed learning rate the noise floor is proportional to ``V``,
    and the time to a given loss in the noise-dominated regime to ``V * T``, so the best
    ``b`` minimises ``V(n-b) T(n-b)`` (a model, not a measurement).
    """
    n = check_int("n", n, lo=1)
    b = check_int("b", b, lo=0, hi=n - 1)
    compute = check_float("compute_seconds", compute_seconds, lo=0)
    check_float("sigma2", sigma2, lo=0)
    check_int("batch", batch, lo=1)
    k = n - b
    t = compute + expected_order_statistic(k, n, delays)
    v = sigma2 / (k * batch)
    return {"k": k, "time_per_step": t, "rate": 1 / t if t > 0 else math.inf,
            "variance": v, "variance_x_time": v * t}


def _flat_grad(model: nn.Module) -> torch.Tensor:
    # a frozen or unused parameter has no gradient: it counts as 0, so it does not move
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
                      for p in model.parameters()])


def _set_flat(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def worker_backup_sgd(rank: int, world_size: int, model: nn.Module, xs: list[torch.Tensor],
                      ys: list[torch.Tensor], b: int, delays: DelayModel, lr: float,
                      steps: int, eval_data=None) -> dict:
    """Synchronous SGD with ``b`` backup workers on real ranks (protocol: module docstring).

    Rank 0 is the server, ranks 1..n (``n = world_size - 1``) the workers; worker w uses
    ``xs[w - 1], ys[w - 1]`` as its data, drawing batch ``step`` as ``xs[w-1][step]``
    (each a tensor of shape ``(steps, batch, ...)``). The server returns, per step, the
    ranks whose gradients it used (``accepted``, in arrival order), which were still
    missing when it decided (``late``), the averaged gradient, its wall time since the
    start, and the test accuracy on ``eval_data = (x, y)`` when given; workers return
    their gradients per step and the parameters they computed them at.
    """
    # Every argument is checked on every rank before the first message (the server checks
    # the workers' data too): a bad one is an error on all ranks, never a server left waiting.
    world_size = check_int("world_size", world_size, lo=2)   # a server and a worker
    n = world_size - 1
    check_int("rank", rank, lo=0, hi=n)
    check_module("model", model)
    from parlearn.multi_device.data_parallel.ddp import refuse_batch_statistics
    refuse_batch_statistics(model, "backup-worker SGD")
    check_int("b", b, lo=0, hi=n - 1)
    steps = check_int("steps", steps, lo=1)
    check_float("lr", lr, lo=0, lo_open=True)
    if not isinstance(delays, DelayModel):
        raise TypeError(f"delays must be a DelayModel, got {type(delays).__name__}")
    for name, seq in (("xs", xs), ("ys", ys)):
        if not isinstance(seq, list | tuple) or len(seq) != n:
            raise TypeError(f"{name} must be a list of {n} tensors (one per worker), got "
                            f"{seq!r:.80}")
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        check_tensor(f"xs[{i}]", x, finite=True)
        check_tensor(f"ys[{i}]", y, floating=False)
        if x.dim() < 2 or x.shape[0] < steps:
            raise ValueError(f"xs[{i}] must have shape (steps, batch, ...) with at least "
                             f"steps={steps} batches, got {tuple(x.shape)}")
        if y.dim() != 2 or tuple(y.shape) != tuple(x.shape[:2]):
            raise ValueError(f"ys[{i}] must have shape {tuple(x.shape[:2])} (labels of xs[{i}]),"
                             f" got {tuple(y.shape)}")
    if eval_data is not None:
        if not isinstance(eval_data, list | tuple) or len(eval_data) != 2:
            raise TypeError(f"eval_data must be None or a pair (x, y), got {eval_data!r:.80}")
        ex = check_tensor("eval_data x", eval_data[0], finite=True)
        ey = check_tensor("eval_data y", eval_data[1], ndim=1, floating=False)
        if ex.dim() == 0 or ex.shape[0] != ey.shape[0]:
            raise ValueError(f"eval_data must hold one label per example, got shapes "
                             f"{tuple(ex.shape)} and {tuple(ey.shape)}")
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if rank == 0:
        return _server(model, theta, n, b, lr, steps, eval_data)
    grads, thetas = [], []
    for step in range(steps):
        tdist.recv(theta, src=0, tag=step)
        _set_flat(model, theta)
        model.zero_grad(set_to_none=True)
        x, y = xs[rank - 1][step], ys[rank - 1][step]
        nn.functional.cross_entropy(model(x), y).backward()
        g = _flat_grad(model).detach().clone()
        time.sleep(delays.delay(rank, step))        # the injected straggling
        tdist.send(g, dst=0, tag=step)
        grads.append(g)
        thetas.append(theta.clone())
    return {"grads": grads, "thetas": thetas}


def _wait_then_post(work, w: int, arrivals: queue.Queue) -> None:
    work.wait()
    arrivals.put(w)


def _server(model, theta, n, b, lr, steps, eval_data) -> dict:
    # gloo's irecv never reports completion without wait(), so one thread per receive
    # waits for it and posts the worker's rank: the queue holds the arrival order.
    sends, waiters = [], []
    log = {"accepted": [], "late": [], "grad": [], "seconds": [], "accuracy": []}
    t0 = time.perf_counter()
    for step in range(steps):
        snapshot = theta.clone()            # each isend owns its buffer until it completes
        sends += [tdist.isend(snapshot, dst=w, tag=step) for w in range(1, n + 1)]
        bufs = {w: torch.empty_like(theta) for w in range(1, n + 1)}
        arrivals: queue.Queue[int] = queue.Queue()
        for w in range(1, n + 1):
            work = tdist.irecv(bufs[w], src=w, tag=step)
            th = threading.Thread(target=_wait_then_post, args=(work, w, arrivals), daemon=True)
            th.start()
            waiters.append(th)
        arrived = [arrivals.get() for _ in range(n - b)]
        late = [w for w in range(1, n + 1) if w not in arrived]
        # a dropped gradient that arrived while we were collecting is still dropped;
        # `late` lists only the ones that had not arrived when the step was decided
        while not arrivals.empty():
            late.remove(arrivals.get())
        g = torch.zeros_like(theta)
        for w in sorted(arrived):
            g += bufs[w]
        g /= len(arrived)
        theta -= lr * g
        log["accepted"].append(arrived)
        log["late"].append(late)
        log["grad"].append(g)
        log["seconds"].append(time.perf_counter() - t0)
        if eval_data is not None:
            _set_flat(model, theta)
            with torch.no_grad():
                pred = model(eval_data[0]).argmax(1)
            log["accuracy"].append(float((pred == eval_data[1]).double().mean()))
    for work in sends:
        work.wait()
    for th in waiters:
        th.join()
    log["drained_seconds"] = time.perf_counter() - t0
    return log
