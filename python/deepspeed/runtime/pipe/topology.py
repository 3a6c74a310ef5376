"""deepspeed.runtime.pipe.topology: the rank grids a PipelineModule takes (strata/pipe.py)."""
from strata.pipe import (PipeDataParallelTopology, PipeModelDataParallelTopology,  # noqa: F401
                         ProcessTopology)
