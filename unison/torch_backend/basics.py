"""Horovod's build and runtime queries, ``init`` and process-set management, for this build.

Unison is one Python build over MPI (mpi4py) on CPU tensors, so the answers are
fixed: MPI is built and enabled; Gloo, NCCL, DDL, oneCCL, CUDA and ROCm are not.
A script that guards a feature with ``hvd.nccl_built()`` takes its CPU path.

``is_homogeneous()`` (every host runs the same number of ranks) needs every
rank's local size; it is exchanged once, during ``init()``.
"""

from __future__ import annotations

from unison.common.capabilities import (  # re-exported under Horovod's names
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from unison.common.engine import frontend
from unison.common.engine.frontend import add_process_set, start_timeline, stop_timeline
from unison.common.engine.process_sets import ProcessSet
from unison.common.runtime import init

__all__ = [
    "init", "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "is_homogeneous",
    "start_timeline", "stop_timeline", "add_process_set", "remove_process_set",
]



def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (every rank, same order); False for the global set, as in Horovod.

    Collective: every rank frees the set's communicator at the same point; afterwards
    the object refuses to be used ("not registered").
    """
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} is not registered (never added, or already removed)")
    if process_set.process_set_id == 0 or process_set.ranks is None:
        return False
    return bool(frontend.remove_process_set(process_set))
