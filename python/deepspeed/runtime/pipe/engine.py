"""deepspeed.runtime.pipe.engine: the engine initialize returns for a PipelineModule."""
from strata.pipe import PipelineEngine  # noqa: F401
