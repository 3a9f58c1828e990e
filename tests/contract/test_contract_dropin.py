"""The argument contract of the drop-in APIs for torch users (see harness.py)."""

from __future__ import annotations

from harness import Case, contract_tests


def _owned_by_ranks(result, kw):
    """One owner per tensor, each a rank of the world; with as many ranks as tensors or more,
    each tensor gets a rank of its own (greedy: the emptiest rank takes the next tensor)."""
    assert len(result) == len(kw["sizes"])
    assert set(result) <= set(range(kw["world_size"]))
    if kw["world_size"] >= len(kw["sizes"]):
        assert len(set(result)) == len(result)


CASES: list[Case] = [
    Case("parlearn.sharding.owners", lambda: dict(sizes=[30, 20, 10], world_size=2),
         ranges={"world_size": (1, None)}, check=_owned_by_ranks),
    Case("parlearn.sharding.dropin_check",
         lambda: dict(world_size=2, variants=["zero1"], steps=1, batch=4, micro_batches=2, seed=0,
                      timeout=60.0),
         ranges={"world_size": (1, None), "steps": (1, None), "seed": (0, None)},
         bad={"variants": [[], "zero1", ["sgd"], [3]], "batch": [0, 3, 6],
              "micro_batches": [0, 4], "timeout": [0.0, -1.0]},
         run_good=False),   # starts rank processes
    Case("parlearn.tensor_parallel.megatron_layers_check",
         lambda: dict(world_size=2, seed=0, timeout=60.0),
         ranges={"seed": (0, None)}, bad={"world_size": [0, 3, 5], "timeout": [0.0, -1.0]},
         run_good=False),   # starts rank processes
]

test_refuses, test_accepts, test_accepts_range = contract_tests(CASES)

COVERED_ELSEWHERE: dict[str, str] = {
    "parlearn.sharding.ShardedOptimizer": "tests/multi_device/test_sharded_optimizer.py::"
                                          "test_bad_arguments_fail_on_every_rank_naming_them",
}
COVERED_ELSEWHERE.update({
    "parlearn.sharding.shard_module": "tests/multi_device/test_fsdp_wrapper.py::"
                                      "test_bad_arguments_fail_on_every_rank_naming_them",
    "parlearn.sharding.MixedPrecisionPolicy": "tests/multi_device/test_fsdp_wrapper.py::"
                                              "test_policy_refuses_non_float_dtypes",
    "parlearn.sharding.recipe_worker": "tests/multi_device/test_dropin_recipe.py::"
                                       "test_bad_arguments_fail_on_every_rank",
    "parlearn.tensor_parallel.megatron_layers_worker":
        "tests/multi_device/test_megatron_layers.py::test_lesson_check_refuses_bad_arguments",
})
EXEMPT: dict[str, str] = {
    "parlearn.sharding.ShardedModule": "built by shard_module() (which checks its arguments), "
                                       "never by users",
}
