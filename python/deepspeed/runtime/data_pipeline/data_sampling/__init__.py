"""deepspeed.runtime.data_pipeline.data_sampling: variable_batch_size_and_lr (strata.variable_batch)."""
from . import variable_batch_size_and_lr  # noqa: F401
