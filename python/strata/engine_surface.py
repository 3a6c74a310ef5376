"""DeepSpeed's engine, name by name: what each public method, property and attribute of
DeepSpeedEngine (deepspeed/runtime/engine.py, 0.19.6) is on a StrataEngine.

Every row has one of three answers:
  same     implemented with DeepSpeed's meaning;
  differs  implemented; the note says where Strata's meaning differs, and why;
  refused  not implemented: reading the name raises NotSupportedError, which is also an
           AttributeError (hasattr() is False), naming the feature and what to use instead.
A name that is in neither the table nor the engine falls through to the model, as with
DeepSpeed's engine (engine.generate(...) is the model's generate).

    python3 -m strata.engine_surface       # the table as Markdown: python/ENGINE_SURFACE.md
"""

import collections

from . import unsupported

Row = collections.namedtuple("Row", "name kind status note")

SAME, DIFFERS, REFUSED = "same", "differs", "refused"

_CONFIG_AS_GIVEN = "the configured value (DeepSpeed's default when unset); Strata does not act on it"


def _rows(kind, status, names, note=""):
    return [Row(n, kind, status, note) for n in names.split()]


# Sections in the order of the Markdown table.
SECTIONS = collections.OrderedDict()

SECTIONS["Training loop"] = [
    Row("forward", "method", SAME, "runs the model under the unit hooks that gather and release "
        "its parameters"),
    Row("backward", "method", DIFFERS, "(loss, allreduce_gradients=True, release_loss=False, "
        "retain_graph=False, scale_wrt_gas=True); returns the loss as given; "
        "allreduce_gradients=False and retain_graph=True are refused by name (every gradient is "
        "reduced into its shard during backward, and units are released after it)"),
    Row("step", "method", SAME, "applies the optimizer at each accumulation boundary, a no-op "
        "before it; an fp16 overflow skips the update and the schedule"),
    Row("is_gradient_accumulation_boundary", "method", DIFFERS, "true once the last micro-batch's "
        "backward has run (DeepSpeed: from its forward on); equal when asked after backward"),
    Row("set_gradient_accumulation_boundary", "method", DIFFERS, "kept; step() refuses a "
        "boundary that is not a multiple of gradient_accumulation_steps, with the counts"),
    Row("zero_grad", "method", SAME, "nothing to clear: gradients never stay in .grad"),
    Row("was_step_applied", "method", SAME, "false after an fp16 overflow or before any step"),
    Row("get_global_grad_norm", "method", DIFFERS, "a float; None before the first step and "
        "after an overflow (DeepSpeed keeps the last good norm)"),
    Row("get_lr", "method", SAME, "one lr per parameter group"),
    Row("get_mom", "method", SAME, "momentum for SGD and RMSprop, betas otherwise, per group"),
    Row("get_type", "method", SAME, "each group's \"type\" key"),
    Row("train", "method", SAME, "the module's train(mode)"),
    Row("eval", "method", SAME, "the module's eval()"),
    Row("destroy", "method", DIFFERS, "ends the engine and writes the fp32 master weights back "
        "into the model's parameters (collective under stage 3)"),
    Row("empty_partition_cache", "method", SAME, "empties the device allocator's cache; stage 3 "
        "keeps no gathered parameters between forwards"),
    Row("offload_states", "method", SAME, "stage 3; pin_memory and non_blocking are accepted"),
    Row("reload_states", "method", SAME, ""),
    Row("scale", "method", REFUSED, "manual_scale"),
    Row("no_sync", "contextmanager", REFUSED, "no_sync"),
    Row("coalesce_grad_reduction", "contextmanager", REFUSED, "no_sync"),
    Row("allreduce_gradients", "method", REFUSED, "no_sync"),
    Row("clip_fp32_gradients", "method", REFUSED, "manual_clip"),
    Row("get_wall_clock_timers", "method", REFUSED, "timers"),
    Row("print_forward_breakdown", "method", REFUSED, "moe"),
    Row("get_pld_theta", "method", REFUSED, "pld"),
]

SECTIONS["Batch and data"] = [
    Row("train_batch_size", "method", SAME, "micro × accumulation × data-parallel ranks"),
    Row("train_micro_batch_size_per_gpu", "method", SAME, ""),
    Row("gradient_accumulation_steps", "method", SAME, ""),
    Row("get_batch_info", "method", SAME, "the three getters themselves, as DeepSpeed returns"),
    Row("deepspeed_io", "method", SAME, "a DataLoader over this rank's share: a "
        "DistributedSampler over the data-parallel ranks (no shuffle for eval/predict routes)"),
    Row("dataloader_drop_last", "method", SAME, ""),
    Row("is_map_style_dataset", "staticmethod", SAME, ""),
    Row("is_iterable_style_dataset", "staticmethod", SAME, ""),
    Row("managed_gradient_accumulation", "method", DIFFERS, _CONFIG_AS_GIVEN +
        ": the engine always counts micro-batches itself"),
    Row("set_train_batch_size", "method", REFUSED, "resize_batch"),
    Row("set_train_micro_batch_size", "method", REFUSED, "resize_batch"),
    Row("set_data_post_process_func", "method", REFUSED, "data_efficiency"),
    Row("set_custom_curriculum_learning_schedule", "method", REFUSED, "data_efficiency"),
]

SECTIONS["Ranks and groups"] = [
    Row("get_data_parallel_rank", "method", SAME, ""),
    Row("get_model_parallel_rank", "method", SAME, "0: no model parallelism"),
    Row("get_tensor_parallel_rank", "method", SAME, "0: no tensor parallelism"),
    Row("is_first_weights_partition_group", "method", SAME, "every rank under stage 3 (no MiCS)"),
    Row("mics_shard_size", "method", DIFFERS, _CONFIG_AS_GIVEN),
    Row("get_sequence_parallel_group", "method", REFUSED, "sequence_parallel"),
    Row("tensor_parallel_config", "method", REFUSED, "tensor_parallel"),
    Row("autotp_size", "method", REFUSED, "tensor_parallel"),
    Row("is_elastic_model_parallel_supported", "method", REFUSED, "elasticity"),
    Row("elasticity_enabled", "method", SAME, ""),
]

SECTIONS["ZeRO config"] = [
    Row("zero_optimization", "method", SAME, "stage > 0"),
    Row("zero_optimization_stage", "method", SAME, ""),
    Row("zero_optimization_partition_gradients", "method", SAME, "stage >= 2"),
    Row("zero_optimization_partition_weights", "method", SAME, "stage >= 3"),
    Row("zero_offload_optimizer", "method", SAME, "the section as an object with its keys as "
        "attributes, or None"),
    Row("zero_offload_param", "method", SAME, "the section as an object, or None"),
    Row("zero_use_cpu_optimizer", "method", SAME, "offload_optimizer on cpu or nvme"),
    Row("zero_cpu_offload", "method", SAME, ""),
    Row("zero_nvme_offload_optimizer", "method", SAME, ""),
    Row("zero_partial_offload", "method", DIFFERS, _CONFIG_AS_GIVEN +
        " (the whole optimizer state is offloaded)"),
    Row("zero_gather_16bit_weights_on_model_save", "method", SAME, ""),
    Row("zero_reduce_bucket_size", "method", SAME, ""),
    Row("zero_allgather_bucket_size", "method", SAME, ""),
    Row("zero_max_live_parameters", "method", SAME, ""),
    Row("zero_max_reuse_distance", "method", SAME, ""),
    Row("zero_prefetch_bucket_size", "method", SAME, ""),
    Row("zero_param_persistence_threshold", "method", SAME, ""),
    Row("zero_allow_untested_optimizer", "method", SAME, ""),
    Row("zero_overlap_comm", "method", DIFFERS, _CONFIG_AS_GIVEN +
        " (collectives run on the compute thread)"),
    Row("zero_contiguous_gradients", "method", DIFFERS, _CONFIG_AS_GIVEN +
        " (gradients always live in contiguous chunks)"),
    Row("zero_sub_group_size", "method", DIFFERS, _CONFIG_AS_GIVEN +
        " (the optimizer works one chunk at a time)"),
] + _rows("method", DIFFERS, """zero_reduce_scatter zero_multi_rank_bucket_allreduce
    zero_load_from_fp32_weights zero_elastic_checkpoint zero_module_granularity_threshold
    zero_model_persistence_threshold zero_grad_hooks zero_legacy_stage1
    zero_ignore_unused_parameters zero_allgather_partitions zero_round_robin_gradients
    zero_hpz_partition_size zero_quantized_weights zero_quantized_nontrainable_weights
    zero_quantized_gradients zeropp_loco_param zero_log_trace_cache_warnings
    zero_allgather_sequential is_sanity_checks_enabled zero_save_muon_momentum_buffer_in_memory
    zero_force_ds_cpu_optimizer""", _CONFIG_AS_GIVEN) + [
    Row("super_offload", "method", SAME, "false unless configured; SuperOffload itself is "
        "refused at initialize"),
    Row("cpuadam_cores_perc", "method", REFUSED, "super_offload"),
    Row("zenflow_config", "method", REFUSED, "super_offload"),
    Row("swap_tensor_config", "method", REFUSED, "internal"),
    Row("aio_config", "method", DIFFERS, "the aio section Strata's io_uring reads, defaults "
        "filled (Strata's defaults)"),
]

SECTIONS["Precision and loss scale"] = [
    Row("fp16_enabled", "method", SAME, ""),
    Row("bfloat16_enabled", "method", SAME, ""),
    Row("loss_scale", "method", SAME, "the config's static fp16.loss_scale (0: dynamic); the "
        "scale in use is engine.optimizer.cur_scale"),
    Row("dynamic_loss_scale", "method", SAME, ""),
    Row("initial_dynamic_scale", "method", SAME, ""),
    Row("dynamic_loss_scale_args", "method", DIFFERS, "DeepSpeed's dict; consecutive_hysteresis "
        "is reported but has no effect"),
    Row("get_data_types", "method", DIFFERS, "(working precision, torch.float32): gradients "
        "accumulate in fp32"),
    Row("communication_data_type", "property", DIFFERS, "torch.float32 always (gradients are "
        "reduced in fp32); assigning another dtype is refused by name"),
    Row("gradient_clipping", "method", SAME, ""),
    Row("postscale_gradients", "method", SAME, ""),
    Row("gradient_predivide_factor", "method", DIFFERS, _CONFIG_AS_GIVEN),
] + _rows("method", DIFFERS, """fp16_auto_cast fp16_master_weights_and_gradients
    torch_autocast_enabled""", _CONFIG_AS_GIVEN) + [
    Row("bf16_master_weights_and_gradients", "method", SAME, "the configured value; Strata "
        "keeps the master and gradients in bf16 under it (README, \"Compact layouts\")"),
    Row("bf16_optimizer_states", "method", SAME, "the configured value; Strata keeps the "
        "moments in bf16 under it"),
    Row("amp_enabled", "method", SAME, "false unless configured; apex AMP itself is refused"),
    Row("amp_params", "method", REFUSED, "amp"),
    Row("torch_autocast_dtype", "method", REFUSED, "internal"),
    Row("torch_autocast_lower_precision_safe_modules", "method", REFUSED, "internal"),
]

SECTIONS["Optimizer, scheduler and logging config"] = [
    Row("optimizer_name", "method", SAME, "the client optimizer's class name, else the config's "
        "optimizer.type"),
    Row("optimizer_params", "method", SAME, ""),
    Row("optimizer_legacy_fusion", "method", DIFFERS, _CONFIG_AS_GIVEN),
    Row("scheduler_name", "method", SAME, ""),
    Row("scheduler_params", "method", SAME, ""),
    Row("steps_per_print", "method", SAME, ""),
    Row("log_level", "method", DIFFERS, _CONFIG_AS_GIVEN + " (STRATA_LOG_LEVEL sets Strata's)"),
] + _rows("method", DIFFERS, """wall_clock_breakdown memory_breakdown dump_state graph_harvesting
    use_node_local_storage load_universal_checkpoint""", _CONFIG_AS_GIVEN) + [
    Row("checkpoint_tag_validation_enabled", "method", DIFFERS, _CONFIG_AS_GIVEN),
    Row("checkpoint_tag_validation_fail", "method", DIFFERS, _CONFIG_AS_GIVEN),
    Row("sparse_gradients_enabled", "method", SAME, "false unless configured; sparse gradients "
        "themselves are refused"),
    Row("checkpoint_serialization_enabled", "method", REFUSED, "internal"),
    Row("checkpoint_writer_enabled", "method", REFUSED, "internal"),
    Row("quantize_training", "method", REFUSED, "compression"),
]

SECTIONS["Features Strata does not implement"] = [
    Row("pld_enabled", "method", SAME, "false unless configured")] + _rows(
    "method", REFUSED, "pld_params pld_theta pld_gamma", "pld") + [
    Row("eigenvalue_enabled", "method", SAME, "false unless configured")] + _rows(
    "method", REFUSED, """eigenvalue_verbose eigenvalue_max_iter eigenvalue_tol
    eigenvalue_stability eigenvalue_gas_boundary_resolution eigenvalue_layer_name
    eigenvalue_layer_num""", "eigenvalue") + [
    Row("curriculum_enabled_legacy", "method", SAME, "false unless configured"),
    Row("data_efficiency_enabled", "method", SAME, "false unless configured")] + _rows(
    "method", REFUSED, """curriculum_params_legacy data_efficiency_config data_sampling_enabled
    data_sampling_config curriculum_learning_enabled curriculum_learning_config random_ltd_enabled
    random_ltd_config random_ltd_initialize""", "data_efficiency") + [
    Row("flops_profiler_enabled", "method", SAME, "false unless configured")] + _rows(
    "method", REFUSED, """flops_profiler_recompute_fwd_factor flops_profiler_profile_step
    flops_profiler_module_depth flops_profiler_top_modules flops_profiler_detailed
    flops_profiler_output_file""", "flops_profiler") + [
    Row("autotuning_enabled", "method", SAME, "false unless configured")] + _rows(
    "method", REFUSED, """autotuning_start_profile_step autotuning_end_profile_step
    autotuning_metric_path autotuning_model_info_path autotuning_metric
    autotuning_profile_model_info""", "autotuning") + [
    Row("is_compiled", "property", SAME, "false: the engine is never compiled")] + _rows(
    "method", REFUSED, """compile get_compile_time register_compile_pass is_deepcompile_enabled
    is_deepcompile_active compile_zero_optimization_stage compile_autosp compile_autotp
    uses_parallelization_pass_only get_autosp_backend get_autotp_backend get_deepcompile_backend
    get_deepspeed_compile_backend""", "compile") + _rows(
    "method", REFUSED, """allreduce_bucket allreduce_and_copy allreduce_no_retain
    buffered_allreduce_fallback sparse_allreduce_no_retain sparse_allreduce_bucket
    sparse_allreduce sparse_all_gather all_gather_scalar""", "grad_comm") + [
    Row("load_moe_state_dict", "staticmethod", REFUSED, "moe"),
]

SECTIONS["Checkpoints and weights"] = [
    Row("save_checkpoint", "method", DIFFERS, "(save_dir, tag=None, client_state=None, "
        "save_latest=True, exclude_frozen_parameters=False); Strata's own layout (tag "
        "global_step<N>, a latest file, one directory per tag; frozen parameters once, by rank "
        "0); returns True"),
    Row("load_checkpoint", "method", DIFFERS, "(load_dir, tag=None, load_module_strict=True, "
        "load_optimizer_states=True, load_lr_scheduler_states=True, load_module_only=False, "
        "custom_load_fn=None); returns (the tag's directory, client_state); "
        "load_optimizer_states=False loads the weights, the counters and the schedule, and the "
        "optimizer keeps its states and its own step count, as DeepSpeed's; custom_load_fn is "
        "refused by name"),
    Row("save_16bit_model", "method", SAME, "under stage 3 it needs "
        "stage3_gather_16bit_weights_on_model_save, else returns False"),
    Row("save_fp16_model", "method", SAME, "save_16bit_model's older name"),
    Row("module_state_dict", "method", DIFFERS, "under stage 3, gathered copies of the whole "
        "model on every rank (DeepSpeed returns the empty partitioned tensors)"),
    Row("load_module_state_dict", "method", SAME, "checkpoint['module'] into the model's "
        "weights, fp32 master included, from rank 0's values; custom_load_fn is called as "
        "DeepSpeed calls it"),
]

SECTIONS["Attributes"] = [
    Row("module", "attribute", SAME, ""),
    Row("optimizer", "attribute", DIFFERS, "a StrataOptimizer: param_groups, state_dict, "
        "overflow, cur_scale and loss_scale; its state lives in the engine's tiers"),
    Row("basic_optimizer", "attribute", DIFFERS, "the client optimizer when one was given, "
        "else engine.optimizer"),
    Row("client_optimizer", "attribute", SAME, "the optimizer given to initialize, or None"),
    Row("lr_scheduler", "attribute", SAME, "assignable"),
    Row("client_lr_scheduler", "attribute", SAME, ""),
    Row("training_dataloader", "attribute", SAME, "the loader initialize built, assignable"),
    Row("training_data", "attribute", SAME, ""),
    Row("collate_fn", "attribute", SAME, ""),
    Row("config", "attribute", DIFFERS, "the effective config: defaults filled in, \"auto\" "
        "resolved"),
    Row("global_steps", "attribute", DIFFERS, "optimizer steps applied: an fp16-overflow skip "
        "is counted in skipped_steps only (DeepSpeed counts it in both); read-only"),
    Row("global_samples", "attribute", DIFFERS, "global_steps × train_batch_size(); read-only"),
    Row("micro_steps", "attribute", DIFFERS, "micro-batches through backward (DeepSpeed counts "
        "step() calls: the same in a loop that calls both once per micro-batch)"),
    Row("skipped_steps", "attribute", SAME, "fp16-overflow skips"),
    Row("global_rank", "attribute", SAME, ""),
    Row("local_rank", "attribute", SAME, ""),
    Row("world_size", "attribute", SAME, ""),
    Row("dp_world_size", "attribute", SAME, "every rank: Strata is data-parallel only"),
    Row("mp_world_size", "attribute", SAME, "1"),
    Row("seq_dp_world_size", "attribute", SAME, "dp_world_size"),
    Row("sequence_parallel_size", "attribute", SAME, "1"),
    Row("device", "attribute", SAME, ""),
    Row("data_parallel_group", "attribute", SAME, "the world group"),
    Row("seq_data_parallel_group", "attribute", SAME, "data_parallel_group"),
    Row("mpu", "attribute", SAME, "None: initialize refuses an mpu"),
    Row("pipeline_parallelism", "attribute", SAME, "False; True on a PipelineModule's engine"),
    Row("has_moe_layers", "attribute", SAME, "False"),
    Row("param_names", "attribute", SAME, "parameter -> its name in the model"),
    Row("dont_change_device", "attribute", SAME, "False"),
    Row("gradient_average", "attribute", SAME, "True: gradients are averaged over the ranks"),
] + _rows("attribute", REFUSED, """num_experts gate_modules moe_layers expert_parallel_group
    expert_data_parallel_group""", "moe") + _rows(
    "attribute", REFUSED, "seq_parallel_group", "sequence_parallel") + _rows(
    "attribute", REFUSED, "all_to_all_group local_all_to_all_group", "zeropp") + _rows(
    "attribute", REFUSED, "progressive_layer_drop", "pld") + _rows(
    "attribute", REFUSED, "eigenvalue block_eigenvalue", "eigenvalue") + _rows(
    "attribute", REFUSED, "curriculum_scheduler_legacy random_ltd_scheduler", "data_efficiency") + \
    _rows("attribute", REFUSED, "flops_profiler flops", "flops_profiler") + _rows(
    "attribute", REFUSED, """timers tput_timer engine_timers engine_timers_cache monitor
    summary_events fwd_duration""", "timers") + _rows(
    "attribute", REFUSED, "compression_scheduler quantizer", "compression") + _rows(
    "attribute", REFUSED, "autotuning_model_info", "autotuning") \
    + _rows("attribute", REFUSED, "mesh_device", "tensor_parallel") + _rows(
    "attribute", REFUSED, """warn_unscaled_loss loaded_checkpoint_mp_world_size
    loaded_checkpoint_dp_world_size enable_backward_allreduce inside_no_sync_ctxt gas_boundary_ctr
    dist_backend use_ds_comm checkpoint_engine scale_wrt_gas losses module_forward_pre_hook
    module_forward_post_hook torch_autocast_z0_gradscaler sparse_tensor_module_names
    save_non_zero_checkpoint save_zero_checkpoint flatten unflatten checkpoint_mp_rank
    first_dataloader_check update_interval optimized_linear_base_weight_sharding
    optimized_linear_lora_enabled""",
    "internal")

ROWS = {row.name: row for rows in SECTIONS.values() for row in rows}
REFUSED_NAMES = {name: row.note for name, row in ROWS.items() if row.status == REFUSED}


def refusal(name):
    """The error for reading a refused name on the engine."""
    return unsupported.refused_attribute("engine", name, REFUSED_NAMES[name])


def markdown():
    lines = ["# The engine's public surface",
             "",
             "Every public method, property and attribute of DeepSpeed's `DeepSpeedEngine` "
             "(deepspeed/runtime/engine.py, 0.19.6), and what it is on the engine "
             "`strata.initialize` / `deepspeed.initialize` returns. Generated by "
             "`python3 -m strata.engine_surface` from python/strata/engine_surface.py; "
             "tests/python/test_engine_surface.py calls every implemented row and reads every "
             "refused one.",
             "",
             "- **same**: DeepSpeed's meaning.",
             "- **differs**: implemented; the note says how it differs.",
             "- **refused**: reading it raises `NotSupportedError` (an `AttributeError` too, so "
             "`hasattr` is false) that names the feature and what to use instead.",
             "",
             "A name that is neither here nor on the engine is looked up on the model, as "
             "DeepSpeed's engine does.",
             ""]
    for title, rows in SECTIONS.items():
        lines += [f"## {title}", "", "| name | kind | Strata | note |", "|---|---|---|---|"]
        for r in rows:
            note = unsupported.message(r.note) if r.status == REFUSED else r.note
            lines.append(f"| `{r.name}` | {r.kind} | {r.status} | {note} |")
        lines.append("")
    counts = collections.Counter(r.status for r in ROWS.values())
    lines.append(f"{len(ROWS)} names: {counts[SAME]} same, {counts[DIFFERS]} differ, "
                 f"{counts[REFUSED]} refused.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
