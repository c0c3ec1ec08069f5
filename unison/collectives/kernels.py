"""Data movement once the ranks agree on a call: one function per collective.

Both front ends call these: the direct API (:mod:`unison.collectives.api`, after
its header exchange) and the engine (:mod:`unison.common.engine`, after its
negotiation). Inputs are 1-D contiguous arrays; nothing here checks agreement.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from unison.collectives import native, rhd, ring, tree
from unison.collectives.p2p import exchange
from unison.collectives.reduce import finalize, prescale, reducer
from unison.collectives.select import choose_allreduce, choose_simple
from unison.common.ops import ReduceOp

__all__ = ["allreduce", "allgatherv", "broadcast", "reducescatter", "alltoallv"]

TAG_A2A = 41


def _elems(chunk_bytes: int, itemsize: int) -> int:
    return max(1, chunk_bytes // itemsize)


def allreduce(comm: Any, mpi: Any, src: np.ndarray, out: np.ndarray, op: ReduceOp,
              prescale_factor: float, postscale_factor: float, algorithm: str,
              chunk_bytes: int) -> None:
    """``out = postscale * op(prescale * src over ranks)``; ``out`` may be ``src`` (in place)."""
    n = comm.Get_size()
    algo = choose_allreduce(algorithm, out.nbytes, n)
    chunk = _elems(chunk_bytes, out.itemsize)
    if out.size == 0:
        return
    if n == 1:
        prescale(src, prescale_factor, out)
        finalize(out, op, 1, postscale_factor)
        return

    def finish(seg: np.ndarray) -> None:
        finalize(seg, op, n, postscale_factor)

    if algo == "rhd":
        prescale(src, prescale_factor, out)
        rhd.allreduce(comm, mpi, out, reducer(out.dtype, op), chunk, finish)
        return
    if prescale_factor != 1.0:
        scaled = np.empty_like(src)
        prescale(src, prescale_factor, scaled)
        src = scaled
    if algo == "ring":
        ring.allreduce(comm, mpi, src, out, reducer(out.dtype, op), chunk, finish)
    else:
        native.allreduce(comm, mpi, src, out, op)
        finish(out)


def allgatherv(comm: Any, mpi: Any, mine: np.ndarray, out: np.ndarray, byte_counts: list[int],
               algorithm: str, chunk_bytes: int) -> None:
    """Gather every rank's bytes (``byte_counts[r]`` each) into ``out`` in rank order."""
    offsets = [0] * len(byte_counts)
    for i in range(1, len(byte_counts)):
        offsets[i] = offsets[i - 1] + byte_counts[i - 1]
    ob = out.reshape(-1).view(np.uint8)
    if choose_simple("allgather", algorithm, sum(byte_counts), comm.Get_size()) == "mpi":
        native.allgatherv(comm, mine, out, byte_counts, offsets, mpi)
        return
    r = comm.Get_rank()
    ob[offsets[r]:offsets[r] + byte_counts[r]] = mine.reshape(-1).view(np.uint8)
    ring.allgatherv(comm, mpi, ob, byte_counts, offsets, chunk_bytes)


def broadcast(comm: Any, mpi: Any, buf: np.ndarray, root: int, algorithm: str,
              chunk_bytes: int) -> None:
    """Broadcast ``buf`` (contiguous) from ``root`` in place."""
    ob = buf.reshape(-1).view(np.uint8)
    if ob.size == 0:
        return
    if choose_simple("broadcast", algorithm, ob.size, comm.Get_size()) == "mpi":
        native.broadcast(comm, ob, root, mpi)
    else:
        tree.broadcast(comm, ob, root, chunk_bytes)


def reducescatter(comm: Any, mpi: Any, src: np.ndarray, out: np.ndarray, counts: list[int],
                  op: ReduceOp, prescale_factor: float, postscale_factor: float, algorithm: str,
                  chunk_bytes: int) -> None:
    """Reduce ``src`` over ranks; write this rank's ``counts[rank]`` elements to ``out``."""
    n, r = comm.Get_size(), comm.Get_rank()
    if n == 1:
        prescale(src, prescale_factor, out)
        finalize(out, op, 1, postscale_factor)
        return
    if prescale_factor != 1.0:
        scaled = np.empty_like(src)
        prescale(src, prescale_factor, scaled)
        src = scaled
    if choose_simple("reducescatter", algorithm, src.nbytes, n) == "mpi":
        native.reduce_scatter(comm, mpi, src, out, counts, op)
    else:
        offsets = [sum(counts[:i]) for i in range(n)]
        work = np.empty_like(src)
        ring.reduce_scatter(comm, mpi, src, work, counts, offsets, reducer(src.dtype, op),
                            _elems(chunk_bytes, src.itemsize), shift=0)
        out[:] = work[offsets[r]:offsets[r] + counts[r]]
    finalize(out, op, n, postscale_factor)


def alltoallv(comm: Any, mpi: Any, send: np.ndarray, send_counts: list[int], out: np.ndarray,
              recv_counts: list[int], algorithm: str, chunk_bytes: int) -> None:
    """Send ``send_counts[i]`` bytes to rank i, receive ``recv_counts[i]`` from it, in rank order."""
    n, r = comm.Get_size(), comm.Get_rank()
    xb, ob = send.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8)
    soffs = [sum(send_counts[:i]) for i in range(n)]
    roffs = [sum(recv_counts[:i]) for i in range(n)]
    if choose_simple("alltoall", algorithm, xb.size, n) == "mpi":
        native.alltoallv(comm, mpi, xb, send_counts, soffs, ob, recv_counts, roffs)
        return
    ob[roffs[r]:roffs[r] + recv_counts[r]] = xb[soffs[r]:soffs[r] + send_counts[r]]
    for k in range(1, n):
        d, s = (r + k) % n, (r - k) % n
        exchange(comm, mpi, xb[soffs[d]:soffs[d] + send_counts[d]], d,
                 ob[roffs[s]:roffs[s] + recv_counts[s]], s, TAG_A2A, chunk_bytes)
