"""Every public primitive that takes a user's model runs on the users' model zoo.

A public callable (in any module's ``__all__``) with an argument annotated ``nn.Module``,
``nn.Sequential`` or a sequence of them takes a model a user brings. Each must be listed in
``ZOO_RUNS`` (the tests that run it on the zoo, tests/zoo.py, or on models with the same
features: frozen, tied, bias-free, LayerNorm, other activations, float32), in
``ZOO_EXEMPT`` with a reason (it takes one of the course's own model types, or only reads
the model), or in ``ZOO_PENDING``: the open work, named, which may only shrink.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "contract"))
import harness  # noqa: E402

P = "parlearn."
DP = "tests/multi_device/test_data_parallel.py::"
PIPE = "tests/multi_device/test_pipeline_models.py::"
REPL = "tests/many_copies/test_replicas.py::"
NEQ = "tests/serial_chain/test_neq.py::"
REPU = "tests/serial_chain/test_repurpose.py::"
BZ = "tests/multi_device/test_batching_zoo_training.py::"

ZOO_RUNS: dict[str, list[str]] = {
    "many_copies.dither.gradients.parallel_grad":
        ["tests/many_copies/test_dither.py::test_zoo_parallel_grad_equals_sequential",
         "tests/many_copies/test_dither.py::test_zoo_batchnorm_refused_up_front"],
    "many_copies.dither.gradients.grad_variance":
        ["tests/many_copies/test_dither.py::"
         "test_zoo_grad_variance_equals_the_variance_of_sequential_gradients"],
    "many_copies.dither.gradients.sequential_grad":
        ["tests/many_copies/test_dither.py::test_zoo_parallel_grad_equals_sequential"],
    **{f"many_copies.replicas.stacked.{f}":
       [REPL + "test_zoo_batched_equals_looped_and_frozen_never_moves",
        REPL + "test_zoo_batchnorm_refused_in_training_mode_and_equal_in_eval_mode"]
       for f in ("stack", "sgd_step_batched", "sgd_step_looped")},
    **{f"many_copies.replicas.{f}":
       [REPL + "test_zoo_train_batched_equals_train_looped_and_predict_equals_each_model"]
       for f in ("runs.train_batched", "runs.train_looped", "stacked.predict")},
    "multi_device.batching.training.train":
        [BZ + "test_on_ranks_equals_one_process_on_the_zoo"],
    "multi_device.batching.training.worker_train":
        [BZ + "test_on_ranks_equals_one_process_on_the_zoo"],
    "multi_device.batching.training.train_runs":
        [BZ + "test_runs_in_one_launch_equal_one_process_each_on_the_zoo"],
    "multi_device.batching.noise_scale.measure_noise_scale":
        [BZ + "test_noise_scale_and_sweep_run_on_the_zoo_and_leave_the_model_alone"],
    "multi_device.batching.tradeoff.batch_sweep":
        [BZ + "test_noise_scale_and_sweep_run_on_the_zoo_and_leave_the_model_alone"],
    "multi_device.batching.halves.half_gradients":
        ["tests/multi_device/test_batching_zoo.py::test_halves_average_to_the_whole_batch"],
    "multi_device.batching.halves.worker_half_gradients":
        ["tests/multi_device/test_batching_zoo.py::test_on_ranks_equal_to_one_process"],
    **{f"multi_device.data_parallel.ddp.{f}":
       [DP + "test_dp_wrappers_on_the_zoo_equal_one_process_or_refuse_up_front"]
       for f in ("NaiveDP", "BucketedDP", "CompressedDP")},
    **{f"multi_device.data_parallel.ddp.{f}":
       ["tests/multi_device/test_dp_zoo_training.py::"
        "test_worker_train_on_the_zoo_equals_train_reference"]
       for f in ("make_ddp", "train_reference", "worker_train")},
    "multi_device.data_parallel.stragglers.worker_backup_sgd":
        ["tests/multi_device/test_stragglers_zoo.py::test_equals_one_process_sgd_on_the_zoo"],
    "multi_device.sharding.zero.ShardedAdam":
        ["tests/multi_device/test_sharding.py::"
         "test_sharded_adam_on_the_zoo_equals_torch_adam_or_refuses_up_front"],
    "multi_device.sharding.fsdp.shard_module":
        ["tests/multi_device/test_fsdp_wrapper.py::test_equal_to_one_process_on_the_zoo",
         "tests/multi_device/test_fsdp_wrapper.py::test_frozen_parameters_never_move"],
    "multi_device.pipeline.runtime.run_pipeline":
        [PIPE + "test_every_two_stage_cut_equals_single_process",
         PIPE + "test_float32_models_send_float32"],
    "multi_device.pipeline.runtime.reference_grads":
        [PIPE + "test_every_two_stage_cut_equals_single_process"],
    "multi_device.pipeline.virtual.run_schedule":
        [PIPE + "test_virtual_and_torch_schedules_on_the_odd_model"],
    "multi_device.pipeline.torch_pipeline.run_torch_pipeline":
        [PIPE + "test_virtual_and_torch_schedules_on_the_odd_model"],
    "multi_device.pipeline.torch_pipeline.run_torch_zoo":
        [PIPE + "test_torchs_multi_stage_schedules_on_the_odd_model"],
    "multi_device.pipeline.hydra.hydra_train":
        [PIPE + "test_hydra_trains_models_with_a_frozen_layer_as_if_alone"],
    "multi_device.pipeline.hydra.hydra_reference":
        [PIPE + "test_hydra_trains_models_with_a_frozen_layer_as_if_alone"],
    "multi_device.pipeline.partition.layer_costs":
        [PIPE + "test_layer_costs_measure_a_frozen_layer"],
    "multi_device.memory.measured.saved_tensors":
        ["tests/multi_device/test_memory.py::"
         "test_bf16_copies_of_conv_weights_are_weight_copies_not_activations"],
    "serial_chain.leapfrog.schedules.grad":
        ["tests/serial_chain/test_leapfrog.py::test_zoo_grad_equals_autograd",
         "tests/serial_chain/test_leapfrog.py::test_zoo_conv_model_refused_naming_the_layer"],
    "serial_chain.local.rules.local_step":
        ["tests/serial_chain/test_local_zoo.py::test_local_step_is_sgd_on_the_blocks_own_loss"],
    "serial_chain.local.net.LocalNet":
        ["tests/serial_chain/test_local_zoo.py::"
         "test_backprop_step_is_sgd_on_the_whole_loss_even_with_a_weight_shared_by_two_blocks"],
    "serial_chain.neq.backward.masked_backward":
        [NEQ + "test_zoo_masked_backward_equals_reference"],
    "serial_chain.neq.backward.reference_backward":
        [NEQ + "test_zoo_masked_backward_equals_reference"],
    "serial_chain.neq.equilibrium.linear_layers":
        [NEQ + "test_zoo_masked_backward_equals_reference"],
    "serial_chain.neq.training.train":
        [NEQ + "test_zoo_eps_zero_equals_torch_sgd_and_frozen_never_moves",
         NEQ + "test_zoo_training_with_freezing_skip_equals_reference",
         NEQ + "test_zoo_models_neq_cannot_handle_are_refused_up_front"],
    "serial_chain.repurpose.restructure":
        [REPU + "test_zoo_restructure_and_prune_keep_the_function",
         REPU + "test_zoo_nets_repurpose_cannot_handle_are_refused_up_front"],
    **{f"serial_chain.repurpose.{f}":
       [REPU + "test_zoo_every_entry_point_keeps_the_function_on_nets_it_accepts",
        REPU + "test_zoo_every_entry_point_refuses_nets_it_cannot_handle"]
       for f in ("assign_groups", "comm_bytes", "megatron_bytes", "megatron_inference",
                 "message_mask", "off_block_mass", "permute", "split_inference", "tradeoff")},
    **{f"serial_chain.repurpose.{f}":
       [REPU + "test_zoo_every_entry_point_keeps_the_function_on_nets_it_accepts",
        REPU + "test_zoo_rank_workers_refuse_on_every_rank"]
       for f in ("split_worker", "megatron_worker")},
    "serial_chain.repurpose.prune_and_refit":
        [REPU + "test_zoo_restructure_and_prune_keep_the_function"],
    "serial_chain.repurpose.calibration_energy":
        [REPU + "test_calibration_refuses_a_dtype_other_than_the_nets"],
}

ZOO_EXEMPT: dict[str, str] = {
    "many_copies.diffusion.conditional_distance":
        "scores a denoiser against a toy language's exact conditionals; reads its outputs only",
    "multi_device.context_parallel.sequence_parallel.SequenceParallelBlock":
        "splits the lesson's own LayerNorm-MLP block, refusing any other layout",
    "multi_device.context_parallel.sequence_parallel.TensorParallelBlock":
        "splits the lesson's own LayerNorm-MLP block, refusing any other layout",
    "multi_device.tensor_parallel.megatron.MegatronMLP":
        "splits a two-Linear MLP built by serial_mlp, refusing any other layout",
    "multi_device.moe.layer.aux_loss": "reads the MoE layers of the course's MoE-GPT only",
    "multi_device.moe.layer.moe_layers": "lists the MoE layers of the course's MoE-GPT only",
    "multi_device.moe.modern.drop_rates":
        "re-runs the MoE layers of the course's MoE-GPT (or a layer); other models are refused",
    "multi_device.moe.parallel.sync_grads": "acts on the MoE-GPT's expert and dense parameters",
    "multi_device.moe.parallel.to_expert_parallel": "converts the course's MoE-GPT only",
    "multi_device.sharding.fsdp.ShardedModule":
        "built by shard_module (which runs on the zoo), never by users",
    "multi_device.pipeline.runtime.make_data": "reads the first and last widths to draw data",
    "multi_device.memory.steps.state_bytes": "counts bytes of parameters, grads and state only",
    "serial_chain.leapfrog.terms.Tape": "a record that forward() builds and grad() reads",
    "serial_chain.leapfrog.terms.forward":
        "the forward half of leapfrog.grad, which runs on the zoo",
    "serial_chain.leapfrog.terms.weight_grads":
        "one layer's term of leapfrog.grad, which runs on the zoo",
    "serial_chain.leapfrog.schedules.timeline":
        "times the tasks of leapfrog.grad, which runs on the zoo",
    "serial_chain.neq.training.NEqRun": "a record that neq.train returns; users only read it",
    "serial_chain.neq.training.accuracy": "argmax accuracy of any classifier's logits, read only",
    "serial_chain.neq.backward.count_backward_flops":
        "counts the FLOPs of masked_backward, which runs on the zoo",
    "serial_chain.repurpose.accuracy": "argmax accuracy of any classifier's logits, read only",
    "serial_chain.repurpose.linears":
        "lists the Linears of restructure's nets; restructure runs on the zoo",
    "many_copies.dither.regimes.throughput":
        "times parallel_grad, which runs on the zoo; measures speed only",
    "many_copies.replicas.stacked.check_stacked": "validates stack()'s output for sgd steps",
}

ZOO_PENDING: list[str] = []

_MODEL = re.compile(r"\bnn\.(Module|Sequential)\b")


def takes_a_users_model() -> set[str]:
    """Public callables (paths without ``parlearn.``) with an argument annotated as a model
    (``type[nn.Module]`` and activation choices are classes, not models)."""
    out = set()
    for home in harness.public_callables().values():
        try:
            params = inspect.signature(harness.resolve(home)).parameters.values()
        except (TypeError, ValueError):
            continue
        if any(_MODEL.search(str(p.annotation)) and "type[" not in str(p.annotation)
               and p.name != "activation" for p in params):
            out.add(home.removeprefix(P))
    return out


def test_every_primitive_taking_a_model_is_run_on_the_zoo_or_says_why():
    listed = set(ZOO_RUNS) | set(ZOO_EXEMPT) | set(ZOO_PENDING)
    missing = sorted(takes_a_users_model() - listed)
    assert not missing, ("these take a user's model and are not run on the zoo (add them to "
                         "ZOO_RUNS, ZOO_EXEMPT with a reason, or ZOO_PENDING):\n"
                         + "\n".join(missing))


def test_lists_name_only_such_primitives_once():
    names = [*ZOO_RUNS, *ZOO_EXEMPT, *ZOO_PENDING]
    assert len(names) == len(set(names)), "listed twice"
    stale = sorted(set(names) - takes_a_users_model())
    assert not stale, f"not a public callable taking a model (covered? renamed?): {stale}"


def test_zoo_runs_point_at_real_tests():
    bad = []
    for name, refs in ZOO_RUNS.items():
        for ref in refs:
            path, _, test = ref.partition("::")
            file = HERE.parent / path
            if not file.exists() or not re.search(rf"def {re.escape(test)}\b", file.read_text()):
                bad.append(f"{name}: {ref}")
    assert not bad, "ZOO_RUNS names tests that do not exist:\n" + "\n".join(bad)


def test_exemptions_say_why():
    short = [n for n, why in ZOO_EXEMPT.items() if len(why.split()) < 4]
    assert not short, f"an exemption needs a reason of a few words: {short}"
