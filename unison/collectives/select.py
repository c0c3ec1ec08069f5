"""Which algorithm ``"auto"`` runs, by message size and rank count.

The thresholds come from ``benchmarks/collectives.py`` on a 2-core shared-memory
host (see docs/collectives.md); every rank computes the same choice from the
same inputs, so no agreement is needed.
"""

from __future__ import annotations

__all__ = ["choose_allreduce", "choose_simple"]

#: Below this (and above the 4 KiB inline exchange), recursive halving/doubling's
#: 2 log2(n) messages beat the ring's 2(n - 1) when n > 2. Measured at np=4 on a
#: 2-core host: rhd and ring cross between 256 KiB and 1 MiB.
RHD_MAX_BYTES = 256 << 10


def choose_allreduce(requested: str, nbytes: int, size: int) -> str:
    """Resolve ``requested`` ("auto", "ring", "rhd", "mpi") for a message of ``nbytes``."""
    if requested != "auto":
        return requested
    if size > 2 and nbytes < RHD_MAX_BYTES:
        return "rhd"
    return "ring"


def choose_simple(collective: str, requested: str, nbytes: int, size: int) -> str:
    """Resolve the algorithm of allgather, broadcast, reducescatter or alltoall."""
    if requested != "auto":
        return requested
    return {"allgather": "ring", "broadcast": "tree", "reducescatter": "ring",
            "alltoall": "pairwise"}[collective]
