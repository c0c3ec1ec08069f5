"""Horovod's in-place and object broadcasts for TensorFlow: ``broadcast_``, ``broadcast_global_variables``,
``broadcast_object``, ``broadcast_object_fn`` and ``allgather_object`` with Horovod's signatures.

``broadcast_(variables, root_rank)`` assigns the root's values to the variables
(eagerly or inside ``tf.function``) and returns their new values, as Horovod's
in-place kernel does; every variable's broadcast is its own non-blocking op, so
a list of any length cannot deadlock. Objects travel pickled (see
``unison.common.engine.objects``); ``root_rank`` is a global rank, as in Horovod.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from unison.common.engine import objects
from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.tf_backend.mpi_ops import _ps, broadcast

__all__ = ["broadcast_", "broadcast_global_variables", "BroadcastGlobalVariablesHook", "broadcast_object",
           "broadcast_object_fn", "allgather_object"]


def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: ProcessSet | None = global_process_set) -> list[tf.Tensor]:
    """Assign ``root_rank``'s values to ``variables`` in place; returns their updated values.

    Raises:
        ValueError: resource and reference variables are mixed (Horovod's rule).
    """
    variables = list(variables)
    kinds = {resource_variable_ops.is_resource_variable(v) for v in variables}
    if len(kinds) > 1:
        raise ValueError("All variables passed to broadcast_() should be of the same kind, resource or "
                         "reference")
    out = []
    for v in variables:
        vname = f"{name}_{v.name}" if name is not None else None
        value = broadcast(v, root_rank, name=vname, process_set=process_set)
        out.append(v.assign(value) if tf.executing_eagerly() else _assigned(v, value))
    return [tf.convert_to_tensor(v) if tf.executing_eagerly() else o for v, o in zip(variables, out,
                                                                                      strict=True)]


def _assigned(var: Any, value: tf.Tensor) -> tf.Tensor:
    with tf.control_dependencies([var.assign(value)]):
        if hasattr(var, "read_value"):
            return var.read_value()
        # a Keras 3 variable has no read_value (its assign returns the value given, not an op: in a
        # tf.function the automatic control dependencies order the read after the assign)
        return tf.identity(tf.convert_to_tensor(var))


def broadcast_global_variables(root_rank: int) -> Any:
    """Broadcast ``tf.compat.v1.global_variables()`` from ``root_rank`` (TF1 graphs only, as Horovod).

    Raises:
        RuntimeError: called eagerly (Horovod's error: use ``broadcast_variables`` instead).
    """
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    from unison.tf_backend.functions import broadcast_variables

    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcast ``root_rank``'s global variables once the session is made (or its model restored).

    Horovod's hook for ``tf.compat.v1.train.MonitoredTrainingSession``. Horovod 0.28 defines it
    only where ``tf.estimator`` or TF1's ``tf.train.SessionRunHook`` exists, neither of which
    TensorFlow 2.16+ has; TF1's hook class still lives in ``tf.compat.v1``, so it is here.
    ``device`` is accepted for Horovod's signature (this library reduces on the host).
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op: Any = None

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: ProcessSet | None = global_process_set) -> Any:
    """``root_rank``'s ``obj`` on every rank of the set (``session`` is accepted for Horovod's signature)."""
    ps = _ps(process_set)
    return objects.broadcast_object(obj, root_rank, name, ps)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet | None = global_process_set) -> Callable[[Any], Any]:
    """A function that broadcasts its argument from ``root_rank`` (Horovod's ``broadcast_object_fn``)."""
    def fn(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, session, name, process_set)

    return fn


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet | None = global_process_set) -> list:
    """Every rank's ``obj`` in rank order (``session`` is accepted for Horovod's signature)."""
    return objects.allgather_object(obj, name, _ps(process_set))
