"""BSP rounds: one table operation as collective all-to-alls over the table's communicator.

[Note: a BSP round]
::

    every rank                                     (dedicated server ranks send op SERVE, 0 keys)
    Alltoall  [op, keys for you]         -> every rank sees every rank's op: an error or a
                                            mismatch (one rank pulls, one pushes) raises on all
    Alltoallv storage indices            -> each shard gets the indices it owns
    Alltoallv gradient rows   (push)     -> shard sums over workers, scales by 1/workers, applies
    Alltoallv rows back       (pull)     -> each worker gets its rows, in the order it sent

A pull after a push therefore sees every worker's push: BSP.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Round", "SERVE", "PULL", "PUSH", "PUSH_PULL", "CLOSE", "SAVE", "LOAD", "ERROR", "OP_NAMES"]

SERVE, PULL, PUSH, PUSH_PULL, CLOSE, SAVE, LOAD, ERROR = range(8)
OP_NAMES = {
    SERVE: "serve",
    PULL: "pull",
    PUSH: "push",
    PUSH_PULL: "push_pull",
    CLOSE: "close",
    SAVE: "save",
    LOAD: "load",
    ERROR: "error",
}


def _displs(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


class Round:
    """The exchanges of one BSP round on ``comm`` (mpi4py), counting the bytes that leave this rank."""

    def __init__(self, comm: Any, mpi: Any, me: int) -> None:
        self.comm, self.mpi, self.me = comm, mpi, me
        self.sent = 0
        self.received = 0

    def header(self, op: int, counts: np.ndarray) -> np.ndarray:
        """Alltoall of ``[op, count]``: returns an array (size, 2) of what every rank sent here."""
        send = np.stack([np.full(len(counts), op, np.int64), counts.astype(np.int64)], axis=1)
        recv = np.empty_like(send)
        self.comm.Alltoall([send, 2, self.mpi.INT64_T], [recv, 2, self.mpi.INT64_T])
        return recv

    def alltoallv(
        self,
        send: np.ndarray,
        send_rows: np.ndarray,
        recv_rows: np.ndarray,
        row_shape: tuple[int, ...],
        dtype: np.dtype,
    ) -> np.ndarray:
        """Rows ``send`` (grouped by destination, ``send_rows`` each) to everyone; returns what came, by source."""
        width = int(np.prod(row_shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        recv = np.empty((int(recv_rows.sum()),) + row_shape, dtype)
        sc, rc = send_rows * width, recv_rows * width
        self.sent += int(sc.sum() - sc[self.me])
        self.received += int(rc.sum() - rc[self.me])
        sbuf = np.ascontiguousarray(send).reshape(-1).view(np.uint8)
        rbuf = recv.reshape(-1).view(np.uint8)
        self.comm.Alltoallv(
            [sbuf, (sc.tolist(), _displs(sc).tolist()), self.mpi.BYTE],
            [rbuf, (rc.tolist(), _displs(rc).tolist()), self.mpi.BYTE],
        )
        return recv
