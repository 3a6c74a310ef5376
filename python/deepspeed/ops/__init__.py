"""deepspeed.ops: the optimizer classes initialize reads (strata.ops)."""
from . import adam  # noqa: F401

__compatible_ops__ = {"cpu_adam": True, "fused_adam": True, "async_io": False}
