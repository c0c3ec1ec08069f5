"""Unison for Keras 3 on every backend: ``import unison.keras as uk``.

The same script trains across ranks with ``KERAS_BACKEND=tensorflow``, ``jax`` or
``torch``; only the active backend's framework is imported.

* :class:`DataParallel`: build and compile inside ``scope()``, then ``model.fit`` /
  ``evaluate`` / ``predict`` on the global data and the global batch size.
* Horovod-style pieces: :func:`DistributedOptimizer`, :mod:`~unison.keras.callbacks`
  (``BroadcastGlobalVariablesCallback``, ``MetricAverageCallback``,
  ``LearningRateWarmupCallback``, rank-0 ``ModelCheckpoint``), :func:`broadcast_variables`,
  and :func:`allreduce` / :func:`allgather` / :func:`broadcast` on the backend's tensors;
  :func:`barrier` (e.g. after rank 0's ``model.save``, before every rank reads the file).
* The process's place in the job: :func:`init`, :func:`rank`, :func:`size`,
  :func:`local_rank`, :func:`local_size`, :func:`shutdown`.
"""

from importlib import import_module as _import_module

try:  # first, so that a missing Keras (or backend) names the fix instead of failing deep inside a submodule
    _import_module("keras")
except ImportError as _exc:
    if getattr(_exc, "name", None) in ("tensorflow", "jax", "jaxlib", "torch"):  # KERAS_BACKEND's
        raise ImportError(f"unison.keras: Keras failed to import its backend ({_exc}): install it, or set "
                          "KERAS_BACKEND to an installed one (tensorflow, the default; jax; torch)") from _exc
    raise ImportError(f"unison.keras needs Keras 3, which failed to import ({_exc}): pip install 'keras>=3.15' "
                      "(or the checkout's [keras] extra: pip install '.[keras]')") from _exc

from unison.common.compression import Compression
from unison.common.engine.frontend import barrier
from unison.common.ops import Average, Sum
from unison.common.runtime import init, is_initialized, local_rank, local_size, rank, shutdown, size
from unison.keras import callbacks
from unison.keras.data_parallel import DataParallel
from unison.keras.ops import allgather, allreduce, broadcast, broadcast_variables
from unison.keras.optimizer import DistributedOptimizer, load_model

__all__ = ["Average", "Compression", "DataParallel", "DistributedOptimizer", "Sum", "allgather", "allreduce",
           "barrier", "broadcast", "broadcast_variables", "callbacks", "init", "is_initialized", "load_model",
           "local_rank", "local_size", "rank", "shutdown", "size"]
