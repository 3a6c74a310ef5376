"""deepspeed.inference: the inference engine, which Strata does not implement."""
from strata import unsupported as _unsupported

__getattr__ = _unsupported.module_getattr("deepspeed.inference", "inference")
