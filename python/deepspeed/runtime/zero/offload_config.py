"""deepspeed.runtime.zero.offload_config: the enums engine.offload_states takes (DeepSpeed's
names and values). Strata reads the config's offload sections itself (runtime/base/config.cc)."""
from enum import Enum


class OffloadDeviceEnum(str, Enum):
    """Where offloaded state goes; engine.offload_states supports cpu."""
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The states engine.offload_states moves."""
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"
