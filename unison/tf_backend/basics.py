"""``horovod.tensorflow``'s build/runtime queries and small helpers, for this build.

Unison is one Python build over MPI on CPU tensors: MPI is built and enabled;
Gloo, NCCL, DDL, oneCCL, CUDA and ROCm are not, so a script that guards a feature
with ``hvd.nccl_built()`` takes its CPU path. (The PyTorch backend answers the
same in ``unison/torch_backend/basics.py``; both should move to one neutral
module.)
"""

from __future__ import annotations

from typing import Any

from unison.common import runtime
from unison.common.engine import frontend
from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.ops import ReduceOp, resolve_op

__all__ = [
    "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built", "is_homogeneous", "handle_average_backwards_compatibility", "check_num_rank_power_of_2",
    "Adasum", "is_adasum", "reduce_op", "remove_process_set", "process_set_by_id", "init", "start_timeline",
]


def mpi_enabled() -> bool:
    """Whether collectives run over MPI (always, when mpi4py is installed)."""
    return runtime.mpi_built()


def gloo_built() -> bool:
    """False: Unison has no Gloo transport."""
    return False


def gloo_enabled() -> bool:
    """False: Unison has no Gloo transport."""
    return False


def nccl_built() -> bool:
    """False: this build moves CPU tensors over MPI (Horovod returns 0 or the NCCL version)."""
    return False


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False


def cuda_built() -> bool:
    """False: this build reduces CPU tensors only."""
    return False


def rocm_built() -> bool:
    """False: this build reduces CPU tensors only."""
    return False


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks (collective on the first call).

    Raises:
        NotInitializedError: ``init()`` was not called.
    """
    st = runtime.state("is_homogeneous()")
    if "homogeneous" not in st.cache:
        sizes = [st.local_size] if st.comm is None or st.size == 1 else st.comm.allgather(st.local_size)
        st.cache["homogeneous"] = all(s == sizes[0] for s in sizes)
    return bool(st.cache["homogeneous"])


def check_num_rank_power_of_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (Horovod's helper of the same name)."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


class _AdasumOp:
    """Horovod's ``hvd.Adasum`` until the core's ReduceOp has an ADASUM member."""

    def __repr__(self) -> str:
        return "unison.Adasum"


#: ``op=hvd.Adasum``: the core's constant when the engine knows it, else a marker
Adasum: Any = ReduceOp.ADASUM if hasattr(ReduceOp, "ADASUM") else _AdasumOp()


def is_adasum(op: Any) -> bool:
    return op is Adasum or type(op).__name__ == "_AdasumOp" or (
        isinstance(op, str) and op.strip().lower() == "adasum")


def reduce_op(average: bool | None, op: Any) -> Any:
    """Horovod's ``average=`` / ``op=`` pair: a ReduceOp, or :data:`Adasum`.

    Raises:
        ValueError: both are given, or ``op`` names no reduction.
    """
    if is_adasum(op):
        if average is not None:
            raise ValueError("pass either average= (deprecated) or op=, not both")
        return Adasum
    return resolve_op(average, op)


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
    for ps in getattr(eng, "_set_objs", []) if eng is not None else []:
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
    remover = getattr(frontend, "remove_process_set", None)
    if remover is not None:
        return bool(remover(process_set))
    process_set.process_set_id = None  # the engine keeps its idle communicator until shutdown()
    return True



def init(comm: Any = None, process_sets: Any = None, **settings: Any) -> None:
    """Horovod's ``hvd.init``: ``process_sets`` is a list of sets (or rank lists), or ``"dynamic"``.

    Unison always allows adding process sets later, so ``"dynamic"`` registers none now.

    Raises:
        ValueError: ``process_sets`` is a string other than ``"dynamic"``.
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
