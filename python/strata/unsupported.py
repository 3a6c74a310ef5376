"""What Strata does not implement, refused with one message that names the feature and what to
use instead, at the call (importing the module still works, so a script that only imports a
name it never uses runs)."""

class NotSupportedError(NotImplementedError):
    """A DeepSpeed feature Strata does not implement."""


# feature key -> (what it is, what to do instead)
FEATURES = {
    "moe": ("mixture of experts (deepspeed.moe)",
            "build the experts as ordinary torch modules; expert parallelism is not available"),
    "compression": ("model compression (deepspeed.compression)",
                    "compress with torch.ao or another library, then train with Strata"),
    "inference": ("the inference engine (deepspeed.init_inference)",
                  "run the trained model with plain PyTorch"),
    "mics": ("MiCS with shard groups smaller than the world (zero.MiCS_Init)",
             "use zero.Init with ZeRO stage 3, which shards across all ranks"),
    "sequence_parallel": ("sequence parallelism", "use data parallelism with ZeRO"),
    "tensor_parallel": ("tensor parallelism (tp_model_init, autotp)",
                        "use ZeRO stage 3, which partitions every parameter"),
    "zeropp": ("ZeRO++ (hierarchical partitions, quantized weights and gradients, LoCo)",
               "use ZeRO stage 3; Strata reduces gradients in fp32"),
    "pld": ("progressive layer drop", "drop layers in the model's own forward"),
    "eigenvalue": ("the eigenvalue analysis", "compute it outside the engine with torch.autograd"),
    "data_efficiency": ("DeepSpeed's data efficiency library (curriculum learning, data "
                        "sampling, random-LTD)", "order and sample the data in your own "
                        "DataLoader"),
    "flops_profiler": ("the flops profiler", "use torch.profiler, or strata-train's per-lane times"),
    "autotuning": ("DeepSpeed's autotuner", "use strata-tune (README: tune the offload config)"),
    "compile": ("compiling the engine (torch.compile, DeepCompile)",
                "train uncompiled: Strata's unit hooks run around each module's forward"),
    "elasticity": ("elastic training", "save a checkpoint and resume it on the new number of "
                                       "ranks (README: Elastic resume)"),
    "sparse_gradients": ("sparse gradients", "use dense embeddings (nn.Embedding(sparse=False))"),
    "amp": ("NVIDIA apex AMP", "enable bf16 or fp16 in the config"),
    "grad_comm": ("gradient all-reduce through the engine's helpers",
                  "engine.backward(loss) reduces the gradients; use torch.distributed for your "
                  "own tensors"),
    "no_sync": ("skipping or deferring the gradient reduction (no_sync, coalesce_grad_reduction, "
                "allreduce_gradients)", "set gradient_accumulation_steps in the config; the "
                "engine reduces each micro-batch's gradients into its shards during backward"),
    "manual_scale": ("engine.scale(loss) before a loss.backward() of your own",
                     "call engine.backward(loss), which applies the loss scale"),
    "manual_clip": ("clipping outside the step (clip_fp32_gradients)",
                    "set gradient_clipping in the config: the engine clips at each step"),
    "resize_batch": ("changing the batch size of a running engine",
                     "save a checkpoint and initialize a new engine with the new "
                     "train_micro_batch_size_per_gpu / gradient_accumulation_steps"),
    "timers": ("the engine's timer and monitor machinery",
               "read engine.last_report (step times per lane, bytes moved, loss scale) or run "
               "strata-train --json"),
    "super_offload": ("SuperOffload and ZenFlow", "offload_optimizer to cpu or nvme"),
    "internal": ("this part of DeepSpeed's engine internals", "python/ENGINE_SURFACE.md lists what a Strata "
                                                 "engine answers"),
}


def message(feature):
    what, instead = FEATURES[feature]
    return f"{what} is not implemented by Strata; {instead}. (README: Python, what is refused)"


def refused_class(name, feature):
    """A class standing for a refused DeepSpeed class: making one raises NotSupportedError."""

    def __init__(self, *args, **kwargs):
        raise NotSupportedError(f"{name}: {message(feature)}")

    return type(name, (), {"__init__": __init__, "__doc__": message(feature)})


def refused_function(name, feature):
    def refused(*args, **kwargs):
        raise NotSupportedError(f"{name}: {message(feature)}")

    refused.__name__ = name
    refused.__doc__ = message(feature)
    return refused


def module_getattr(module_name, feature):
    """A module-level __getattr__ for a refused module: any other name is an AttributeError
    that says why."""

    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{module_name}.{name}: {message(feature)}")

    return __getattr__


class RefusedAttributeError(NotSupportedError, AttributeError):
    """Reading a DeepSpeed engine attribute that Strata refuses. It is an AttributeError too, so
    hasattr() and getattr(..., default) treat it as absent, while the message says why."""


def refused_attribute(owner, name, feature):
    return RefusedAttributeError(f"{owner}.{name}: {message(feature)}")
