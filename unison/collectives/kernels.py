"""Data movement once the ranks agree on a call: one function per collective.

Both front ends call these: the direct API (:mod:`unison.collectives.api`, after
its header exchange) and the engine (:mod:`unison.common.engine`, after its
negotiation). Inputs are 1-D contiguous arrays; nothing here checks agreement.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from unison.collectives import adasum, native, rhd, ring, tree
from unison.collectives.p2p import exchange
from unison.collectives.reduce import accumulator, finalize, prescale, reducer
from unison.collectives.select import choose_allreduce, choose_simple
from unison.common.ops import ReduceOp

__all__ = ["allreduce", "allgatherv", "broadcast", "reducescatter", "alltoallv"]

TAG_A2A = 41
#: Integer averages are summed in int64 (see [Note: integer average] in :mod:`.reduce`)
#: this many elements at a time, so the accumulator stays at most 32 MiB.
WIDE_PIECE_ELEMS = 4 << 20


def _elems(chunk_bytes: int, itemsize: int) -> int:
    return max(1, chunk_bytes // itemsize)


def allreduce(comm: Any, mpi: Any, src: np.ndarray, out: np.ndarray, op: ReduceOp,
              prescale_factor: float, postscale_factor: float, algorithm: str,
              chunk_bytes: int) -> None:
    """``out = postscale * op(prescale * src over ranks)``; ``out`` may be ``src`` (in place)."""
    if op is ReduceOp.ADASUM:  # its own algorithm (vector halving, distance doubling); never fused
        adasum.allreduce(comm, mpi, src, out, prescale_factor, postscale_factor, chunk_bytes)
        return
    n = comm.Get_size()
    algo = choose_allreduce(algorithm, out.nbytes, n)
    chunk = _elems(chunk_bytes, out.itemsize)
    if out.size == 0:
        return
    if n == 1:
        prescale(src, prescale_factor, out)
        finalize(out, op, 1, postscale_factor)
        return
    wide = accumulator(out.dtype, op)
    if wide is not None:
        _allreduce_widened(comm, mpi, src, out, wide, op, prescale_factor, postscale_factor, algo,
                           chunk_bytes)
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


def _allreduce_widened(comm: Any, mpi: Any, src: np.ndarray, out: np.ndarray, wide: np.dtype,
                       op: ReduceOp, prescale_factor: float, postscale_factor: float, algo: str,
                       chunk_bytes: int) -> None:
    """An integer average summed in ``wide``, piece by piece (every rank cuts the same pieces)."""
    acc = np.empty(min(out.size, WIDE_PIECE_ELEMS), dtype=wide)
    for lo in range(0, out.size, acc.size):
        hi = min(lo + acc.size, out.size)
        piece = acc[:hi - lo]
        prescale(src[lo:hi], prescale_factor, piece)  # scaled in the input's dtype, then widened
        allreduce(comm, mpi, piece, piece, op, 1.0, postscale_factor, algo, chunk_bytes)
        np.copyto(out[lo:hi], piece, casting="unsafe")


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
    algo = choose_simple("reducescatter", algorithm, src.nbytes, n)
    wide = accumulator(src.dtype, op)
    if wide is not None:  # see [Note: integer average] in .reduce
        acc, acc_out = np.empty(src.size, dtype=wide), np.empty(out.size, dtype=wide)
        prescale(src, prescale_factor, acc)
        reducescatter(comm, mpi, acc, acc_out, counts, op, 1.0, postscale_factor, algo, chunk_bytes)
        np.copyto(out, acc_out, casting="unsafe")
        return
    if prescale_factor != 1.0:
        scaled = np.empty_like(src)
        prescale(src, prescale_factor, scaled)
        src = scaled
    if algo == "mpi":
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
