"""deepspeed.checkpointing: activation checkpointing (strata.checkpointing)."""
from strata.checkpointing import *  # noqa: F401,F403
