"""The Keras flavours of ``horovod.tensorflow.keras`` / ``horovod.keras``: value ops and ``load_model``.

Horovod's Keras modules take *values* (``allreduce(value, name=None, average=None,
...)``): the value becomes a ``tf.constant`` named ``name`` and goes through the
unnamed TensorFlow op; eagerly the result is a tf.Tensor. The positional order
differs from ``horovod.tensorflow`` (``name`` comes second), so
``unison.tf_backend.keras`` must export these, not the TensorFlow ones.

``load_model`` loads a Keras model and wraps its optimizer in
``DistributedOptimizer`` with the loaded optimizer state (iterations, slots), so
training resumes where it stopped, on every rank.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from unison.common.ops import Average
from unison.tf_backend import mpi_ops
from unison.tf_backend.compression import Compression

__all__ = ["allreduce", "allgather", "broadcast", "reducescatter", "load_model"]


def allreduce(value: Any, name: str | None = None, average: bool | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: Any = None, compression: Any = Compression.none) -> tf.Tensor:
    """Reduce a tensor-compatible ``value`` over the ranks (Average unless ``average=False`` / ``op``)."""
    return mpi_ops.allreduce(tf.constant(value, name=name), average=average, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, op=op, compression=compression)


def allgather(value: Any, name: str | None = None) -> tf.Tensor:
    """Concatenate every rank's ``value`` along the first dimension."""
    return mpi_ops.allgather(tf.constant(value, name=name))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> tf.Tensor:
    """``root_rank``'s ``value`` on every rank."""
    return mpi_ops.broadcast(tf.constant(value, name=name), root_rank)


def reducescatter(value: Any, name: str | None = None, op: Any = Average) -> tf.Tensor:
    """Reduce ``value`` over the ranks and keep this rank's rows."""
    return mpi_ops.reducescatter(tf.constant(value, name=name), op=op)


def load_model(filepath: Any, custom_optimizers: Any = None, custom_objects: dict | None = None,
               compression: Any = Compression.none, legacy_opts: bool = False) -> Any:
    """Load a saved Keras model whose optimizer becomes a ``DistributedOptimizer`` (state kept).

    ``custom_optimizers`` (optimizer classes) are made known to the loader like
    ``custom_objects``; ``legacy_opts`` is accepted for Horovod's signature
    (Keras 3 has no legacy optimizers).
    """
    from unison.keras.optimizer import load_wrapped
    from unison.tf_backend.keras.optimizer import DistributedOptimizer

    return load_wrapped(filepath, custom_optimizers, custom_objects,
                        lambda loaded: DistributedOptimizer(loaded, compression=compression))
