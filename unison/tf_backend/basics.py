"""``horovod.tensorflow``'s build/runtime queries and small helpers, for this build.

Unison is one Python build over MPI on CPU tensors: MPI is built and enabled;
Gloo, NCCL, DDL, oneCCL, CUDA and ROCm are not, so a script that guards a feature
with ``hvd.nccl_built()`` takes its CPU path. (The answers live in
:mod:`unison.common.capabilities`, shared with the PyTorch backend.)
"""

from __future__ import annotations

from typing import Any

from unison.common.capabilities import (  # re-exported under Horovod's names
    ccl_built,
    check_num_rank_power_of_2,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    mpi_enabled,
    nccl_built,
    rocm_built,
)
from unison.common.engine import frontend
from unison.common.engine.frontend import start_timeline
from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.ops import Adasum, is_adasum, resolve_op
from unison.common.runtime import init

__all__ = [
    "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built", "is_homogeneous", "handle_average_backwards_compatibility", "check_num_rank_power_of_2",
    "Adasum", "is_adasum", "reduce_op", "remove_process_set", "process_set_by_id", "init", "start_timeline",
]


def handle_average_backwards_compatibility(op: Any, average: bool | None) -> Any:
    """Horovod's helper: the op meant by ``op`` / the deprecated ``average`` flag (Average by default)."""
    return reduce_op(average, op)


def process_set_by_id(process_set_id: int) -> ProcessSet:
    """The registered process set with id ``process_set_id`` (0: the global set).

    Raises:
        ValueError: no registered set has this id.
    """
    if int(process_set_id) == 0:
        return global_process_set
    eng = frontend.engine("process_set_by_id()")
    for ps in eng.registered_sets() if eng is not None else []:
        if ps.process_set_id == int(process_set_id):
            return ps
    raise ValueError(f"process_set_id={process_set_id} names no registered process set; register it "
                     "with hvd.add_process_set() on every rank first")


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (every rank, same order); False for the global set, as in Horovod.

    Raises:
        ValueError: the set is not registered.
    """
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} is not registered (never added, or already removed)")
    if process_set.process_set_id == 0 or process_set.ranks is None:
        return False
    return bool(frontend.remove_process_set(process_set))


#: Horovod's ``average=`` / ``op=`` pair: a ReduceOp (``Adasum`` included).
reduce_op = resolve_op
