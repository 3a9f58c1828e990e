"""A whole training step measured: bytes per parameter, recomputation's price, fp16's trap.

- :func:`state_bytes`: after one optimizer step, the bytes of the parameters, their
  gradients and the optimizer's state, per parameter, read off the tensors themselves.
  torch.amp (autocast) keeps fp32 parameters (they are the master weights) and fp32
  gradients, and makes bf16 copies of the weights during the step: 4 + 4 + 8 + 2 B per
  parameter at the peak, where a framework that keeps bf16 weights and gradients beside an
  fp32 master copy holds the ZeRO paper's 2 + 2 + 12 = 16.
- :func:`recompute_cost`: step time and saved bytes of ``recompute`` none / selective /
  full, measured side by side (interleaved repeats, median and spread).
- :func:`fp16_underflow`: a constructed case where fp16 gradients flush to zero, and the
  same step with ``torch.amp.GradScaler``, which scales the loss so they survive.
"""

from __future__ import annotations

import torch
from torch import nn

from parlearn.core.checks import check_choice, check_float, check_int, check_module
from parlearn.core.timing import compare
from parlearn.multi_device.memory.measured import saved_tensors
from parlearn.multi_device.transformer.model import GPT, RECOMPUTE

__all__ = ["state_bytes", "recompute_cost", "fp16_underflow"]


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Bytes per parameter held by ``model``'s parameters, their ``.grad`` and
    ``optimizer.state`` (run a step first; Adam's per-tensor ``step`` scalars included)."""
    check_module("model", model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    params = [p for p in model.parameters()]
    n = sum(p.numel() for p in params)
    state = [t for s in optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)]
    out = {"params": _nbytes(params) / n,
           "grads": _nbytes(p.grad for p in params if p.grad is not None) / n,
           "optimizer": _nbytes(state) / n}
    out["total"] = sum(out.values())
    return out


def recompute_cost(model: GPT, idx: torch.Tensor, targets: torch.Tensor, *, repeat: int = 5,
                   autocast: torch.dtype | None = None, threads: int | None = None) -> dict:
    """Per ``recompute`` mode: saved activation bytes (the :class:`SavedLedger`'s count,
    everything the GPT keeps for backward: see :mod:`parlearn.memory.measured`) and the
    measured step time (forward + backward, interleaved over modes). Returns
    ``{"activation_bytes": {mode: bytes}, "timing": Comparison}``; ``model``'s ``.grad`` is
    left as it was."""
    from parlearn.multi_device.memory.measured import AUTOCAST_DTYPES
    from parlearn.multi_device.transformer.train import _check_gpt, _check_ids

    _check_gpt(model)
    _check_ids("idx", idx, model)
    _check_ids("targets", targets, model, like=idx)
    repeat = check_int("repeat", repeat, lo=1)
    if autocast is not None:
        check_choice("autocast", autocast, AUTOCAST_DTYPES)
    if threads is not None:
        check_int("threads", threads, lo=1)
    params = list(model.parameters())
    # Set the user's .grad aside (not merely remember it): backward adds into an existing
    # .grad in place, so the remembered tensor itself would change.
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        nbytes = {}
        for mode in RECOMPUTE:
            ledger, loss = saved_tensors(model, idx, targets, autocast=autocast, recompute=mode)
            nbytes[mode] = ledger.bytes("activation") + ledger.bytes("weight copy")
            del loss

        def step(mode):
            def run():
                with torch.autocast(idx.device.type, dtype=autocast or torch.bfloat16,
                                    enabled=autocast is not None):
                    _, loss = model(idx, targets, recompute=mode)
                loss.backward()
                for p in model.parameters():
                    p.grad = None
            return run

        timing = compare({m: step(m) for m in RECOMPUTE}, repeat=repeat, device=idx.device,
                         threads=threads)
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
    return {"activation_bytes": nbytes, "timing": timing}


def fp16_underflow(scale: float = 2.0 ** 16, *, seed: int = 0) -> dict:
    """One backward of a small fp32-master model under fp16 autocast, where the true
    weight gradients are about 1e-8 (below fp16's smallest subnormal, 6e-8): without a
    scaler they flush to zero; with ``GradScaler(init_scale=scale)`` they survive and,
    unscaled, match the fp32 gradients. Returns the three gradients and summaries."""
    scale = check_float("scale", scale, lo=0, lo_open=True)
    g = torch.Generator().manual_seed(check_int("seed", seed, lo=0))
    w1 = torch.randn(16, 16, generator=g) * 0.25
    w2 = torch.randn(1, 16, generator=g) * 0.25
    x = torch.randn(64, 16, generator=g)

    def make():
        m = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Tanh(), nn.Linear(16, 1, bias=False))
        with torch.no_grad():
            m[0].weight.copy_(w1)
            m[2].weight.copy_(w2)
        return m

    def loss_of(m, dtype):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            return m(x).float().mean() * 1e-7  # a loss whose gradients are tiny

    ref = make()
    loss_of(ref, None).backward()
    plain = make()
    loss_of(plain, torch.float16).backward()
    scaled = make()
    opt = torch.optim.SGD(scaled.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(loss_of(scaled, torch.float16)).backward()
    scaler.unscale_(opt)
    grads = {name: m[0].weight.grad.clone() for name, m in
             (("fp32", ref), ("fp16", plain), ("fp16 + scaler", scaled))}
    zero = {k: (v == 0).float().mean().item() for k, v in grads.items()}
    rel = {k: ((v - grads["fp32"]).norm() / grads["fp32"].norm()).item() for k, v in grads.items()}
    return {"grads": grads, "zero_fraction": zero, "relative_error": rel,
            "master_dtype": scaled[0].weight.dtype, "grad_dtype": scaled[0].weight.grad.dtype}
