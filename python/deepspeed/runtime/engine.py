"""deepspeed.runtime.engine: the engine class."""
from strata import DeepSpeedEngine  # noqa: F401
