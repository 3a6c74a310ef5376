"""deepspeed.ops: the optimizer classes initialize reads (strata.ops)."""
from . import adagrad, adam, lion  # noqa: F401

__compatible_ops__ = {"cpu_adam": True, "fused_adam": True, "cpu_adagrad": True, "cpu_lion": True,
                      "fused_lion": True, "async_io": False}
