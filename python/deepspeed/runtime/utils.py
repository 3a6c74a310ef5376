"""deepspeed.runtime.utils: helpers scripts call (strata.runtime_utils)."""
from strata.runtime_utils import *  # noqa: F401,F403
