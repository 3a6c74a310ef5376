"""Strata: ZeRO training of any torch.nn.Module across device memory, host DRAM and NVMe, with
DeepSpeed's API. A DeepSpeed training script runs after

    import strata as deepspeed

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config="ds_config.json")
    for batch in data:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

The C++ engine does the work: partitioning (ZeRO stages 0-3), the tier manager (device, pinned
host pool, NVMe through io_uring), gradient reduction and the CPU Adam.
"""

try:
    import torch  # noqa: F401  - the extension links the LibTorch this torch was built with
except ImportError as e:  # pragma: no cover - depends on the interpreter
    raise ImportError(
        "strata needs PyTorch in this interpreter; on Debian run it with /usr/bin/python3 "
        "(python3-torch), or rebuild Strata against this Python's torch "
        "(-DSTRATA_PYTHON_EXECUTABLE=...)") from e

from ._strata import InvalidArgumentError, StrataError, host_description
from .initialize import initialize
from . import checkpointing, zero
from .engine import StrataEngine
from .unsupported import NotSupportedError

__version__ = "0.1.0"

DeepSpeedEngine = StrataEngine  # scripts that check isinstance(engine, deepspeed.DeepSpeedEngine)


def init_distributed(dist_backend=None, **kwargs):
    """Accepted for DeepSpeed scripts: the engine joins the ranks itself at initialize, from the
    torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""


__all__ = ["initialize", "init_distributed", "zero", "checkpointing", "StrataEngine",
           "DeepSpeedEngine", "StrataError", "InvalidArgumentError", "NotSupportedError",
           "host_description"]
