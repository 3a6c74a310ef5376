"""deepspeed.compression.compress: model compression, which Strata does not implement."""
from strata import unsupported as _unsupported

init_compression = _unsupported.refused_function("init_compression", "compression")
redundancy_clean = _unsupported.refused_function("redundancy_clean", "compression")
__getattr__ = _unsupported.module_getattr("deepspeed.compression.compress", "compression")
