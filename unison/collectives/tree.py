"""Binomial-tree broadcast, pipelined in pieces.

Ranks are numbered relative to the root; in round j every rank that already has
the data sends it to the rank 2^j further on, so all n ranks have it after
ceil(log2 n) rounds::

    root=0, n=6:   round 1: 0 -> 4
                   round 2: 0 -> 2, 4 -> 5
                   round 3: 0 -> 1, 2 -> 3

Large buffers travel piece by piece, so a child forwards piece k while its
parent is already sending piece k + 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from unison.collectives.p2p import _u8

__all__ = ["broadcast"]

TAG_BCAST = 31


def broadcast(comm: Any, buf: np.ndarray, root: int, chunk: int) -> None:
    """Broadcast ``buf`` (1-D contiguous) from ``root`` in place."""
    n, r = comm.Get_size(), comm.Get_rank()
    vr = (r - root) % n
    parent = None
    mask = 1
    while mask < n:
        if vr & mask:
            parent = (vr - mask + root) % n
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask:
        if vr + mask < n:
            children.append((vr + mask + root) % n)
        mask >>= 1
    for lo in range(0, buf.size, chunk):
        piece = _u8(buf[lo:lo + chunk])
        if parent is not None:
            comm.Recv(piece, parent, TAG_BCAST)
        for child in children:
            comm.Send(piece, child, TAG_BCAST)
