"""deepspeed.launcher: the `deepspeed` command (strata.launcher)."""
