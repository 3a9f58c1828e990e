"""One recipe (AdamW with decay groups, accumulation, global-norm clipping, warm-up + cosine)
under DDP's no_sync, ZeRO-1/2, torch's ZeroRedundancyOptimizer and the FSDP-style wrapper
equals one process on the whole batch, in float64; what each rank holds is the ZeRO model's."""

from __future__ import annotations

import pytest
from ranks import assert_refused_on_every_rank

from parlearn.multi_device.sharding import dropin
from parlearn.multi_device.sharding.dropin import dropin_check, recipe_worker


@pytest.mark.parametrize("world, micro", [(2, 2), (4, 1)])
def test_every_variant_equals_one_process_and_holds_what_zero_says(world, micro):
    res = dropin_check(world, steps=3, batch=8, micro_batches=micro)
    n = res["n_params"]
    for variant in dropin.VARIANTS:
        assert res[variant]["diff"] < 1e-12, (variant, res[variant]["diff"])
        held = res[variant]["held"]
        states = [h["state"] for h in held]
        if variant == "ddp":
            assert states == [2 * n] * world   # Adam's two moments, replicated
        elif variant == "fsdp":                # two moments of this rank's (padded) shard
            assert states == [2 * h["params"] for h in held]
        else:                                  # each tensor's two moments on its owner only
            assert sum(states) == 2 * n and max(states) < 2 * n
        grads = [h["grads"] for h in held]
        if variant == "zero2":
            assert sum(grads) == n             # each gradient kept by its owner only
        if variant == "fsdp":
            assert all(h["params"] * world >= n for h in held) and max(
                h["params"] for h in held) < n  # a shard each, padded per unit


def test_the_check_sees_a_recipe_that_differs(monkeypatch):
    """Weight decay on the norms too (one group) moves the parameters off the reference: the
    comparison is sharp enough to see it."""
    monkeypatch.setattr(dropin.Recipe, "param_groups", lambda self, params: [
        {"params": list(params), "weight_decay": self.weight_decay}])
    reference = dropin._one_process(3, 8, 0)
    monkeypatch.undo()
    right = dropin._one_process(3, 8, 0)
    gap = max((a[n] - b[n]).abs().max().item() for a, b in zip(reference, right, strict=True)
              for n in a)
    assert gap > 1e-7


@pytest.mark.parametrize("args, name", [(("sgd", 3, 8, 2, 0), "variant"),
                                        (("zero1", 3, 7, 2, 0), "batch"),
                                        (("zero1", 0, 8, 2, 0), "steps")])
def test_bad_arguments_fail_on_every_rank(args, name):
    assert_refused_on_every_rank(recipe_worker, args, name=name)
