"""`deepspeed`, served by Strata: DeepSpeed's Python API over Strata's engine, so that training
scripts written for DeepSpeed run unchanged. Turned on by `source <build>/deepspeed-env.sh`
(README, "DeepSpeed scripts"); it never shadows a real DeepSpeed installation.

Every module here is a thin name map onto the `strata` package, which holds the implementation.
What Strata does not implement (MoE, compression, inference, ...) imports
but refuses at the call, naming the feature and what to use instead.
"""

import strata as _strata
from strata import DeepSpeedEngine, InvalidArgumentError, StrataError, initialize
from strata import unsupported as _unsupported
from strata.arguments import add_config_arguments
from strata.comm import init_distributed

from . import accelerator, checkpointing, comm, ops, runtime, utils, zero  # noqa: F401
from .runtime import lr_schedules  # noqa: F401  (accelerate reads it right after import)

# The DeepSpeed API level these modules follow; the distribution's metadata says the same.
__version__ = "0.16.0+strata." + _strata.__version__
__version_major__, __version_minor__, __version_patch__ = 0, 16, 0
__git_hash__ = None
__git_branch__ = None
__strata__ = True  # a script can tell Strata's deepspeed from DeepSpeed's

init_inference = _unsupported.refused_function("deepspeed.init_inference", "inference")
tp_model_init = _unsupported.refused_function("deepspeed.tp_model_init", "tensor_parallel")
from strata.pipe import PipelineModule  # noqa: E402  (every stage on each rank)
from strata.pipe_engine import PipelineEngine  # noqa: E402


def is_compile_supported():
    return False


def add_tuning_arguments(parser):
    """Autotuning flags are accepted for compatibility (strata-tune is Strata's tuner)."""
    return parser


__all__ = ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine", "zero",
           "checkpointing", "comm", "accelerator", "ops", "runtime", "utils", "StrataError",
           "InvalidArgumentError", "init_inference", "PipelineModule", "PipelineEngine"]
