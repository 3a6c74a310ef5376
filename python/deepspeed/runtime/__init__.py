"""deepspeed.runtime: the engine class and the names scripts import from here."""
from strata import DeepSpeedEngine  # noqa: F401

from . import lr_schedules, utils  # noqa: F401
