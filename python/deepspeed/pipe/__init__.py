"""deepspeed.pipe: pipeline parallelism, which Strata does not implement."""
from strata import unsupported as _unsupported

PipelineModule = _unsupported.refused_class("PipelineModule", "pipe")
LayerSpec = _unsupported.refused_class("LayerSpec", "pipe")
TiedLayerSpec = _unsupported.refused_class("TiedLayerSpec", "pipe")
__getattr__ = _unsupported.module_getattr("deepspeed.pipe", "pipe")
