"""MPI's own collectives, as one more algorithm.

Open MPI picks its own algorithm inside these calls. Data travels with its real
MPI datatype so MPI can reduce it; float16 and bfloat16, which MPI has no
standard type for, reduce through a user-defined op over a 2-byte type.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from unison.collectives.reduce import reducer
from unison.common.dtypes import bfloat16
from unison.common.ops import ReduceOp

__all__ = ["allreduce", "allgatherv", "broadcast", "reduce_scatter", "alltoallv", "mpi_type", "mpi_op"]


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
def _half_op(mpi: Any, dtype: np.dtype, op: ReduceOp) -> Any:
    ufunc = reducer(dtype, op)

    def combine(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        a = np.frombuffer(inbuf, dtype=dtype)
        b = np.frombuffer(inoutbuf, dtype=dtype)
        ufunc(a, b, out=b)

    return mpi.Op.Create(combine, commute=True)


def mpi_type(mpi: Any, dtype: np.dtype) -> Any:
    """The MPI datatype that carries one element of ``dtype``."""
    if dtype == np.float16 or dtype == bfloat16:
        return _half_type(mpi)
    return _type_table(mpi)[np.dtype(dtype)]


def mpi_op(mpi: Any, dtype: np.dtype, op: ReduceOp) -> Any:
    """The MPI op computing ``op`` (Average is a Sum; scaling happens afterwards)."""
    if dtype == np.float16 or dtype == bfloat16:
        return _half_op(mpi, np.dtype(dtype), op)
    if dtype == np.bool_:
        return mpi.LOR if op in (ReduceOp.SUM, ReduceOp.MAX) else mpi.LAND
    return {ReduceOp.AVERAGE: mpi.SUM, ReduceOp.SUM: mpi.SUM, ReduceOp.MIN: mpi.MIN,
            ReduceOp.MAX: mpi.MAX, ReduceOp.PRODUCT: mpi.PROD}[op]


def allreduce(comm: Any, mpi: Any, inp: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    t = mpi_type(mpi, inp.dtype)
    send = mpi.IN_PLACE if inp.ctypes.data == out.ctypes.data else [inp, inp.size, t]
    comm.Allreduce(send, [out, out.size, t], op=mpi_op(mpi, inp.dtype, op))


def reduce_scatter(comm: Any, mpi: Any, inp: np.ndarray, out: np.ndarray, counts: list[int],
                   op: ReduceOp) -> None:
    t = mpi_type(mpi, inp.dtype)
    comm.Reduce_scatter([inp, inp.size, t], [out, out.size, t], counts,
                        op=mpi_op(mpi, inp.dtype, op))


def allgatherv(comm: Any, sendbuf: np.ndarray, out: np.ndarray, byte_counts: list[int],
               byte_offsets: list[int], mpi: Any) -> None:
    comm.Allgatherv(sendbuf.view(np.uint8), [out.view(np.uint8), byte_counts, byte_offsets, mpi.BYTE])


def broadcast(comm: Any, buf: np.ndarray, root: int, mpi: Any) -> None:
    comm.Bcast([buf.view(np.uint8), mpi.BYTE], root=root)


def alltoallv(comm: Any, mpi: Any, send: np.ndarray, send_counts: list[int], send_offsets: list[int],
              recv: np.ndarray, recv_counts: list[int], recv_offsets: list[int]) -> None:
    """All-to-all with byte counts and offsets."""
    comm.Alltoallv([send.view(np.uint8), send_counts, send_offsets, mpi.BYTE],
                   [recv.view(np.uint8), recv_counts, recv_offsets, mpi.BYTE])
