"""deepspeed.runtime.pipe.engine: the engine initialize returns for a PipelineModule."""
from strata.pipe_engine import PipelineEngine  # noqa: F401
