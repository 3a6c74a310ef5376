"""deepspeed.ops.adam: DeepSpeedCPUAdam and FusedAdam, run by Strata's own Adam."""
from strata.ops import DeepSpeedCPUAdam, FusedAdam  # noqa: F401
