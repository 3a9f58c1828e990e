"""The users' model zoo: the models people bring, which our own MLPs and GPT never were.

Every model maps a batch ``x`` of shape ``(batch, IN)`` to logits ``(batch, OUT)``, so one loss
(cross-entropy against ``y``) serves all of them::

    from zoo import ZOO, batch, build, kept_state

    model = build("frozen", torch.float64)     # a fresh copy, seeded, in that dtype
    x, y = batch(7, torch.float64)              # prime batch sizes, seeded
    with kept_state(model):                     # .grad, the RNG and threads left as they were
        primitive(model, x, y)

``ZOO`` names each model; ``FEATURES`` says what it has (``frozen``, ``tied``, ``no_bias``,
``norm``, ``batchnorm``, ``conv``) so a primitive that cannot handle a feature can be tested
for refusing it up front, and the rest for equality with its serial reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

IN, HIDDEN, OUT = 16, 12, 3
DTYPES = (torch.float32, torch.float64)
BATCHES = (1, 7, 13)  # one, and primes: nothing divides evenly


def _mlp(act: type[nn.Module] = nn.ReLU, bias: bool = True) -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HIDDEN, bias=bias), act(),
                         nn.Linear(HIDDEN, HIDDEN, bias=bias), act(),
                         nn.Linear(HIDDEN, OUT, bias=bias))


def _frozen() -> nn.Module:
    model = _mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


def _tied() -> nn.Module:
    shared = nn.Linear(HIDDEN, HIDDEN)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), shared, nn.Tanh(), shared, nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


def _norm(affine: bool) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(IN, HIDDEN), nn.LayerNorm(HIDDEN, elementwise_affine=affine),
                             nn.GELU(), nn.Linear(HIDDEN, OUT))
    return make


def _batchnorm() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, OUT))


def _conv() -> nn.Module:
    return nn.Sequential(nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, 3, 3, padding=1), nn.SiLU(),
                         nn.Flatten(), nn.Linear(3 * 16, OUT))


ZOO: dict[str, Callable[[], nn.Module]] = {
    "relu": _mlp,
    "gelu": lambda: _mlp(nn.GELU),
    "tanh": lambda: _mlp(nn.Tanh),
    "silu": lambda: _mlp(nn.SiLU),
    "no_bias": lambda: _mlp(bias=False),
    "frozen": _frozen,
    "tied": _tied,
    "layernorm": _norm(True),
    "layernorm_no_affine": _norm(False),
    "batchnorm": _batchnorm,
    "conv": _conv,
}

FEATURES: dict[str, set[str]] = {
    "relu": set(), "gelu": set(), "tanh": set(), "silu": set(), "no_bias": {"no_bias"},
    "frozen": {"frozen"}, "tied": {"tied"}, "layernorm": {"norm"},
    "layernorm_no_affine": {"norm", "no_affine"}, "batchnorm": {"batchnorm", "buffers"},
    "conv": {"conv"},
}


def build(name: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    """A fresh zoo model, initialised from ``seed`` without touching the global RNG."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = ZOO[name]().to(dtype)
    finally:
        torch.random.set_rng_state(state)
    return model


def batch(n: int, dtype: torch.dtype = torch.float64, seed: int = 1
          ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, IN, generator=g, dtype=dtype),
            torch.randint(0, OUT, (n,), generator=g))


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Unique trainable parameters (a tied weight once), in registration order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def frozen(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the parameters that must never move."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def assert_frozen_unmoved(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    now = dict(model.named_parameters())
    for name, value in before.items():
        assert torch.equal(now[name].detach(), value), f"frozen parameter {name} moved"


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


@contextlib.contextmanager
def kept_state(*models: nn.Module) -> Iterator[None]:
    """Asserts on exit that the models' ``.grad``, the global torch RNG and the thread count
    are as they were on entry: a primitive must never change them behind the user's back."""
    grads = [_grads(m) for m in models]
    rng = torch.random.get_rng_state()
    threads = torch.get_num_threads()
    yield
    assert torch.get_num_threads() == threads, "the thread count changed"
    assert torch.equal(torch.random.get_rng_state(), rng), "the global RNG moved"
    for m, before in zip(models, grads, strict=True):
        for i, (a, b) in enumerate(zip(before, _grads(m), strict=True)):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (
                f"parameter {i}'s .grad changed")


def cases(dtypes=DTYPES, names=None) -> list[tuple[str, torch.dtype]]:
    """(name, dtype) pairs for ``pytest.mark.parametrize``."""
    return [(n, d) for n in (names or ZOO) for d in dtypes]
