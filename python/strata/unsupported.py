"""What Strata does not implement, refused with one message that names the feature and what to
use instead, at the call (importing the module still works, so a script that only imports a
name it never uses runs)."""

class NotSupportedError(NotImplementedError):
    """A DeepSpeed feature Strata does not implement."""


# feature key -> (what it is, what to do instead)
FEATURES = {
    "pipe": ("pipeline parallelism (deepspeed.pipe)",
             "train the model as one module with ZeRO stage 3 and offload, which Strata runs on "
             "any number of ranks"),
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
