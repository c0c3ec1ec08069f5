"""Unison: distributed deep-learning training over MPI.

    import unison
    unison.init()
    total = unison.allreduce(np.ones(4), op=unison.Sum)

Run under ``unisonrun -np 4 python train.py`` (or plain ``mpirun``); a plain
``python train.py`` is a job of size 1.
"""

from unison.collectives import allgather, allreduce, alltoall, barrier, broadcast, reducescatter
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

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "mpi_built", "mpi_threads_supported",
    "allreduce", "allgather", "broadcast", "reducescatter", "alltoall", "barrier",
    "ReduceOp", "Average", "Sum", "Min", "Max", "Product",
    "UnisonError", "NotInitializedError", "MismatchError", "CollectiveError", "InvalidArgumentError",
]
