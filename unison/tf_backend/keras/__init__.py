"""Horovod-compatible Keras API: ``import unison.tf_backend.keras as hvd``.

Like ``horovod.tensorflow.keras``: the TensorFlow collectives, a Keras 3
``DistributedOptimizer`` for plain ``model.fit`` and the usual callbacks.
"""

from unison.tf_backend import *  # noqa: F403 - the whole TF API, as horovod.tensorflow.keras does
from unison.tf_backend import __all__ as _tf_all
from unison.tf_backend.keras import callbacks
from unison.tf_backend.keras.optimizer import DistributedOptimizer

__all__ = list(_tf_all) + ["DistributedOptimizer", "callbacks"]
