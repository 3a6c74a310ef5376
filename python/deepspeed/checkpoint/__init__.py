"""deepspeed.checkpoint: checkpoint helpers."""
from . import utils  # noqa: F401
