"""deepspeed.accelerator: the device Strata computes on (strata.accelerator)."""
from strata.accelerator import get_accelerator, set_accelerator  # noqa: F401
