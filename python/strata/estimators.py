"""DeepSpeed's memory estimators (deepspeed.runtime.zero.stage_1_and_2 and .stage3:
estimate_zero2_model_states_mem_needs*, estimate_zero3_model_states_mem_needs*), answered by
Strata's planner: each row of DeepSpeed's table is Strata's engine under that option, sized by
the memory model strata-estimate uses (tools/planner/memory_model.h), not DeepSpeed's formulas.

The table keeps DeepSpeed's layout (per CPU = one node's host memory, per GPU = one rank's
device memory) and adds one line saying whose figures they are. The engine is assumed to train
with a bf16 working copy and AdamW, as DeepSpeed's formulas assume 16-bit parameters and Adam.
additional_buffer_factor is accepted and not applied: the planner counts the engine's buffers
themselves. zero_init=0 adds what each rank's process holds while it builds the whole model in
fp32 before initialize (with zero.Init a module at a time is staged to disk).
"""

import json

from . import _strata

_WHOSE = ("Figures: Strata's planner (the memory model behind strata-estimate) for Strata's "
          "engine with a bf16 working copy and AdamW; DeepSpeed's formulas give other numbers.")


def _config(stage, offload_optimizer, offload_param):
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": stage,
                                  "offload_optimizer": {"device": offload_optimizer},
                                  "offload_param": {"device": offload_param}}}


def _layers_of(total_params, largest_layer_params):
    """A model known by its sizes: layers of largest_layer_params, the last one the rest."""
    total, largest = int(total_params), max(1, int(largest_layer_params or total_params))
    layers, left = [], total
    while left > 0:
        layers.append(min(largest, left))
        left -= layers[-1]
    return [(f"layer{i}.weight", n, i) for i, n in enumerate(layers)]


def _layers_of_model(model):
    """A live model: each module's own parameters are one unit, in registration order, a
    shared parameter counted once."""
    seen, out, unit = set(), [], 0
    for name, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        for n, p in own:
            seen.add(id(p))
            out.append((f"{name}.{n}" if name else n, p.numel(), unit))
        if own:
            unit += 1
    return out


def _estimate(layers, stage, offload_optimizer, offload_param, gpus_per_node, nodes,
              zero_init=True):
    """(bytes of host memory per node, bytes of device memory per rank) for Strata's engine."""
    world = int(gpus_per_node) * int(nodes)
    est = json.loads(_strata.estimate_memory(
        json.dumps(_config(stage, offload_optimizer, offload_param)), layers, world, "cuda"))
    host_per_rank = est["host_pinned_bytes"] + est["host_pageable_bytes"]
    if not zero_init:
        # Without zero.Init each process first builds the whole model in fp32.
        host_per_rank = max(host_per_rank, 4 * sum(n for _, n, _ in layers))
    return int(host_per_rank * int(gpus_per_node)), int(est["hbm_bytes"])


def _header(total_params, num_gpus_per_node, num_nodes, largest_layer_params=None):
    nodes_str = "nodes" if num_nodes > 1 else "node"
    gpus_str = "GPUs" if num_gpus_per_node > 1 else "GPU"
    sw = f"SW: Model with {int(total_params / 1e6)}M total params"
    if largest_layer_params is not None:
        sw += f", {int(largest_layer_params / 1e6)}M largest layer params"
    print("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {num_nodes} {nodes_str}, {num_gpus_per_node} {gpus_str} per node.\n"
          f"{sw}.")
    print("  per CPU  |  per GPU |   Options")


def _row(cpu, gpu, options):
    print(f" {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | {options}")


def _device(on):
    return "cpu " if on else "none"


# --- ZeRO-2 -----------------------------------------------------------------------------------------
def model_to_params_zero2(model):
    return sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())


def estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=1, num_nodes=1,
                                          cpu_offload=True, additional_buffer_factor=1.5):
    """(host bytes per node, device bytes per rank) of Strata's engine at ZeRO-2."""
    return _estimate(_layers_of(total_params, None), 2, "cpu" if cpu_offload else "none", "none",
                     num_gpus_per_node, num_nodes)


def _zero2_table(layers, total_params, num_gpus_per_node, num_nodes):
    _header(total_params, num_gpus_per_node, num_nodes)
    for cpu_offload in (True, False):
        cpu, gpu = _estimate(layers, 2, "cpu" if cpu_offload else "none", "none",
                             num_gpus_per_node, num_nodes)
        _row(cpu, gpu, f"offload_optimizer={_device(cpu_offload)}")
    print(_WHOSE)


def estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node=1,
                                                   num_nodes=1, additional_buffer_factor=1.5):
    """Prints DeepSpeed's ZeRO-2 table for a model of total_params, with Strata's figures."""
    _zero2_table(_layers_of(total_params, None), total_params, num_gpus_per_node, num_nodes)


def estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    """The same for a model object, its parameters laid out as the engine would lay them."""
    layers = _layers_of_model(model)
    _zero2_table(layers, sum(n for _, n, _ in layers), num_gpus_per_node, num_nodes)


# --- ZeRO-3 -----------------------------------------------------------------------------------------
def model_to_params_zero3(model):
    total = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
                  default=0)
    return total, largest


def estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node=1,
                                          num_nodes=1, cpu_offload=True, cpu_offload_params=True,
                                          zero_init=True, additional_buffer_factor=1.5):
    """(host bytes per node, device bytes per rank, the largest layer's bf16 working copy) of
    Strata's engine at ZeRO-3."""
    cpu, gpu = _estimate(_layers_of(total_params, largest_layer_params), 3,
                         "cpu" if cpu_offload else "none", "cpu" if cpu_offload_params else "none",
                         num_gpus_per_node, num_nodes, zero_init)
    return cpu, gpu, 2 * int(largest_layer_params)


def _zero3_table(layers, total_params, largest_layer_params, num_gpus_per_node, num_nodes):
    _header(total_params, num_gpus_per_node, num_nodes, largest_layer_params)
    for cpu_offload in (True, False):
        for cpu_offload_params in (True, False):
            if cpu_offload_params and not cpu_offload:
                continue
            for zero_init in (True, False):
                cpu, gpu = _estimate(layers, 3, "cpu" if cpu_offload else "none",
                                     "cpu" if cpu_offload_params else "none", num_gpus_per_node,
                                     num_nodes, zero_init)
                _row(cpu, gpu, f"offload_param={_device(cpu_offload_params)}, "
                               f"offload_optimizer={_device(cpu_offload)}, "
                               f"zero_init={1 if zero_init else 0}")
    print(_WHOSE)


def estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params,
                                                   num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    """Prints DeepSpeed's ZeRO-3 table for a model of these sizes, with Strata's figures."""
    _zero3_table(_layers_of(total_params, largest_layer_params), total_params,
                 largest_layer_params, num_gpus_per_node, num_nodes)


def estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    """The same for a model object, its parameters laid out as the engine would lay them."""
    layers = _layers_of_model(model)
    total, largest = model_to_params_zero3(model)
    _zero3_table(layers, total, largest, num_gpus_per_node, num_nodes)
