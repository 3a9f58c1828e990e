"""Data parallelism from scratch, beside torch's DistributedDataParallel.

Every rank holds a full replica of the model, runs forward and backward on its own
shard of the batch, and the ranks average their gradients before the optimizer step;
with equal shards the average is the full-batch gradient, so N ranks train exactly as
one process on the whole batch. Three ways to average, each wrapping an ordinary
``nn.Module`` so that plain ``loss.backward()`` and any optimizer keep working:

- :class:`NaiveDP`: when backward has finished, one ``all_reduce`` per gradient.
- :class:`BucketedDP`: gradients are packed into buckets of about ``bucket_bytes`` (in
  reverse registration order, the order backward produces them); a gradient hook
  (``register_post_accumulate_grad_hook``) launches a bucket's asynchronous all-reduce
  as soon as its last gradient is accumulated, while backward is still computing the
  earlier layers: the overlap of Li et al., "PyTorch Distributed" (VLDB 2020).
- :func:`make_ddp`: torch's ``DistributedDataParallel``, the engine a user deploys.

The from-scratch wrappers refuse a model with BatchNorm (statistics of each rank's shard
are not the whole batch's, so the result would not equal one process) and check, in one
``all_gather_object`` before any other message, that every rank wraps the same model
(names, shapes, dtypes): a disagreement is a ``ValueError`` on every rank, not a hang.
All three keep a ``no_sync()`` context for gradient accumulation (no communication;
the next synchronised backward averages the accumulated sum). Every trainable parameter
must receive a gradient in each synchronised backward, as with DDP's default
``find_unused_parameters=False``. :func:`train_reference` is the single-process
reference they are tested against, :func:`dp_step_model` the alpha-beta cost model of
one step. :func:`worker_train` runs them on real ranks under :func:`parlearn.distributed.run`;
the measurement workers of lesson 11 and the bench live in
:mod:`parlearn.data_parallel.workers`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as tdist
from torch import nn

from parlearn.core.checks import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_module,
    check_tensor,
)
from parlearn.distributed.agree import agree

__all__ = ["NaiveDP", "BucketedDP", "CompressedDP", "make_ddp", "TiedMLP", "train_reference",
           "shard", "worker_train"]


def refuse_batch_statistics(module: nn.Module, who: str, *,
                            training_only: bool = False) -> None:
    """Raise ``ValueError`` naming the first BatchNorm in ``module``: its statistics are of
    each rank's shard (and its running buffers drift apart), so data parallelism over it
    would not equal one process on the whole batch. With ``training_only``, only one in
    training mode is refused (in eval mode it normalises by its running statistics, not by
    the batch's)."""
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or not training_only):
            mode = " in training mode" if training_only else ""
            raise ValueError(
                f"module has {type(m).__name__} at {name!r}{mode}: {who} averages gradients, "
                "but batch statistics computed on each rank's shard differ from the whole "
                "batch's (and running buffers drift apart), so it would not train as one "
                "process; use LayerNorm/GroupNorm, or SyncBatchNorm with torch's DDP or FSDP")


def check_same_on_every_rank(module: nn.Module, group, who: str) -> None:
    """The parameters' and buffers' names, shapes, dtypes and ``requires_grad`` agree on every
    rank (:func:`parlearn.distributed.agree.agree`, before any other message): a model that
    differs is a ``ValueError`` on every rank, not a hang or a garbled broadcast."""
    agree({f"module (wrapped by {who}: names, shapes, dtypes, requires_grad)": [
        (n, tuple(t.shape), str(t.dtype), bool(t.requires_grad))
        for n, t in [*module.named_parameters(), *module.named_buffers()]]}, group=group)


class _DataParallel(nn.Module):
    """What the from-scratch wrappers share: replica sync at start, hooks, event log."""

    def __init__(self, module: nn.Module, *, group=None, record: bool = True) -> None:
        super().__init__()
        check_module("module", module)
        check_bool("record", record)
        self.record = record
        refuse_batch_statistics(module, type(self).__name__)
        if not tdist.is_initialized():
            raise RuntimeError("data parallel wrappers need an initialised process group "
                               "(run the worker with parlearn.distributed.run or torchrun)")
        check_same_on_every_rank(module, group, type(self).__name__)
        self.module = module
        self.group = group
        self.world_size = tdist.get_world_size(group)
        self._sync = True
        self._queued = False
        # (what, label, perf_counter seconds): the order gradients arrive and buckets go.
        # A few entries per parameter per step: pass record=False for long runs.
        self.events: list[tuple[str, str, float]] = []
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = {id(p): n for n, p in named}
        self._params = [p for _, p in named]
        src = 0 if group is None else tdist.get_global_rank(group, 0)
        with torch.no_grad():   # every replica starts from rank 0's weights and buffers
            for t in list(module.parameters()) + list(module.buffers()):
                tdist.broadcast(t.data, src=src, group=group)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                         for p in self._params]

    def _log(self, what: str, label: str = "") -> None:
        if self.record:
            self.events.append((what, label, time.perf_counter()))

    def forward(self, *args, **kwargs):
        self._log("forward")
        out = self.module(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._on_backward_start)
        return out

    def _on_backward_start(self, grad):
        self._log("backward")
        return grad

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally and communicate nothing."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad(self, p: torch.Tensor) -> None:
        self._log("grad", self._names[id(p)])
        if not self._sync:
            return
        if not self._queued:
            self._queued = True
            # Runs once, when the autograd engine has finished this whole backward.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._grad_ready(p)

    def _grad_ready(self, p: torch.Tensor) -> None:
        pass

    def _end_of_backward(self) -> None:
        self._queued = False
        missing = [self._names[id(p)] for p in self._params if p.grad is None]
        if missing:
            raise RuntimeError(f"parameters {missing} got no gradient in this backward; "
                               "every trainable parameter must be used (as in DDP without "
                               "find_unused_parameters)")
        self._finish()
        self._log("end")

    def _finish(self) -> None:
        raise NotImplementedError

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the wrapped module's parameters."""
        for h in self._handles:
            h.remove()
        self._handles = []


def _flat_buffer(buf: torch.Tensor | None, grads: list[torch.Tensor]) -> torch.Tensor:
    """``buf`` if it can hold ``grads`` flattened end to end (same total size, dtype and
    device as the first), else a new buffer that can."""
    numel = sum(g.numel() for g in grads)
    g = grads[0]
    if buf is None or buf.numel() != numel or buf.dtype != g.dtype or buf.device != g.device:
        buf = torch.empty(numel, dtype=g.dtype, device=g.device)
    return buf


def _unpack(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` back into ``grads`` (the inverse of packing)."""
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class NaiveDP(_DataParallel):
    """After backward, ``all_reduce`` each gradient (one message per parameter) and divide
    by the world size. Nothing overlaps: communication starts when backward is done."""

    def _finish(self) -> None:
        for p in self._params:
            tdist.all_reduce(p.grad, group=self.group)
            p.grad.div_(self.world_size)
            self._log("reduced", self._names[id(p)])


class BucketedDP(_DataParallel):
    """Gradients packed into buckets; each bucket's all-reduce launched from the gradient
    hook of its last gradient, during backward.

    Buckets are filled greedily in reverse registration order up to ``bucket_bytes``
    (a larger parameter gets a bucket of its own), so every trainable parameter is in
    exactly one bucket (``self.buckets`` holds their names). Buckets are launched in
    index order (bucket i only after buckets < i) so every rank issues the same sequence
    of collectives. The end-of-backward callback waits for them and copies the averages
    back into ``.grad``. Events ``launch``/``done`` record when each bucket was issued
    and when its all-reduce completed (a callback on its future).
    """

    def __init__(self, module: nn.Module, *, bucket_bytes: int = 25 * 2**20, group=None,
                 record: bool = True):
        check_int("bucket_bytes", bucket_bytes, lo=1)
        super().__init__(module, group=group, record=record)
        self.bucket_bytes = bucket_bytes
        self._bucket_params: list[list[torch.Tensor]] = []
        size = 0
        for p in reversed(self._params):
            nbytes = p.numel() * p.element_size()
            if not self._bucket_params or size + nbytes > bucket_bytes:
                self._bucket_params.append([])
                size = 0
            self._bucket_params[-1].append(p)
            size += nbytes
        self._bucket_of = {id(p): i for i, b in enumerate(self._bucket_params) for p in b}
        self.buckets = [[self._names[id(p)] for p in b] for b in self._bucket_params]
        # one flat buffer per bucket, kept from step to step (as DDP's buckets are): a
        # fresh one each step would cost its pages again
        self._flats: list[torch.Tensor | None] = [None] * len(self._bucket_params)
        self._reset()

    def _reset(self) -> None:
        self._pending = [len(b) for b in self._bucket_params]
        self._next = 0
        self._inflight: list[tuple[torch.distributed.Work, torch.Tensor]] = []

    def _launch_ready(self) -> None:
        while self._next < len(self._bucket_params) and self._pending[self._next] == 0:
            i = self._next
            grads = [p.grad.reshape(-1) for p in self._bucket_params[i]]
            self._flats[i] = flat = _flat_buffer(self._flats[i], grads)
            torch.cat(grads, out=flat)
            self._log("launch", str(i))
            work = tdist.all_reduce(flat, group=self.group, async_op=True)
            if self.record:     # the future's callback runs when gloo has finished
                work.get_future().then(lambda _f, i=i: self._log("done", str(i)))
            self._inflight.append((work, flat))
            self._next += 1

    def _grad_ready(self, p: torch.Tensor) -> None:
        self._pending[self._bucket_of[id(p)]] -= 1
        self._launch_ready()

    def _finish(self) -> None:
        self._launch_ready()
        if self._next != len(self._bucket_params):
            raise RuntimeError("a bucket was not complete at the end of backward")
        for (work, flat), params in zip(self._inflight, self._bucket_params, strict=True):
            work.wait()
            flat.div_(self.world_size)
            _unpack(flat, [p.grad for p in params])
        self._reset()


class CompressedDP(_DataParallel):
    """After backward, all gradients flattened into one vector and averaged by
    :func:`parlearn.compression.compressed_all_reduce` (8-bit dynamic-tree codes),
    optionally with error feedback; the averages are written back into ``.grad``.
    ``reference_coding`` uses the serial reference coders (same result, slower)."""

    def __init__(self, module: nn.Module, *, error_feedback: bool = False, group=None,
                 record: bool = True, reference_coding: bool = False):
        from parlearn.multi_device.data_parallel.compression import ErrorFeedback

        check_bool("error_feedback", error_feedback)
        check_bool("reference_coding", reference_coding)
        super().__init__(module, group=group, record=record)
        self.error_feedback = ErrorFeedback() if error_feedback else None
        self.reference_coding = reference_coding
        self._flat: torch.Tensor | None = None

    def _finish(self) -> None:
        from parlearn.multi_device.data_parallel.compression import compressed_all_reduce

        grads = [p.grad.reshape(-1) for p in self._params]
        # one buffer kept from step to step, packed, reduced and decoded in place: a
        # fresh one each step cost its pages again (measured, 2 gloo ranks)
        self._flat = flat = _flat_buffer(self._flat, grads)
        torch.cat(grads, out=flat)
        compressed_all_reduce(flat, average=True, error_feedback=self.error_feedback,
                              group=self.group, reference_coding=self.reference_coding,
                              out=flat)
        _unpack(flat, [p.grad for p in self._params])


def make_ddp(module: nn.Module, *, bucket_bytes: int = 25 * 2**20, group=None
             ) -> nn.parallel.DistributedDataParallel:
    """torch's ``DistributedDataParallel`` around ``module`` (CPU/gloo or one GPU per rank),
    with its bucket cap set to ``bucket_bytes``. A plain BatchNorm is refused, as by the
    from-scratch wrappers: DDP would normalise each rank's shard by its own statistics and
    not train as one process (convert it with ``nn.SyncBatchNorm.convert_sync_batchnorm`` on
    GPUs, or use LayerNorm/GroupNorm)."""
    check_module("module", module)
    check_int("bucket_bytes", bucket_bytes, lo=1)
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(
                m, nn.SyncBatchNorm):
            raise ValueError(
                f"module has {type(m).__name__} at {name!r}: DDP would normalise each rank's "
                "shard by its own batch statistics, so it would not train as one process; "
                "convert it with nn.SyncBatchNorm.convert_sync_batchnorm (GPUs) or use "
                "LayerNorm/GroupNorm")
    dev = next(module.parameters()).device
    ids = [dev.index] if dev.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(module, device_ids=ids,
                                               bucket_cap_mb=bucket_bytes / 2**20,
                                               process_group=group)


class TiedMLP(nn.Module):
    """A small MLP with the awkward cases DP must handle: a frozen layer (no gradient)
    and one weight matrix used twice (tied: one parameter, two uses in the graph)."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int, *, seed: int = 0,
                 dtype: torch.dtype = torch.float64) -> None:
        for name, v in (("d_in", d_in), ("d_hidden", d_hidden), ("d_out", d_out)):
            check_int(name, v, lo=1)
        check_choice("dtype", dtype, (torch.float32, torch.float64))
        super().__init__()
        gen = torch.Generator().manual_seed(check_int("seed", seed, lo=0))

        def lin(i, o, bias=True):
            # skip_init: nn.Linear's own init would draw from the caller's global RNG.
            layer = nn.utils.skip_init(nn.Linear, i, o, bias=bias, dtype=dtype)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(o, i, generator=gen, dtype=dtype) / i**0.5)
                if bias:
                    layer.bias.copy_(0.1 * torch.randn(o, generator=gen, dtype=dtype))
            return layer

        self.inp = lin(d_in, d_hidden)
        self.frozen = lin(d_hidden, d_hidden)
        self.frozen.requires_grad_(False)
        self.shared = lin(d_hidden, d_hidden, bias=False)
        self.out = lin(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))          # first use of the tied weight
        h = torch.tanh(self.frozen(h))
        h = torch.tanh(self.shared(h)) + h      # second use
        return self.out(h)


def shard(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous equal share of ``x`` along dim 0 (sizes must divide)."""
    check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have a batch dimension, got a 0-d tensor")
    check_int("world_size", world_size, lo=1)
    check_int("rank", rank, lo=0, hi=world_size - 1)
    if x.shape[0] % world_size:
        raise ValueError(f"batch of {x.shape[0]} does not split into world_size={world_size} "
                         "equal shards")
    m = x.shape[0] // world_size
    return x[rank * m:(rank + 1) * m]


def _make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr)


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().cpu() for n, p in module.named_parameters()}


def _train_steps(model: nn.Module, opt: torch.optim.Optimizer, xs, ys, accum: int,
                 sync_context: Callable[[], contextlib.AbstractContextManager]) -> list[dict]:
    snaps = []
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad(set_to_none=True)
        for j, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
            ctx = sync_context() if j < accum - 1 else contextlib.nullcontext()
            with ctx:
                loss = nn.functional.cross_entropy(model(xm), ym) / accum
                loss.backward()
        opt.step()
        snaps.append(_snapshot(model.module if hasattr(model, "module") else model))
    return snaps


def train_reference(model: nn.Module, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor],
                    *, lr: float = 0.1, optimizer: str = "sgd") -> list[dict]:
    """Single-process training on the full batches ``xs[t], ys[t]`` (cross-entropy, mean
    over the batch): the parameters after each step. Trains ``model`` in place."""
    check_module("model", model)
    for name, seq in (("xs", xs), ("ys", ys)):
        if isinstance(seq, str | torch.Tensor) or not isinstance(seq, Sequence):
            raise TypeError(f"{name} must be a sequence of tensors (one per step), got "
                            f"{type(seq).__name__}")
        for t, v in enumerate(seq):
            check_tensor(f"{name}[{t}]", v)
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys must have one batch per step each, got {len(xs)} and "
                         f"{len(ys)}")
    check_float("lr", lr, lo=0, lo_open=True)
    check_choice("optimizer", optimizer, ("sgd", "adam"))
    opt = _make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad], lr)
    return _train_steps(model, opt, xs, ys, 1, contextlib.nullcontext)


def worker_train(rank: int, world_size: int, kind: str, model: nn.Module, xs, ys, lr: float,
                 optimizer: str = "sgd", accum: int = 1, bucket_bytes: int = 2048
                 ) -> dict:
    """A :func:`parlearn.distributed.run` worker: train ``model`` (rank's shard of each batch,
    ``accum`` micro-batches per step with ``no_sync`` on all but the last) wrapped by
    ``kind`` in ``("naive", "bucketed", "ddp")``; returns the parameters after each step,
    the wrapper's event log and the bucket layout."""
    check_choice("kind", kind, ("naive", "bucketed", "ddp"))
    check_int("accum", accum, lo=1)
    if kind == "naive":
        wrapped = NaiveDP(model)
    elif kind == "bucketed":
        wrapped = BucketedDP(model, bucket_bytes=bucket_bytes)
    else:
        wrapped = make_ddp(model, bucket_bytes=bucket_bytes)
    opt = _make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad], lr)
    mine_x = [shard(x, rank, world_size) for x in xs]
    mine_y = [shard(y, rank, world_size) for y in ys]
    snaps = _train_steps(wrapped, opt, mine_x, mine_y, accum, wrapped.no_sync)
    return {"snapshots": snaps, "events": list(getattr(wrapped, "events", [])),
            "buckets": list(getattr(wrapped, "buckets", []))}
