"""deepspeed.runtime.lr_schedules: the config's scheduler names."""
from strata.lr_schedules import *  # noqa: F401,F403
