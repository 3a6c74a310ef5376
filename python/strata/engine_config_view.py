"""DeepSpeed's config getters on the engine (engine.zero_reduce_bucket_size(), engine.loss_scale(),
engine.optimizer_name(), ...): what the run's config says, with DeepSpeed's defaults where the
script left a key out, so that code written against DeepSpeed's engine reads the same values.

Two sources, on purpose:
  - what Strata decided (the stage, the offload devices, precision, batch sizes, clipping) comes
    from the effective config, the one the C++ engine runs (defaults filled, "auto" resolved);
  - DeepSpeed's knobs that Strata reads differently or not at all come from the user's config as
    given, so a getter reports what the script asked for. python/ENGINE_SURFACE.md says which
    of them Strata acts on.
"""

import sys
import types

import torch

from .unsupported import NotSupportedError

# Getter -> (keys in zero_optimization, the first found wins; DeepSpeed's default).
_ZERO_KEYS = {
    "zero_reduce_scatter": (("reduce_scatter",), True),
    "zero_sub_group_size": (("sub_group_size",), 10**9),
    "zero_reduce_bucket_size": (("reduce_bucket_size",), 5 * 10**8),
    "zero_multi_rank_bucket_allreduce": (("use_multi_rank_bucket_allreduce",), True),
    "zero_allgather_bucket_size": (("allgather_bucket_size",), 5 * 10**8),
    "zero_contiguous_gradients": (("contiguous_gradients",), True),
    "zero_load_from_fp32_weights": (("load_from_fp32_weights",), True),
    "zero_elastic_checkpoint": (("elastic_checkpoint",), False),
    "zero_max_live_parameters": (("stage3_max_live_parameters", "max_live_parameters"), 10**9),
    "zero_max_reuse_distance": (("stage3_max_reuse_distance", "max_reuse_distance"), 10**9),
    "zero_prefetch_bucket_size": (("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
                                  5 * 10**7),
    "zero_module_granularity_threshold": (("stage3_module_granularity_threshold",
                                           "module_granularity_threshold"), 0),
    "zero_param_persistence_threshold": (("stage3_param_persistence_threshold",
                                          "param_persistence_threshold"), 10**5),
    "zero_model_persistence_threshold": (("stage3_model_persistence_threshold",
                                          "model_persistence_threshold"), sys.maxsize),
    "zero_grad_hooks": (("grad_hooks",), True),
    "zero_legacy_stage1": (("legacy_stage1",), False),
    "zero_ignore_unused_parameters": (("ignore_unused_parameters",), True),
    "zero_allgather_partitions": (("allgather_partitions",), True),
    "zero_round_robin_gradients": (("round_robin_gradients",), False),
    "zero_hpz_partition_size": (("zero_hpz_partition_size",), 1),
    "zero_quantized_weights": (("zero_quantized_weights",), False),
    "zero_quantized_nontrainable_weights": (("zero_quantized_nontrainable_weights",), False),
    "zero_quantized_gradients": (("zero_quantized_gradients",), False),
    "zeropp_loco_param": (("zeropp_loco_param",), None),
    "zero_log_trace_cache_warnings": (("log_trace_cache_warnings",), False),
    "zero_allgather_sequential": (("stage3_allgather_sequential", "allgather_sequential"), False),
    "is_sanity_checks_enabled": (("enable_sanity_checks",), False),
    "zero_save_muon_momentum_buffer_in_memory": (("save_muon_momentum_buffer_in_memory",), False),
    "mics_shard_size": (("mics_shard_size",), -1),
}

# Getter -> (path in the user's config; DeepSpeed's default).
_TOP_KEYS = {
    "zero_allow_untested_optimizer": (("zero_allow_untested_optimizer",), False),
    "zero_force_ds_cpu_optimizer": (("zero_force_ds_cpu_optimizer",), True),
    "wall_clock_breakdown": (("wall_clock_breakdown",), False),
    "memory_breakdown": (("memory_breakdown",), False),
    "dump_state": (("dump_state",), False),
    "sparse_gradients_enabled": (("sparse_gradients",), False),
    "graph_harvesting": (("graph_harvesting",), False),
    "gradient_predivide_factor": (("gradient_predivide_factor",), 1.0),
    "dataloader_drop_last": (("dataloader_drop_last",), False),
    "use_node_local_storage": (("checkpoint", "use_node_local_storage"), False),
    "load_universal_checkpoint": (("checkpoint", "load_universal"), False),
    "managed_gradient_accumulation": (("managed_gradient_accumulation",), True),
    "fp16_auto_cast": (("fp16", "auto_cast"), False),
    "fp16_master_weights_and_gradients": (("fp16", "fp16_master_weights_and_grads"), False),
    "bf16_master_weights_and_gradients": (("bf16", "bf16_master_weights_and_grads"), False),
    "bf16_optimizer_states": (("bf16", "bf16_optimizer_states"), False),
    "amp_enabled": (("amp", "enabled"), False),
    "torch_autocast_enabled": (("torch_autocast", "enabled"), False),
    "elasticity_enabled": (("elasticity", "enabled"), False),
    "optimizer_legacy_fusion": (("optimizer", "legacy_fusion"), False),
    "pld_enabled": (("progressive_layer_drop", "enabled"), False),
    "eigenvalue_enabled": (("eigenvalue", "enabled"), False),
    "flops_profiler_enabled": (("flops_profiler", "enabled"), False),
    "autotuning_enabled": (("autotuning", "enabled"), False),
    "curriculum_enabled_legacy": (("curriculum_learning", "enabled"), False),
    "data_efficiency_enabled": (("data_efficiency", "enabled"), False),
    "log_level": (("log_level",), "warning"),
}

# DeepSpeed's fp16 defaults (its precision config).
_FP16_DEFAULTS = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                  "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1}


def _lookup(cfg, path, default):
    for key in path:
        if not isinstance(cfg, dict) or cfg.get(key) is None:
            return default
        cfg = cfg[key]
    return default if cfg == "auto" else cfg


def _zero_getter(name, keys, default):
    def getter(self):
        zero = self._user_zero()
        for key in keys:
            if zero.get(key) is not None and zero.get(key) != "auto":
                return zero[key]
        return default

    getter.__name__ = name
    getter.__doc__ = f"zero_optimization.{keys[0]} as configured (DeepSpeed's default {default!r})."
    return getter


def _top_getter(name, path, default):
    def getter(self):
        return _lookup(self._user_cfg(), path, default)

    getter.__name__ = name
    getter.__doc__ = f"{'.'.join(path)} as configured (DeepSpeed's default {default!r})."
    return getter


def _offload_section(kind):
    def getter(self):
        section = self._user_zero().get(kind)
        if section is None and self._config["zero_optimization"].get(kind, {}).get(
                "device", "none") == "none":
            return None
        merged = dict(section or {})
        merged["device"] = self._config["zero_optimization"].get(kind, {}).get("device", "none")
        return types.SimpleNamespace(**merged)

    getter.__name__ = f"zero_{kind}"
    getter.__doc__ = (f"zero_optimization.{kind} as an object with its keys as attributes "
                      "(device, pin_memory, nvme_path, ...), or None when the config has no such "
                      "section: DeepSpeed's answer, truthy whenever the section exists.")
    return getter


class ConfigView:
    """Mixed into StrataEngine: DeepSpeed's config getters. Needs self._config (effective) and
    self._user_config (as given)."""

    def _user_cfg(self):
        return getattr(self, "_user_config", None) or {}

    def _user_zero(self):
        return self._user_cfg().get("zero_optimization") or {}

    def _offload_device(self, kind):
        return self._config["zero_optimization"].get(kind, {}).get("device", "none")

    # --- what Strata decided --------------------------------------------------------------------
    def train_micro_batch_size_per_gpu(self):
        return self._config["train_micro_batch_size_per_gpu"]

    def gradient_accumulation_steps(self):
        return self._config["gradient_accumulation_steps"]

    def train_batch_size(self):
        return (self.train_micro_batch_size_per_gpu() * self.gradient_accumulation_steps() *
                self.dp_world_size)

    def get_batch_info(self):
        """As DeepSpeed: the three batch-size getters themselves (bound methods, not values)."""
        return (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                self.gradient_accumulation_steps)

    def steps_per_print(self):
        return self._config.get("steps_per_print", self._user_cfg().get("steps_per_print"))

    def zero_optimization_stage(self):
        return self._config["zero_optimization"]["stage"]

    def zero_optimization(self):
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self):
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self):
        return self.zero_optimization_stage() >= 3

    zero_offload_optimizer = _offload_section("offload_optimizer")
    zero_offload_param = _offload_section("offload_param")

    def zero_use_cpu_optimizer(self):
        return self._offload_device("offload_optimizer") in ("cpu", "nvme")

    def zero_cpu_offload(self):
        return self._offload_device("offload_optimizer") == "cpu"

    def zero_nvme_offload_optimizer(self):
        return self._offload_device("offload_optimizer") == "nvme"

    def zero_partial_offload(self):
        return (self._user_zero().get("offload_optimizer") or {}).get("ratio", 1.0)

    def super_offload(self):
        return bool((self._user_zero().get("offload_optimizer") or {}).get("super_offload", False))

    def zero_overlap_comm(self):
        value = self._user_zero().get("overlap_comm")
        return self.zero_optimization_stage() == 3 if value is None else value

    def zero_gather_16bit_weights_on_model_save(self):
        z = self._user_zero()
        return bool(z.get("stage3_gather_16bit_weights_on_model_save",
                          z.get("gather_16bit_weights_on_model_save",
                                z.get("stage3_gather_fp16_weights_on_model_save", False))))

    def is_first_weights_partition_group(self):
        # Without MiCS every rank holds a partition of every parameter: all are "first".
        return self.zero_optimization_partition_weights()

    def fp16_enabled(self):
        return bool(self._config.get("fp16", {}).get("enabled", False))

    def bfloat16_enabled(self):
        return bool(self._config.get("bf16", {}).get("enabled", False))

    def gradient_clipping(self):
        return self._config.get("gradient_clipping", 0.0)

    def postscale_gradients(self):
        return not self._user_cfg().get("prescale_gradients", False)

    def get_data_types(self):
        """(the working precision, the gradient accumulation dtype): gradients accumulate and
        reduce in fp32 whatever the working precision."""
        model = torch.float16 if self.fp16_enabled() else \
            torch.bfloat16 if self.bfloat16_enabled() else torch.float32
        return model, torch.float32

    @property
    def communication_data_type(self):
        """The dtype gradients are reduced in: fp32 always (a 16-bit reduction loses the small
        gradients the fp32 master keeps)."""
        return torch.float32

    @communication_data_type.setter
    def communication_data_type(self, value):
        if value != torch.float32:
            raise NotSupportedError(
                f"engine.communication_data_type = {value}: Strata reduces gradients in fp32 "
                "only; leave it at torch.float32")

    # --- fp16: the config's values (the current scale is engine.optimizer.cur_scale) ------------
    def _fp16(self, key):
        value = (self._user_cfg().get("fp16") or {}).get(key)
        return _FP16_DEFAULTS[key] if value is None or value == "auto" else value

    def loss_scale(self):
        """The config's static fp16.loss_scale (0: dynamic), as DeepSpeed's engine.loss_scale();
        the scale in use is engine.optimizer.cur_scale."""
        return self._fp16("loss_scale")

    def dynamic_loss_scale(self):
        return self.loss_scale() == 0

    def initial_dynamic_scale(self):
        return 2**self._fp16("initial_scale_power")

    def dynamic_loss_scale_args(self):
        return {"init_scale": self.initial_dynamic_scale(),
                "scale_window": self._fp16("loss_scale_window"),
                "delayed_shift": self._fp16("hysteresis"),
                "consecutive_hysteresis": self._fp16("consecutive_hysteresis"),
                "min_scale": self._fp16("min_loss_scale")}

    # --- the optimizer and scheduler sections --------------------------------------------------
    def optimizer_name(self):
        client = getattr(self, "_client_optimizer", None)
        if client is not None:
            return type(client).__name__
        return (self._user_cfg().get("optimizer") or {}).get("type")

    def optimizer_params(self):
        return (self._user_cfg().get("optimizer") or {}).get("params")

    def scheduler_name(self):
        return (self._user_cfg().get("scheduler") or {}).get("type")

    def scheduler_params(self):
        return (self._user_cfg().get("scheduler") or {}).get("params")

    # --- checkpoints and NVMe --------------------------------------------------------------------
    def _tag_validation(self):
        mode = (self._user_cfg().get("checkpoint") or {}).get("tag_validation", "Warn")
        return str(mode).capitalize()

    def checkpoint_tag_validation_enabled(self):
        return self._tag_validation() != "Ignore"

    def checkpoint_tag_validation_fail(self):
        return self._tag_validation() == "Fail"

    def aio_config(self):
        """The aio section Strata's io_uring reads (block_size, queue_depth, ...), defaults
        filled."""
        return dict(self._config.get("aio", {}))


for _name, (_keys, _default) in _ZERO_KEYS.items():
    setattr(ConfigView, _name, _zero_getter(_name, _keys, _default))
for _name, (_path, _default) in _TOP_KEYS.items():
    setattr(ConfigView, _name, _top_getter(_name, _path, _default))
