"""Horovod's TensorFlow ``Compression`` on ``tf.Tensor``s, graph-safe.

``horovod.tensorflow.Compression.fp16.compress(t)`` returns ``(tf.cast(t,
float16), t.dtype)`` for floating-point tensors and leaves others alone; it is
made of TensorFlow ops, so it works on symbolic tensors inside ``tf.function``.
Unison has one ``Compression`` for every framework (``unison.common.compression``,
see its [Note: one Compression for every framework]); this module registers the
TensorFlow caster it uses for ``tf.Tensor`` and ``tf.Variable``. ``bf16`` is an
addition (bfloat16 on the wire).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from unison.common import compression as _common

__all__ = ["Compression", "TFCaster"]

Compression = _common.Compression


class TFCaster:
    """Casts tf.Tensors with ``tf.cast``: floating-point dtypes (Horovod's ``dtype.is_floating``)."""

    _WIRE = {"float16": tf.float16, "bfloat16": tf.bfloat16}

    def compressible(self, tensor: Any) -> bool:
        return tf.as_dtype(tensor.dtype).is_floating

    def cast(self, tensor: Any, wire: str) -> Any:
        return tf.cast(tensor, self._WIRE[wire])

    def dtype(self, tensor: Any) -> Any:
        return tf.as_dtype(tensor.dtype)

    def cast_back(self, tensor: Any, dtype: Any) -> Any:
        return tf.cast(tensor, dtype)


for _type in (tf.Tensor, tf.Variable):
    _common.register_caster(_type, TFCaster())
