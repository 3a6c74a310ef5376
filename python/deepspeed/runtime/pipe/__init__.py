"""deepspeed.runtime.pipe: the pipeline names, from strata/pipe.py."""
from strata.pipe import LayerSpec, PipelineModule, ProcessTopology, TiedLayerSpec  # noqa: F401
