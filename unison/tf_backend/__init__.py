"""Horovod-compatible TensorFlow API: ``import unison.tf_backend as hvd``.

Like ``horovod.tensorflow``: collectives on tf.Tensors (eager and inside
``tf.function``, with gradients), ``broadcast_variables``, ``broadcast_object``,
``allgather_object`` and ``DistributedGradientTape``. Everything goes through
Unison's engine. ``Pipeline`` trains a ``keras.Sequential`` as pipeline stages across ranks
(docs/pipeline.md).
"""

from unison.common.compression import Compression
from unison.common.engine.engine import DuplicateNameError, ShutdownError, StallError
from unison.common.engine.frontend import add_process_set, start_timeline, stop_timeline
from unison.common.engine.objects import allgather_object, broadcast_object
from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.exceptions import (
    CollectiveError,
    InvalidArgumentError,
    MismatchError,
    NotInitializedError,
    UnisonError,
)
from unison.common.ops import Average, Max, Min, Product, ReduceOp, Sum
from unison.common.runtime import (
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_threads_supported,
    rank,
    shutdown,
    size,
)
from unison.tf_backend.functions import DistributedGradientTape, broadcast_variables
from unison.tf_backend.mpi_ops import (
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    grouped_allreduce,
    join,
    rank_op,
    reducescatter,
    size_op,
)
from unison.tf_backend.pipeline import (
    Pipeline,
    PipelineError,
    PipelineGrid,
    balance_by_params,
    balance_by_time,
    pipeline_grid,
)
from unison.tf_backend.strategy import UnisonStrategy

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "mpi_built", "mpi_threads_supported", "allreduce", "grouped_allreduce", "allgather",
    "broadcast", "alltoall", "reducescatter", "join", "barrier", "size_op", "rank_op",
    "broadcast_variables", "broadcast_object", "allgather_object", "DistributedGradientTape", "UnisonStrategy",
    "Compression", "ProcessSet", "global_process_set", "add_process_set", "start_timeline",
    "stop_timeline", "ReduceOp", "Average", "Sum", "Min", "Max", "Product", "UnisonError",
    "NotInitializedError", "MismatchError", "CollectiveError", "InvalidArgumentError", "StallError",
    "ShutdownError", "DuplicateNameError", "Pipeline", "PipelineGrid", "pipeline_grid", "balance_by_params",
    "balance_by_time",
    "PipelineError",
]
