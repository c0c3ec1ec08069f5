"""Deterministic reductions: every element reduced in rank order 0, 1, ..., n-1.

Floating-point addition is not associative, so a ring (which starts each
segment's sum at a different rank), a hierarchy (which sums within hosts
first), MPI's own algorithms and numpy's pairwise ``reduce`` each give slightly
different bits, and which one runs depends on the message size -- so on
fusion, on autotuning, even on timing. With ``UNISON_DETERMINISTIC=1`` every
float all-reduce and reduce-scatter instead computes, for every element::

    ((x_0 op x_1) op x_2) ... op x_{n-1}        (x_r: rank r's prescaled input)

then averages and post-scales it element by element. That value depends on
nothing but the inputs, so fused and unfused tensors, any fusion threshold,
one host or many, give the same bits (as does a numpy loop over the ranks).

How: a direct reduce-scatter. The buffer is cut into one segment per rank;
each rank sends every other rank that rank's segment (an all-to-all, pure data
movement), and each segment's owner folds the n pieces in rank order. An
all-gather then copies the finished segments everywhere::

    rank 1 receives s1 from every rank     then folds    s1 = ((x0 + x1) + x2) + x3
    r0: [s0 s1 s2 s3] --s1-->  r1: rows x0 x1 x2 x3      all-gather s0..s3

Each rank sends and receives 2(n-1)/n of the buffer, as in the ring, but the
pieces of one segment wait for each other, and neither the hierarchy nor MPI's
reductions may be used: docs/collectives.md measures the cost. Integer and bool
data are exact in any order and never take this path. Large buffers go in
rounds of ``chunk`` elements per segment, so the temporary stack stays small.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from unison.collectives import ring, select
from unison.collectives.p2p import segments
from unison.collectives.reduce import accumulator, finalize, reducer
from unison.common.ops import ReduceOp

__all__ = ["fold_rows", "reduce_stack", "reduce_scatter", "allreduce"]


def fold_rows(rows: list[np.ndarray] | np.ndarray, op: np.ufunc, out: np.ndarray) -> None:
    """``out = ((rows[0] op rows[1]) op rows[2]) ...``, strictly in row order.

    numpy's ``ufunc.reduce`` over rows is not: for one column and nine rows or
    more it sums pairwise.
    """
    if len(rows) == 1:
        np.copyto(out, rows[0])
        return
    op(rows[0], rows[1], out=out)
    for row in rows[2:]:
        op(out, row, out=out)


def reduce_stack(stack: np.ndarray, op: ReduceOp, out: np.ndarray, size: int,
                 postscale_factor: float) -> None:
    """``out`` = the finished ``op`` over the rows of ``stack`` (one per rank), folded in rank order.

    The same contract as :func:`unison.collectives.reduce.reduce_stack`; integer
    averages are summed in the wide accumulator (exact in any order).
    """
    wide = accumulator(stack.dtype, op)
    if wide is None:
        fold_rows(stack, reducer(stack.dtype, op), out)
        finalize(out, op, size, postscale_factor)
        return
    acc = np.add.reduce(stack, axis=0, dtype=wide)
    finalize(acc, op, size, postscale_factor)
    np.copyto(out, acc, casting="unsafe")


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def reduce_scatter(comm: Any, mpi: Any, src: np.ndarray, mine: np.ndarray, counts: list[int],
                   offsets: list[int], op: np.ufunc, chunk: int) -> None:
    """``mine`` = rank-order fold of every rank's ``src[offsets[r]:offsets[r] + counts[r]]`` (r: this rank).

    Args:
        src: this rank's (prescaled) input, 1-D.
        mine: this rank's segment of the result, ``counts[rank]`` elements.
        counts, offsets: every rank's segment of ``src``, in elements.
        chunk: elements per segment per round.
    """
    n, r = comm.Get_size(), comm.Get_rank()
    item = src.itemsize
    chunk = max(1, chunk)
    stack = np.empty((n, min(chunk, counts[r])), dtype=src.dtype)
    rounds = -(-max(counts) // chunk)
    # byte displacements into src over 2 GiB fail in MPI ([Note: messages over 2 GiB] in .select):
    # then each round's pieces are packed into one buffer first (the same on every rank: sizes agree)
    big = src.nbytes > select.MAX_MPI_BYTES
    packed = np.empty(n * min(chunk, max(counts)), dtype=src.dtype) if big else None
    for k in range(rounds):
        lo = k * chunk
        send = [max(0, min(chunk, c - lo)) for c in counts]
        width = send[r]
        sdispl = [(offsets[q] + lo) * item if send[q] else 0 for q in range(n)]
        origin = src
        if packed is not None:
            at = 0
            for q in range(n):
                packed[at:at + send[q]] = src[offsets[q] + lo:offsets[q] + lo + send[q]]
                sdispl[q], at = at * item, at + send[q]
            origin = packed
        rows = stack[:, :width]
        comm.Alltoallv([_bytes(origin), [s * item for s in send], sdispl, mpi.BYTE],
                       [_bytes(stack), [width * item] * n, [q * stack.shape[1] * item for q in range(n)],
                        mpi.BYTE])
        if width:
            fold_rows(rows, op, mine[lo:lo + width])


def allreduce(comm: Any, mpi: Any, src: np.ndarray, out: np.ndarray, op: np.ufunc, chunk: int,
              finish: Callable[[np.ndarray], None] | None = None) -> None:
    """Deterministic all-reduce of ``src`` into ``out`` (1-D, same size; may be the same array).

    ``finish`` runs on this rank's finished segment before the all-gather.
    """
    n, r = comm.Get_size(), comm.Get_rank()
    counts, offsets = segments(out.size, n)
    mine = np.empty(counts[r], dtype=out.dtype)
    reduce_scatter(comm, mpi, src, mine, counts, offsets, op, chunk)
    if finish is not None:
        finish(mine)
    item = out.itemsize
    if out.nbytes > select.MAX_MPI_BYTES:  # the displacements would not fit: our ring, in pieces
        ob = _bytes(out)
        ob[offsets[r] * item:(offsets[r] + counts[r]) * item] = _bytes(mine)
        ring.allgatherv(comm, mpi, ob, [c * item for c in counts], [o * item for o in offsets],
                        max(1, chunk) * item)
        return
    comm.Allgatherv(_bytes(mine), [_bytes(out), [c * item for c in counts],
                                   [o * item for o in offsets], mpi.BYTE])
