"""Horovod's data-moving collectives on tf.Tensors: allgather, grouped_allgather, broadcast, alltoall.

Same machinery, names and gradients as :mod:`unison.tf_backend.mpi_ops` (which
re-exports these): allgather's gradient is this rank's rows of the average over
ranks, broadcast's the average on the root and zeros elsewhere, alltoall's an
alltoall back with the received splits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from unison.common.engine import frontend
from unison.common.engine.process_sets import ProcessSet, global_process_set, set_rank, set_size
from unison.common.ops import Average
from unison.tf_backend import host_ops
from unison.tf_backend.op_base import (
    _MOVABLE,
    _allreduce,
    _check_dtype,
    _empty_group,
    _op_name,
    _ps,
    _refused,
    _rows_shape,
    _tensor,
    dense_gradient,
)

__all__ = ["allgather", "grouped_allgather", "broadcast", "alltoall"]


# ------------------------------------------------------------------------------- allgather
def _gathered_rows(x: tf.Tensor, ps: ProcessSet | None, name: str) -> tf.Tensor:
    """Every rank's first dimension of ``x``, in rank order (an allgather of one int32)."""
    # a 0-d tensor is one row; tf.shape(x)[:1] is empty for it, so this holds when the rank is known only
    # when the step runs too (before: an unknown rank was taken for a scalar: every rank "held" 1 row)
    rows = tf.reshape(tf.reduce_prod(tf.shape(x)[:1]), [1])
    return _allgather(rows, _op_name("allgather", name + "_rows", rows), ps, differentiable=False)


def _allgather(x: tf.Tensor, name: str, ps: ProcessSet | None, differentiable: bool = True) -> tf.Tensor:
    def start(a: np.ndarray) -> Any:
        h = frontend.allgather_async(host_ops.to_wire(a, False), name, ps)
        return h, lambda r: [host_ops.from_wire(r, a.dtype).reshape((-1, *a.shape[1:]))]

    if not differentiable:
        return host_ops.run(start, [x], [x.dtype], [_rows_shape(x)], name)[0]

    @dense_gradient
    def gather(t: tf.Tensor) -> Any:
        y = host_ops.run(start, [t], [t.dtype], [_rows_shape(t)], name)[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            avg = _allreduce(dy, Average, _op_name("allreduce", name + "_grad", dy), 1.0, 1.0, ps)
            rows = _gathered_rows(t, ps, name + "_grad")
            me = set_rank(ps)
            begin = tf.reduce_sum(rows[:me])
            return tf.reshape(avg[begin:begin + rows[me]], tf.shape(t))

        return y, grad

    return gather(x)


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet | None = global_process_set) -> tf.Tensor:
    """Concatenate every rank's tensor along dimension 0 (which may differ per rank); differentiable."""
    x = _tensor(tensor)
    ps = _ps(process_set)
    _refused(lambda: _check_dtype("allgather", x, _MOVABLE),  # [Note: a refusal travels]
             lambda data: frontend.allgather_async(data, _op_name("allgather", name, x, ignore_name_scope, ps),
                                                   ps))
    return _allgather(x, _op_name("allgather", name, x, ignore_name_scope, ps), ps)


def grouped_allgather(tensors: Sequence[Any], name: str | None = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet | None = global_process_set) -> list[tf.Tensor]:
    """All-gather several tensors as one group; differentiable (per tensor, as Horovod)."""
    if not tensors:
        ps = _ps(process_set)
        _empty_group(lambda: frontend.group_size_agreement(
            _op_name("grouped_allgather", name, None, ignore_name_scope, ps), 0, ps))
        return list(tensors)
    xs = [_tensor(t) for t in tensors]
    ps = _ps(process_set)

    def check() -> None:
        for x in xs:
            _check_dtype("grouped_allgather", x, _MOVABLE)

    def refuse(data: Any) -> Any:  # the others' calls: the group's count agreement, then each member's
        base = _op_name("grouped_allgather", name, xs[0], ignore_name_scope, ps)
        # (the count is this rank's real one, so that a count mismatch too settles every member: frontend
        # [Note: a longer group's extra members])
        return host_ops.Many([frontend.group_size_agreement(base, len(xs), ps)]
                             + [frontend.allgather_async(data, f"{base}.{i}", ps) for i in range(len(xs))])

    _refused(check, refuse)  # [Note: a refusal travels]
    base = _op_name("grouped_allgather", name, xs[0], ignore_name_scope, ps)

    @dense_gradient
    def gather(*ts: tf.Tensor) -> Any:
        def start(*arrays: np.ndarray) -> Any:
            hs = [frontend.group_size_agreement(base, len(arrays), ps)]  # (waited first: ranks' counts differ)
            hs += [frontend.allgather_async(host_ops.to_wire(a, False), f"{base}.{i}", ps)
                   for i, a in enumerate(arrays)]
            return host_ops.Many(hs), lambda rs: [host_ops.from_wire(r, a.dtype).reshape((-1, *a.shape[1:]))
                                          for r, a in zip(rs[1:], arrays, strict=True)]

        ys = host_ops.run(start, list(ts), [t.dtype for t in ts], [_rows_shape(t) for t in ts], base)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            me = set_rank(ps)
            out = []
            for i, (t, dy) in enumerate(zip(ts, dys, strict=True)):
                avg = _allreduce(dy, Average, _op_name("allreduce", f"{base}.{i}_grad", dy), 1.0, 1.0, ps)
                rows = _gathered_rows(t, ps, f"{base}.{i}_grad")
                begin = tf.reduce_sum(rows[:me])
                out.append(tf.reshape(avg[begin:begin + rows[me]], tf.shape(t)))
            return out

        return ys, grad

    return list(gather(*xs))


# ------------------------------------------------------------------------------- broadcast
def _root_in_set(root_rank: Any, ps: ProcessSet | None) -> int:
    """Horovod's global ``root_rank`` as a rank of ``ps``; -1 (refused by the engine on every rank) if absent."""
    if ps is None or ps.ranks is None or not isinstance(root_rank, (int, np.integer)):
        return root_rank
    return ps.ranks.index(int(root_rank)) if int(root_rank) in ps.ranks else -1


def _broadcast(x: tf.Tensor, root_rank: int, name: str, ps: ProcessSet | None) -> tf.Tensor:
    root = _root_in_set(root_rank, ps)

    @dense_gradient
    def bcast(t: tf.Tensor) -> Any:
        def start(a: np.ndarray) -> Any:
            data: Any = host_ops.to_wire(a, False)
            if root == -1 and ps is not None:  # every rank raises this, naming the global root and the set
                data = frontend.Refused(ValueError(
                    f"root_rank={root_rank} is not a rank of process set {ps.process_set_id} (ranks {ps.ranks}); "
                    "root_rank is a rank of the job, as in Horovod: pass one of the set's ranks"))
            h = frontend.broadcast_async(data, root, name, ps)
            return h, lambda r: [host_ops.from_wire(r, a.dtype).reshape(a.shape)]

        y = host_ops.run(start, [t], [t.dtype], [t.shape], name)[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            avg = _allreduce(dy, Average, _op_name("allreduce", name + "_grad", dy), 1.0, 1.0, ps)
            return avg if set_rank(ps) == root else avg * 0

        return y, grad

    return bcast(x)


def broadcast(tensor: Any, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet | None = global_process_set) -> tf.Tensor:
    """``root_rank``'s tensor (a global rank, as in Horovod) on every rank of the set; differentiable."""
    x = _tensor(tensor)
    ps = _ps(process_set)
    _refused(lambda: _check_dtype("broadcast", x, _MOVABLE),  # [Note: a refusal travels]
             lambda data: frontend.broadcast_async(data, 0, _op_name("broadcast", name, x, ignore_name_scope, ps),
                                                   ps))
    return _broadcast(x, root_rank, _op_name("broadcast", name, x, ignore_name_scope, ps), ps)


# ------------------------------------------------------------------------------- alltoall
def _alltoall(x: tf.Tensor, splits: tf.Tensor, name: str, ps: ProcessSet | None) -> tuple[tf.Tensor, tf.Tensor]:
    n = set_size(ps)

    @dense_gradient
    def exchange(t: tf.Tensor) -> Any:
        def start(a: np.ndarray, sp: np.ndarray) -> Any:
            h = frontend.alltoall_async(host_ops.to_wire(a, False), sp if sp.size else None, name, ps)
            return h, lambda r: [host_ops.from_wire(r[0], a.dtype).reshape((-1, *a.shape[1:])),
                                 np.asarray(r[1], dtype=np.int32).reshape(n)]

        y, recv = host_ops.run(start, [t, splits], [t.dtype, tf.int32], [_rows_shape(t), [n]], name)

        def grad(dy: tf.Tensor, _recv_grad: Any = None) -> tf.Tensor:
            back, _ = _alltoall(dy, recv, _op_name("alltoall", name + "_grad", dy), ps)
            return tf.reshape(back, tf.shape(t))

        return (y, recv), grad

    y, recv = exchange(x)
    return y, tf.stop_gradient(recv)


def alltoall(tensor: Any, splits: Any = None, name: str | None = None, ignore_name_scope: bool = False,
             process_set: ProcessSet | None = global_process_set) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` to rank i (equal parts without ``splits``); differentiable.

    Returns, as Horovod: the received rows, and with ``splits`` given also the
    received splits (an int32 tensor, one count per rank).

    Raises:
        TypeError: a dtype alltoall does not take, or non-integer splits.
    """
    x = _tensor(tensor)
    ps = _ps(process_set)
    sp = tf.constant([], dtype=tf.int32) if splits is None else _tensor(splits)

    def check() -> None:
        _check_dtype("alltoall", x, _MOVABLE)
        if not sp.dtype.is_integer:
            raise TypeError(f"alltoall splits must be integers (int32, as in Horovod); got {sp.dtype.name}")

    _refused(check, lambda data: frontend.alltoall_async(  # [Note: a refusal travels]
        data, None, _op_name("alltoall", name, x, ignore_name_scope, ps), ps))
    sp = tf.cast(sp, tf.int32)
    out, recv = _alltoall(x, sp, _op_name("alltoall", name, x, ignore_name_scope, ps), ps)
    return (out, recv) if splits is not None else out
