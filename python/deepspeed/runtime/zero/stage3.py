"""deepspeed.runtime.zero.stage3: DeepSpeed's ZeRO-3 memory estimators, answered by Strata's
planner (strata/estimators.py)."""
from strata.estimators import (  # noqa: F401
    estimate_zero3_model_states_mem_needs, estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live)
from strata.estimators import model_to_params_zero3 as model_to_params  # noqa: F401
