"""Recursive halving / doubling all-reduce (Rabenseifner's algorithm).

For p = 2^k ranks: k halving steps exchange half of the current window with the
partner at distance p/2, p/4, ..., 1 and reduce the half each keeps, leaving
rank i with segment i fully reduced; k doubling steps then swap windows back::

    halving (p = 4)              doubling
    r0 <-> r2  keep s0,s1        r0 <-> r1  s0 | s1
    r0 <-> r1  keep s0           r0 <-> r2  s0 s1 | s2 s3

Only 2 log2(p) messages per rank instead of the ring's 2(p - 1), which is why it
wins for small and medium messages. Non-power-of-two rank counts fold the first
``2 * (n - p)`` ranks in pairs before the exchange (the even rank of each pair
hands its data to the odd one and waits for the result afterwards).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from unison.collectives.p2p import exchange, recv_all, segments, send_all

__all__ = ["allreduce"]

TAG_FOLD = 21
TAG_HALVE = 22
TAG_DOUBLE = 23


def allreduce(comm: Any, mpi: Any, buf: np.ndarray, op: np.ufunc, chunk: int,
              finish: Callable[[np.ndarray], None] | None = None) -> None:
    """All-reduce ``buf`` in place (1-D contiguous)."""
    n, r = comm.Get_size(), comm.Get_rank()
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    tmp = np.empty(min(chunk, max(buf.size, 1)), dtype=buf.dtype)

    def real(v: int) -> int:
        return 2 * v + 1 if v < rem else v + rem

    if r < 2 * rem:
        if r % 2 == 0:  # hand data to the odd partner, get the result back at the end
            send_all(comm, buf, r + 1, TAG_FOLD, chunk)
            recv_all(comm, buf, r + 1, TAG_FOLD, chunk)
            return
        recv_all(comm, buf, r - 1, TAG_FOLD, chunk, op=op, tmp=tmp)
        v = r // 2
    else:
        v = r - rem

    counts, offsets = segments(buf.size, p)

    def window(lo: int, hi: int) -> np.ndarray:
        end = offsets[hi - 1] + counts[hi - 1]
        return buf[offsets[lo]:end]

    lo, hi = 0, p
    mask = p >> 1
    while mask:
        partner = real(v ^ mask)
        mid = (lo + hi) // 2
        if v & mask:
            keep, give, lo = (mid, hi), (lo, mid), mid
        else:
            keep, give, hi = (lo, mid), (mid, hi), mid
        exchange(comm, mpi, window(*give), partner, window(*keep), partner, TAG_HALVE,
                 chunk, op=op, tmp=tmp)
        mask >>= 1

    if finish is not None:
        finish(window(v, v + 1))

    mask = 1
    while mask < p:
        partner_v = v ^ mask
        mine = (v // mask) * mask
        theirs = (partner_v // mask) * mask
        exchange(comm, mpi, window(mine, mine + mask), real(partner_v),
                 window(theirs, theirs + mask), real(partner_v), TAG_DOUBLE, chunk)
        mask <<= 1

    if r < 2 * rem:
        send_all(comm, buf, r - 1, TAG_FOLD, chunk)
