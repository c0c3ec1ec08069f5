"""Horovod-compatible Keras API: ``import unison.tf_backend.keras as hvd``.

Like ``horovod.tensorflow.keras`` (and ``horovod.keras``): the TensorFlow API, a Keras 3
``DistributedOptimizer`` (and ``PartialDistributedOptimizer``) for plain ``model.fit``, the
usual callbacks, ``load_model``, and Horovod's Keras flavours of
``allreduce``/``allgather``/``broadcast``/``reducescatter`` (values in, ``name`` second; see
``unison.tf_backend.keras_api``). Every name of ``horovod.tensorflow.keras`` 0.28 and of
``horovod.keras`` 0.28 is here, ``elastic`` included (``unison.tf_backend.elastic``).
"""

from unison.tf_backend import *  # noqa: F403 - the whole TF API, as horovod.tensorflow.keras does
from unison.tf_backend import __all__ as _tf_all
from unison.tf_backend import elastic as elastic  # the Keras elastic API (a re-export)
from unison.tf_backend.functions import PartialDistributedGradientTape
from unison.tf_backend.keras import callbacks
from unison.tf_backend.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from unison.tf_backend.keras_api import allgather, allreduce, broadcast, load_model, reducescatter

_OWN = {"DistributedOptimizer", "PartialDistributedGradientTape", "allreduce", "allgather", "broadcast",
        "reducescatter"}  # the Keras flavours replace the TensorFlow names of the same spelling
__all__ = [n for n in _tf_all if n not in _OWN] + [
    "DistributedOptimizer", "PartialDistributedOptimizer", "PartialDistributedGradientTape", "callbacks",
    "load_model", "allreduce", "allgather", "broadcast", "reducescatter"]
