"""Cached plans for repeated small all-reduces (the inline fast path of :mod:`.api`).

A training loop calls the same small all-reduce every step. The first call goes
through the full path (argument checks, header packing, one exchange); it leaves
a plan behind, keyed by shape, dtype, op, factors and algorithm, so later calls
are one header copy, one all-gather and one local reduction.
"""

from __future__ import annotations

import numpy as np

from unison.collectives.header import HEADER_BYTES, MATCH_BYTES, Call, Negotiator
from unison.collectives.reduce import accumulator, finalize, prescale, reduce_stack
from unison.common.dtypes import dtype_from_code
from unison.common.ops import ReduceOp

__all__ = ["InlineAllreduce"]


class InlineAllreduce:
    """A cached plan for a small all-reduce seen before: header prebuilt, one exchange.

    Repeated calls with the same shape, dtype, op and factors (every training
    step) skip argument parsing and header packing; the call is one all-gather
    and one local reduction.
    """

    def __init__(self, neg: Negotiator, call: Call, ufunc: np.ufunc, op: ReduceOp) -> None:
        self.neg, self.call, self.ufunc, self.op = neg, call, ufunc, op
        self.header = neg.block[:HEADER_BYTES].copy()
        # each rank's must-match words, as memoryviews into the gathered buffer
        gm = memoryview(neg.gathered.reshape(-1))  # type: ignore[arg-type]
        width = neg.gathered.shape[1]
        self.matches = [gm[i * width:i * width + MATCH_BYTES] for i in range(neg.size)]
        self.expected = memoryview(neg.gathered[0, :MATCH_BYTES].tobytes())
        count = int(np.prod(call.shape, dtype=np.int64))
        self.dtype = dtype_from_code(call.dtype_code)
        self.mine = neg.block[HEADER_BYTES:HEADER_BYTES + call.nbytes].view(self.dtype).reshape(call.shape)
        self.stack = neg.inline_rows(call.nbytes).view(self.dtype)
        self.rows = [self.stack[i] for i in range(neg.size)]
        self.count = count
        self.flat = len(call.shape) == 1
        self.plain = call.prescale == 1.0 and call.postscale == 1.0 and op is not ReduceOp.AVERAGE
        #: integer averages sum in a wider dtype (see [Note: integer average] in .reduce)
        self.widened = accumulator(self.dtype, op) is not None

    def fits(self, out: np.ndarray) -> bool:
        return (type(out) is np.ndarray and out.shape == self.call.shape and out.dtype == self.dtype
                and out.flags.c_contiguous)

    def run(self, x: np.ndarray, name: str | None, result: np.ndarray | None) -> np.ndarray:
        neg, call = self.neg, self.call
        if call.prescale == 1.0:
            np.copyto(self.mine, x)
        else:
            prescale(x, call.prescale, self.mine)
        if neg.last_plan is not self:
            neg.block[:HEADER_BYTES] = self.header
            neg.last_plan = self
        neg.comm.Allgather(neg.block, neg.gathered)
        expected = self.expected
        for words in self.matches:
            if words != expected:
                call.name = name
                neg.raise_mismatch(call)
        if result is None:
            result = np.empty(call.shape, dtype=self.dtype)
        out = result if self.flat else result.reshape(self.count)
        if self.widened:
            reduce_stack(self.stack, self.op, out, neg.size, call.postscale)
            return result
        rows, ufunc = self.rows, self.ufunc
        ufunc(rows[0], rows[1], out=out)  # rank order, so every rank computes the same bits
        for row in rows[2:]:
            ufunc(out, row, out=out)
        if not self.plain:
            finalize(out, self.op, neg.size, call.postscale)
        return result
