"""What every TensorFlow collective op shares: names, dtype checks, static shapes, the dense allreduce.

See :mod:`unison.tf_backend.mpi_ops` for how names are chosen and which
gradients the ops have.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.framework.func_graph import FuncGraph
from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph

from unison.common.engine import frontend
from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.ops import Average
from unison.tf_backend import host_ops

__all__: list[str] = []

_MOVABLE = frozenset({tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16,
                      tf.float32, tf.float64, tf.bool})
_REDUCIBLE = _MOVABLE


def _name(kind: str, name: str | None, process_set: ProcessSet | None = None) -> str:
    """An eager-style engine name: ``name``, or the next ``tf.<kind>.noname.<n>`` (counted per
    process set: frontend [Note: a counter per process set])."""
    return frontend._auto_name(f"tf.{kind}", name, process_set)


def _op_name(kind: str, name: str | None, tensor: Any, ignore_name_scope: bool = False,
             process_set: ProcessSet | None = None) -> str:
    """The engine name of an op built now (see the module docstring)."""
    if tf.executing_eagerly():
        return _name(kind, name, process_set)
    if name is None:
        base = getattr(tensor, "name", None) or kind
        name = f"Horovod{kind.capitalize()}_{host_ops._op_name(base)}"
    graph = tf.compat.v1.get_default_graph()
    unique = graph.unique_name(str(name))
    return _function_path(graph) + (unique.rsplit("/", 1)[-1] if ignore_name_scope else unique)


def call_name(base: str) -> str:
    """The engine name of one reduction built now under the fixed name ``base``: ``base`` itself when
    eager (each call completes before the next starts), and ``base`` made unique in the graph being
    traced otherwise, so that two calls in one ``tf.function`` (a persistent tape's second
    ``gradient()``, a second ``apply_gradients``) are two collectives and not one name in flight
    twice, which the ranks could pair the wrong way (seen: each rank averaged one call's gradients
    with another's). The names depend only on the graph, so a rank that retraces alone gets the
    same ones as the others."""
    if tf.executing_eagerly():
        return base
    graph = tf.compat.v1.get_default_graph()
    return _function_path(graph) + graph.unique_name(base)


def _function_path(graph: Any) -> str:
    """``"outer_fn/inner_fn/"`` for a function traced inside another; empty otherwise.

    [Note: names in nested functions] Names are made unique per graph, and a ``tf.function``
    called inside another has a graph of its own: ``HorovodAllreduce_x_0`` in both, two independent
    collectives in flight at once under one name (a duplicate-name error on every rank). So
    a nested function's ops carry the path of function names from the outermost one (left out, so
    that a single function's names stay Horovod's). The names are the Python functions'; the
    number TensorFlow appends to the graphs it makes itself (``__backward_helper_263``) counts
    functions made by this process and could differ between ranks, so it is dropped (from every
    name); a ``tf.cond`` or loop body, whose graph is named by such a counter alone, adds nothing.
    """
    parts = []
    while isinstance(graph, FuncGraph) and isinstance(getattr(graph, "outer_graph", None), FuncGraph):
        if not isinstance(graph, ControlFlowFuncGraph):  # (a tf.cond or while body: named by a process
            # counter, ``cond_true_12``, which differs between ranks that traced other code before)
            parts.append(host_ops._op_name(re.sub(r"_\d+$", "", str(graph.name))))
        graph = graph.outer_graph
    return "".join(f"{part}/" for part in reversed(parts))


def traced_function_path(graph: Any) -> str:
    """``"outermost_fn/inner_fn"``: every function being traced into ``graph``, the outermost included
    (``_function_path`` leaves it out of names); empty outside functions (eager, a TF1 graph).

    It tells one traced function from another where the names made by :func:`call_name` do not (the
    first tape of every function is ``DistributedGradientTape``), and is the same for a retrace of the
    same function. Only the counter of a graph TensorFlow makes itself (``__backward_f_263``, which a
    retrace moves on) is dropped: a Python function's name stays whole (``step_1`` is not ``step_2``).
    Two ``tf.function`` objects whose Python functions share a name (``step`` from a factory) share a
    path: the graph does not say which object it belongs to (known, 2026-12-05; give them names of
    their own where their tapes' None gradients differ between ranks)."""
    parts = []
    while isinstance(graph, FuncGraph):
        if not isinstance(graph, ControlFlowFuncGraph):  # (a tf.cond or loop body: see _function_path)
            name = str(graph.name)
            parts.append(re.sub(r"_\d+$", "", name) if name.startswith("__") else name)
        graph = getattr(graph, "outer_graph", None)
    return "/".join(reversed(parts))


def _ps(process_set: ProcessSet | None) -> ProcessSet | None:
    return None if process_set is None or process_set is global_process_set else process_set


def _check_dtype(kind: str, t: tf.Tensor, allowed: frozenset) -> None:
    if t.dtype not in allowed:
        names = ", ".join(sorted(d.name for d in allowed))
        raise TypeError(f"hvd.{kind} does not take {t.dtype.name} tensors; supported dtypes: {names}. "
                        "Cast the tensor first")


def dense_gradient(f: Callable[..., Any]) -> Callable[..., Any]:
    """``tf.custom_gradient``, with the incoming gradients made dense before ``f``'s gradient function
    sees them.

    A ``tf.gather`` (an embedding lookup) of an op's output sends back a ``tf.IndexedSlices``, which
    the gradient functions would hand on to a collective or to a nested ``tf.custom_gradient``, and
    both take tensors only (eagerly an ``AttributeError``, in a graph a ``TypeError``). Horovod's
    kernels take the dense form as well.
    """
    def forward(*args: Any, **kwargs: Any) -> Any:
        out, grad = f(*args, **kwargs)

        def dense_grad(*dys: Any) -> Any:
            return grad(*(tf.convert_to_tensor(dy) if isinstance(dy, tf.IndexedSlices) else dy for dy in dys))
        return out, dense_grad

    forward.__name__ = forward.__qualname__ = getattr(f, "__name__", "forward")
    return tf.custom_gradient(forward)


def _tensor(value: Any) -> tf.Tensor:
    return value if isinstance(value, tf.Tensor) else tf.convert_to_tensor(value)


def _rows_shape(t: tf.Tensor) -> tf.TensorShape:
    """The static shape of an allgather/alltoall/reducescatter result: unknown first dimension."""
    return tf.TensorShape([None]).concatenate(t.shape[1:]) if t.shape.rank else tf.TensorShape(None)


# ------------------------------------------------------------------------------- allreduce
def _allreduce(x: tf.Tensor, rop: Any, name: str, pre: float, post: float,
               ps: ProcessSet | None) -> tf.Tensor:
    @dense_gradient
    def reduce(t: tf.Tensor) -> Any:
        def start(a: np.ndarray) -> Any:
            h = frontend.allreduce_async(host_ops.to_wire(a, True), rop, name, pre, post, ps)
            return h, lambda r: [host_ops.from_wire(r, a.dtype).reshape(a.shape)]

        y = host_ops.run(start, [t], [t.dtype], [t.shape], name)[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            return _allreduce(dy, rop, _op_name("allreduce", name + "_grad", dy), pre, post, ps)

        return y, grad

    return reduce(x)


def _refused(check: Callable[[], None], submit: Callable[[Any], Any]) -> None:
    """Run ``check``; when it raises, submit the error in place of this rank's data and raise it.

    [Note: a refusal travels] An argument check of one rank (a dtype, a scalar, an op, splits) that
    raised before anything was submitted left the other ranks' matching call unpaired: they waited for
    ever, or their unnamed call paired with this rank's next one and returned another step's data.
    ``submit(frontend.Refused(error))`` submits the call under the name the other ranks use, so their
    call raises the engine's error naming this rank, and this rank raises its own. Eagerly only: while a
    ``tf.function`` is traced the error is raised at once, as before (the trace fails, and the uncaught
    error ends the job): a collective at trace time can meet no run of the others' graph whose op was
    named after another input, waits for ever when the op's input comes from an earlier collective of
    the same function, and for ever again for a trace that never runs (found by a review, 2026-12-05).
    A job of size 1 just raises.
    """
    try:
        check()
    except (TypeError, ValueError, NotImplementedError, tf.errors.OpError) as exc:
        if tf.executing_eagerly() and frontend.running_engine() is not None:
            refusal = exc if isinstance(exc, (TypeError, ValueError)) else ValueError(str(exc))
            try:
                submit(frontend.Refused(refusal)).wait()
            except Exception:  # noqa: BLE001,S110 - the same refusal in the engine's words; this rank raises its own
                pass
        raise


def _empty_group(submit: Callable[[], Any]) -> None:
    """An empty group, eagerly: ``submit()`` the call the other ranks make first (it pairs with theirs: a
    mismatch error on every rank when theirs is not empty). Returned at once on one rank, it left the others'
    call unpaired, a hang, or their next unnamed call paired with it (found by an audit, 2026-12-05). In a
    graph an empty group builds nothing, as before."""
    if tf.executing_eagerly() and frontend.running_engine() is not None:
        submit().wait()


def _check_bool_op(kind: str, x: tf.Tensor, rop: Any) -> None:
    if x.dtype == tf.bool and rop == Average:
        raise TypeError(f"hvd.{kind} of a bool tensor needs op=hvd.Sum/Max (logical or) or hvd.Min/Product "
                        "(logical and); Average is not defined for bool")


def _check_not_scalar(kind: str, x: tf.Tensor) -> None:
    if x.shape.rank == 0:
        msg = f"Horovod{kind} does not support scalar inputs; reshape to [1] or use allreduce"
        if tf.executing_eagerly():
            raise tf.errors.InvalidArgumentError(None, None, msg)
        raise ValueError(msg)
