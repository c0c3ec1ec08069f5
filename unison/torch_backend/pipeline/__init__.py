"""Pipeline parallelism for PyTorch: ``Pipeline`` runs an ``nn.Sequential`` as stages across ranks.

See docs/pipeline.md ("Executors"). The schedules, the simulator and the driver that moves
tensors between ranks live in ``unison.common.pipeline``; this package is the PyTorch side.
"""

from unison.common.pipeline import PipelineError, StepStats
from unison.common.pipeline.grid import PipelineGrid, pipeline_grid
from unison.torch_backend.pipeline.balance import balance_by_params, balance_by_time
from unison.torch_backend.pipeline.executor import Pipeline

__all__ = ["Pipeline", "PipelineGrid", "pipeline_grid", "balance_by_params", "balance_by_time", "PipelineError",
           "StepStats"]
