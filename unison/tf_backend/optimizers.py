"""``horovod.tensorflow.DistributedOptimizer``: Horovod's checks, then the Keras wrapper.

Horovod's TensorFlow ``DistributedOptimizer`` wraps a TF1 ``tf.compat.v1.train.Optimizer``
itself and hands Keras optimizers to ``horovod.tensorflow.keras.DistributedOptimizer``.
TensorFlow 2.21 with Keras 3 trains with Keras optimizers, so ours validates the
arguments as Horovod does and delegates to ``unison.tf_backend.keras``; TF1 optimizers
(graph-and-session training) are refused with a clear error.
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
        raise NotImplementedError("TF1 optimizers (tf.compat.v1.train.Optimizer) are not supported; use a "
                                  "Keras optimizer (keras.optimizers.*) or hvd.DistributedGradientTape")
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
