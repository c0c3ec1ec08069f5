"""Pipeline parallelism for Keras 3: ``Pipeline`` runs a ``keras.Sequential`` as stages across ranks.

See docs/pipeline.md ("Executors"). The schedules, the simulator, the grid and the driver that
moves arrays between ranks live in ``unison.common.pipeline``; this package is the Keras side.
"""

from unison.common.pipeline import PipelineError, StepStats
from unison.common.pipeline.grid import PipelineGrid, pipeline_grid
from unison.tf_backend.pipeline.executor import Pipeline, balance_by_params, balance_by_time

__all__ = ["Pipeline", "PipelineGrid", "pipeline_grid", "balance_by_params", "balance_by_time", "PipelineError",
           "StepStats"]
