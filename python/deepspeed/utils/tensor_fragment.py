"""deepspeed.utils.tensor_fragment: the per-parameter state accessors (strata/param_state.py)."""
from strata.param_state import (  # noqa: F401
    safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
    safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
    safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state,
    safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state)
