"""deepspeed.moe: mixture of experts, which Strata does not implement."""
from strata import unsupported as _unsupported

__getattr__ = _unsupported.module_getattr("deepspeed.moe", "moe")
