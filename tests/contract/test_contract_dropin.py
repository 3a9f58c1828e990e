"""The argument contract of the drop-in APIs for torch users (see harness.py)."""

from __future__ import annotations

from harness import Case, contract_tests

CASES: list[Case] = [
    Case("parlearn.sharding.owners", lambda: dict(sizes=[30, 20, 10], world_size=2),
         ranges={"world_size": (1, None)},
         check=lambda r, kw: sorted(set(r)) == sorted(set(r) & set(range(kw["world_size"])))),
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
})
EXEMPT: dict[str, str] = {
    "parlearn.sharding.ShardedModule": "built by shard_module() (which checks its arguments), "
                                       "never by users",
}
