"""Horovod's ``horovod.tensorflow`` collectives on tf.Tensors, eager and inside ``tf.function``.

Each op hands numpy views of its inputs to Unison's engine. Eagerly it calls the
engine directly; in a graph it runs as a ``tf.numpy_function`` (a host callback
that holds one inter-op thread while it waits). Two such callbacks blocking on
different collectives in different orders on two ranks could deadlock, so the
gradient paths (``DistributedGradientTape``, the Keras optimizer, the strategy)
reduce a whole step's gradients in ONE callback: one grouped engine call, whose
members fuse and may complete in any order.

Names: an op gets its engine name when it is created (traced); a graph runs each
op once per step, so the name is unique while in flight and identical on every
rank as long as ranks build the same graph.

Gradients (of the sum of every rank's loss): allreduce -> allreduce with the same
op; allgather -> this rank's rows of the summed gradients; broadcast -> the summed
gradients on the root, zeros elsewhere; reducescatter -> allgather; alltoall ->
alltoall back with the received splits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from unison.common.compression import Compression
from unison.common.engine import frontend
from unison.common.engine.process_sets import ProcessSet, set_rank, set_size
from unison.common.ops import Average, ReduceOp, Sum, parse_op, resolve_op

__all__ = ["allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
           "join", "barrier", "size_op", "rank_op"]


def _name(kind: str, name: str | None) -> str:
    return frontend._auto_name(f"tf.{kind}", name)


def _host(fn: Callable[..., Any], inputs: Sequence[tf.Tensor], tout: Any) -> Any:
    """Run ``fn`` on numpy values: directly when eager, as a stateful numpy_function in a graph."""
    if tf.executing_eagerly():
        out = fn(*[t.numpy() for t in inputs])
        if isinstance(tout, (list, tuple)):
            return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(out, tout, strict=True)]
        return tf.convert_to_tensor(out, dtype=tout)
    return tf.numpy_function(fn, list(inputs), tout, stateful=True)


def _allreduce_dense(tensor: tf.Tensor, op: ReduceOp, name: str, pre: float, post: float,
                     process_set: ProcessSet | None, compression: Any) -> tf.Tensor:
    @tf.custom_gradient
    def reduce(x: tf.Tensor) -> Any:
        def run(a: np.ndarray) -> np.ndarray:
            wire, ctx = compression.compress(np.asarray(a))
            res = frontend.allreduce(wire, op, name, pre, post, process_set)
            return np.asarray(compression.decompress(res, ctx), dtype=a.dtype)

        y = _host(run, [x], x.dtype)
        if not tf.executing_eagerly():
            y.set_shape(x.shape)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            return _allreduce_dense(dy, op, name + ".grad", pre, post, process_set, compression)

        return y, grad

    return reduce(tf.convert_to_tensor(tensor))


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None,
              process_set: ProcessSet | None = None) -> Any:
    """Reduce ``tensor`` over the ranks (``tf.IndexedSlices`` are all-gathered); differentiable."""
    rop = resolve_op(average, op)
    name = _name("allreduce", name)
    if isinstance(tensor, tf.IndexedSlices):
        values = allgather(tensor.values, name=name + ".values", process_set=process_set)
        indices = allgather(tensor.indices, name=name + ".indices", process_set=process_set)
        if rop == Average:
            values = values / tf.cast(set_size(process_set), values.dtype)
        return tf.IndexedSlices(values * (prescale_factor * postscale_factor), indices,
                                dense_shape=tensor.dense_shape)
    return _allreduce_dense(tensor, rop, name, prescale_factor, postscale_factor, process_set, compression)


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, device_dense: str = "",
                      device_sparse: str = "", compression: Any = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: str | None = None, process_set: ProcessSet | None = None) -> list[tf.Tensor]:
    """All-reduce several tensors in ONE host callback and one fused engine group; differentiable."""
    rop = resolve_op(average, op)
    base = _name("grouped_allreduce", name)
    xs = [tf.convert_to_tensor(t) for t in tensors]
    if not xs:
        return []

    @tf.custom_gradient
    def reduce(*args: tf.Tensor) -> Any:
        def run(*arrays: np.ndarray) -> list[np.ndarray]:
            wires = [compression.compress(np.asarray(a)) for a in arrays]
            outs = frontend.grouped_allreduce([w for w, _ in wires], rop, base, prescale_factor,
                                              postscale_factor, process_set)
            return [np.asarray(compression.decompress(o, c), dtype=a.dtype)
                    for o, (_, c), a in zip(outs, wires, arrays, strict=True)]

        ys = _host(run, list(args), [a.dtype for a in args])
        if not tf.executing_eagerly():
            for y, a in zip(ys, args, strict=True):
                y.set_shape(a.shape)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            return grouped_allreduce(list(dys), None, op=rop, prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor, name=base + ".grad",
                                     process_set=process_set, compression=compression)

        return list(ys), grad

    return reduce(*xs)


def allgather(tensor: Any, name: str | None = None, process_set: ProcessSet | None = None) -> tf.Tensor:
    """Concatenate every rank's tensor along dim 0 (which may differ per rank); differentiable."""
    name = _name("allgather", name)
    x = tf.convert_to_tensor(tensor)

    @tf.custom_gradient
    def gather(t: tf.Tensor) -> Any:
        def run(a: np.ndarray) -> list[np.ndarray]:
            rows = frontend.allgather(np.array([a.shape[0] if a.ndim else 1], np.int64), name + ".rows",
                                      process_set)
            return [frontend.allgather(a, name, process_set).astype(a.dtype, copy=False), rows]

        y, rows = _host(run, [t], [t.dtype, tf.int64])
        if not tf.executing_eagerly():
            y.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))

        def grad(dy: tf.Tensor) -> tf.Tensor:
            total = allreduce(dy, op=Sum, name=name + ".grad", process_set=process_set)
            start = tf.reduce_sum(rows[:set_rank(process_set)])
            return tf.reshape(total[start:start + rows[set_rank(process_set)]], tf.shape(t))

        return y, grad

    return gather(x)


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet | None = None) -> tf.Tensor:
    """``root_rank``'s tensor on every rank; differentiable."""
    name = _name("broadcast", name)
    x = tf.convert_to_tensor(tensor)

    @tf.custom_gradient
    def bcast(t: tf.Tensor) -> Any:
        y = _host(lambda a: frontend.broadcast(a, root_rank, name, process_set).astype(a.dtype, copy=False),
                  [t], t.dtype)
        if not tf.executing_eagerly():
            y.set_shape(t.shape)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            total = allreduce(dy, op=Sum, name=name + ".grad", process_set=process_set)
            return total if set_rank(process_set) == root_rank else tf.zeros_like(total)

        return y, grad

    return bcast(x)


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet | None = None) -> tuple[tf.Tensor, tf.Tensor]:
    """Send ``splits[i]`` rows to rank i; returns (received rows, received splits); differentiable."""
    name = _name("alltoall", name)
    x = tf.convert_to_tensor(tensor)
    n = set_size(process_set)
    s = tf.convert_to_tensor(splits if splits is not None else [-1] * n, dtype=tf.int64)

    @tf.custom_gradient
    def exchange(t: tf.Tensor) -> Any:
        def run(a: np.ndarray, sp: np.ndarray) -> list[np.ndarray]:
            out, recv = frontend.alltoall(a, None if (sp < 0).any() else sp, name, process_set)
            return [out.astype(a.dtype, copy=False), recv.astype(np.int64)]

        y, recv = _host(run, [t, s], [t.dtype, tf.int64])
        if not tf.executing_eagerly():
            y.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))

        def grad(dy: tf.Tensor, _unused: Any = None) -> tf.Tensor:
            back, _ = alltoall(dy, recv, name=name + ".grad", process_set=process_set)
            return tf.reshape(back, tf.shape(t))

        return (y, recv), grad

    y, recv = exchange(x)
    return y, tf.stop_gradient(recv)


def reducescatter(tensor: Any, name: str | None = None, op: Any = Average,
                  process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce over ranks and keep this rank's rows of dim 0; differentiable."""
    rop = parse_op(op)
    name = _name("reducescatter", name)
    x = tf.convert_to_tensor(tensor)

    @tf.custom_gradient
    def scatter(t: tf.Tensor) -> Any:
        y = _host(lambda a: frontend.reducescatter(a, rop, name, prescale_factor, postscale_factor,
                                                   process_set).astype(a.dtype, copy=False), [t], t.dtype)
        if not tf.executing_eagerly():
            y.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))

        def grad(dy: tf.Tensor) -> tf.Tensor:
            g = allgather(dy, name=name + ".grad", process_set=process_set) * (prescale_factor * postscale_factor)
            if rop == Average:
                g = g / tf.cast(set_size(process_set), g.dtype)
            return g

        return y, grad

    return scatter(x)


def join() -> int:
    """Contribute identity values until every rank joins; returns the last rank to join."""
    return frontend.join()


def barrier(process_set: ProcessSet | None = None) -> None:
    frontend.barrier(process_set)


def size_op(process_set: ProcessSet | None = None) -> tf.Tensor:
    return tf.constant(set_size(process_set), dtype=tf.int32)


def rank_op(process_set: ProcessSet | None = None) -> tf.Tensor:
    return tf.constant(set_rank(process_set), dtype=tf.int32)
