"""Collectives as TensorFlow ops that no graph can deadlock: a submit and a collect per op.

Why not one blocking host callback per op: a ``tf.numpy_function`` that waits for
its collective holds a TensorFlow inter-op thread. Build twenty independent
``allreduce`` ops into one ``tf.function`` and evaluate them at once (Horovod
fuses exactly such graphs): rank 0's only thread blocks inside op 3 while rank 1's
blocks inside op 17, each waiting for a peer that never submits. Horovod avoids it
with asynchronous C++ kernels; we have host callbacks, so (as UnisonStrategy does,
see ``strategy.py``) every op is split in two:

* **submit** (``_submit``): hands the arrays to the engine and returns at once
  with a key. It is stateful but marked to run independently of tf.function's
  program-order chain of stateful ops, so it runs as soon as its inputs exist.
* **collect** (``_collect``): waits for the key's result. Collects stay in the
  program-order chain.

[Note: collects wait for every submit they can]
A submit alone is not enough: with one inter-op thread, TensorFlow runs a
collect as soon as its own submit finished, before other ready submits, and
blocks. So when a submit S is built, every earlier collect C of the same graph
that S cannot depend on gets a control input from S: no collect starts while a
submit it could wait for has not run. (Older submits come first anyway: each
submit's collect is built right after it, and collects run in program order; in
a graph without that chain, a TF1 graph, each collect gets them as control
inputs, as far as a session's run allows: [Note: TF1 graphs: which submits a
collect waits for].)

"Cannot depend" must hold in the final graph, after tf.function's automatic
control dependencies (ACD) add their edges, which do not exist yet when S is
built: stateful ops without resource inputs are chained in program order (so
such an op may wait for any older op, C included), and a resource's users are
ordered after its older users. ``_taint(op)`` is the
newest chained op among op and everything it waits for, following the resource
rule too; S can come to wait for C only if ``_taint(S)`` is C or newer, so S gets
the edge to C only when ``_taint(S) < C``'s id, which also rules out cycles.
(Conservative: a submit fed by a stateful op created after C is not waited for,
so with fewer inter-op threads than such collects a graph could still stall;
tests/mpi/mpi_tf_parity.py covers the usual shapes: independent ops, chains,
variable writes then reads, gradients.)

Errors are raised as the ``tf.errors`` class Horovod's kernels report: ranks
that disagree (shape, dtype, root, op) -> ``FailedPreconditionError``, a bad
argument -> ``InvalidArgumentError``; eagerly and in graphs alike (see
:func:`to_tf_error`).

[Note: error classes from graphs]
A host callback cannot choose its op's status code: TensorFlow turns any
exception but ValueError/TypeError (InvalidArgument), NotImplementedError,
IndexError/StopIteration and MemoryError into ``UnknownError``. So in a graph the
collect raises :class:`_GraphOpError`, whose message ends with a marker naming
the wanted code, and :func:`_unknown_error_init` (installed as
``tf.errors.UnknownError.__init__``, which every path that reports a failed op
calls, from C++ or Python) turns such an ``UnknownError`` into the class the
marker names, without the marker. Other errors are untouched.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import errors_impl
from tensorflow.python.ops import control_flow_util

from unison.common.dtypes import dtype_code
from unison.common.engine import engine as _engine_errors
from unison.common.engine.engine import DuplicateNameError, ShutdownError
from unison.common.engine.executor import DIRECT_BYTES
from unison.common.engine.handles import wait_all
from unison.common.exceptions import CollectiveError, InvalidArgumentError, NotInitializedError

__all__ = ["refuse_xla", "run", "run_grouped", "Many", "to_tf_error", "to_wire", "from_wire"]

#: ``start(*arrays) -> (handle, finish)``; ``finish(result) -> list of output arrays``
Start = Callable[..., tuple[Any, Callable[[Any], list[np.ndarray]]]]

_lock = threading.Lock()  # callbacks run on several TensorFlow threads
_pending: dict[int, tuple[Any, Callable[[Any], list[np.ndarray]] | None, BaseException | None]] = {}
_keys = itertools.count(1)
_collects: weakref.WeakKeyDictionary[Any, list[str]] = weakref.WeakKeyDictionary()  # names: an op would keep
# its graph alive (a value of a WeakKeyDictionary that refers to its key keeps the key)
_taints: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
_submits: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
_needs: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
_bits: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
_groups: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_slots: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
_local = threading.local()


# ----------------------------------------------------------------------------- errors
def to_tf_error(exc: BaseException) -> tf.errors.OpError:
    """The ``tf.errors`` exception Horovod's kernel reports for ``exc``.

    Horovod reports every error the coordinator finds across ranks (mismatched
    shapes, dtypes, roots, ops, a broadcast or allgather while a rank joined) as
    ``FailedPreconditionError``; argument errors found locally as
    ``InvalidArgumentError``. A Unison exception comes back as an instance of both
    classes (``except hvd.MismatchError`` keeps working).
    """
    if isinstance(exc, tf.errors.OpError):
        return exc
    join_error = getattr(_engine_errors, "JoinError", ())
    if isinstance(exc, join_error):
        cls: type[tf.errors.OpError] = tf.errors.FailedPreconditionError
    elif isinstance(exc, (InvalidArgumentError, CollectiveError, DuplicateNameError)):
        cls = tf.errors.InvalidArgumentError
    elif isinstance(exc, NotInitializedError):
        cls = tf.errors.FailedPreconditionError
    elif isinstance(exc, ShutdownError):
        cls = tf.errors.UnknownError
    elif isinstance(exc, (ValueError, TypeError)) and not _is_unison(exc):
        cls = tf.errors.InvalidArgumentError
    else:  # MismatchError and the engine's other cross-rank refusals
        cls = tf.errors.FailedPreconditionError
    if _is_unison(exc):
        return _both(cls, type(exc))(None, None, str(exc))
    return cls(None, None, str(exc))


_combined: dict[tuple[type, type], type] = {}


def _both(tf_cls: type, unison_cls: type) -> type:
    """A class that is ``tf_cls`` and ``unison_cls`` at once (named like ``tf_cls``)."""
    key = (tf_cls, unison_cls)
    if key not in _combined:
        _combined[key] = type(tf_cls.__name__, (tf_cls, unison_cls),
                              {"__module__": tf_cls.__module__, "__doc__": tf_cls.__doc__,
                               "__init__": tf_cls.__init__, "__str__": tf_cls.__str__})
    return _combined[key]


def _is_unison(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("unison.")


_MARK = re.compile(r" \[unison-tf-error-code=(\d+)\]")


class _GraphOpError(Exception):
    """Raised in a graph's host callback: carries the ``tf.errors`` code to report (see the Note)."""

    def __init__(self, error: tf.errors.OpError) -> None:
        super().__init__(f"{error.message} [unison-tf-error-code={error.error_code}]")


_unknown_init = errors_impl.UnknownError.__init__


def _unknown_error_init(self: Any, *args: Any, **kwargs: Any) -> None:
    """``UnknownError.__init__``, turning a marked error into the class it names (see the Note)."""
    if type(self) in _made:  # created again by its class (a Session re-raises ``type(e)(node_def, op,
        errors_impl.OpError.__init__(self, *args, **kwargs)  # message)``): the class's own code is in args
        return
    _unknown_init(self, *args, **kwargs)
    found = _MARK.search(self._message or "")  # noqa: SLF001
    if found:
        code = int(found.group(1))
        self._message = self._message.replace(found.group(0), "")  # noqa: SLF001
        try:
            cls = _reported_class(code)
        except Exception:  # noqa: BLE001 - raised here it would replace the op's error: keep UnknownError
            return
        self._error_code = code  # noqa: SLF001
        self.__class__ = cls


_reported: dict[int, type] = {}
_made: set[type] = set()  # the classes _reported_class made


def _reported_class(code: int) -> type:
    """The class for code ``code``, also an UnknownError: Python's exception machinery created this
    exception as an UnknownError and insists it stays one."""
    if code not in _reported:
        base = errors_impl.exception_type_from_error_code(code)
        if issubclass(base, errors_impl.UnknownError):  # (a shut-down engine reports UnknownError,
            _reported[code] = base                       # as Horovod's SHUT_DOWN_ERROR: kept as it is)
        else:
            _reported[code] = type(base.__name__, (base, errors_impl.UnknownError),
                                   {"__module__": base.__module__, "__doc__": base.__doc__})
            _made.add(_reported[code])
    return _reported[code]


if errors_impl.UnknownError.__init__ is not _unknown_error_init and \
        getattr(errors_impl.UnknownError.__init__, "__name__", "") != "_unknown_error_init":
    errors_impl.UnknownError.__init__ = _unknown_error_init


# ----------------------------------------------------------------------------- autograph
def _leave_unison_unconverted() -> bool:
    """Make AutoGraph call Unison's functions as written inside a ``tf.function``.

    [Note: Unison's code is not AutoGraph's] AutoGraph rewrites every function a
    ``tf.function`` calls, nested closures included, unless its module is on the
    do-not-convert list (as ``numpy``, ``tensorflow`` and ``keras`` are). Our host
    callbacks are built inside such calls, so each of their Python calls went
    through ``converted_call`` at run time, once per tensor and step: measured,
    12 ms of a 1000-tensor ``grouped_allreduce``'s 14. Nothing in Unison relies on
    AutoGraph (our graph code is written with TensorFlow ops, as Keras's is), so
    ``unison`` joins that list, ahead of the rules TensorFlow ships.
    Returns whether the rule is in place (False if this TensorFlow lacks the table).
    """
    try:
        from tensorflow.python.autograph.core import config as ag_config
    except ImportError:  # a TensorFlow without AutoGraph's table: nothing to do
        return False
    rules = ag_config.CONVERSION_RULES
    if not any(getattr(r, "_prefix", None) == "unison" for r in rules):
        ag_config.CONVERSION_RULES = (ag_config.DoNotConvert("unison"), *rules)
    return True


AUTOGRAPH_EXCLUDED = _leave_unison_unconverted()


# ----------------------------------------------------------------------------- dtypes
_WIDE_UINT16 = dtype_code(np.dtype(np.uint16)) < 0


def to_wire(a: np.ndarray, arithmetic: bool) -> np.ndarray:
    """``a`` in a dtype the engine moves: uint16 (when the core lacks it) as int32 for
    arithmetic (exact for every op) or viewed as int16 for moving bits."""
    if _WIDE_UINT16 and a.dtype == np.uint16:
        return a.astype(np.int32) if arithmetic else a.view(np.int16)
    return a


def from_wire(r: Any, dtype: np.dtype) -> np.ndarray:
    """The engine's result ``r`` back in the caller's ``dtype`` (the inverse of :func:`to_wire`)."""
    r = np.asarray(r)
    if r.dtype == dtype:
        return r
    if dtype == np.uint16 and r.dtype == np.int16:
        return r.view(np.uint16)
    return r.astype(dtype)  # int32 -> uint16 wraps modulo 2**16, as uint16 arithmetic does


# ----------------------------------------------------------------------------- submit / collect
class Many:
    """Several engine handles waited on as one (a ``start`` may return it as its handle)."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def wait(self) -> list[Any]:
        return wait_all(self.handles)  # [Note: a group waits for all its members]


class _Slot:
    """One graph submit op's last submission, while its collect has not taken it."""

    __slots__ = ("key",)

    def __init__(self) -> None:
        self.key: int | None = None


def key_array(key: int) -> np.ndarray:
    """A submit callback's key as its output: an array of one element.

    [Note: a callback's key is not 0-d] TensorFlow 2.21 leaks about 32 bytes for every 0-d value a
    ``tf.numpy_function`` returns (an ``np.int64``, a 0-d array, a float: measured by an audit,
    2026-12-06, without Unison; an array of shape [1] stays flat), and every collective in a graph
    returned its key that way: 160 bytes a step for five collectives, for as long as the job ran.
    """
    return np.array([key], dtype=np.int64)


def scalars_as_one(shapes: Sequence[Any]) -> tuple[Callable[[list[np.ndarray]], list[np.ndarray]],
                                                    Callable[[list[tf.Tensor]], list[tf.Tensor]]]:
    """For a graph callback whose outputs have static ``shapes``: what the callback applies to its results
    (each output of static rank 0 leaves as one element) and what the graph applies to the callback's
    outputs (those reshaped back to 0-d), as [Note: a callback's key is not 0-d] asks of every value a
    callback returns each step (a scalar loss all-reduced in every step leaked 32 bytes a step)."""
    scalar = [tf.TensorShape(s).rank == 0 for s in shapes]

    def out(arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [np.reshape(a, (1,)) if zero else a for a, zero in zip(arrays, scalar, strict=True)]

    def back(tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        return [tf.reshape(t, []) if zero else t for t, zero in zip(tensors, scalar, strict=True)]

    return out, back


def key_of(key: Any) -> int:
    """The key a submit returned (:func:`key_array`; also a plain integer)."""
    return int(np.asarray(key).reshape(-1)[0])


def _submit(start: Start, *arrays: np.ndarray, slot: _Slot | None = None) -> np.ndarray:
    """Start a collective without waiting; returns the key :func:`_collect` takes.

    [Note: submits a session runs without their collects]
    In a TF1 graph a collect waits for other submits (the deadlock rule of the module
    docstring, within [Note: TF1 graphs: which submits a collect waits for]), so
    ``Session.run`` of one collective may also run the submits of others, whose
    collects it does not run: their results are never taken, and the next run
    submits the same names again. So a graph submit
    op keeps its last submission in ``slot``; if no collect took it when the op runs
    again, it is dropped (no entry is left behind, one per run) after waiting for it
    to finish: every rank submitted it in the same run, so it finishes, and the
    name is free again (submitted while still in flight, it was refused as a
    duplicate name on some ranks and waited for on the others, which then failed
    when those ranks shut down). The cost left is the traffic of those extra
    collectives (docs/horovod.md, TF1 graphs). What a slot holds when its graph is
    freed is dropped with it (though TensorFlow's registry of ``tf.custom_gradient``
    functions, which our differentiable ops use, keeps a TF1 graph alive for good).
    """
    if slot is not None and slot.key is not None:
        with _lock:
            old = _pending.pop(slot.key, None)
        slot.key = None
        if old is not None and old[0] is not None:
            try:
                old[0].wait()
            except Exception:  # noqa: BLE001 - nobody asked for its result (see the Note)
                pass
    try:
        handle, finish = start(*arrays)
        entry: tuple[Any, Any, BaseException | None] = (handle, finish, None)
    except Exception as exc:  # noqa: BLE001 - reported by the collect, in program order
        entry = (None, None, exc)
    with _lock:
        key = next(_keys)
        _pending[key] = entry
    if slot is not None:
        slot.key = key
    return key_array(key)


def _collect(key: Any, in_graph: bool = False) -> list[np.ndarray]:
    """Wait for the collective submitted under ``key``; its output arrays.

    Raises:
        tf.errors.OpError: eagerly, the class Horovod reports (:func:`to_tf_error`).
        _GraphOpError: ``in_graph``, the same, marked for :func:`_status_to_exception`.
    """
    key = key_of(key)
    with _lock:
        entry = _pending.pop(key, None)
    handle, finish, error = entry if entry is not None else (None, None, None)
    if entry is None:
        error = RuntimeError(f"collective {key} was submitted again before its result was read: "
                             "run a graph's collectives from one thread at a time")
    if error is None and finish is not None:
        try:
            return finish(handle.wait() if handle is not None else None)
        except Exception as exc:  # noqa: BLE001 - re-raised as the tf.errors class below
            error = exc
    error = error if error is not None else RuntimeError(f"collective {key} has no result")
    if not in_graph:
        raise to_tf_error(error) from error
    raise _GraphOpError(to_tf_error(error)) from error


def run(start: Start, inputs: Sequence[tf.Tensor], touts: Sequence[tf.DType],
        shapes: Sequence[Any], name: str = "unison") -> list[tf.Tensor]:
    """Run one collective: ``start`` on the inputs' arrays, outputs of dtypes ``touts``.

    Eagerly it submits and waits; in a graph it builds a submit and a collect op
    (see the module docstring). ``shapes`` are the outputs' static shapes.
    """
    if tf.executing_eagerly():
        outs = _collect(_submit(start, *[t.numpy() for t in inputs]))
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, touts, strict=True)]
    refuse_xla(name)
    op_name = _op_name(name)
    graph = tf.compat.v1.get_default_graph()
    tf1 = getattr(graph, "experimental_acd_manager", None) is None
    slot = _Slot() if tf1 else None  # (a tf.function runs every collect it submits)
    if slot is not None:
        _graph_slots(graph).append(slot)
    key = tf.numpy_function(lambda *a: _submit(start, *a, slot=slot), list(inputs), tf.int64, stateful=True,
                            name=f"{op_name}_submit")
    _mark_submit(key.op)
    one, back = scalars_as_one(shapes)
    outs = tf.numpy_function(lambda k: one(_collect(k, in_graph=True)), [key], list(touts), stateful=True,
                             name=f"{op_name}_collect")
    outs = back(list(outs) if isinstance(outs, (list, tuple)) else [outs])
    for o, s in zip(outs, shapes, strict=True):
        o.set_shape(s)
    if tf1:
        # no program-order chain (a TF1 graph): wait for the older submits too (they cannot depend on
        # it), those a run of this op can run at no cost ([Note: TF1 graphs: which submits a collect waits for])
        for name in _submits.get(key.graph, ()):
            if name != key.op.name:
                older = key.graph.get_operation_by_name(name)
                if _tf1_may_wait(key.op, older):
                    outs[0].op._add_control_input(older)  # noqa: SLF001
    _collects.setdefault(key.graph, []).append(outs[0].op.name)
    return list(outs)


def run_grouped(submit: Callable[[list[np.ndarray]], Any], inputs: Sequence[tf.Tensor],
                name: str) -> list[tf.Tensor]:
    """One grouped collective whose outputs have its inputs' dtypes and shapes (an all-reduce).

    ``submit(arrays)`` starts it on the inputs' arrays and returns a handle whose result
    is the list of output arrays, in order. Every output of a host callback costs
    TensorFlow about 10 us to adopt (measured: 1000 outputs 10 ms, one 4 MB output 1 ms), so
    members under ``DIRECT_BYTES`` with a static shape come back as one flat tensor per
    dtype, split in the graph: the engine packs exactly those members back to back in
    one pooled, aligned array (executor [Note: grouped requests]), which TensorFlow
    adopts without a copy; were they split across fusion buffers, they are copied into one.
    """
    packs: dict[tf.DType, list[int]] = {}
    for i, t in enumerate(inputs):
        if t.shape.is_fully_defined() and t.shape.num_elements() * t.dtype.size < DIRECT_BYTES:
            packs.setdefault(t.dtype, []).append(i)
    plan = [idx for idx in packs.values() if len(idx) > 1]
    packed = {i for idx in plan for i in idx}
    singles = [i for i in range(len(inputs)) if i not in packed]
    counts = {i: inputs[i].shape.num_elements() for i in packed}
    touts = [inputs[idx[0]].dtype for idx in plan] + [inputs[i].dtype for i in singles]
    shapes = [tf.TensorShape([sum(counts[i] for i in idx)]) for idx in plan] + [inputs[i].shape for i in singles]

    def start(*arrays: np.ndarray) -> Any:
        def finish(results: list[np.ndarray]) -> list[np.ndarray]:
            flats = dict(getattr(results, "packed", ()))  # the engine's packed arrays, by member indices
            outs = []
            for idx in plan:
                flat = flats.get(tuple(idx))
                if flat is None:  # packed otherwise (a smaller fusion threshold; a job of size 1)
                    flat = np.concatenate([results[i] for i in idx], axis=None)
                outs.append(from_wire(flat, arrays[idx[0]].dtype))
            return outs + [from_wire(results[i], arrays[i].dtype).reshape(arrays[i].shape) for i in singles]
        return submit(list(arrays)), finish

    outs = run(start, list(inputs), touts, shapes, name)
    ys: list[Any] = [None] * len(inputs)
    for idx, flat in zip(plan, outs, strict=False):
        for i, piece in zip(idx, tf.split(flat, [counts[i] for i in idx]), strict=True):
            ys[i] = piece if inputs[i].shape.rank == 1 else tf.reshape(piece, inputs[i].shape)
    for i, out in zip(singles, outs[len(plan):], strict=True):
        ys[i] = out
    return ys


def refuse_xla(what: str) -> None:
    """Raise a clear error when a collective is traced into an XLA-compiled function.

    Unison's collectives are host callbacks, which XLA cannot compile; without this the
    user gets an opaque "Graph execution error" at the first step. Keras's default
    ``jit_compile="auto"`` resolves to False on CPU, so only an explicit
    ``jit_compile=True`` (``model.compile`` or ``tf.function``) lands here.

    Raises:
        ValueError: the current graph is (inside) an XLA context.
    """
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(f"Unison collective {what!r} inside an XLA-compiled function (jit_compile=True): "
                         "its host callback cannot be compiled by XLA. Compile with jit_compile=False "
                         "(model.compile(..., jit_compile=False) or tf.function(jit_compile=False)); "
                         "Keras's default jit_compile='auto' is False on CPU")


def _op_name(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "_-" else "_" for c in name).lstrip("_-")
    return cleaned or "unison"


def _mark_submit(op: Any) -> None:
    """Free ``op`` from the stateful chain and make earlier collects wait for it (see the Note)."""
    graph = op.graph
    manager = getattr(graph, "experimental_acd_manager", None)
    if manager is not None:
        manager.run_independently(op)
    _submits.setdefault(graph, set()).add(op.name)
    _groups.setdefault(graph, {})[op.name] = getattr(_local, "group", None)
    collects = _collects.get(graph)
    if not collects:
        return
    taint = max([_taint(t.op) for t in op.inputs] + [_taint(c) for c in op.control_inputs] + [-1])
    for c in map(graph.get_operation_by_name, collects):
        if c._id > taint and (manager is not None or _tf1_may_wait(c.inputs[0].op, op)):  # noqa: SLF001
            c._add_control_input(op)  # noqa: SLF001 - (op ids grow with creation order)


# [Note: TF1 graphs: which submits a collect waits for]
# A TF1 session runs only what its fetches need, control inputs included. A collect made to
# wait for every other submit of the graph (the deadlock rule above) made a run of one
# collective run the others' submits and everything they need: a placeholder only they read
# had to be fed, an iterator only they read advanced (its element lost), a variable broadcast
# built beside the training op ran at every step, and edges into a v1 cond or while loop broke
# the graph. So in a TF1 graph the collect of submit S waits for another submit T only when a
# run of S already runs everything T needs that is not free: every placeholder and every
# stateful op among T's ancestors is among S's (constants and arithmetic on them are free), both
# are outside v1 control flow, and both were built in the same isolation group (the broadcasts
# of one broadcast_variables call are one group: they wait for each other, not for the
# training step's collectives, nor it for them). What such an edge still adds is a collective
# whose result nobody reads in that run (a metric's all-reduce, built from the loss, runs with
# the gradients'): traffic, nothing else ([Note: submits a session runs without their
# collects]). Collectives that need different placeholders or stateful ops and are run
# together no longer wait for each other: they are deadlock-free as long as the ranks build
# them in the same order or the session has an inter-op thread per collective that blocks.


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """Collectives built inside form their own group in a TF1 graph (see the Note)."""
    previous = getattr(_local, "group", None)
    _local.group = object()
    try:
        yield
    finally:
        _local.group = previous


def _tf1_may_wait(submit: Any, other: Any) -> bool:
    """Whether a collect whose submit is ``submit`` may wait for the submit ``other`` (see the Note)."""
    groups = _groups.get(submit.graph, {})
    if groups.get(submit.name) is not groups.get(other.name):
        return False
    if submit._get_control_flow_context() is not None or other._get_control_flow_context() is not None:  # noqa: SLF001
        return False
    return _input_needs(other) & ~_input_needs(submit) == 0


def _input_needs(op: Any) -> int:
    """The placeholders and stateful ops among ``op``'s ancestors, as a bit set over the graph
    (kept: a submit's inputs and control inputs never change after it is built)."""
    memo = _needs.setdefault(op.graph, {})
    key = op.name + ":inputs"
    if key not in memo:
        needs = 0
        for parent in [t.op for t in op.inputs] + list(op.control_inputs):
            needs |= _needs_of(parent)
        memo[key] = needs
    return memo[key]


def _needs_of(op: Any) -> int:
    """``op`` (when it is a placeholder or stateful) and the same of its ancestors, as a bit set."""
    memo = _needs.setdefault(op.graph, {})
    if op.name in memo:
        return memo[op.name]
    bits = _bits.setdefault(op.graph, {})
    stack = [(op, False)]
    while stack:
        node, expanded = stack.pop()
        if node.name in memo:
            continue
        parents = [t.op for t in node.inputs] + list(node.control_inputs)
        if not expanded:
            stack.append((node, True))
            stack.extend((p, False) for p in parents if p.name not in memo)
            continue
        own = 0
        if node._is_stateful or node.type in ("Placeholder", "PlaceholderWithDefault", "PlaceholderV2"):  # noqa: SLF001
            own = 1 << bits.setdefault(node.name, len(bits))
        for p in parents:
            own |= memo.get(p.name, 0)
        memo[node.name] = own
    return memo[op.name]


def _graph_slots(graph: Any) -> list[Any]:
    """The graph's submit slots; what they still hold is dropped when the graph is freed."""
    slots = _slots.get(graph)
    if slots is None:
        slots = _slots[graph] = []
        weakref.finalize(graph, _drop_slots, slots)
    return slots


def _drop_slots(slots: list[Any]) -> None:
    with _lock:
        for slot in slots:
            if slot.key is not None:
                _pending.pop(slot.key, None)


def _chained(op: Any) -> bool:
    """Whether automatic control dependencies chain ``op`` after every older stateful op without
    resources (stateful, no resource input, not one of our submits): it may wait for any older op."""
    if op.name in _submits.get(op.graph, ()):
        return False
    return bool(op._is_stateful) and not _resources(op)  # noqa: SLF001


def _resources(op: Any) -> list[Any]:
    return [t for t in op.inputs if t.dtype == tf.resource]


def _parents(op: Any) -> list[Any]:
    """The ops ``op`` waits for once automatic control dependencies are added (as far as they can be).

    Its inputs and control inputs, and for a resource user every older user of the same
    resource (ACD orders a resource's users after its last writer, and writers after reads).
    """
    parents = [t.op for t in op.inputs] + list(op.control_inputs)
    for handle in _resources(op):
        parents += [c for c in handle.consumers() if c._id < op._id]  # noqa: SLF001
    return [p for p in parents if p.graph is op.graph]


def _taint(op: Any) -> int:
    """The id of the newest op that is :func:`_chained` among ``op`` and what it waits for (-1: none).

    Ops created after a collect C can come to wait for C only through such an op (see the Note).
    """
    memo = _taints.setdefault(op.graph, {})
    if op.name in memo:
        return memo[op.name]
    stack = [(op, False)]
    while stack:
        node, expanded = stack.pop()
        if node.name in memo:
            continue
        parents = _parents(node)
        if not expanded:
            stack.append((node, True))
            stack.extend((p, False) for p in parents if p.name not in memo)
            continue
        own = node._id if _chained(node) else -1  # noqa: SLF001
        memo[node.name] = max([own] + [memo.get(p.name, -1) for p in parents])
    return memo[op.name]
