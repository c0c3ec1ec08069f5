"""Horovod-compatible TensorFlow API: ``import unison.tf_backend as hvd``.

Like ``horovod.tensorflow`` 0.28, call for call, on CPU tensors: the collectives
on tf.Tensors (eager and inside ``tf.function``, with Horovod's gradients and
``tf.errors``), grouped variants, ``broadcast_`` in place, ``broadcast_variables``,
object broadcasts, ``DistributedGradientTape``, process sets and the build
queries. docs/horovod.md lists every name with its status. Everything goes
through Unison's engine. ``Pipeline`` trains a ``keras.Sequential`` as pipeline
stages across ranks (docs/pipeline.md); ``UnisonStrategy`` is a
``tf.distribute.Strategy`` for Keras ``model.fit``.
"""

from importlib import import_module as _import_module

# First, so that a missing framework names the fix instead of failing deep inside a submodule (this also
# covers unison.tf_backend.keras, which imports this package first). import_module binds no name here: a
# plain `import keras` would shadow the unison.tf_backend.keras subpackage.
try:
    _import_module("tensorflow")
except ImportError as _exc:
    raise ImportError(f"unison.tf_backend needs TensorFlow, which failed to import ({_exc}): "
                      "pip install tensorflow (or the checkout's [tf] extra: pip install '.[tf]')") from _exc
try:
    _import_module("keras")
except ImportError as _exc:
    raise ImportError(f"unison.tf_backend needs Keras 3, which failed to import ({_exc}): "
                      "pip install 'keras>=3.15' (or the checkout's [tf] extra: pip install '.[tf]')") from _exc

from unison.common.engine.engine import DuplicateNameError, JoinError, ShutdownError, StallError
from unison.common.engine.frontend import add_process_set, stop_timeline
from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.exceptions import (
    CollectiveError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    InvalidArgumentError,
    MismatchError,
    NotInitializedError,
    UnisonError,
    UnisonInternalError,
)
from unison.common.ops import Average, Max, Min, Product, ReduceOp, Sum
from unison.common.runtime import (
    cross_rank,
    cross_size,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_threads_supported,
    rank,
    shutdown,
    size,
)
from unison.tf_backend.basics import (
    Adasum,
    ccl_built,
    check_num_rank_power_of_2,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    handle_average_backwards_compatibility,
    init,
    is_homogeneous,
    mpi_enabled,
    nccl_built,
    remove_process_set,
    rocm_built,
    start_timeline,
)
from unison.tf_backend.compression import Compression
from unison.tf_backend.embedding import ShardedEmbedding
from unison.tf_backend.functions import (
    DistributedGradientTape,
    PartialDistributedGradientTape,
    broadcast_variables,
)
from unison.tf_backend.mpi_ops import (
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    reducescatter,
    size_op,
)
from unison.tf_backend.optimizers import DistributedOptimizer
from unison.tf_backend.pipeline import (
    Pipeline,
    PipelineError,
    PipelineGrid,
    balance_by_params,
    balance_by_time,
    pipeline_grid,
)
from unison.tf_backend.strategy import UnisonStrategy
from unison.tf_backend.variables import (
    BroadcastGlobalVariablesHook,
    allgather_object,
    broadcast_,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
)
from unison.tf_backend.zero_checkpoint import load_sharded, save_sharded

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built",
    "gloo_enabled", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
    "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier", "size_op", "local_size_op",
    "rank_op", "local_rank_op", "process_set_included_op", "broadcast_variables",
    "broadcast_global_variables", "BroadcastGlobalVariablesHook", "broadcast_object", "broadcast_object_fn",
    "allgather_object",
    "DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer", "UnisonStrategy",
    "Compression", "ProcessSet",
    "global_process_set",
    "add_process_set", "remove_process_set", "start_timeline", "stop_timeline", "ReduceOp", "Average",
    "Sum", "Min", "Max", "Product", "Adasum", "handle_average_backwards_compatibility",
    "check_num_rank_power_of_2", "UnisonError", "NotInitializedError", "MismatchError", "CollectiveError",
    "InvalidArgumentError", "StallError", "ShutdownError", "DuplicateNameError", "JoinError", "Pipeline",
    "PipelineGrid",
    "pipeline_grid", "balance_by_params", "balance_by_time", "PipelineError", "SyncBatchNormalization",
    "save_sharded", "load_sharded", "elastic", "UnisonInternalError", "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "ParallelMLP", "ParallelSelfAttention", "ParallelTransformerBlock", "scatter_to_sequence",
    "gather_from_sequence", "reduce_scatter_to_sequence", "model_parallel_manual_seed", "save_tensor_parallel",
    "load_tensor_parallel", "parallelize",
    "ShardedEmbedding",
]

# Keras 3 tensor-parallel layers, loaded on first use (they import Keras): name -> module
_TENSOR_PARALLEL = {
    **dict.fromkeys(("ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
                     "vocab_parallel_cross_entropy"), "unison.tf_backend.tensor_parallel"),
    **dict.fromkeys(("ParallelMLP", "ParallelSelfAttention", "ParallelTransformerBlock"),
                    "unison.tf_backend.tensor_parallel_blocks"),
    **dict.fromkeys(("scatter_to_sequence", "gather_from_sequence", "reduce_scatter_to_sequence"),
                    "unison.tf_backend.tensor_parallel_comm"),
    "model_parallel_manual_seed": "unison.tf_backend.tensor_parallel_random",
    "parallelize": "unison.tf_backend.tensor_parallel_plan",
    **dict.fromkeys(("save_tensor_parallel", "load_tensor_parallel"),
                    "unison.tf_backend.tensor_parallel_checkpoint"),
}


def __getattr__(name: str) -> object:
    """``SyncBatchNormalization``, ``elastic`` and the tensor-parallel layers are loaded on first use (they
    import Keras)."""
    import importlib

    if name == "elastic":
        return importlib.import_module("unison.tf_backend.elastic")
    if name in _TENSOR_PARALLEL:
        return getattr(importlib.import_module(_TENSOR_PARALLEL[name]), name)
    if name == "SyncBatchNormalization":
        from unison.tf_backend.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
