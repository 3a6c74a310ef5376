"""strata.runtime_utils: the helpers DeepSpeed scripts import from `deepspeed.runtime.utils`."""

import gc
import random

import torch

from . import accelerator as _accelerator
from . import comm as _comm


class RepeatingLoader:
    """Iterates over `loader` forever, starting it again whenever it runs out."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def set_random_seed(seed):
    """Seeds Python's, NumPy's (when present) and torch's generators."""
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)
    _accelerator.get_accelerator().manual_seed_all(seed)


def see_memory_usage(message, force=False):
    """Prints the device's memory counters on rank 0 when `force` is set (as DeepSpeed)."""
    if not force or _comm.get_rank() != 0:
        return
    gc.collect()
    acc = _accelerator.get_accelerator()
    gib = 1 << 30
    print(f"{message} | MA {acc.memory_allocated() / gib:.2f} GB | "
          f"Max_MA {acc.max_memory_allocated() / gib:.2f} GB | "
          f"CA {acc.memory_reserved() / gib:.2f} GB | "
          f"Max_CA {acc.max_memory_reserved() / gib:.2f} GB", flush=True)


def clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None):
    """torch.nn.utils.clip_grad_norm_ for parameters outside an engine (inside one, set the
    config's gradient_clipping: the engine clips the partitioned gradients itself)."""
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)


__all__ = ["RepeatingLoader", "set_random_seed", "see_memory_usage", "clip_grad_norm_"]
