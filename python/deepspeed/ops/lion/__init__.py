"""deepspeed.ops.lion: DeepSpeedCPULion and FusedLion, run by Strata's own Lion."""
from strata.ops import DeepSpeedCPULion, FusedLion  # noqa: F401
