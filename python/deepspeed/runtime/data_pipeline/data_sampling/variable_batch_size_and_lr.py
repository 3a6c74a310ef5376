"""deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr, served by
strata.variable_batch (which says where Strata differs)."""
from strata.variable_batch import (  # noqa: F401
    VariableBatchSizeLR, batch_by_seqlens, dataloader_for_variable_batch_size,
    get_dataloader_and_lr_scheduler_for_variable_batch_size,
    get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed,
    lr_scheduler_for_variable_batch_size, scale_lr)
