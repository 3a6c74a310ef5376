"""deepspeed.moe.utils: mixture of experts, which Strata does not implement."""
from strata import unsupported as _unsupported

split_params_into_different_moe_groups_for_optimizer = _unsupported.refused_function(
    "split_params_into_different_moe_groups_for_optimizer", "moe")
is_moe_param = _unsupported.refused_function("is_moe_param", "moe")
__getattr__ = _unsupported.module_getattr("deepspeed.moe.utils", "moe")
