"""deepspeed.utils: the logger, rank-aware logging and the per-parameter state accessors."""
import logging

from strata.comm import get_rank as _get_rank
from strata.runtime_utils import RepeatingLoader  # noqa: F401

from .tensor_fragment import *  # noqa: F401,F403  - safe_get_full_fp32_param and its kin

logger = logging.getLogger("DeepSpeed")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def log_dist(message, ranks=None, level=logging.INFO):
    """Logs on the listed ranks (all ranks for None or [-1])."""
    if ranks is None or -1 in ranks or _get_rank() in ranks:
        logger.log(level, f"[Rank {_get_rank()}] {message}")


def print_json_dist(message, ranks=None, path=None):
    import json

    if ranks is None or -1 in ranks or _get_rank() in ranks:
        text = json.dumps(message, indent=2, default=str)
        if path:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        else:
            print(text)
