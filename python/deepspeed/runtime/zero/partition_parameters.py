"""deepspeed.runtime.zero.partition_parameters: ZeRO-3's parameter status and the gather and
init context managers (strata/param_state.py, strata/zero.py)."""
from strata.param_state import ZeroParamStatus, ZeroParamType  # noqa: F401
from strata.zero import GatheredParameters, Init  # noqa: F401
