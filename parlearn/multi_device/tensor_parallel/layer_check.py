"""Megatron's layer API on real ranks against the full layers: :func:`megatron_layers_check`.

Lesson 14 runs it: each of Megatron's tensor-parallel layers, built from its sizes as
Megatron-LM builds it, equals the full layer a user would build with the same seed
(outputs and every gradient, float64). It also runs the one mistake this API exists to
prevent: gathering a column-parallel output with sequence parallelism's gather, whose backward
*sums* the ranks' gradients (right when each rank's gathered tensor feeds a different
computation, wrong here, where every rank computes the same loss): the weight gradient comes
out ``N`` times too large.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn.functional as F

from parlearn.core.checks import check_float, check_int

__all__ = ["megatron_layers_check", "megatron_layers_worker"]

IN, OUT, BATCH, VOCAB = 8, 12, 6, 16
HEADS, SEQ = 4, 3   # the attention check: IN = HEADS x 2 features, BATCH // 2 sequences


class _GatherSumBackward(torch.autograd.Function):
    """All-gather along the last dim forward; backward sums the ranks' gradients and keeps
    this rank's slice (a reduce-scatter): sequence parallelism's pair, used where it does
    not belong."""

    @staticmethod
    def forward(ctx, x):
        world = tdist.get_world_size()
        parts = [torch.empty_like(x) for _ in range(world)]
        tdist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        world, rank = tdist.get_world_size(), tdist.get_rank()
        total = grad.contiguous().clone()
        tdist.all_reduce(total)
        return total.chunk(world, dim=-1)[rank].contiguous()


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max())


def _attention(x: torch.Tensor, q, k, v, o, heads: int) -> torch.Tensor:
    """Causal self-attention of ``x`` ``(b, s, d)`` with ``heads`` heads of ``q``, ``k``,
    ``v``'s outputs, then ``o``: the same code for the full layer and a rank's shard."""
    b, s, _ = x.shape
    q_, k_, v_ = (lin(x).view(b, s, heads, -1).transpose(1, 2) for lin in (q, k, v))
    y = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
    return o(y.transpose(1, 2).reshape(b, s, -1))


def _attention_check(rank: int, world_size: int, seed: int, g: torch.Generator) -> float:
    """Max |difference| between the head-split attention layer and the full one: output,
    ``dx`` and every weight and bias gradient (this rank's slice of the full gradient)."""
    from parlearn.multi_device.tensor_parallel import layers as L

    f64 = torch.float64
    x = torch.randn(BATCH // 2, SEQ, IN, generator=g, dtype=f64)
    probe = torch.randn(BATCH // 2, SEQ, IN, generator=g, dtype=f64)
    seeds = [seed + 10 + i for i in range(4)]
    full = [L.serial_linear(IN, IN, seed=s, dtype=f64) for s in seeds]
    xf = x.clone().requires_grad_()
    yf = _attention(xf, *full, heads=HEADS)
    (yf * probe).sum().backward()
    part = [L.MegatronColumnParallelLinear(IN, IN, seed=s, dtype=f64) for s in seeds[:3]]
    part.append(L.MegatronRowParallelLinear(IN, IN, input_is_parallel=True, seed=seeds[3],
                                            dtype=f64))
    xs = x.clone().requires_grad_()
    ys = _attention(xs, *part, heads=HEADS // world_size)
    (ys * probe).sum().backward()
    cols = slice(rank * IN // world_size, (rank + 1) * IN // world_size)
    errs = [_err(ys, yf), _err(xs.grad, xf.grad), _err(part[3].weight.grad,
            full[3].weight.grad[:, cols]), _err(part[3].bias.grad, full[3].bias.grad)]
    for p, f in zip(part[:3], full[:3], strict=True):
        errs += [_err(p.weight.grad, f.weight.grad[cols]), _err(p.bias.grad, f.bias.grad[cols])]
    return max(errs)


def megatron_layers_worker(rank: int, world_size: int, seed: int) -> dict:
    """Worker: every layer against its full version (max |difference| of output and of each
    gradient) and the weight-gradient ratio of the wrong gather to the right one."""
    from parlearn.multi_device.tensor_parallel import layers as L

    check_int("seed", seed, lo=0)
    f64 = torch.float64
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(BATCH, IN, generator=g, dtype=f64)
    probe = torch.randn(BATCH, OUT, generator=g, dtype=f64)   # loss = sum(probe * y)
    out: dict = {}

    # Column-parallel, output gathered: against nn.Linear(IN, OUT).
    full = L.serial_linear(IN, OUT, seed=seed, dtype=f64)
    xf = x.clone().requires_grad_()
    (full(xf) * probe).sum().backward()
    col = L.MegatronColumnParallelLinear(IN, OUT, gather_output=True, seed=seed, dtype=f64)
    xc = x.clone().requires_grad_()
    y = col(xc)
    (y * probe).sum().backward()
    rows = slice(rank * OUT // world_size, (rank + 1) * OUT // world_size)
    out["column (gather_output=True)"] = max(
        _err(y, full(x)), _err(xc.grad, xf.grad), _err(col.weight.grad, full.weight.grad[rows]),
        _err(col.bias.grad, full.bias.grad[rows]))

    # The same layer gathered with a summing backward: N times the weight gradient.
    wrong = L.MegatronColumnParallelLinear(IN, OUT, gather_output=False, seed=seed, dtype=f64)
    (_GatherSumBackward.apply(wrong(x.clone().requires_grad_())) * probe).sum().backward()
    out["wrong_ratio"] = float(wrong.weight.grad.norm() / col.weight.grad.norm())

    # Row-parallel, input split by the layer: against nn.Linear(OUT, IN).
    full_r = L.serial_linear(OUT, IN, seed=seed + 2, dtype=f64)
    h = torch.randn(BATCH, OUT, generator=g, dtype=f64)
    hf = h.clone().requires_grad_()
    (full_r(hf) ** 2).sum().backward()
    row = L.MegatronRowParallelLinear(OUT, IN, input_is_parallel=False, seed=seed + 2, dtype=f64)
    hr = h.clone().requires_grad_()
    z = row(hr)
    (z ** 2).sum().backward()
    out["row (input_is_parallel=False)"] = max(
        _err(z, full_r(h)), _err(hr.grad, hf.grad),
        _err(row.weight.grad, full_r.weight.grad[:, rows]), _err(row.bias.grad, full_r.bias.grad))

    # Vocabulary-parallel embedding and cross-entropy: against nn.Embedding, F.cross_entropy.
    ids = torch.randint(0, VOCAB, (BATCH,), generator=g)
    emb_full = L.serial_embedding(VOCAB, IN, seed=seed + 3, dtype=f64)
    emb = L.VocabParallelEmbedding(VOCAB, IN, seed=seed + 3, dtype=f64)
    logits = torch.randn(BATCH, VOCAB, generator=g, dtype=f64)
    lf = logits.clone().requires_grad_()
    F.cross_entropy(lf, ids).backward()
    cols = slice(rank * VOCAB // world_size, (rank + 1) * VOCAB // world_size)
    ls = logits[:, cols].clone().requires_grad_()
    loss = L.vocab_parallel_cross_entropy(ls, ids)
    loss.backward()
    e_probe = torch.randn(BATCH, IN, generator=g, dtype=f64)
    (emb_full(ids) * e_probe).sum().backward()
    e = emb(ids)
    (e * e_probe).sum().backward()
    out["vocab-parallel embedding"] = max(_err(e, emb_full(ids)),
                                          _err(emb.weight.grad, emb_full.weight.grad[cols]))
    out["vocab-parallel cross-entropy"] = max(_err(loss, F.cross_entropy(logits, ids)),
                                              _err(ls.grad, lf.grad[:, cols]))
    out["attention, heads split"] = _attention_check(rank, world_size, seed, g)
    return out


def megatron_layers_check(world_size: int = 2, *, seed: int = 0, timeout: float = 60) -> dict:
    """Run :func:`megatron_layers_worker` on ``world_size`` gloo ranks: ``{layer: max |ours -
    full| over ranks}`` and ``"wrong_ratio"``, the weight-gradient norm with a summing gather
    over the right one (``world_size`` exactly, on every rank)."""
    from parlearn.distributed import run

    world_size = check_int("world_size", world_size, lo=1)
    if OUT % world_size or VOCAB % world_size or HEADS % world_size:
        raise ValueError(f"world_size={world_size} must divide {OUT} features, {HEADS} heads "
                         f"and {VOCAB} vocabulary entries: use 1, 2 or 4")
    check_int("seed", seed, lo=0)
    check_float("timeout", timeout, lo=0, lo_open=True)
    ranks = run(megatron_layers_worker, world_size, backend="gloo", timeout=timeout,
                args=(seed,))
    return {k: max(r[k] for r in ranks) if k != "wrong_ratio" else [r[k] for r in ranks]
            for k in ranks[0]}
