"""strata.accelerator: the device a script asks about (DeepSpeed's `get_accelerator()`).

One object answers for the device the engine computes on: a CUDA GPU when torch sees one, the
CPU device otherwise. Scripts use it to place tensors (`get_accelerator().device_name()`), seed,
synchronize and read memory counters without naming CUDA.

On the CPU device the memory counters are those of the device it stands in for: the bytes the
live engines' device allocators hold now (memory_allocated) and the most they have held
(max_memory_allocated), what torch.cuda's counters report on a GPU. So a script that frees device
memory (engine.offload_states) sees the counter fall, and a process with no engine reads 0. The
process's resident memory is host_memory_resident() (VmRSS). fp16 is unsupported there (the engine
refuses it on the CPU device); bf16 is supported.
"""

import os

import torch


def _proc_status_bytes(field):
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _engine_device_bytes(counter):
    """A device-allocator counter summed over the engines alive in this process."""
    from . import engine as _engine
    total = 0
    for e in list(_engine._live_engines.values()):
        try:
            total += getattr(e._cpp, counter)
        except Exception:  # an engine closing meanwhile holds nothing
            pass
    return total


class Accelerator:
    """DeepSpeed's accelerator interface for the device Strata computes on."""

    def __init__(self, cuda=None):
        self._cuda = torch.cuda.is_available() if cuda is None else cuda
        self._name = "cuda" if self._cuda else "cpu"
        self._communication_backend_name = "nccl" if self._cuda else "gloo"

    # --- the device ---------------------------------------------------------------------------
    def is_available(self):
        return True

    def device_name(self, device_index=None):
        if device_index is None or not self._cuda:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index=None):
        return torch.device(self.device_name(device_index))

    def current_device(self):
        if self._cuda:
            return torch.cuda.current_device()
        return int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self):
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self):
        if self._cuda:
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def set_device(self, device_index):
        if self._cuda:
            torch.cuda.set_device(device_index)

    def synchronize(self, device_index=None):
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def is_synchronized_device(self):
        """True where work is done when the call returns (the CPU device)."""
        return not self._cuda

    def on_accelerator(self, tensor):
        return tensor.device.type == self._name

    def communication_backend_name(self):
        return self._communication_backend_name

    # --- numbers ------------------------------------------------------------------------------
    def is_bf16_supported(self):
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self):
        return self._cuda

    def supported_dtypes(self):
        dtypes = [torch.float32, torch.bfloat16]
        return dtypes + [torch.float16] if self._cuda else dtypes

    def manual_seed(self, seed):
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self):
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def random(self):
        return torch.random

    # --- memory -------------------------------------------------------------------------------
    def pin_memory(self, tensor, align_bytes=1):
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor):
        return tensor.is_pinned() if self._cuda else True

    def memory_allocated(self, device_index=None):
        if self._cuda:
            return torch.cuda.memory_allocated(device_index)
        return _engine_device_bytes("device_bytes_in_use")

    def max_memory_allocated(self, device_index=None):
        """On the CPU device: the sum of the live engines' device high-water marks (they are not
        reset by reset_peak_memory_stats)."""
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        return _engine_device_bytes("device_peak_bytes")

    @staticmethod
    def host_memory_resident():
        """The process's resident memory (VmRSS), on either device."""
        return _proc_status_bytes("VmRSS")

    def memory_reserved(self, device_index=None):
        return torch.cuda.memory_reserved(device_index) if self._cuda else self.memory_allocated()

    def max_memory_reserved(self, device_index=None):
        if self._cuda:
            return torch.cuda.max_memory_reserved(device_index)
        return self.max_memory_allocated()

    def reset_peak_memory_stats(self, device_index=None):
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def reset_max_memory_allocated(self, device_index=None):
        self.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index=None):
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index=None):
        if self._cuda:
            free, _ = torch.cuda.mem_get_info(device_index)
            return free
        return _proc_meminfo_available()

    def empty_cache(self):
        if self._cuda:
            torch.cuda.empty_cache()

    def __getattr__(self, name):
        # Only reached for names the class lacks: say which interface this is, not a bare
        # AttributeError from deep inside a script.
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"get_accelerator().{name}: not part of Strata's accelerator; it implements "
            f"{', '.join(sorted(n for n in dir(Accelerator) if not n.startswith('_')))}")


def _proc_meminfo_available():
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


_accelerator = None


def get_accelerator():
    """The process's accelerator (made on first use)."""
    global _accelerator
    if _accelerator is None:
        _accelerator = Accelerator()
    return _accelerator


def set_accelerator(accel):
    global _accelerator
    _accelerator = accel


__all__ = ["Accelerator", "get_accelerator", "set_accelerator"]
