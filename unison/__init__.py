"""Unison: distributed deep-learning training over MPI.

    import unison
    unison.init()
    total = unison.allreduce(np.ones(4), op=unison.Sum)

Run under ``unisonrun -np 4 python train.py`` (or plain ``mpirun``); a plain
``python train.py`` is a job of size 1. The top-level collectives go through the
engine (named, negotiated, fused; ``*_async`` variants return handles);
``unison.collectives`` holds the direct, algorithm-level calls.
"""

from unison.common import capabilities as _capabilities  # noqa: F401  (registers is_homogeneous's init hook)
from unison.common import heartbeat as _heartbeat  # noqa: F401  (registers the host heartbeat's init hook)
from unison.common import liveness as _liveness  # noqa: F401  (registers the rank's file for the elastic driver)
from unison.common.compression import Compression
from unison.common.engine.engine import DuplicateNameError, JoinError, ShutdownError, StallError
from unison.common.engine.frontend import (
    add_process_set,
    allgather,
    allgather_async,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_async,
    grouped_allreduce,
    grouped_allreduce_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    start_timeline,
    stop_timeline,
    synchronize,
)
from unison.common.engine.handles import Handle
from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.exceptions import (
    CollectiveError,
    ForkedProcessError,
    InvalidArgumentError,
    MismatchError,
    NotInitializedError,
    UnisonError,
)
from unison.common.ops import Adasum, Average, Band, Bor, Bxor, Max, Min, Product, ReduceOp, Sum
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

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "mpi_built", "mpi_threads_supported",
    "allreduce", "allgather", "broadcast", "reducescatter", "alltoall", "barrier",
    "allreduce_async", "allgather_async", "broadcast_async", "reducescatter_async", "alltoall_async",
    "grouped_allreduce", "grouped_allreduce_async", "poll", "synchronize", "join", "Handle",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "start_timeline", "stop_timeline",
    "Compression", "ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Adasum", "Band", "Bor", "Bxor",
    "UnisonError", "NotInitializedError", "MismatchError", "CollectiveError", "InvalidArgumentError",
    "ForkedProcessError",
    "StallError", "ShutdownError", "DuplicateNameError", "JoinError",
]
