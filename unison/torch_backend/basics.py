"""Horovod's build and runtime queries, ``init`` and process-set management, for this build.

Unison is one Python build over MPI (mpi4py) on CPU tensors, so the answers are
fixed: MPI is built and enabled; Gloo, NCCL, DDL, oneCCL, CUDA and ROCm are not.
A script that guards a feature with ``hvd.nccl_built()`` takes its CPU path.

``is_homogeneous()`` (every host runs the same number of ranks) needs every
rank's local size; it is exchanged once, during ``init()``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from unison.common import runtime
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
from unison.common.engine.process_sets import ProcessSet

__all__ = [
    "init", "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "is_homogeneous",
    "start_timeline", "stop_timeline", "add_process_set", "remove_process_set",
]

logger = logging.getLogger(__name__)















def init(comm: Any = None, process_sets: Any = None, **settings: Any) -> None:
    """Horovod's ``hvd.init``: ``process_sets`` is a list of sets (or rank lists), or ``"dynamic"``.

    Unison always allows adding process sets later, so ``"dynamic"`` registers none now.
    """
    if isinstance(process_sets, str):
        if process_sets != "dynamic":
            raise ValueError(f"init(process_sets={process_sets!r}): pass a list of ProcessSet objects "
                             "(or rank lists), or 'dynamic'")
        process_sets = None
    runtime.init(comm, process_sets, **settings)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording a Chrome-trace timeline to ``file_path`` (rank 0 writes it).

    ``mark_cycles`` is accepted for Horovod's signature; engine cycles are not marked.
    """
    frontend.start_timeline(file_path)


def stop_timeline() -> None:
    """Stop recording the timeline and close its file."""
    frontend.stop_timeline()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (every rank, same order); returns the ProcessSet."""
    return frontend.add_process_set(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (every rank, same order); False for the global set, as in Horovod.

    Afterwards the object refuses to be used ("not registered"). Until the engine
    can free a set's communicator (``frontend.remove_process_set``), the
    communicator lives on, idle, until ``shutdown()``.
    """
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} is not registered (never added, or already removed)")
    if process_set.process_set_id == 0 or process_set.ranks is None:
        return False
    remover = getattr(frontend, "remove_process_set", None)
    if remover is not None:
        return bool(remover(process_set))
    process_set.process_set_id = None
    logger.debug("removed %r on the Python side; its communicator stays until shutdown()", process_set)
    return True
