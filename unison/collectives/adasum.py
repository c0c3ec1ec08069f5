"""Adasum: Horovod's scale-invariant combination of gradients (Maleki et al., 2020).

Summing the gradients of N ranks overshoots when they point the same way;
averaging them undershoots when they are orthogonal. Adasum combines two
gradients ``a`` and ``b`` as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a  +  (1 - a.b / (2 |b|^2)) b

so two orthogonal gradients add, two equal gradients give one of them, and
rescaling one input rescales its share only. A coefficient whose vector has a
squared norm below ``1e-8`` stays 1 (Horovod's guard against dividing by zero).
N ranks (a power of two) combine in a binary tree of pairs::

    level 1:   g0 g1   g2 g3        adasum(g0, g1)       adasum(g2, g3)
    level 2:     \\  /     \\  /               \\             /
                 v01      v23    ->    adasum(v01, v23)  on every rank

The algorithm below computes exactly that tree the way Horovod does, by
vector halving and distance doubling over point-to-point messages: at level
``d`` each rank swaps half of its current segment with rank ``rank ^ d``, so it
holds one half of both sides' vectors; the three partial dot products
(a.b, |a|^2, |b|^2) are then summed over the ``2d`` ranks that together hold
the whole vectors (recursive doubling on three float64 numbers), and every rank
combines its half with the same coefficients. After the last level each rank
owns ``1/N`` of the result; the levels are undone in reverse order (distance
halving) to give every rank the whole, bitwise identical, result. Arithmetic
runs in float64 and each level rounds once into the tensor's dtype.

Only floating-point dtypes have a meaning here, and only power-of-two rank
counts (Horovod's rule, and its error text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from unison.collectives.p2p import exchange
from unison.common.dtypes import is_float
from unison.common.exceptions import CollectiveError, MismatchError

__all__ = ["combine", "reference", "check_size", "check_dtype", "allreduce", "allreduce_direct"]

#: A norm below this keeps its coefficient at 1 (Horovod's threshold).
NORM_EPS = 1e-8
TAG_DATA = 47
TAG_DOTS = 48


def _coefficients(dot: float, anormsq: float, bnormsq: float) -> tuple[float, float]:
    acoeff = 1.0 - dot / anormsq * 0.5 if anormsq >= NORM_EPS else 1.0
    bcoeff = 1.0 - dot / bnormsq * 0.5 if bnormsq >= NORM_EPS else 1.0
    return acoeff, bcoeff


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``adasum(a, b)`` of two whole vectors, in ``a``'s dtype (computed in float64)."""
    a64, b64 = np.asarray(a, np.float64).reshape(-1), np.asarray(b, np.float64).reshape(-1)
    acoeff, bcoeff = _coefficients(float(a64 @ b64), float(a64 @ a64), float(b64 @ b64))
    return (acoeff * a64 + bcoeff * b64).astype(np.asarray(a).dtype).reshape(np.shape(a))


def reference(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """The binary-tree Adasum of ``vectors`` (rank order), for tests and one-process use.

    Raises:
        NotImplementedError: the number of vectors is not a power of two.
    """
    check_size(len(vectors))
    level = [np.asarray(v) for v in vectors]
    while len(level) > 1:
        level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def check_size(size: int) -> None:
    """Raises NotImplementedError (Horovod's type and text) unless ``size`` is a power of two."""
    if size < 1 or size & (size - 1):
        raise NotImplementedError(
            f"Running Adasum with non-power of 2 ranks is not supported yet (got {size} ranks); "
            "run on 1, 2, 4, 8, ... ranks, or use op=Average")


def check_dtype(dtype: np.dtype) -> None:
    """Raises CollectiveError unless ``dtype`` is floating point (Adasum needs dot products)."""
    if not is_float(np.dtype(dtype)):
        raise CollectiveError(f"op=Adasum combines floating-point gradients; got dtype {np.dtype(dtype)}. "
                              "Cast the tensor to float32 (or use op=Sum / op=Average)")


def _group_sum(comm: Any, values: np.ndarray, rank: int, level: int) -> np.ndarray:
    """Sum ``values`` over the ``2 * level`` ranks sharing ``rank``'s bits above ``level``.

    Recursive doubling: both partners of a step add the same two numbers, so
    every rank of the group ends with bitwise the same sums.
    """
    other = np.empty_like(values)
    dist = 1
    while dist <= level:
        peer = rank ^ dist
        comm.Sendrecv(values, peer, TAG_DOTS, other, peer, TAG_DOTS)
        values = values + other
        dist <<= 1
    return values


def _halve(comm: Any, mpi: Any, buf: np.ndarray, recv: np.ndarray, seg: tuple[int, int], rank: int,
           level: int, chunk: int) -> tuple[int, int]:
    """One level: swap halves with ``rank ^ level``, combine this rank's half; returns it."""
    lo, hi = seg
    mid = lo + ((hi - lo) >> 1)
    left = not rank & level
    keep, give = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
    peer = rank ^ level
    exchange(comm, mpi, buf[give[0]:give[1]], peer, recv[keep[0]:keep[1]], peer, TAG_DATA, chunk)
    mine = buf[keep[0]:keep[1]].astype(np.float64)
    theirs = recv[keep[0]:keep[1]].astype(np.float64)
    dot, na, nb = float(mine @ theirs), float(mine @ mine), float(theirs @ theirs)
    sums = _group_sum(comm, np.array([dot, na, nb] if left else [dot, nb, na]), rank, level)
    nleft, nright = float(sums[1]), float(sums[2])
    acoeff, bcoeff = _coefficients(float(sums[0]), *((nleft, nright) if left else (nright, nleft)))
    buf[keep[0]:keep[1]] = acoeff * mine + bcoeff * theirs
    return keep


def allreduce(comm: Any, mpi: Any, src: np.ndarray, out: np.ndarray, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, chunk_bytes: int = 1 << 20) -> None:
    """``out = postscale * adasum(prescale * src over the ranks of comm)``; ``out`` may be ``src``.

    ``src`` and ``out`` are 1-D contiguous arrays of one floating dtype. Collective:
    every rank of ``comm`` calls it with the same size and dtype (not checked here).

    Raises:
        NotImplementedError: the communicator's size is not a power of two.
        CollectiveError: the dtype is not floating point.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    check_size(size)
    check_dtype(out.dtype)
    out[...] = src if prescale_factor == 1.0 else src.astype(np.float64) * prescale_factor
    if size > 1 and out.size:
        recv = np.empty_like(out)
        chunk = max(1, chunk_bytes // out.itemsize)
        segments, seg, level = [], (0, out.size), 1
        while level < size:
            segments.append(seg)
            seg = _halve(comm, mpi, out, recv, seg, rank, level, chunk)
            level <<= 1
        while segments:  # distance halving: give back what each level split off
            level >>= 1
            whole = segments.pop()
            missing = (whole[0], seg[0]) if seg[0] > whole[0] else (seg[1], whole[1])
            peer = rank ^ level
            exchange(comm, mpi, out[seg[0]:seg[1]], peer, out[missing[0]:missing[1]], peer, TAG_DATA, chunk)
            seg = whole
    if postscale_factor != 1.0:
        out[...] = out.astype(np.float64) * postscale_factor


def allreduce_direct(tensor: np.ndarray, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     comm: Any = None) -> np.ndarray:
    """Blocking Adasum of ``tensor`` over ``comm`` (the runtime's by default), after checking agreement.

    The ranks first exchange (shape, dtype, factors); any difference raises
    :class:`MismatchError` on every rank instead of corrupting the result.

    Raises:
        NotImplementedError: not a power-of-two number of ranks.
        CollectiveError: not a floating-point dtype (on every rank).
        MismatchError: ranks disagree on shape, dtype or factors (on every rank).
    """
    arr = np.asarray(tensor)
    arr = np.ascontiguousarray(arr).reshape(arr.shape)  # (ascontiguousarray alone makes 0-d 1-d)
    if comm is None:
        from unison.common import runtime

        comm = runtime.state("Adasum").comm
    if comm is None or comm.Get_size() == 1:
        check_dtype(arr.dtype)
        return (arr.astype(np.float64) * (prescale_factor * postscale_factor)).astype(arr.dtype)
    check_size(comm.Get_size())
    mine = (arr.shape, arr.dtype.str, float(prescale_factor), float(postscale_factor))
    everyone = comm.allgather(mine)
    if any(v != everyone[0] for v in everyone):
        raise MismatchError("Adasum allreduce: ranks disagree on (shape, dtype, prescale, postscale): "
                            + "; ".join(f"rank {r}: {v}" for r, v in enumerate(everyone))
                            + ". Every rank must reduce the same tensor")
    check_dtype(arr.dtype)
    from mpi4py import MPI

    out = np.empty_like(arr)
    allreduce(comm, MPI, arr.reshape(-1), out.reshape(-1), prescale_factor, postscale_factor)
    return out
