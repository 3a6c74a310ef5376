"""deepspeed.zero: zero.Init and GatheredParameters (strata.zero)."""
from strata.zero import *  # noqa: F401,F403
from strata.zero import GatheredParameters, Init  # noqa: F401
from strata.zero import MiCS_Init  # noqa: F401
