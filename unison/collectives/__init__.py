"""Collectives on numpy arrays, over MPI point-to-point (ours) or MPI's own calls."""

from unison.collectives.api import allgather, allreduce, alltoall, barrier, broadcast, reducescatter

__all__ = ["allreduce", "allgather", "broadcast", "reducescatter", "alltoall", "barrier"]
