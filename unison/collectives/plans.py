"""Cached plans for repeated calls: the fast paths of :mod:`.api`.

A training loop makes the same collective call every step. The first call goes
through the full path (argument checks, header packing, one exchange, the
kernel); it leaves a plan behind, keyed by the call's local signature (shape,
dtype, op, factors, root, splits, algorithm), so that later calls are:

1. the agreement, replayed: the plan's header bytes (built once) all-gathered
   with the same fixed-size exchange as every other call, so a mismatch with
   any rank's call still raises on every rank (:meth:`.Negotiator.replay`);
2. the data movement, with everything precomputed: MPI's own call on
   prebuilt counts, datatypes and ops where the kernel would have made that
   call anyway (:func:`.kernels.allreduce_is_native` and friends), the kernel
   otherwise.

A plan also keeps the bytes every rank sent the last time. When they come back
identical, the per-rank parts of the call (the first dimension of an
all-gather, an all-to-all's splits) are as before and the precomputed counts
hold; when only those parts differ, :meth:`.Plan.agree` says so and the caller
recomputes them from the gathered headers (never a second exchange).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from unison.collectives import kernels, native
from unison.collectives.header import HEADER_BYTES, MATCH_BYTES, Call, Negotiator
from unison.collectives.native import mpi_op, mpi_type
from unison.collectives.reduce import accumulator, finalize, prescale, reduce_stack, same_start
from unison.common import pool
from unison.common.dtypes import dtype_from_code
from unison.common.ops import ReduceOp

__all__ = ["Plan", "InlineAllreduce", "AllreducePlan", "AllgatherPlan", "BroadcastPlan",
           "ReducescatterPlan", "AlltoallPlan"]


def _allocator(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """The allocator of a plan's results: ``np.empty`` below the pool's minimum (as the pool itself
    would), else the pool; chosen once per plan."""
    return np.empty if math.prod(shape) * dtype.itemsize < pool.MIN_BYTES else pool.results.empty


def _offsets(counts: list[int]) -> list[int]:
    offs = [0] * len(counts)
    for i in range(1, len(counts)):
        offs[i] = offs[i - 1] + counts[i - 1]
    return offs


class Plan:
    """The replayed agreement every plan shares (built right after a full path's exchange)."""

    def __init__(self, neg: Negotiator, call: Call, prefix_bytes: int = HEADER_BYTES) -> None:
        self.neg, self.call = neg, call
        self.dtype = dtype_from_code(call.dtype_code)
        self.prefix = neg.block[:prefix_bytes].copy()
        self.seen = neg.gathered[:, :prefix_bytes]
        self.expected = self.seen.tobytes()
        self.match = neg.gathered[neg.rank, :MATCH_BYTES].tobytes() * neg.size

    def agree(self, name: str | None) -> bool:
        """Exchange the plan's header; True when every rank's bytes are as the plan last saw them.

        Raises:
            MismatchError, CollectiveError, InvalidArgumentError: as :meth:`.Negotiator.exchange`.
        """
        return self.neg.replay(self, self.prefix, self.seen, self.expected, self.match, self.call, name)


class InlineAllreduce(Plan):
    """A small all-reduce seen before: header prebuilt, one exchange, a local reduction in rank order."""

    def __init__(self, neg: Negotiator, call: Call, ufunc: np.ufunc, op: ReduceOp) -> None:
        super().__init__(neg, call)
        self.ufunc, self.op = ufunc, op
        self.mine = neg.block[HEADER_BYTES:HEADER_BYTES + call.nbytes].view(self.dtype).reshape(call.shape)
        self.stack = neg.inline_rows(call.nbytes).view(self.dtype)
        self.rows = [self.stack[i] for i in range(neg.size)]
        self.count = math.prod(call.shape)
        self.flat = len(call.shape) == 1
        self.plain = call.prescale == 1.0 and call.postscale == 1.0 and op is not ReduceOp.AVERAGE
        #: integer averages sum in a wider dtype (see [Note: integer average] in .reduce)
        self.widened = accumulator(self.dtype, op) is not None

    def fits(self, out: np.ndarray) -> bool:
        # (writeable too: a read-only out= goes the full path, whose check raises on every rank; a plan took it
        # before 2026-12-05, and that rank failed alone in the data phase while the others hung or returned)
        return (type(out) is np.ndarray and out.shape == self.call.shape and out.dtype == self.dtype
                and out.flags.c_contiguous and out.flags.writeable)

    def run(self, x: np.ndarray, name: str | None, result: np.ndarray | None) -> np.ndarray:
        call = self.call
        if call.prescale == 1.0:
            np.copyto(self.mine, x)
        else:
            prescale(x, call.prescale, self.mine)
        self.agree(name)
        if result is None:
            result = np.empty(call.shape, dtype=self.dtype)
        out = result if self.flat else result.reshape(self.count)
        if self.widened:
            reduce_stack(self.stack, self.op, out, self.neg.size, call.postscale)
            return result
        rows, ufunc = self.rows, self.ufunc
        ufunc(rows[0], rows[1], out=out)  # rank order, so every rank computes the same bits
        for row in rows[2:]:
            ufunc(out, row, out=out)
        if not self.plain:
            finalize(out, self.op, self.neg.size, call.postscale)
        return result


class AllreducePlan(Plan):
    """An all-reduce above the inline size: the agreement, then ``MPI_Allreduce`` or the kernel."""

    def __init__(self, neg: Negotiator, call: Call, op: ReduceOp, chunk_bytes: int) -> None:
        super().__init__(neg, call)
        self.op, self.chunk_bytes = op, chunk_bytes
        self.count = math.prod(call.shape)
        self.direct = kernels.allreduce_is_native(neg.comm, neg.mpi, call.nbytes, self.dtype, op,
                                                  call.prescale, call.algorithm)
        if self.direct:
            self.mtype, self.mop = mpi_type(neg.mpi, self.dtype), mpi_op(neg.mpi, self.dtype, op)
        self.finish = op is ReduceOp.AVERAGE or call.postscale != 1.0
        self.empty = _allocator(call.shape, self.dtype)

    def fits(self, out: np.ndarray) -> bool:
        # (writeable too: a read-only out= goes the full path, whose check raises on every rank; a plan took it
        # before 2026-12-05, and that rank failed alone in the data phase while the others hung or returned)
        return (type(out) is np.ndarray and out.shape == self.call.shape and out.dtype == self.dtype
                and out.flags.c_contiguous and out.flags.writeable)

    def run(self, x: np.ndarray, name: str | None, out: np.ndarray | None) -> np.ndarray:
        """``x`` is C-contiguous with the plan's shape and dtype; ``out`` passed :meth:`fits`."""
        self.agree(name)
        neg, call = self.neg, self.call
        result = self.empty(call.shape, self.dtype) if out is None else out
        if not self.direct:
            kernels.allreduce(neg.comm, neg.mpi, x.reshape(-1), result.reshape(-1), self.op, call.prescale,
                              call.postscale, call.algorithm, self.chunk_bytes)
            return result
        mpi, t = neg.mpi, self.mtype
        same = out is not None and same_start(out, x)
        send = mpi.IN_PLACE if same else [x, self.count, t]
        neg.comm.Allreduce(send, [result, self.count, t], op=self.mop)
        if self.finish:
            finalize(result, self.op, neg.size, call.postscale)
        return result


class AllgatherPlan(Plan):
    """An all-gather whose every rank sent more than the inline space, with the same rows as before."""

    def __init__(self, neg: Negotiator, call: Call, rows: list[int], chunk_bytes: int) -> None:
        super().__init__(neg, call)
        trailing = call.shape[1:]
        self.out_shape = (sum(rows),) + trailing
        row_bytes = math.prod(trailing) * self.dtype.itemsize
        self.counts = [k * row_bytes for k in rows]
        self.offsets = _offsets(self.counts)
        self.chunk_bytes = chunk_bytes
        self.direct = kernels.simple_is_native(neg.comm, neg.mpi, "allgather", sum(self.counts),
                                               call.algorithm)
        self.empty = _allocator(self.out_shape, self.dtype)

    def run(self, x: np.ndarray, name: str | None) -> np.ndarray | None:
        """The gathered array, or None when some rank's first dimension changed (recompute)."""
        if not self.agree(name):
            return None
        neg = self.neg
        out = self.empty(self.out_shape, self.dtype)
        if self.direct:  # the call kernels.allgatherv would make
            native.allgatherv(neg.comm, x, out, self.counts, self.offsets, neg.mpi)
        else:
            kernels.allgatherv(neg.comm, neg.mpi, x.reshape(-1), out, self.counts, self.call.algorithm,
                               self.chunk_bytes)
        return out


class BroadcastPlan(Plan):
    """A broadcast above the inline size: the agreement, then ``MPI_Bcast`` or the kernel."""

    def __init__(self, neg: Negotiator, call: Call, chunk_bytes: int) -> None:
        super().__init__(neg, call)
        self.chunk_bytes = chunk_bytes
        self.root_here = neg.rank == call.root
        self.direct = kernels.simple_is_native(neg.comm, neg.mpi, "broadcast", call.nbytes, call.algorithm)
        self.empty = _allocator(call.shape, self.dtype)

    def run(self, x: np.ndarray, name: str | None) -> np.ndarray:
        self.agree(name)
        neg, call = self.neg, self.call
        out = self.empty(call.shape, self.dtype)
        flat = out.reshape(-1)
        source = x.reshape(-1) if self.root_here else None
        if self.direct:  # the call kernels.broadcast would make
            native.broadcast(neg.comm, flat, call.root, neg.mpi, source)
        else:
            kernels.broadcast(neg.comm, neg.mpi, flat, call.root, call.algorithm, self.chunk_bytes,
                              source=source)
        return out


class ReducescatterPlan(Plan):
    """A reduce-scatter above the inline size: the agreement, then ``MPI_Reduce_scatter`` or the kernel."""

    def __init__(self, neg: Negotiator, call: Call, op: ReduceOp, counts: list[int],
                 out_shape: tuple[int, ...], chunk_bytes: int) -> None:
        super().__init__(neg, call)
        self.op, self.counts, self.out_shape, self.chunk_bytes = op, counts, out_shape, chunk_bytes
        self.mine = counts[neg.rank]
        self.direct = kernels.reducescatter_is_native(neg.comm, neg.mpi, call.nbytes, self.dtype, op,
                                                      call.prescale, call.algorithm)
        if self.direct:  # the call native.reduce_scatter would make, its arguments found once
            self.mtype, self.mop = mpi_type(neg.mpi, self.dtype), mpi_op(neg.mpi, self.dtype, op)
            self.block = counts.count(counts[0]) == len(counts)  # every rank's counts: the same call everywhere
        self.finish = op is ReduceOp.AVERAGE or call.postscale != 1.0
        self.empty = _allocator((self.mine,), self.dtype)

    def run(self, x: np.ndarray, name: str | None) -> np.ndarray:
        self.agree(name)
        neg, call = self.neg, self.call
        out = self.empty((self.mine,), self.dtype)
        if not self.direct:
            kernels.reducescatter(neg.comm, neg.mpi, x.reshape(-1), out, self.counts, self.op, call.prescale,
                                  call.postscale, call.algorithm, self.chunk_bytes)
            return out.reshape(self.out_shape)
        t, mine = self.mtype, self.mine
        if self.block:  # (mpi4py counts a block call's send buffer per rank too)
            neg.comm.Reduce_scatter_block([x, mine, t], [out, mine, t], op=self.mop)
        else:
            neg.comm.Reduce_scatter([x, x.size, t], [out, mine, t], self.counts, op=self.mop)
        if self.finish:
            finalize(out, self.op, neg.size, call.postscale)
        return out.reshape(self.out_shape)


class AlltoallPlan(Plan):
    """An all-to-all above the inline size whose splits travel inline: every rank's splits as before."""

    def __init__(self, neg: Negotiator, call: Call, all_splits: np.ndarray, chunk_bytes: int) -> None:
        super().__init__(neg, call, HEADER_BYTES + 8 * neg.size)
        r = neg.rank
        self.recv_splits = all_splits[:, r].copy()
        row_bytes = math.prod(call.shape[1:]) * self.dtype.itemsize
        self.out_shape = (int(self.recv_splits.sum()),) + call.shape[1:]
        self.scounts = [int(v) * row_bytes for v in all_splits[r]]
        self.rcounts = [int(v) * row_bytes for v in self.recv_splits]
        self.soffs, self.roffs = _offsets(self.scounts), _offsets(self.rcounts)
        self.uniform = bool((all_splits == all_splits[0, 0]).all())  # every rank's, so equal everywhere
        self.chunk_bytes = chunk_bytes
        self.largest = kernels.alltoall_largest(all_splits, row_bytes)
        self.direct = kernels.simple_is_native(neg.comm, neg.mpi, "alltoall", self.largest, call.algorithm)
        self.empty = _allocator(self.out_shape, self.dtype)

    def run(self, x: np.ndarray, name: str | None) -> tuple[np.ndarray, np.ndarray] | None:
        """``(output, received_splits)``, or None when some rank's splits changed (recompute)."""
        if not self.agree(name):
            return None
        neg = self.neg
        out = self.empty(self.out_shape, self.dtype)
        if self.direct and self.uniform:  # the calls kernels.alltoallv would make
            neg.comm.Alltoall([x, self.scounts[0], neg.mpi.BYTE], [out, self.rcounts[0], neg.mpi.BYTE])
        elif self.direct:
            native.alltoallv(neg.comm, neg.mpi, x, self.scounts, self.soffs, out, self.rcounts, self.roffs)
        else:
            kernels.alltoallv(neg.comm, neg.mpi, x.reshape(-1), self.scounts, out, self.rcounts,
                              self.call.algorithm, self.chunk_bytes, uniform=self.uniform, largest=self.largest)
        return out, self.recv_splits.copy()
