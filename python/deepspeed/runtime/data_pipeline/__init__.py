"""deepspeed.runtime.data_pipeline: of DeepSpeed's data-efficiency library, the variable batch
size and lr (data_sampling.variable_batch_size_and_lr); curriculum learning and data routing are
not implemented."""
from . import data_sampling  # noqa: F401
