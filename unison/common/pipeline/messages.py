"""The point-to-point messages of a pipeline step: arrays with a small header, and their ledger.

Every activation or gradient that crosses ranks travels as two messages with the same tag
(``Schedule.tag``) on the driver's own communicator::

    header  int64[16]: status, dtype code, ndim, dims...   (status FAILED: no payload follows)
    payload the array's bytes, C order, in pieces of at most PIECE_BYTES (only when status is OK)

The payload travels in pieces because Open MPI refuses a count over 2**31 - 1 bytes
(``MPI_ERR_ARG``; [Note: messages over 2 GiB] in :mod:`unison.collectives.select`): before
2026-12-05 a stage boundary of 2 GiB or more failed so. Messages of one source, tag and
communicator arrive in the order sent, so the receiver reads the pieces in order and knows
their number from the header's shape.

The receiver learns shape and dtype from the header, so it allocates exactly (from a
:class:`~unison.common.pool.ResultPool`) and any dtype in ``unison.common.dtypes`` travels,
bfloat16 included. A rank that stops early sends a ``FAILED`` header in place of each array it
still owed, so no receiver waits forever.

[Note: the message ledger] Both sides keep a ledger: the sender lists ``(dest, tag,
pieces)`` for every message it posted (``pieces``: of payload, 0 after a ``FAILED`` header) and
the receiver counts how many parts (the header, then each piece) of each ``(source, tag)`` it
consumed. After a failure the ranks exchange their ledgers and
every rank receives (and discards) what was sent to it but never received, so every
non-blocking send completes and the next step starts with no message in flight.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from unison.common.dtypes import dtype_code, dtype_from_code, dtype_name, supported_names
from unison.common.pool import ResultPool

__all__: list[str] = []

HEADER_LEN = 16
#: The most payload bytes one MPI message carries (under Open MPI's 2**31 - 1).
PIECE_BYTES = 1 << 30
MAX_NDIM = HEADER_LEN - 3
OK, FAILED = 0, 1


class Mailbox:
    """Sends and receives of one pipeline step on communicator ``comm``, with their ledger."""

    def __init__(self, comm: Any, pool: ResultPool) -> None:
        self.comm = comm
        self.pool = pool
        self.requests: list[Any] = []
        self.keep: list[np.ndarray] = []  # send buffers stay alive until their sends complete
        self.sent: list[tuple[int, int, int]] = []  # (dest, tag, payload pieces)
        self.consumed: dict[tuple[int, int], int] = {}  # (source, tag) -> parts received

    def send(self, array: np.ndarray, dest: int, tag: int) -> None:
        """Post the header and payload of ``array`` without waiting."""
        from mpi4py import MPI

        data = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        header = np.zeros(HEADER_LEN, np.int64)
        header[:3] = (OK, dtype_code(array.dtype), array.ndim)
        header[3:3 + array.ndim] = array.shape
        self.requests.append(self.comm.Isend([header, MPI.INT64_T], dest=dest, tag=tag))
        pieces = _pieces(_bytes(data))
        for piece in pieces:
            self.requests.append(self.comm.Isend([piece, MPI.BYTE], dest=dest, tag=tag))
        self.keep += [header, data]
        self.sent.append((dest, tag, len(pieces)))

    def send_failed(self, dest: int, tag: int) -> None:
        """Post a ``FAILED`` header in place of an array this rank will not produce."""
        from mpi4py import MPI

        header = np.zeros(HEADER_LEN, np.int64)
        header[0] = FAILED
        self.requests.append(self.comm.Isend([header, MPI.INT64_T], dest=dest, tag=tag))
        self.keep.append(header)
        self.sent.append((dest, tag, 0))

    def recv(self, source: int, tag: int) -> np.ndarray | None:
        """Block for an array; ``None`` when the sender failed and sent only a header."""
        from mpi4py import MPI

        header = np.empty(HEADER_LEN, np.int64)
        self.comm.Recv([header, MPI.INT64_T], source=source, tag=tag)
        self.consumed[(source, tag)] = 1
        if header[0] != OK:
            return None
        shape = tuple(int(d) for d in header[3:3 + int(header[2])])
        array = self.pool.empty(shape, dtype_from_code(int(header[1])))
        for piece in _pieces(_bytes(array)):
            self.comm.Recv([piece, MPI.BYTE], source=source, tag=tag)
            self.consumed[(source, tag)] += 1
        return array

    def discard(self, source: int, tag: int, pieces: int) -> None:
        """Receive and drop whatever part of message ``(source, tag)`` (``pieces`` of payload) is unread."""
        from mpi4py import MPI

        parts = self.consumed.get((source, tag), 0)
        if parts == 0:
            self.comm.Recv([np.empty(HEADER_LEN, np.int64), MPI.INT64_T], source=source, tag=tag)
            parts = 1
        status = MPI.Status()  # messages of one (source, tag) arrive in order: these are the pieces left
        for _ in range(parts - 1, pieces):
            self.comm.Probe(source=source, tag=tag, status=status)
            self.comm.Recv([np.empty(status.Get_count(MPI.BYTE), np.uint8), MPI.BYTE], source=source, tag=tag)
        self.consumed[(source, tag)] = 1 + pieces

    def wait_all(self) -> None:
        """Complete every send of the step and release the buffers."""
        from mpi4py import MPI

        MPI.Request.Waitall(self.requests)
        self.requests.clear()
        self.keep.clear()


def check_sendable(array: object, what: str) -> str | None:
    """Why ``array`` cannot cross ranks (``what`` names it in the message), or None."""
    if not isinstance(array, np.ndarray):
        return (f"{what} is {type(array).__name__}, but the next stage needs a numpy array; return the "
                "stage's output (or input gradient) as np.ndarray")
    if dtype_code(array.dtype) < 0:
        return (f"{what} has dtype {array.dtype}, which cannot cross ranks; use one of {supported_names()}")
    if array.ndim > MAX_NDIM:
        return (f"{what} has {array.ndim} dimensions, more than the {MAX_NDIM} a pipeline message "
                f"carries; reshape it to at most {MAX_NDIM} dimensions")
    return None


def describe(array: np.ndarray) -> str:
    """``(4, 8) float32``: shape and dtype as error messages print them."""
    return f"{tuple(array.shape)} {dtype_name(array.dtype)}"


def _bytes(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (0-d and empty arrays included)."""
    return array.reshape(-1).view(np.uint8)


def _pieces(flat: np.ndarray) -> list[np.ndarray]:
    """``flat`` (bytes) cut into the payload's messages; one (perhaps empty) at least."""
    step = PIECE_BYTES
    return [flat[lo:lo + step] for lo in range(0, max(flat.size, 1), step)]
