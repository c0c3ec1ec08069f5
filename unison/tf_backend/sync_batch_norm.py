"""``SyncBatchNormalization``: Keras batch normalization with statistics over every rank's batch.

Horovod's TensorFlow layer averages the ranks' batch means and mean squares,
which is exact only when every rank has the same batch size, and forms the
variance as ``E[x^2] - mean^2``. Ours computes the statistics of the union of the
ranks' batches exactly, in two passes (counts and sums, then squared deviations
from the global mean, all in float32 or wider as Keras computes BN), so unequal
batches and large-mean activations get the statistics one process would compute
on the concatenated batch. Both collectives are differentiable, so gradients flow
through the global statistics to every rank's inputs.
"""

from __future__ import annotations

import logging
from typing import Any

import keras
import tensorflow as tf
from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph

from unison.common.engine.process_sets import ProcessSet, global_process_set, set_size
from unison.common.ops import Sum
from unison.tf_backend.mpi_ops import allreduce, grouped_allreduce

__all__ = ["SyncBatchNormalization"]

logger = logging.getLogger(__name__)


@keras.saving.register_keras_serializable(package="unison")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose training statistics cover the batches of all ranks.

    Registered with Keras's serialization, so ``keras.models.load_model`` reloads a saved model
    holding it without ``custom_objects``. Its process set is not saved: a reloaded layer
    synchronizes over every rank (a warning says so when a layer on a smaller set is saved).

    Args:
        process_set: the ranks whose batches are normalized together (default: all).
        **kwargs: ``keras.layers.BatchNormalization``'s arguments.
    """

    def __init__(self, *args: Any, process_set: ProcessSet | None = global_process_set, fused: Any = False,
                 **kwargs: Any) -> None:
        if fused is not False:  # Horovod's signature and check (Keras 3's layer has no fused kernel to pick)
            raise ValueError(f"SyncBatchNormalization does not support fused={fused!r}; leave it False")
        super().__init__(*args, **kwargs)
        self._process_set = process_set

    def get_config(self) -> dict[str, Any]:
        if self._process_set is not global_process_set and self._process_set is not None:
            logger.warning("SyncBatchNormalization %r synchronizes over process set %s, which is not saved: "
                           "loaded again, the layer synchronizes over every rank", self.name,
                           getattr(self._process_set, "ranks", None))
        return super().get_config()

    def _moments(self, inputs: Any, mask: Any) -> Any:
        if set_size(None if self._process_set is global_process_set else self._process_set) == 1:
            return super()._moments(inputs, mask)
        x = tf.convert_to_tensor(inputs)
        # masked positions are selected out, never multiplied by 0: a padded step holding inf or NaN made
        # every statistic NaN on every rank (inf * 0), where Keras's own layer selects (before 2026-12-07)
        keep = tf.ones_like(x, tf.bool) if mask is None else tf.broadcast_to(
            tf.cast(tf.expand_dims(mask, -1), tf.bool), tf.shape(x))
        weights, zeros = tf.cast(keep, x.dtype), tf.zeros_like(x)
        axes = list(self._reduction_axes)
        count, total = grouped_allreduce([tf.reduce_sum(weights, axes, keepdims=True),
                                          tf.reduce_sum(tf.where(keep, x, zeros), axes, keepdims=True)],
                                         op=Sum, process_set=self._process_set, name=_name("sync_batch_norm"),
                                         ignore_name_scope=True)
        mean = total / tf.maximum(count, 1.0)
        squares = allreduce(tf.reduce_sum(tf.where(keep, tf.square(x - mean), zeros), axes, keepdims=True),
                            op=Sum, process_set=self._process_set, name=_name("sync_batch_norm_squares"),
                            ignore_name_scope=True)
        variance = squares / tf.maximum(count, 1.0)
        return tf.squeeze(mean, axes), tf.squeeze(variance, axes)


def _name(base: str) -> str | None:
    """The engine name of a statistics collective built now: None eagerly (the calls are numbered as they
    run), else ``base`` made unique in the graph being traced outside every name scope. Named after the
    input tensors, as unnamed ops are in a graph, the names held the layer's Keras name, which counts the
    layers this process made: a rank that built one more layer (an evaluation copy) traced other names,
    and every rank waited for ever (before 2026-12-05)."""
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    # a tf.cond or loop body counts its names on its own, and the function path leaves it out: numbered
    # in the function graph around it, a layer inside and one outside it cannot share a name
    while isinstance(graph, ControlFlowFuncGraph) and getattr(graph, "outer_graph", None) is not None:
        graph = graph.outer_graph
    with graph.name_scope(None):  # type: ignore[arg-type]
        return graph.unique_name(base)  # (the ops add the function path, ignoring the layer's name scope)
