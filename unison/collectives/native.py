"""MPI's own collectives, as one more algorithm.

Open MPI picks its own algorithm inside these calls. Data travels with its real
MPI datatype so MPI can reduce it; float16 and bfloat16, which MPI has no
standard type for, reduce through a user-defined op over a 2-byte type.

[Note: MPI's reductions that differ from numpy's] Every algorithm must give one
answer, whatever the size or the algorithm ``auto`` picks; ours reduce with numpy's
ufuncs. Two of MPI's predefined ops differ from them, so those reductions also go
through a user-defined op running the ufunc (:func:`_numpy_op`):

* ``MPI_SUM`` of 8- and 16-bit integers: Open MPI 5's vectorised op component
  (``op/avx``) saturates them (three int8 70s sum to 127), where numpy and our
  algorithms wrap (-46), as int32 and int64 do in MPI too.
* ``MPI_MIN``/``MPI_MAX`` of floats drop a NaN or keep it depending on which
  operand it is, while ``np.minimum``/``np.maximum`` propagate it: a rank whose
  values went NaN would show or hide depending on the tensor's size.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from unison.collectives import select
from unison.collectives.reduce import reducer, same_start
from unison.common.dtypes import is_bfloat16
from unison.common.ops import ReduceOp

__all__ = ["allreduce", "allgatherv", "broadcast", "reduce_scatter", "alltoallv", "mpi_type", "mpi_op",
           "copy_exact", "bcast_bytes"]


@functools.cache
def _type_table(mpi: Any) -> dict[np.dtype, Any]:
    return {
        np.dtype(np.float32): mpi.FLOAT,
        np.dtype(np.float64): mpi.DOUBLE,
        np.dtype(np.int8): mpi.INT8_T,
        np.dtype(np.int16): mpi.INT16_T,
        np.dtype(np.int32): mpi.INT32_T,
        np.dtype(np.int64): mpi.INT64_T,
        np.dtype(np.uint8): mpi.UINT8_T,
        np.dtype(np.uint16): mpi.UINT16_T,
        np.dtype(np.bool_): mpi.C_BOOL,
    }


@functools.cache
def _half_type(mpi: Any) -> Any:
    return mpi.BYTE.Create_contiguous(2).Commit()


@functools.cache
def _numpy_op(mpi: Any, dtype: np.dtype, op: ReduceOp) -> Any:
    """A user-defined MPI op applying ``op``'s numpy ufunc to elements of ``dtype``."""
    ufunc = reducer(dtype, op)

    def combine(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        a = np.frombuffer(inbuf, dtype=dtype)
        b = np.frombuffer(inoutbuf, dtype=dtype)
        ufunc(a, b, out=b)

    return mpi.Op.Create(combine, commute=True)


def mpi_type(mpi: Any, dtype: np.dtype) -> Any:
    """The MPI datatype that carries one element of ``dtype``."""
    if dtype == np.float16 or is_bfloat16(dtype):
        return _half_type(mpi)
    return _type_table(mpi)[np.dtype(dtype)]


@functools.cache
def mpi_op(mpi: Any, dtype: np.dtype, op: ReduceOp) -> Any:
    """The MPI op computing ``op`` (Average is a Sum; scaling happens afterwards) as numpy would
    (see [Note: MPI's reductions that differ from numpy's])."""
    dtype = np.dtype(dtype)
    if (dtype == np.float16 or is_bfloat16(dtype)  # no MPI type of their own
            or (op in (ReduceOp.SUM, ReduceOp.AVERAGE) and dtype.kind in "iu" and dtype.itemsize <= 2)
            or (op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.kind == "f")):
        return _numpy_op(mpi, dtype, op)
    if dtype == np.bool_:
        if op is ReduceOp.BXOR:
            return mpi.LXOR
        return mpi.LOR if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR) else mpi.LAND
    return {ReduceOp.AVERAGE: mpi.SUM, ReduceOp.SUM: mpi.SUM, ReduceOp.MIN: mpi.MIN,
            ReduceOp.MAX: mpi.MAX, ReduceOp.PRODUCT: mpi.PROD, ReduceOp.BAND: mpi.BAND,
            ReduceOp.BOR: mpi.BOR, ReduceOp.BXOR: mpi.BXOR}[op]


def allreduce(comm: Any, mpi: Any, inp: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    t = mpi_type(mpi, inp.dtype)
    send = mpi.IN_PLACE if same_start(inp, out) else [inp, inp.size, t]
    comm.Allreduce(send, [out, out.size, t], op=mpi_op(mpi, inp.dtype, op))


def reduce_scatter(comm: Any, mpi: Any, inp: np.ndarray, out: np.ndarray, counts: list[int],
                   op: ReduceOp) -> None:
    """``MPI_Reduce_scatter_block`` when every rank's count is equal, else ``MPI_Reduce_scatter``.

    ``counts`` is every rank's, the same list on every rank, so all ranks make the same call.
    """
    t = mpi_type(mpi, inp.dtype)
    if counts.count(counts[0]) == len(counts):  # mpi4py counts a block call's send buffer per rank too
        comm.Reduce_scatter_block([inp, counts[0], t], [out, counts[0], t], op=mpi_op(mpi, inp.dtype, op))
        return
    comm.Reduce_scatter([inp, inp.size, t], [out, out.size, t], counts,
                        op=mpi_op(mpi, inp.dtype, op))


def allgatherv(comm: Any, sendbuf: np.ndarray, out: np.ndarray, byte_counts: list[int],
               byte_offsets: list[int], mpi: Any) -> None:
    """``MPI_Allgather`` when every rank sends as many bytes, else ``MPI_Allgatherv``.

    ``byte_counts`` is every rank's, the same list on every rank, so all ranks make the same call.
    """
    if byte_counts.count(byte_counts[0]) == len(byte_counts):
        comm.Allgather([sendbuf, byte_counts[0], mpi.BYTE], [out, byte_counts[0], mpi.BYTE])
        return
    comm.Allgatherv(sendbuf.view(np.uint8), [out.view(np.uint8), byte_counts, byte_offsets, mpi.BYTE])


def broadcast(comm: Any, buf: np.ndarray, root: int, mpi: Any, source: np.ndarray | None = None) -> None:
    """``MPI_Ibcast`` of ``buf`` from ``root``, waited for; a root given ``source`` sends it and copies it
    into ``buf`` while the data travels. ``source`` has ``buf``'s shape and dtype.

    [Note: broadcast overlap] Every rank posts the non-blocking call, whatever its role (MPI never
    matches a blocking collective with a non-blocking one, and only the root knows whether it was
    given ``source``). A root that copied first and then sent made every receiver wait for the copy:
    at np 2 here (2026-12-07, best of five rounds, the agreement included) a 64 KiB broadcast took
    25.9 us that way against 11.0 us overlapped (``MPI_Bcast`` in place 4.7 us), 16 KiB 14.0 against
    8.7, 4 KiB 9.5 against 8.5; from 256 KiB up, where the overlap already applied, the same.
    """
    if buf.nbytes > select.MAX_MPI_BYTES:  # in pieces MPI takes ([Note: messages over 2 GiB] in .select)
        if source is not None:
            copy_exact(buf, source)
        bcast_bytes(comm, mpi, buf.view(np.uint8), root)
        return
    if source is not None and np.may_share_memory(buf, source):
        copy_exact(buf, source)  # (sent from source, the receivers could get what this copy wrote over it)
        source = None
    if source is None:
        comm.Ibcast([buf.view(np.uint8), mpi.BYTE], root=root).Wait()
        return
    req = comm.Ibcast([source.view(np.uint8), mpi.BYTE], root=root)
    copy_exact(buf, source)
    req.Wait()


def bcast_bytes(comm: Any, mpi: Any, ob: np.ndarray, root: int) -> None:
    """``MPI_Bcast`` of the bytes ``ob`` in pieces of at most 1 GiB (one piece below it)."""
    piece = min(1 << 30, select.MAX_MPI_BYTES)
    for lo in range(0, max(ob.size, 1), piece):
        comm.Bcast([ob[lo:lo + piece], mpi.BYTE], root=root)


def alltoallv(comm: Any, mpi: Any, send: np.ndarray, send_counts: list[int], send_offsets: list[int],
              recv: np.ndarray, recv_counts: list[int], recv_offsets: list[int]) -> None:
    """All-to-all with byte counts and offsets."""
    comm.Alltoallv([send.view(np.uint8), send_counts, send_offsets, mpi.BYTE],
                   [recv.view(np.uint8), recv_counts, recv_offsets, mpi.BYTE])


def copy_exact(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` bit for bit; both C-contiguous, of one shape and dtype.

    [Note: slow memmove] Two arrays of the same size allocated one after the
    other lie 16 bytes past a multiple of 4 KiB apart, and glibc's ``memmove``
    (``rep movsb``, which ``np.copyto`` ends in) runs 4-7x slower at that
    distance on this machine: 24 us instead of 3 us for 64 KiB. A ufunc loop over
    8-byte words is not affected, and ``w | w`` is ``w``, every bit as it was.
    """
    if src.nbytes % 8 or src.nbytes < 4096:
        np.copyto(dst, src)
        return
    words = (src if src.ndim == 1 else src.reshape(-1)).view(np.uint64)
    np.bitwise_or(words, words, out=(dst if dst.ndim == 1 else dst.reshape(-1)).view(np.uint64))
