"""Local learning on the users' model zoo: a block's local step is SGD on its own local loss
(nothing flows back into its input), global backprop over a LocalNet is SGD on the whole
loss, also when a weight is shared by two blocks; frozen parameters never move."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import zoo
from torch import nn

from parlearn.serial_chain import local as lo

LR, WD = 0.1, 0.01


def _head(dtype):
    g = torch.Generator().manual_seed(7)
    head = nn.Linear(zoo.OUT, zoo.OUT).to(dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype))
    return head


def _torch_sgd(modules, loss_of, weight_decay=WD):
    params = list(dict.fromkeys(p for m in modules for p in m.parameters() if p.requires_grad))
    opt = torch.optim.SGD(params, lr=LR, weight_decay=weight_decay)
    opt.zero_grad()
    loss_of().backward()
    opt.step()
    for p in params:
        p.grad = None


@pytest.mark.parametrize("name,dtype", zoo.cases())
@pytest.mark.parametrize("critic", [False, True])
def test_local_step_is_sgd_on_the_blocks_own_loss(name, dtype, critic):
    block, head = zoo.build(name, dtype), _head(dtype)
    ref_block, ref_head = zoo.build(name, dtype), _head(dtype)
    x, y = zoo.batch(7, dtype)
    x = x.requires_grad_()
    before = zoo.frozen(block)
    with zoo.kept_state(block, head):
        h, loss, head_grads = lo.local_step(block, head, x, y, LR, WD, critic=critic)
    assert x.grad is None                              # nothing flowed back into the input
    _torch_sgd([ref_block] if critic else [ref_block, ref_head],
               lambda: F.cross_entropy(ref_head(ref_block(x.detach())), y))
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5,
                                                                          atol=1e-6)
    for got, want in ((block, ref_block), (head, ref_head)):
        for (n, p), q in zip(got.named_parameters(), want.parameters(), strict=True):
            torch.testing.assert_close(p, q, **tol, msg=n)
    if critic:   # a critic's head waits: unchanged, its gradient handed back
        assert all(torch.equal(p, q) for p, q in zip(head.parameters(), _head(dtype).parameters(),
                                                      strict=True))
        assert len(head_grads) == 2
    zoo.assert_frozen_unmoved(block, before)


def _net(shared: bool, dtype=torch.float64):
    g = torch.Generator().manual_seed(3)

    def lin(a, b):
        m = nn.Linear(a, b).to(dtype)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) / a ** 0.5)
        return m

    mid = lin(6, 6)
    blocks = [nn.Sequential(lin(4, 6), nn.Tanh()), nn.Sequential(mid, nn.Tanh()),
              nn.Sequential(mid if shared else lin(6, 6), nn.GELU(), nn.LayerNorm(6, dtype=dtype))]
    blocks[0][0].bias.requires_grad_(False)            # a frozen bias too
    return lo.LocalNet(blocks, [lin(6, 3) for _ in blocks])


@pytest.mark.parametrize("shared", [False, True])
def test_backprop_step_is_sgd_on_the_whole_loss_even_with_a_weight_shared_by_two_blocks(shared):
    net, ref = _net(shared), _net(shared)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(9, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (9,),
                                                                              generator=g)
    frozen_bias = net.blocks[0][0].bias.detach().clone()
    lo.backprop_step(net, x, y, LR, WD)
    _torch_sgd([*ref.blocks, ref.heads[-1]], lambda: F.cross_entropy(ref(x), y))
    for (n, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=n)
    assert torch.equal(net.blocks[0][0].bias, frozen_bias)
