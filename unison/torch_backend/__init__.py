"""Horovod-compatible PyTorch API: ``import unison.torch_backend as hvd``.

A Horovod training script runs unchanged after replacing ``import horovod.torch
as hvd`` with this import. CPU tensors; collectives go through Unison's engine.
"""

from importlib import import_module as _import_module

try:  # first, so that a missing PyTorch names the fix instead of failing deep inside a submodule
    _import_module("torch")
except ImportError as _exc:
    raise ImportError(f"unison.torch_backend needs PyTorch, which failed to import ({_exc}): "
                      "pip install torch (or the checkout's [torch] extra: pip install '.[torch]')") from _exc

from unison.common.compression import Compression
from unison.common.engine.engine import DuplicateNameError, JoinError, ShutdownError, StallError
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
    UnsupportedError,
)
from unison.common.ops import Average, Max, Min, Product, ReduceOp, Sum
from unison.common.runtime import (
    cross_rank,
    cross_size,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from unison.torch_backend import elastic
from unison.torch_backend import process_group as _process_group
from unison.torch_backend.basics import (
    add_process_set,
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    remove_process_set,
    rocm_built,
    start_timeline,
    stop_timeline,
)
from unison.torch_backend.embedding import ShardedEmbedding
from unison.torch_backend.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from unison.torch_backend.mpi_ops import (
    Adasum,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from unison.torch_backend.optimizer import DistributedOptimizer
from unison.torch_backend.pipeline import (
    Pipeline,
    PipelineError,
    PipelineGrid,
    balance_by_params,
    balance_by_time,
    pipeline_grid,
)
from unison.torch_backend.sync_batch_norm import SyncBatchNorm
from unison.torch_backend.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from unison.torch_backend.tensor_parallel_blocks import (
    ParallelMLP,
    ParallelSelfAttention,
    ParallelTransformerBlock,
)
from unison.torch_backend.tensor_parallel_checkpoint import load_tensor_parallel, save_tensor_parallel
from unison.torch_backend.tensor_parallel_comm import (
    gather_from_sequence,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
)
from unison.torch_backend.tensor_parallel_plan import parallelize
from unison.torch_backend.tensor_parallel_random import (
    activation_checkpoint,
    get_rng_tracker,
    model_parallel_manual_seed,
)
from unison.torch_backend.zero3 import (
    clip_sharded_grad_norm_,
    full_state_dict,
    load_full_state_dict,
    shard_module,
    zero3_memory,
)
from unison.torch_backend.zero_amp import GradScaler
from unison.torch_backend.zero_checkpoint import load_sharded, save_sharded
from unison.torch_backend.zero_state import clip_grad_norm_

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "is_homogeneous",
    "sparse_allreduce_async", "remove_process_set", "Adasum",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "barrier", "join",
    "poll", "synchronize", "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
    "allgather_object", "DistributedOptimizer", "SyncBatchNorm", "Compression", "ProcessSet",
    "global_process_set", "add_process_set", "start_timeline", "stop_timeline", "ReduceOp", "Average",
    "Sum", "Min", "Max", "Product", "UnisonError", "NotInitializedError", "MismatchError",
    "CollectiveError", "InvalidArgumentError", "UnsupportedError", "StallError", "ShutdownError",
    "DuplicateNameError", "JoinError",
    "Pipeline", "PipelineGrid", "pipeline_grid", "balance_by_params", "balance_by_time", "PipelineError",
    "save_sharded", "load_sharded", "shard_module", "full_state_dict", "load_full_state_dict", "clip_grad_norm_",
    "clip_sharded_grad_norm_", "zero3_memory", "GradScaler", "elastic", "UnisonInternalError",
    "HorovodInternalError", "HostsUpdatedInterrupt", "ShardedEmbedding",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "ParallelMLP", "ParallelSelfAttention", "ParallelTransformerBlock", "parallelize",
    "scatter_to_sequence", "gather_from_sequence", "reduce_scatter_to_sequence", "get_rng_tracker",
    "model_parallel_manual_seed", "activation_checkpoint", "save_tensor_parallel", "load_tensor_parallel",
]

_process_group.register()  # dist.init_process_group("unison") (unison/torch_backend/process_group.py)
