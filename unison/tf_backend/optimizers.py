"""``horovod.tensorflow.DistributedOptimizer``: Horovod's checks, then the Keras wrapper.

Horovod's TensorFlow ``DistributedOptimizer`` wraps a TF1 ``tf.compat.v1.train.Optimizer``
itself and hands Keras optimizers to ``horovod.tensorflow.keras.DistributedOptimizer``.
TensorFlow 2.21 with Keras 3 trains with Keras optimizers, so ours validates the
arguments as Horovod does and delegates Keras optimizers to ``unison.tf_backend.keras``;
a TF1 optimizer (graph-and-session training) is wrapped by :class:`_DistributedTF1Optimizer`,
whose ``compute_gradients`` all-reduces the gradients as one group.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import tensorflow as tf

from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.ops import Average
from unison.tf_backend.basics import is_adasum
from unison.tf_backend.compression import Compression

__all__ = ["DistributedOptimizer"]

_DEFAULTS = {"device_dense": "", "device_sparse": "", "average_aggregated_gradients": False,
             "scale_local_gradients": True, "groups": None}


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False,  # noqa: N802
                         device_dense: str = "", device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None,
                         process_set: ProcessSet | None = global_process_set,
                         scale_local_gradients: bool = True, zero_stage: int = 0) -> Any:
    """Wrap ``optimizer`` so gradients are averaged over the ranks before each update.

    Raises:
        ValueError: Horovod's argument errors (predivide factor with an op other than
            Average, Adasum with aggregated-gradient averaging or with Keras, bad
            ``groups``, an object that is no optimizer), or a bad ``zero_stage`` (see the
            Keras ``DistributedOptimizer``).
        NotImplementedError: a TF1 ``tf.compat.v1.train.Optimizer``, or an option the
            Keras wrapper does not offer yet.
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError(f"gradient_predivide_factor not supported with op != Average (got op={op!r})")
    if is_adasum(op) and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups`", DeprecationWarning, stacklevel=2)
        groups = num_groups if groups is None else groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError(f"groups should be a non-negative integer or a list of list of tf.Variable; "
                         f"got {groups!r}")
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        refused = {"backward_passes_per_step": backward_passes_per_step != 1, "op=Adasum": is_adasum(op),
                   "zero_stage": zero_stage != 0, "average_aggregated_gradients": average_aggregated_gradients}
        if any(refused.values()):
            raise NotImplementedError(f"DistributedOptimizer options {[k for k, v in refused.items() if v]} are "
                                      "not supported for TF1 optimizers; leave them at their defaults, or "
                                      "train with a Keras optimizer")
        return _DistributedTF1Optimizer(optimizer, name, use_locking, compression, sparse_as_dense, op,
                                        gradient_predivide_factor, process_set)
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"Provided optimizer doesn't inherit from either legacy TensorFlow or Keras "
                         f"optimizer: {optimizer!r}")
    if is_adasum(op):
        raise ValueError("op == Adasum is not supported yet with Keras")
    from unison.tf_backend.keras.optimizer import DistributedOptimizer as keras_wrapper

    given = {"name": name, "op": op, "device_dense": device_dense, "device_sparse": device_sparse,
             "compression": compression, "sparse_as_dense": sparse_as_dense,
             "gradient_predivide_factor": gradient_predivide_factor,
             "backward_passes_per_step": backward_passes_per_step,
             "average_aggregated_gradients": average_aggregated_gradients, "groups": groups,
             "process_set": process_set, "scale_local_gradients": scale_local_gradients,
             "zero_stage": zero_stage}
    accepted = inspect.signature(keras_wrapper).parameters
    unsupported = [k for k, v in given.items() if k not in accepted and _DEFAULTS.get(k, v) != v]
    if unsupported:
        raise NotImplementedError(f"DistributedOptimizer options {unsupported} are not supported yet for "
                                  "Keras optimizers; leave them at their defaults")
    return keras_wrapper(optimizer, **{k: v for k, v in given.items() if k in accepted})


class _DistributedTF1Optimizer(tf.compat.v1.train.Optimizer):
    """A TF1 optimizer whose gradients are all-reduced over the ranks before it applies them.

    ``compute_gradients`` hands every gradient (dense, or ``tf.IndexedSlices``, which are
    all-gathered unless ``sparse_as_dense``) to one ``grouped_allreduce``: one request for the
    whole step, so no order of the graph's ops can deadlock the ranks. Everything else is the
    wrapped optimizer's.
    """

    def __init__(self, optimizer: Any, name: str | None, use_locking: bool, compression: Any,
                 sparse_as_dense: bool, op: Any, predivide: float, process_set: ProcessSet | None) -> None:
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)
        self._optimizer = optimizer
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = op
        self._predivide = predivide
        self._process_set = process_set

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        from unison.tf_backend.mpi_ops import grouped_allreduce

        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        present = [i for i, (g, _) in enumerate(pairs) if g is not None]
        if not present:
            return pairs
        grads = [pairs[i][0] for i in present]
        if self._sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        # the predivide factor scales dense gradients before the sum and back after it (the same
        # average, a smaller range on the wire); IndexedSlices are gathered, so there is no sum to scale
        sparse = [k for k, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        dense = [k for k, g in enumerate(grads) if not isinstance(g, tf.IndexedSlices)]
        scale = {} if self._predivide == 1.0 else {"prescale_factor": 1.0 / self._predivide,
                                                   "postscale_factor": self._predivide}
        reduced: list[Any] = [None] * len(grads)
        for members, kwargs, tag in ((dense, scale, "allreduce"), (sparse, {}, "allreduce_sparse")):
            if members:
                outs = grouped_allreduce([grads[k] for k in members], op=self._op, compression=self._compression,
                                         process_set=self._process_set, name=f"{self._name}_{tag}", **kwargs)
                for k, g in zip(members, outs, strict=True):
                    reduced[k] = g
        out = list(pairs)
        for i, g in zip(present, reduced, strict=True):
            out[i] = (g, pairs[i][1])
        return out

    def apply_gradients(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)
