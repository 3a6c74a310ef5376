"""deepspeed.ops.adagrad: DeepSpeedCPUAdagrad, run by Strata's own Adagrad."""
from strata.ops import DeepSpeedCPUAdagrad  # noqa: F401
