"""Horovod's ``horovod.torch`` collectives on CPU tensors, through Unison's engine.

Every call converts the tensor to a numpy view (no copy for contiguous CPU
tensors), submits it to the engine and converts the result back. The ``_``
variants work in place. The blocking, out-of-place ops are autograd functions
whose gradients are Horovod 0.28's, call for call (docs/horovod.md):

===================== =====================================================
forward               backward
===================== =====================================================
allreduce(op)         allreduce of the gradients with the same op and factors
allgather             this rank's rows of the *average* over ranks of the gradients
broadcast             the average over ranks on the root, zeros elsewhere
reducescatter(op)     allgather of the gradients (times the set size for Sum,
                      times prescale * postscale)
alltoall              alltoall of the gradients back with the received splits
grouped_*             the same, on every tensor of the list
===================== =====================================================

Compression (``Compression.fp16``) casts the torch tensor before the
collective and back after it, outside the autograd function, as Horovod does.
"""

from __future__ import annotations

from unison.common.engine import frontend
from unison.common.engine.process_sets import ProcessSet
from unison.torch_backend.allreduce_ops import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from unison.torch_backend.gather_ops import (
    allgather,
    allgather_async,
    alltoall,
    alltoall_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
)
from unison.torch_backend.handles import Adasum, poll, set_or_none, synchronize

__all__ = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "barrier", "join",
    "poll", "synchronize", "Adasum",
]


def barrier(process_set: ProcessSet | None = None) -> None:
    """Wait until every rank (of ``process_set``) reaches the barrier."""
    frontend.barrier(set_or_none(process_set))


def join(device: int = -1) -> int:
    """Keep contributing identity values until every rank joins; returns the last rank to join."""
    return frontend.join()
