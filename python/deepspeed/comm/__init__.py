"""deepspeed.comm: torch's default process group (strata.comm)."""
from strata.comm import *  # noqa: F401,F403
from strata.comm import ReduceOp, get_local_rank, init_distributed  # noqa: F401
