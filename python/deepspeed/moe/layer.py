"""deepspeed.moe.layer: mixture of experts, which Strata does not implement."""
from strata import unsupported as _unsupported

MoE = _unsupported.refused_class("MoE", "moe")
__getattr__ = _unsupported.module_getattr("deepspeed.moe.layer", "moe")
