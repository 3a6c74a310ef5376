"""deepspeed.runtime.pipe.topology: the rank grids a PipelineModule takes (strata/pipe.py)."""
from strata.pipe_topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,  # noqa: F401
                                  ProcessTopology)
