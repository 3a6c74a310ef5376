"""deepspeed.checkpoint.utils: clone_tensors_for_torch_save (strata.checkpoint_utils)."""
from strata.checkpoint_utils import clone_tensors_for_torch_save  # noqa: F401
