"""Horovod's ``horovod.tensorflow`` collectives on tf.Tensors, eager and inside ``tf.function``.

Every op runs through :mod:`unison.tf_backend.host_ops`: a non-blocking submit
and an ordered collect, so no graph deadlocks whatever order TensorFlow picks
and however few threads it has (see its [Note: collects wait for every submit
they can]). Errors are Horovod's ``tf.errors`` classes.

Names (how ranks match their ops): eagerly, ``name`` or ``tf.<op>.noname.<n>``
(the n-th unnamed call of that op). In a graph, like Horovod's node names:
``name`` or ``Horovod<Op>_<input tensor name>``, inside the current name scope
(unless ``ignore_name_scope``) and made unique within the graph, so the names
agree on every rank that builds the same graph, whatever the build order of
explicitly named ops. A ``tf.function`` traced inside another prefixes its ops'
names with the path of function names (op_base [Note: names in nested functions]).

Gradients are Horovod 0.28's (``horovod/tensorflow/mpi_ops.py``):

* allreduce -> allreduce of the gradient with the same op and scale factors;
* allgather -> the average over ranks of the gradient, this rank's rows;
* broadcast -> the average over ranks on the root, zeros elsewhere;
* reducescatter -> allgather of the gradient (times the set size for Sum);
* alltoall -> alltoall back with the received splits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from unison.common.engine import frontend
from unison.common.engine.process_sets import ProcessSet, global_process_set, set_rank, set_size
from unison.common.ops import Average, ReduceOp, Sum, parse_op
from unison.tf_backend import host_ops
from unison.tf_backend.basics import is_adasum, process_set_by_id, reduce_op
from unison.tf_backend.compression import Compression
from unison.tf_backend.gather_ops import (  # noqa: F401 - re-exported
    _allgather,
    _root_in_set,
    allgather,
    alltoall,
    broadcast,
    grouped_allgather,
)
from unison.tf_backend.op_base import (  # noqa: F401 - _name, _op_name, _ps are used by sibling modules
    _REDUCIBLE,
    _allreduce,
    _check_bool_op,
    _check_dtype,
    _check_not_scalar,
    _empty_group,
    _name,
    _op_name,
    _ps,
    _refused,
    _rows_shape,
    _tensor,
    dense_gradient,
)

__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
           "reducescatter", "grouped_reducescatter", "join", "barrier", "size_op", "local_size_op",
           "rank_op", "local_rank_op", "process_set_included_op"]

def _parsed_op(parse: Callable[[], Any]) -> tuple[Any, Exception | None]:
    """``parse()``'s op and None; for a bad op, Sum (a stand-in) and the error, which the call's check raises
    so that it travels ([Note: a refusal travels]: raised here, on one rank, the others' call went unpaired)."""
    try:
        return parse(), None
    except ValueError as exc:
        return Sum, exc


def _raise(error: Exception | None) -> None:
    if error is not None:
        raise error


def _check_adasum(ps: ProcessSet | None) -> None:
    """Horovod's rules for op=Adasum on CPU: the global set, a power-of-two number of ranks.

    Raises:
        NotImplementedError: either rule is broken (Horovod's error type).
    """
    from unison.collectives import adasum

    if ps is not None:
        raise NotImplementedError("Adasum does not support non-global process sets yet (as in Horovod)")
    adasum.check_size(set_size(None))


def _engine_adasum(rop: Any) -> bool:
    """Whether ``rop`` is Adasum and the engine reduces it itself (then it goes the usual way)."""
    return is_adasum(rop) and rop is getattr(ReduceOp, "ADASUM", object())


def _adasum_eager(x: tf.Tensor, pre: float, post: float, ps: ProcessSet | None) -> tf.Tensor:
    """Horovod's Adasum on CPU tensors before the engine knows it (eager only)."""
    from unison.collectives import adasum

    _check_adasum(ps)
    if not tf.executing_eagerly():
        raise NotImplementedError("op=hvd.Adasum inside tf.function needs the engine's Adasum (pending); "
                                  "call it eagerly or use op=hvd.Average")
    return tf.convert_to_tensor(adasum.allreduce_direct(x.numpy(), pre, post).reshape(x.shape.as_list()))


def _allreduce_sparse(t: tf.IndexedSlices, rop: Any, pre: float, post: float, ps: ProcessSet | None,
                      ignore_name_scope: bool, bad_op: Exception | None = None) -> tf.IndexedSlices:
    """Horovod's IndexedSlices allreduce: two allgathers; Average divides the values by the size."""
    def check() -> None:
        _raise(bad_op)
        if is_adasum(rop):
            raise NotImplementedError("The Adasum reduction does not currently support sparse tensors; pass "
                                      "sparse_as_dense=True or reduce a dense tensor")
        if rop not in (Sum, Average):
            raise NotImplementedError(f"Only Sum and Average ops are supported with tf.IndexedSlices; got {rop!r}")

    def refuse(data: Any) -> Any:  # the others' first all-gather (of the values): it raises there, so they
        return frontend.allgather_async(  # make no second one
            data, _op_name("allgather", None, t.values, ignore_name_scope, ps), ps)

    _refused(check, refuse)  # [Note: a refusal travels]
    values = allgather(t.values, process_set=ps or global_process_set, ignore_name_scope=ignore_name_scope)
    indices = allgather(t.indices, process_set=ps or global_process_set, ignore_name_scope=ignore_name_scope)
    if pre != 1.0 or post != 1.0:  # after the gathers, as Horovod, so no peer is left waiting
        raise NotImplementedError(f"prescale_factor={pre} / postscale_factor={post} are not supported with "
                                  "tf.IndexedSlices (as in Horovod); scale the values yourself")
    if rop == Average:
        values = values / size_now(ps, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=t.dense_shape)


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None,
              process_set: ProcessSet | None = global_process_set, ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` over the ranks of ``process_set`` (default op Average); differentiable.

    ``tf.IndexedSlices`` are all-gathered (values and indices), as in Horovod.

    Raises:
        TypeError: a dtype the op does not take (bool with Average).
        NotImplementedError: IndexedSlices with an op other than Sum/Average or with scale factors.
    """
    rop, bad_op = _parsed_op(lambda: reduce_op(average, op))
    ps = _ps(process_set)
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, rop, prescale_factor, postscale_factor, ps, ignore_name_scope, bad_op)
    compression = compression or Compression.none
    x = _tensor(tensor)
    _refused(lambda: (_raise(bad_op), _check_dtype("allreduce", x, _REDUCIBLE),
                      _check_bool_op("allreduce", x, rop)),
             lambda data: frontend.allreduce_async(
                 data, Sum, _op_name("allreduce", name, x, ignore_name_scope, ps), process_set=ps))
    wire, ctx = compression.compress(x)
    if is_adasum(rop) and not _engine_adasum(rop):
        return compression.decompress(_adasum_eager(wire, prescale_factor, postscale_factor, ps), ctx)
    if _engine_adasum(rop):
        _check_adasum(ps)
    name = _op_name("allreduce", name, x, ignore_name_scope, ps)
    return compression.decompress(_allreduce(wire, rop, name, prescale_factor, postscale_factor, ps), ctx)


def _grouped_dense(xs: list[tf.Tensor], rop: Any, base: str, pre: float, post: float,
                   ps: ProcessSet | None) -> list[tf.Tensor]:
    @dense_gradient
    def reduce(*ts: tf.Tensor) -> Any:
        def submit(arrays: list[np.ndarray]) -> Any:
            return frontend.grouped_allreduce_async([host_ops.to_wire(a, True) for a in arrays], rop, base, pre,
                                                    post, ps)

        ys = host_ops.run_grouped(submit, ts, base)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            return _grouped_dense(list(dys), rop, _op_name("grouped_allreduce", base + "_grad", dys[0]), pre,
                                  post, ps)

        return ys, grad

    return list(reduce(*xs))


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, device_dense: str = "",
                      device_sparse: str = "", compression: Any = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet | None = global_process_set, ignore_name_scope: bool = False,
                      name: str | None = None) -> Any:
    """All-reduce several tensors as one group (one fused engine call); IndexedSlices may be mixed in.

    Returns ``tensors`` itself when it is empty, as Horovod.
    """
    rop, bad_op = _parsed_op(lambda: reduce_op(average, op))
    ps = _ps(process_set)
    if not tensors:
        _empty_group(lambda: frontend.grouped_allreduce_async(
            [], Sum, _op_name("grouped_allreduce", name, None, ignore_name_scope, ps), process_set=ps))
        return tensors
    out: list[Any] = [None] * len(tensors)
    sparse = [(i, t) for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [(i, _tensor(t)) for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse:
        def check_sparse() -> None:
            _raise(bad_op)
            _check_sparse(rop, prescale_factor, postscale_factor)

        def refuse_sparse(data: Any) -> Any:  # the others' first call: the values' grouped_allgather
            pset = _ps(ps or global_process_set)
            base = _op_name("grouped_allgather", None, sparse[0][1].values, ignore_name_scope, pset)
            members = [frontend.allgather_async(data, f"{base}.{i}", pset) for i in range(len(sparse))]
            return host_ops.Many([frontend.group_size_agreement(base, len(sparse), pset)] + members)

        # [Note: a refusal travels] (an op refused on one rank raised there alone: the others waited for ever in
        # the values' all-gather, before 2026-12-05)
        _refused(check_sparse, refuse_sparse)
        for (i, _), r in zip(sparse, _grouped_sparse([t for _, t in sparse], rop, prescale_factor,
                                                     postscale_factor, ps, ignore_name_scope), strict=True):
            out[i] = r
    if dense:
        compression = compression or Compression.none

        def check() -> None:
            _raise(bad_op)
            for _, x in dense:
                _check_dtype("grouped_allreduce", x, _REDUCIBLE)
                _check_bool_op("grouped_allreduce", x, rop)

        _refused(check, lambda data: frontend.grouped_allreduce_async(
            [data], Sum, _op_name("grouped_allreduce", name, dense[0][1], ignore_name_scope, ps),
            process_set=ps))  # [Note: a refusal travels]
        wires = [compression.compress(x) for _, x in dense]
        if is_adasum(rop) and not _engine_adasum(rop):
            reduced = [_adasum_eager(w, prescale_factor, postscale_factor, ps) for w, _ in wires]
        else:
            if _engine_adasum(rop):
                _check_adasum(ps)
            base = _op_name("grouped_allreduce", name, dense[0][1], ignore_name_scope, ps)
            reduced = _grouped_dense([w for w, _ in wires], rop, base, prescale_factor, postscale_factor, ps)
        for (i, _), r, (_, ctx) in zip(dense, reduced, wires, strict=True):
            out[i] = compression.decompress(r, ctx)
    return out


def _check_sparse(rop: Any, pre: float, post: float) -> None:
    """What a group with IndexedSlices refuses (as Horovod does), before anything is sent."""
    if is_adasum(rop):
        raise NotImplementedError("The Adasum reduction does not currently support sparse tensors; pass "
                                  "sparse_as_dense=True or reduce dense tensors")
    if rop not in (Sum, Average):
        raise NotImplementedError(f"Only Sum and Average ops are supported with tf.IndexedSlices; got {rop!r}")
    if pre != 1.0 or post != 1.0:
        raise NotImplementedError(f"prescale_factor={pre} / postscale_factor={post} are not supported with "
                                  "tf.IndexedSlices (as in Horovod); scale the values yourself")


def _grouped_sparse(slices: list[tf.IndexedSlices], rop: Any, pre: float, post: float,
                    ps: ProcessSet | None, ignore_name_scope: bool) -> list[tf.IndexedSlices]:
    pset = ps or global_process_set
    values = grouped_allgather([s.values for s in slices], process_set=pset, ignore_name_scope=ignore_name_scope)
    indices = grouped_allgather([s.indices for s in slices], process_set=pset,
                                ignore_name_scope=ignore_name_scope)
    if rop == Average:
        values = [v / size_now(ps, v.dtype) for v in values]
    return [tf.IndexedSlices(v, i, dense_shape=s.dense_shape) for v, i, s in zip(values, indices, slices,
                                                                                 strict=True)]


# ------------------------------------------------------------------------------- reducescatter
def _reducescatter(x: tf.Tensor, rop: Any, name: str, pre: float, post: float,
                   ps: ProcessSet | None) -> tf.Tensor:
    @dense_gradient
    def scatter(t: tf.Tensor) -> Any:
        def start(a: np.ndarray) -> Any:
            h = frontend.reducescatter_async(host_ops.to_wire(a, True), rop, name, pre, post, ps)
            return h, lambda r: [host_ops.from_wire(r, a.dtype).reshape((-1, *a.shape[1:]))]

        y = host_ops.run(start, [t], [t.dtype], [_rows_shape(t)], name)[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            if rop == Sum:
                dy = dy * size_now(ps, dy.dtype)
            return _allgather(dy, _op_name("allgather", name + "_grad", dy), ps, differentiable=False)

        return y, grad

    return scatter(x)


def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none, op: Any = Average,
                  name: str | None = None, process_set: ProcessSet | None = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce over the ranks, then keep this rank's rows of dimension 0 (Horovod's split); differentiable."""
    rop, bad_op = _parsed_op(lambda: parse_op(op))
    x = _tensor(tensor)
    ps = _ps(process_set)
    _refused(lambda: (_raise(bad_op), _check_dtype("reducescatter", x, _REDUCIBLE),
                      _check_bool_op("reducescatter", x, rop), _check_not_scalar("Reducescatter", x)),
             lambda data: frontend.reducescatter_async(data, Sum, _op_name("reducescatter", name, x,
                                                                           ignore_name_scope, ps),
                                                       process_set=ps))  # [Note: a refusal travels]
    compression = compression or Compression.none
    wire, ctx = compression.compress(x)
    name = _op_name("reducescatter", name, x, ignore_name_scope, _ps(process_set))
    return compression.decompress(_reducescatter(wire, rop, name, prescale_factor, postscale_factor,
                                                 _ps(process_set)), ctx)


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "", compression: Any = Compression.none,
                          op: Any = Average, process_set: ProcessSet | None = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    """Reduce-scatter several tensors as one group; differentiable. Empty input is returned as is."""
    if not tensors:
        _empty_group(lambda: frontend.group_size_agreement(
            _op_name("grouped_reducescatter", None, None, process_set=_ps(process_set)), 0, _ps(process_set),
            "reducescatter"))
        return tensors
    rop, bad_op = _parsed_op(lambda: parse_op(op))
    xs = [_tensor(t) for t in tensors]

    def check() -> None:
        _raise(bad_op)
        for x in xs:
            _check_dtype("grouped_reducescatter", x, _REDUCIBLE)
            _check_bool_op("grouped_reducescatter", x, rop)
            _check_not_scalar("GroupedReducescatter", x)

    def refuse(data: Any) -> Any:  # the others' calls: the group's count agreement, then each member's
        ps = _ps(process_set)
        base = _op_name("grouped_reducescatter", None, xs[0], process_set=ps)
        # (the count is this rank's real one, so that a count mismatch too settles every member: frontend
        # [Note: a longer group's extra members])
        return host_ops.Many([frontend.group_size_agreement(base, len(xs), ps, "reducescatter")]
                             + [frontend.reducescatter_async(data, Sum, f"{base}.{i}", process_set=ps)
                                for i in range(len(xs))])

    _refused(check, refuse)  # [Note: a refusal travels]
    compression = compression or Compression.none
    wires = [compression.compress(x) for x in xs]
    ps = _ps(process_set)
    base = _op_name("grouped_reducescatter", None, xs[0], process_set=ps)
    pre, post = prescale_factor, postscale_factor

    @dense_gradient
    def scatter(*ts: tf.Tensor) -> Any:
        def start(*arrays: np.ndarray) -> Any:
            hs = [frontend.group_size_agreement(base, len(arrays), ps, "reducescatter")]  # (waited first)
            hs += [frontend.reducescatter_async(host_ops.to_wire(a, True), rop, f"{base}.{i}", pre, post, ps)
                   for i, a in enumerate(arrays)]
            return host_ops.Many(hs), lambda rs: [host_ops.from_wire(r, a.dtype).reshape((-1, *a.shape[1:]))
                                          for r, a in zip(rs[1:], arrays, strict=True)]

        ys = host_ops.run(start, list(ts), [t.dtype for t in ts], [_rows_shape(t) for t in ts], base)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            return [_allgather(dy * size_now(ps, dy.dtype) if rop == Sum else dy,
                               _op_name("allgather", f"{base}.{i}_grad", dy), ps, differentiable=False)
                    for i, dy in enumerate(dys)]

        return ys, grad

    reduced = scatter(*[w for w, _ in wires])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, wires, strict=True)]


# ------------------------------------------------------------------------------- join, queries
def join() -> tf.Tensor:
    """Contribute identity values until every rank joins; the last rank to join (an int32 scalar tensor)."""
    if tf.executing_eagerly():
        return tf.constant(frontend.join(), dtype=tf.int32)
    # (one element, reshaped in the graph: host_ops [Note: a callback's key is not 0-d])
    last = tf.numpy_function(lambda: np.array([frontend.join()], np.int32), [], tf.int32, stateful=True)
    return tf.reshape(last, [])


def barrier(process_set: ProcessSet | None = global_process_set) -> tf.Tensor | None:
    """Wait until every rank of the set arrives (not in ``horovod.tensorflow``: Unison's addition).

    Eagerly it waits and returns None. In a graph (``tf.function``, TF1) it is an op that waits each time
    it runs, returned as an int32 scalar (0) for a TF1 session to run; a ``tf.function`` runs it in
    program order as any stateful op. (Before 2026-12-05 it waited once, while tracing, and the graph held
    nothing: later calls did not wait, and a rank that retraced alone paired its trace's barrier with a
    peer's real one.)
    """
    ps = _ps(process_set)
    if tf.executing_eagerly():
        frontend.barrier(ps)
        return None

    def wait() -> np.ndarray:
        frontend.barrier(ps)
        return np.zeros(1, np.int32)  # (not 0-d: host_ops [Note: a callback's key is not 0-d])

    return tf.reshape(tf.numpy_function(wait, [], tf.int32, stateful=True, name="UnisonBarrier"), [])


def _set_of(process_set: Any) -> ProcessSet | None:
    if isinstance(process_set, ProcessSet):
        return _ps(process_set)
    return _ps(process_set_by_id(int(process_set or 0)))


def _query_op(value: Callable[[], int], name: str | None) -> tf.Tensor:
    """An int32 scalar read when it runs, as Horovod's query ops: eagerly at once; in a graph
    each time the graph runs (a graph may be built before ``init()``, or run after a re-init)."""
    if tf.executing_eagerly():
        return tf.constant(value(), dtype=tf.int32, name=name)
    out = tf.numpy_function(lambda: np.array([value()], np.int32), [], tf.int32, stateful=True,
                            name=name or "unison_query")
    return tf.reshape(out, [])  # (one element from the callback: host_ops [Note: a callback's key is not 0-d])


def size_op(process_set_id: Any = 0, name: str | None = None) -> tf.Tensor:
    """The number of ranks (of the process set with this id, or a ProcessSet), as an int32 tensor."""
    return _query_op(lambda: set_size(_set_of(process_set_id)), name)


def size_now(process_set: ProcessSet | None, dtype: Any) -> tf.Tensor:
    """The size of ``process_set`` (None: every rank) as a ``dtype`` scalar read when the op runs: at once
    eagerly, at each run of a traced function.

    For the averages and scalings computed outside the engine (gathered ``IndexedSlices``, a reduce-scatter's
    gradient): a size read while tracing was a constant of the function, so after an elastic reset changed the
    number of ranks a user's ``tf.function`` step kept dividing by the old one (3 -> 2 ranks: sparse gradients
    scaled by 2/3, silently, before 2026-12-05), where Horovod reads ``size_op()`` at run time.
    """
    return tf.cast(size_op(process_set if process_set is not None else 0), dtype)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of ranks on this host, as an int32 tensor."""
    from unison.common import runtime

    return _query_op(runtime.local_size, name)


def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank, as an int32 tensor (a ProcessSet as ``name``: its rank in that set)."""
    if isinstance(name, ProcessSet):
        ps = name
        return _query_op(lambda: set_rank(_ps(ps)), None)
    return _query_op(lambda: set_rank(None), name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank on its host, as an int32 tensor (Horovod 0.28 returns the global rank: a bug)."""
    from unison.common import runtime

    return _query_op(runtime.local_rank, name)


def process_set_included_op(process_set_id: Any = 0, name: str | None = None) -> tf.Tensor:
    """1 if this process belongs to the process set, else 0 (an int32 tensor).

    Raises:
        ValueError: no registered process set has this id (eagerly at once; in a graph when it runs).
    """
    def included() -> int:
        ps = process_set_id if isinstance(process_set_id, ProcessSet) else process_set_by_id(int(process_set_id))
        return int(ps.included())
    return _query_op(included, name)

