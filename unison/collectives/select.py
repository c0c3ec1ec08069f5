"""Which algorithm ``"auto"`` runs, by message size and rank count.

Messages of at most 4 KiB travel inline in the agreement exchange (see
:mod:`unison.collectives.header`) before this is consulted. Above that, the
table below comes from ``benchmarks/collectives.py`` on a 2-core shared-memory
host at 2 and 4 ranks (docs/collectives.md has the numbers): Open MPI's own
collectives win for medium messages, where a Python-driven algorithm pays a few
microseconds per message, and our ring wins for large all-reduces and
reduce-scatters, where it streams pieces through cache and writes each output
segment once (1.2-1.5x ``MPI_Allreduce`` at 64-256 MiB). Every rank derives the
same choice from the same inputs, so no agreement is needed.
"""

from __future__ import annotations

__all__ = ["choose_allreduce", "choose_simple"]

#: All-reduce messages from this size up use the ring; smaller ones MPI's call.
RING_MIN_BYTES = 1 << 20
#: Reduce-scatter inputs from this size up use the ring.
RS_RING_MIN_BYTES = 4 << 20


def choose_allreduce(requested: str, nbytes: int, size: int) -> str:
    """Resolve ``requested`` ("auto", "ring", "rhd", "mpi") for a message of ``nbytes``."""
    if requested != "auto":
        return requested
    return "ring" if nbytes >= RING_MIN_BYTES else "mpi"


def choose_simple(collective: str, requested: str, nbytes: int, size: int) -> str:
    """Resolve the algorithm of allgather, broadcast, reducescatter or alltoall.

    Our ring all-gather, binomial tree and pairwise all-to-all stay available by
    name; measured here, MPI's own calls were faster for them at every size.
    """
    if requested != "auto":
        return requested
    if collective == "reducescatter":
        return "ring" if nbytes >= RS_RING_MIN_BYTES else "mpi"
    return "mpi"
