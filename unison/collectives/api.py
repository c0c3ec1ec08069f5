"""The blocking collectives on numpy arrays: Unison's framework-neutral API.

Each call first agrees with the other ranks on what is being called (see
:mod:`unison.collectives.header`), then runs one algorithm:

============== ===================================== ==============================
collective     ours                                  MPI's
============== ===================================== ==============================
allreduce      inline (<= 256 B), rhd, ring,         ``MPI_Allreduce``
               hierarchical
allgather      inline, ring, hierarchical            ``MPI_Allgather(v)``
broadcast      inline, binomial tree, hierarchical   ``MPI_Bcast``
reducescatter  inline, ring                          ``MPI_Reduce_scatter(_block)``
alltoall       inline, pairwise exchange             ``MPI_Alltoallv``
============== ===================================== ==============================

``algorithm="auto"`` (the default, or ``UNISON_<OP>_ALGORITHM``) picks by
topology, message size and rank count; see :mod:`unison.collectives.select`.
Inline all-reduces and reduce-scatters fold the ranks' rows in rank order, as
the deterministic mode does (:mod:`unison.collectives.ordered`).

A call on a C-contiguous numpy array leaves a plan keyed by its local
signature; the same call again replays the agreement with the plan's prebuilt
header and moves the data with precomputed arguments (:mod:`.plans`). Every
call, planned or not, makes the same fixed-size agreement exchange first, so a
mismatch still raises on every rank, and the same MPI calls after it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from unison.collectives import kernels
from unison.collectives.header import ERR_KINDS, INLINE_BYTES, Call, Collective, Negotiator, error_code
from unison.collectives.ordered import reduce_stack  # rank order (numpy's reduce is pairwise at >= 9 rows)
from unison.collectives.plans import (
    AllgatherPlan,
    AllreducePlan,
    AlltoallPlan,
    BroadcastPlan,
    InlineAllreduce,
    ReducescatterPlan,
)
from unison.collectives.reduce import check_op, finalize, overlaps_partly, prescale, reducer
from unison.collectives.validate import as_array, check_root, check_splits, rows_split
from unison.common import pool, runtime
from unison.common.config import validate_algorithm
from unison.common.dtypes import dtype_code
from unison.common.exceptions import refusal_class
from unison.common.ops import Average, ReduceOp, parse_op

__all__ = ["allreduce", "allgather", "broadcast", "reducescatter", "alltoall", "barrier"]


#: Plans kept per communicator before the cache starts over (a plan is a few hundred bytes per rank).
MAX_PLANS = 1024


def _negotiator(st: runtime.State) -> Negotiator:
    neg = st.cache.get("negotiator")
    if neg is None:
        neg = st.cache["negotiator"] = Negotiator(st.comm, st.mpi)
    return neg


def _plan(st: runtime.State, key: tuple[Any, ...]) -> Any:
    """The cached plan of a call signature, if any (see :mod:`.plans`)."""
    neg = st.cache.get("negotiator")
    if neg is None:
        return None
    try:
        return neg.plans.get(key)
    except TypeError:  # an unhashable argument: the full path checks it
        return None


def _keep(neg: Negotiator, key: tuple[Any, ...], plan: Any) -> None:
    try:
        hash(key)
    except TypeError:  # an unhashable argument (a 0-d array as a factor or split): not planned. Kept after the
        return  # data had moved, it raised on the ranks that passed one, the result lost (before 2026-12-07)
    if len(neg.plans) >= MAX_PLANS:
        neg.plans.clear()
    neg.plans[key] = plan


def _op_key(op: Any) -> tuple[Any, Any]:
    """``op`` in a plan's key with its type: ``True`` and ``1.0`` equal and hash as ``ReduceOp.SUM``, so a
    call passing one took a Sum's plan where a first call refuses it (before 2026-12-07)."""
    return type(op), op


def _plannable(tensor: Any, st: runtime.State) -> bool:
    """Whether a call on ``tensor`` may take (or leave) a cached plan."""
    return type(tensor) is np.ndarray and st.size > 1 and tensor.flags.c_contiguous


class _Prep:
    """The local half of a call: the array, and any error to report to all ranks."""

    def __init__(self, coll: Collective, tensor: Any, name: str | None, config_field: str,
                 algorithm: str | None, st: runtime.State) -> None:
        self.call = Call(coll, name=name)
        self.array: np.ndarray = np.empty(0)
        try:
            self.call.algorithm = validate_algorithm(
                config_field, algorithm if algorithm is not None
                else getattr(st.config, config_field))
            self.array = as_array(tensor)
            self.call.dtype_code = dtype_code(self.array.dtype)
            self.call.shape = self.array.shape
            self.call.nbytes = self.array.nbytes
        except TypeError as exc:
            self.fail(exc)
        except ValueError as exc:
            self.fail(exc)

    def fail(self, exc: Exception) -> None:
        if self.call.error is None:
            self.call.error = (error_code(exc), str(exc))

    def check(self, fn: Any, *args: Any) -> None:
        if self.call.error is None:
            try:
                fn(*args)
            except (TypeError, ValueError) as exc:
                self.fail(exc)

    def reduction(self, op: Any, prescale_factor: float, postscale_factor: float) -> ReduceOp:
        """Record the op and scale factors in the call; a bad op or combination is this rank's error."""
        try:
            rop = parse_op(op)
            self.call.op, self.call.prescale = int(rop), float(prescale_factor)
            self.call.postscale = float(postscale_factor)
        except (TypeError, ValueError) as exc:
            self.fail(exc)
            return ReduceOp.SUM
        self.check(check_op, self.array.dtype, rop, self.call.prescale, self.call.postscale,
                   self.call.coll.name.lower())
        return rop

    def raise_local(self) -> None:
        if self.call.error is not None:
            kind, text = self.call.error
            raise refusal_class([ERR_KINDS.get(kind, "V")])(text)  # (the class the ranks of a larger job raise)


def _flat(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr).reshape(-1)


def _run(prep: _Prep, st: runtime.State) -> Negotiator | None:
    """Exchange headers (size > 1) or raise the local error (size 1)."""
    if st.size == 1:
        prep.raise_local()
        return None
    neg = _negotiator(st)
    neg.exchange(prep.call)
    return neg


def _chunk(st: runtime.State, itemsize: int) -> int:
    return max(1, st.config.chunk_bytes // itemsize)


def allreduce(tensor: Any, op: Any = Average, name: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              algorithm: str | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Reduce ``tensor`` over all ranks and return the result on every rank.

    Args:
        tensor: array-like of a supported dtype, any shape; not modified.
        op: ``unison.Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        name: a label for error messages and (with the engine) the timeline.
        prescale_factor: each rank's input is multiplied by this before reducing.
        postscale_factor: the result is multiplied by this after reducing.
        algorithm: ``"auto"``, ``"ring"``, ``"rhd"``, ``"hierarchical"`` or ``"mpi"``; default from
            ``UNISON_ALLREDUCE_ALGORITHM``.
        out: a C-contiguous array of the input's shape and dtype to write the
            result into (it may be ``tensor`` itself, for an in-place reduction).

    Returns:
        The result (``out`` when given, else a new array) of the input's shape
        and dtype, bitwise identical on all ranks.

    Raises:
        NotInitializedError: before ``unison.init()``.
        CollectiveError: an unsupported dtype or op on any rank (a ``TypeError``).
        MismatchError: ranks passed different shapes, dtypes, ops or factors (a ``ValueError``).
    """
    st = runtime.state("unison.allreduce()")
    if out is not None and type(out) is np.ndarray and type(tensor) is np.ndarray and overlaps_partly(out, tensor):
        tensor = tensor.copy()
    key = ("allreduce", tensor.shape, tensor.dtype, _op_key(op), prescale_factor, postscale_factor, algorithm) \
        if _plannable(tensor, st) else None
    if key is not None:
        plan = _plan(st, key)
        if plan is not None and (out is None or plan.fits(out)):
            return plan.run(tensor, name, out)
    prep = _Prep(Collective.ALLREDUCE, tensor, name, "allreduce_algorithm", algorithm, st)
    call, x = prep.call, prep.array
    rop = prep.reduction(op, prescale_factor, postscale_factor)
    n = st.size
    small = call.algorithm == "auto" and x.nbytes <= INLINE_BYTES and rop is not ReduceOp.ADASUM
    flat = _flat(x) if call.error is None else x
    if small and call.error is None and n > 1:
        mine = _negotiator(st).inline_area()[:x.nbytes].view(x.dtype)
        prescale(flat, call.prescale, mine)
        call.inline = True
    if out is not None:
        prep.check(_check_out, out, x)
    neg = _run(prep, st)
    result = pool.results.empty(x.shape, x.dtype) if out is None else out
    out = result.reshape(-1)
    if neg is None:
        prescale(flat, call.prescale, out)
        finalize(out, rop, 1, call.postscale)
        return result
    if x.size == 0:
        return result
    if small:
        reduce_stack(neg.inline_rows(x.nbytes).view(x.dtype), rop, out, n, call.postscale)
        if key is not None:
            _keep(neg, key, InlineAllreduce(neg, call, reducer(x.dtype, rop), rop))
        return result
    kernels.allreduce(neg.comm, neg.mpi, flat, out, rop, call.prescale, call.postscale,
                      call.algorithm, st.config.chunk_bytes)
    if key is not None:
        _keep(neg, key, AllreducePlan(neg, call, rop, st.config.chunk_bytes))
    return result


def _check_out(out: Any, x: np.ndarray) -> None:
    if not isinstance(out, np.ndarray) or out.shape != x.shape or out.dtype != x.dtype \
            or not out.flags.c_contiguous or not out.flags.writeable:
        got = (f"shape={out.shape}, dtype={out.dtype}, contiguous={out.flags.c_contiguous}, "
               f"writeable={out.flags.writeable}" if isinstance(out, np.ndarray) else type(out).__name__)
        raise ValueError(f"out= must be a writeable C-contiguous numpy array with the input's shape {x.shape} "
                         f"and dtype {x.dtype}; got {got}")



def allgather(tensor: Any, name: str | None = None, algorithm: str | None = None) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order.

    The first dimension may differ between ranks; the others and the dtype must
    match. A 0-d input counts as shape ``(1,)``.

    Args:
        tensor: array-like.
        name: a label for error messages.
        algorithm: ``"auto"``, ``"ring"``, ``"hierarchical"`` or ``"mpi"``; default from
            ``UNISON_ALLGATHER_ALGORITHM``.

    Raises:
        MismatchError: trailing shapes or dtypes differ between ranks.
    """
    st = runtime.state("unison.allgather()")
    key = ("allgather", tensor.shape, tensor.dtype, algorithm) \
        if _plannable(tensor, st) and tensor.ndim else None
    if key is not None:
        plan = _plan(st, key)
        if plan is not None:
            got = plan.run(tensor, name)
            # None: another rank's first dimension changed; the exchange is done, recompute
            return got if got is not None else _allgather_rest(plan.neg, tensor, plan.call, st, key)
    prep = _Prep(Collective.ALLGATHER, tensor, name, "allgather_algorithm", algorithm, st)
    x = prep.array.reshape(1) if prep.array.ndim == 0 else prep.array
    call = prep.call
    call.shape, call.vary_dim0 = x.shape, True
    if st.size > 1 and call.error is None and call.algorithm == "auto" and x.nbytes <= INLINE_BYTES:
        _negotiator(st).inline_area()[:x.nbytes] = _flat(x).view(np.uint8)
        call.inline = True
    neg = _run(prep, st)
    if neg is None:
        return np.array(x, order="C")
    return _allgather_rest(neg, x, call, st, key)


def _allgather_rest(neg: Negotiator, x: np.ndarray, call: Call, st: runtime.State,
                    key: tuple[Any, ...] | None) -> np.ndarray:
    """An all-gather once the headers are agreed; leaves a plan for ``key`` when one applies."""
    rows = neg.dim0s()
    trailing = x.shape[1:]
    out = pool.results.empty((sum(rows),) + trailing, x.dtype)
    row_bytes = math.prod(trailing) * x.itemsize
    counts = [r * row_bytes for r in rows]
    ob = out.reshape(-1).view(np.uint8)
    if neg.all_inline():
        start = 0
        for i in range(st.size):
            ob[start:start + counts[i]] = neg.payload(i, counts[i])
            start += counts[i]
        return out
    kernels.allgatherv(neg.comm, neg.mpi, _flat(x), out, counts, call.algorithm, st.config.chunk_bytes)
    if key is not None and not call.inline:
        _keep(neg, key, AllgatherPlan(neg, call, rows, st.config.chunk_bytes))
    return out


def broadcast(tensor: Any, root_rank: int = 0, name: str | None = None,
              algorithm: str | None = None) -> np.ndarray:
    """Return ``root_rank``'s ``tensor`` on every rank.

    Every rank passes an array of the same shape and dtype (its values are
    ignored except on the root).

    Raises:
        InvalidArgumentError: ``root_rank`` is not a rank (a ``ValueError``).
        MismatchError: ranks disagree on shape, dtype or root.
    """
    st = runtime.state("unison.broadcast()")
    key = ("broadcast", tensor.shape, tensor.dtype, root_rank, algorithm) \
        if _plannable(tensor, st) and type(root_rank) is int else None
    if key is not None:
        plan = _plan(st, key)
        if plan is not None:
            return plan.run(tensor, name)
    prep = _Prep(Collective.BROADCAST, tensor, name, "broadcast_algorithm", algorithm, st)
    call, x = prep.call, prep.array
    prep.check(check_root, root_rank, st.size)
    call.root = int(root_rank) if call.error is None else -1
    small = call.algorithm == "auto" and x.nbytes <= INLINE_BYTES
    if small and st.size > 1 and call.error is None and st.rank == call.root:
        _negotiator(st).inline_area()[:x.nbytes] = _flat(x).view(np.uint8)
    call.inline = small
    neg = _run(prep, st)
    out = pool.results.empty(x.shape, x.dtype)
    root_here = neg is None or st.rank == call.root
    if neg is None or x.size == 0 or small:
        if root_here:
            np.copyto(out, x)
        if neg is not None and not root_here and x.size:
            out.reshape(-1).view(np.uint8)[:] = neg.payload(call.root, x.nbytes)
        return out
    kernels.broadcast(neg.comm, neg.mpi, out, call.root, call.algorithm, st.config.chunk_bytes,
                      source=_flat(x) if root_here else None)
    if key is not None:
        _keep(neg, key, BroadcastPlan(neg, call, st.config.chunk_bytes))
    return out


def reducescatter(tensor: Any, op: Any = Average, name: str | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  algorithm: str | None = None) -> np.ndarray:
    """Reduce ``tensor`` over all ranks and return this rank's rows of the result.

    The first dimension is split into ``size`` contiguous parts; when it does not
    divide evenly the first ``dim0 % size`` ranks get one extra row (Horovod's rule).

    Raises:
        InvalidArgumentError: a 0-d input.
        MismatchError: ranks passed different shapes, dtypes, ops or factors.
    """
    st = runtime.state("unison.reducescatter()")
    key = ("reducescatter", tensor.shape, tensor.dtype, _op_key(op), prescale_factor, postscale_factor,
           algorithm) \
        if _plannable(tensor, st) and tensor.ndim else None
    if key is not None:
        plan = _plan(st, key)
        if plan is not None:
            return plan.run(tensor, name)
    prep = _Prep(Collective.REDUCESCATTER, tensor, name, "reducescatter_algorithm", algorithm, st)
    call, x = prep.call, prep.array
    rop = prep.reduction(op, prescale_factor, postscale_factor)
    if call.error is None and x.ndim == 0:
        prep.fail(ValueError("reducescatter needs an array with at least one dimension to split; "
                             "got a 0-d array. Reshape it to (1,) or use allreduce"))
    n, r = st.size, st.rank
    small = call.algorithm == "auto" and x.nbytes <= INLINE_BYTES
    flat = _flat(x) if call.error is None else x
    if small and n > 1 and call.error is None:
        prescale(flat, call.prescale, _negotiator(st).inline_area()[:x.nbytes].view(x.dtype))
        call.inline = True
    neg = _run(prep, st)
    rows = rows_split(x.shape[0], n)
    row_elems = math.prod(x.shape[1:])
    counts = [k * row_elems for k in rows]
    out = pool.results.empty((counts[r],), x.dtype)
    shape = (rows[r],) + x.shape[1:]
    if neg is None:
        prescale(flat, call.prescale, out)
        finalize(out, rop, 1, call.postscale)
        return out.reshape(shape)
    if small:
        offset = sum(counts[:r])
        stack = neg.inline_rows(x.nbytes).view(x.dtype)[:, offset:offset + counts[r]]
        reduce_stack(stack, rop, out, n, call.postscale)
        return out.reshape(shape)
    kernels.reducescatter(neg.comm, neg.mpi, flat, out, counts, rop, call.prescale,
                          call.postscale, call.algorithm, st.config.chunk_bytes)
    if key is not None and x.size:
        _keep(neg, key, ReducescatterPlan(neg, call, rop, counts, shape, st.config.chunk_bytes))
    return out.reshape(shape)


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             algorithm: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Send ``splits[i]`` rows of ``tensor`` to rank i; receive each rank's rows for this rank.

    Args:
        tensor: array-like with at least one dimension.
        splits: rows for each rank, in rank order; by default an equal split
            (the first dimension must then divide by the number of ranks).

    Returns:
        ``(output, received_splits)``: the received rows concatenated in rank
        order, and how many came from each rank (int64 array).

    Raises:
        InvalidArgumentError: bad ``splits`` or a 0-d input.
        MismatchError: trailing shapes or dtypes differ between ranks.
    """
    st = runtime.state("unison.alltoall()")
    key = None
    if _plannable(tensor, st) and tensor.ndim and (splits is None or type(splits) in (list, tuple)):
        key = ("alltoall", tensor.shape, tensor.dtype, splits if splits is None else tuple(splits), algorithm)
        plan = _plan(st, key)
        if plan is not None:
            got = plan.run(tensor, name)
            # None: another rank's splits changed; the exchange is done, recompute
            return got if got is not None else _alltoall_rest(plan.neg, tensor, plan.call, st, key)
    prep = _Prep(Collective.ALLTOALL, tensor, name, "alltoall_algorithm", algorithm, st)
    call, x = prep.call, prep.array
    n = st.size
    call.vary_dim0 = True
    if call.error is None and x.ndim == 0:
        prep.fail(ValueError("alltoall needs an array with at least one dimension; got a 0-d array"))
    my_splits = [0] * n
    try:
        if call.error is None:
            my_splits = check_splits(splits, x.shape[0], n)
    except ValueError as exc:
        prep.fail(exc)
    split_bytes = 8 * n
    if n > 1 and split_bytes <= INLINE_BYTES:
        area = _negotiator(st).inline_area()
        area[:split_bytes].view(np.int64)[:] = my_splits
        if call.error is None and call.algorithm == "auto" and split_bytes + x.nbytes <= INLINE_BYTES:
            area[split_bytes:split_bytes + x.nbytes] = _flat(x).view(np.uint8)
            call.inline = True
    neg = _run(prep, st)
    if neg is None:
        return np.array(x, order="C"), np.asarray(my_splits, dtype=np.int64)
    return _alltoall_rest(neg, x, call, st, key, my_splits)


def _alltoall_rest(neg: Negotiator, x: np.ndarray, call: Call, st: runtime.State,
                   key: tuple[Any, ...] | None, my_splits: list[int] | None = None,
                   ) -> tuple[np.ndarray, np.ndarray]:
    """An all-to-all once the headers are agreed; leaves a plan for ``key`` when one applies.

    ``my_splits`` is needed only when the splits do not travel inline (more than
    ``INLINE_BYTES / 8`` ranks); a plan exists only when they do.
    """
    n, r = st.size, st.rank
    split_bytes = 8 * n
    row_bytes = math.prod(x.shape[1:]) * x.itemsize if x.ndim else 0
    if split_bytes <= INLINE_BYTES:
        all_splits = neg.inline_rows(split_bytes).view(np.int64).copy()
    else:
        all_splits = np.empty((n, n), dtype=np.int64)
        neg.comm.Allgather(np.asarray(my_splits, dtype=np.int64), all_splits)
    recv_splits = all_splits[:, r].copy()
    out = pool.results.empty((int(recv_splits.sum()),) + x.shape[1:], x.dtype)
    ob = out.reshape(-1).view(np.uint8)
    rcounts = [int(v) * row_bytes for v in recv_splits]
    if neg.all_inline():
        start = 0
        for i in range(n):
            src = split_bytes + int(all_splits[i, :r].sum()) * row_bytes
            ob[start:start + rcounts[i]] = neg.payload(i, rcounts[i], src)
            start += rcounts[i]
        return out, recv_splits
    scounts = [int(v) * row_bytes for v in all_splits[r]]
    kernels.alltoallv(neg.comm, neg.mpi, _flat(x), scounts, out, rcounts, call.algorithm,
                      st.config.chunk_bytes, uniform=bool((all_splits == all_splits[0, 0]).all()),
                      largest=kernels.alltoall_largest(all_splits, row_bytes))
    if key is not None and not call.inline and split_bytes <= INLINE_BYTES:
        _keep(neg, key, AlltoallPlan(neg, call, all_splits, st.config.chunk_bytes))
    return out, recv_splits


def barrier() -> None:
    """Block until every rank has called ``barrier()``.

    Raises:
        MismatchError: another rank is in a different collective.
    """
    st = runtime.state("unison.barrier()")
    if st.size > 1:
        _negotiator(st).exchange(Call(Collective.BARRIER, algorithm="auto"))

