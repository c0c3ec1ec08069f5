"""Local reduction kernels and scaling, the arithmetic every algorithm shares.

All reductions run through numpy ufuncs into preallocated outputs, so the
arithmetic is as fast as numpy's loops and identical inputs give bitwise
identical outputs on every rank.

[Note: integer average] ``Average`` of integers divides a sum that can overflow
the input dtype (two ranks' uint8 200s sum to 144). Every algorithm therefore
sums int8, uint8, int16 and int32 data in an int64 accumulator
(:func:`accumulator`), divides there, truncating toward zero like C integer
division (Horovod's result whenever its own narrow sum does not overflow), and
casts the average -- always within the input's range -- back. ``prescale_factor``
scales each rank's input in its own dtype first (truncating, as before), and
``postscale_factor`` scales the average. int64 cannot be widened: its sums wrap
beyond +-2**63, as ``Sum`` of any integer dtype wraps (numpy's and MPI's rule).
Float data never takes this path, so its speed is unchanged.
"""

from __future__ import annotations

import numpy as np

from unison.common.dtypes import is_bool, is_float
from unison.common.exceptions import CollectiveError
from unison.common.ops import BITWISE, ReduceOp

__all__ = ["reducer", "check_op", "prescale", "finalize", "accumulator", "reduce_stack", "overlaps_partly"]

#: The accumulator of integer averages (see [Note: integer average]).
WIDE = np.dtype(np.int64)

_FLOAT_UFUNCS = {
    ReduceOp.AVERAGE: np.add,
    ReduceOp.SUM: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.BAND: np.bitwise_and,  # integers only (check_op)
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
_BOOL_UFUNCS = {
    ReduceOp.SUM: np.logical_or,
    ReduceOp.MAX: np.logical_or,
    ReduceOp.MIN: np.logical_and,
    ReduceOp.PRODUCT: np.logical_and,
    ReduceOp.BAND: np.logical_and,
    ReduceOp.BOR: np.logical_or,
    ReduceOp.BXOR: np.logical_xor,
}


def check_op(dtype: np.dtype, op: ReduceOp, prescale_factor: float, postscale_factor: float,
             collective: str = "allreduce") -> None:
    """Refuse combinations with no meaning.

    Raises:
        CollectiveError: Average or a scale factor on bool data; Adasum on integers, or in a
            collective other than an all-reduce (``collective`` names it).
    """
    if op is ReduceOp.ADASUM and collective != "allreduce":
        raise CollectiveError(f"op=unison.Adasum is an all-reduce (Horovod's too); {collective} cannot "
                              "combine with it. Use unison.Sum or unison.Average")
    if op is ReduceOp.ADASUM and not is_float(dtype):
        raise CollectiveError(f"op=unison.Adasum combines floating-point gradients; got dtype {np.dtype(dtype)}. "
                              "Cast the array to float32, or use unison.Sum / unison.Average")
    if op in BITWISE:
        if is_float(dtype) or np.dtype(dtype).kind == "c":
            raise CollectiveError(f"op={op!r} is a bitwise operation on integers or bools; got dtype "
                                  f"{np.dtype(dtype)}. Cast the array to an integer type, or use another op")
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise CollectiveError(f"prescale_factor={prescale_factor} / postscale_factor={postscale_factor} "
                                  f"cannot scale a bitwise op={op!r}; leave both at 1.0")
    if is_bool(dtype):
        if op is ReduceOp.AVERAGE:
            raise CollectiveError(
                "op=unison.Average is not defined for bool arrays; use unison.Sum or unison.Max "
                "(logical or), or unison.Min or unison.Product (logical and)")
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise CollectiveError(
                f"prescale_factor={prescale_factor} / postscale_factor={postscale_factor} cannot "
                "scale bool arrays; leave both at 1.0 or cast the array to a number type")


def reducer(dtype: np.dtype, op: ReduceOp) -> np.ufunc:
    """The binary ufunc that combines two partial results of ``op`` on ``dtype``."""
    return (_BOOL_UFUNCS if is_bool(dtype) else _FLOAT_UFUNCS)[op]


def _scale(buf: np.ndarray, factor: float, out: np.ndarray) -> None:
    dt = buf.dtype
    if dt == np.float32 or dt == np.float64:
        np.multiply(buf, dt.type(factor), out=out)
    elif is_float(dt):  # float16, bfloat16: scale in float32, round once
        out[...] = (buf.astype(np.float32) * np.float32(factor)).astype(dt)
    else:  # integers: scale in float64 and truncate toward zero, as a C cast would
        out[...] = np.trunc(buf.astype(np.float64) * factor).astype(dt)


def same_start(a: np.ndarray, b: np.ndarray) -> bool:
    """True when ``a`` and ``b`` start at the same address (an in-place call).

    ``ndarray.ctypes.data`` builds a ctypes object (about 2 us a read here), so the cheap
    overlap test goes first: arrays that share no memory, the usual case, never build one.
    """
    return a is b or (np.may_share_memory(a, b) and a.ctypes.data == b.ctypes.data)


def overlaps_partly(out: np.ndarray, x: np.ndarray) -> bool:
    """Whether ``out`` shares memory with ``x`` other than as the same array in place (same start, same layout).

    The algorithms read ``x`` while they write ``out``: given ``out`` half way into ``x``, the ring
    read segments it had already overwritten (50000 of 300000 elements wrong on every rank, before
    2026-12-07; an audit, then a second for the engine's ``out=``), and MPI forbids such aliased
    buffers. The callers copy ``x`` first."""
    return np.may_share_memory(out, x) and not (same_start(out, x) and out.strides == x.strides)


def prescale(src: np.ndarray, factor: float, out: np.ndarray) -> None:
    """``out = src * factor`` (``src`` may equal ``out``)."""
    if factor == 1.0:
        if not same_start(out, src):
            np.copyto(out, src)
    else:
        _scale(src, factor, out)


def finalize(buf: np.ndarray, op: ReduceOp, size: int, postscale_factor: float) -> None:
    """Turn a fully reduced buffer into the result, in place: average, then postscale.

    Float averages multiply by ``postscale_factor / size`` in one pass; integer
    averages divide exactly, truncating toward zero.
    """
    if buf.size == 0:
        return
    factor = postscale_factor
    if op is ReduceOp.AVERAGE:
        if is_float(buf.dtype):
            factor = postscale_factor / size
        elif buf.dtype.kind == "u":
            np.floor_divide(buf, size, out=buf)
        else:
            # truncation toward zero without abs(): abs(INT64_MIN) overflows to itself, and an exact
            # sum of -2^63 averaged to +2^62 at 2 ranks (sign flipped; before 2026-12-05)
            wide = buf.astype(np.int64)
            quotient = wide // size
            quotient += (wide % size != 0) & (wide < 0)
            buf[...] = quotient.astype(buf.dtype)
    if factor != 1.0:
        _scale(buf, factor, buf)



def accumulator(dtype: np.dtype, op: ReduceOp) -> np.dtype | None:
    """The wider dtype in which ``op`` must sum ``dtype`` data, or None when ``dtype`` itself will do.

    See [Note: integer average].
    """
    dt = np.dtype(dtype)
    if op is ReduceOp.AVERAGE and dt.kind in "iu" and dt.itemsize < WIDE.itemsize:
        return WIDE
    return None


def reduce_stack(stack: np.ndarray, op: ReduceOp, out: np.ndarray, size: int,
                 postscale_factor: float) -> None:
    """``out`` = the finished ``op`` over the rows of ``stack`` (one per rank, in rank order)."""
    wide = accumulator(stack.dtype, op)
    if wide is None:
        reducer(stack.dtype, op).reduce(stack, axis=0, out=out)
        finalize(out, op, size, postscale_factor)
        return
    acc = np.add.reduce(stack, axis=0, dtype=wide)
    finalize(acc, op, size, postscale_factor)
    np.copyto(out, acc, casting="unsafe")
