"""strata.lr_schedules: the names of the config's "scheduler" types (DeepSpeed's
`deepspeed.runtime.lr_schedules`). The schedules themselves run in the engine
(runtime/state/lr_schedule.h): the lr of every step is computed there from the config."""

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"

# DeepSpeed's list, which accelerate and the Trainer test names against.
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
# The ones Strata's engine runs; the others are refused by the config parser with this list.
IMPLEMENTED_LR_SCHEDULES = [WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__all__ = ["VALID_LR_SCHEDULES", "IMPLEMENTED_LR_SCHEDULES", "LR_RANGE_TEST", "ONE_CYCLE",
           "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR"]
