"""deepspeed.runtime.pipe.module: PipelineModule and its layer specs (strata/pipe.py)."""
from strata.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: F401
