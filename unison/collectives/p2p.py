"""Point-to-point building blocks: streamed, piecewise exchanges with a neighbour.

Every algorithm here moves data as raw bytes (``MPI.BYTE``) with the buffer API,
so nothing is pickled and any dtype travels, bfloat16 included. Large transfers
are cut into pieces of at most ``chunk`` elements; a received piece is reduced
while it is still in cache, which is what keeps a ring all-reduce at memory speed.

[Note: piece matching] A rank's send and receive in one step may differ in
length (segments differ by one element, allgather blocks differ per rank). Both
sides of a transfer cut it the same way, so the k-th piece one rank sends is the
k-th piece its peer receives; a rank with nothing left to send (or receive) in
round k uses ``MPI.PROC_NULL`` for that side.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["exchange", "send_all", "recv_all", "EMPTY"]

EMPTY = np.empty(0, dtype=np.uint8)


def _pieces(n: int, chunk: int) -> int:
    return -(-n // chunk)


def _u8(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8)


def exchange(comm: Any, mpi: Any, send: np.ndarray | None, dest: int,
             recv: np.ndarray | None, source: int, tag: int, chunk: int,
             op: np.ufunc | None = None, base: np.ndarray | None = None,
             tmp: np.ndarray | None = None) -> None:
    """Send ``send`` to ``dest`` while receiving ``recv`` from ``source``, piece by piece.

    With ``op``, each received piece lands in ``tmp`` and ``recv[piece] =
    op(base[piece], tmp)``; ``base`` defaults to ``recv`` itself. ``send`` and
    ``recv`` are 1-D contiguous arrays of one dtype; either may be None.
    """
    ns = 0 if send is None else send.size
    nr = 0 if recv is None else recv.size
    rounds = max(_pieces(ns, chunk), _pieces(nr, chunk))
    if op is not None and base is None:
        base = recv
    proc_null = mpi.PROC_NULL
    for k in range(rounds):
        lo = k * chunk
        if lo < ns:
            sbuf, d = _u8(send[lo:lo + chunk]), dest  # type: ignore[index]
        else:
            sbuf, d = EMPTY, proc_null
        if lo < nr:
            hi = min(lo + chunk, nr)
            target = recv[lo:hi] if op is None else tmp[:hi - lo]  # type: ignore[index]
            rbuf, s = _u8(target), source
        else:
            rbuf, s = EMPTY, proc_null
        comm.Sendrecv(sbuf, d, tag, rbuf, s, tag)
        if op is not None and lo < nr:
            op(base[lo:hi], target, out=recv[lo:hi])  # type: ignore[index]


def send_all(comm: Any, buf: np.ndarray, dest: int, tag: int, chunk: int) -> None:
    """Blocking send of ``buf`` in pieces (matched by :func:`recv_all`)."""
    for lo in range(0, buf.size, chunk):
        comm.Send(_u8(buf[lo:lo + chunk]), dest, tag)


def recv_all(comm: Any, buf: np.ndarray, source: int, tag: int, chunk: int,
             op: np.ufunc | None = None, tmp: np.ndarray | None = None) -> None:
    """Blocking receive into ``buf`` in pieces; with ``op``, reduce each piece into ``buf``."""
    for lo in range(0, buf.size, chunk):
        hi = min(lo + chunk, buf.size)
        if op is None:
            comm.Recv(_u8(buf[lo:hi]), source, tag)
        else:
            piece = tmp[:hi - lo]  # type: ignore[index]
            comm.Recv(_u8(piece), source, tag)
            op(buf[lo:hi], piece, out=buf[lo:hi])


def segments(count: int, parts: int) -> tuple[list[int], list[int]]:
    """Split ``count`` elements into ``parts`` near-equal segments: (counts, offsets)."""
    base, extra = divmod(count, parts)
    counts = [base + (1 if i < extra else 0) for i in range(parts)]
    offsets = [0] * parts
    for i in range(1, parts):
        offsets[i] = offsets[i - 1] + counts[i - 1]
    return counts, offsets
