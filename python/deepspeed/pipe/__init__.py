"""deepspeed.pipe: DeepSpeed's pipeline API, with every stage on each rank (Note [pipelines on
one rank] in strata/pipe.py)."""
from strata.pipe import (LayerSpec, PipeDataParallelTopology, PipelineModule,  # noqa: F401
                         PipeModelDataParallelTopology, ProcessTopology, TiedLayerSpec)
