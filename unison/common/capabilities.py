"""What this build of Unison can do: Horovod's ``*_built()`` / ``*_enabled()`` queries, answered once.

Unison is one Python build over MPI (mpi4py) on CPU tensors, so the answers are
fixed: MPI is built and enabled; Gloo, NCCL, DDL, oneCCL, CUDA and ROCm are not.
A script that guards a feature with ``hvd.nccl_built()`` takes its CPU path.
Both backends re-export these functions under Horovod's names.

``is_homogeneous()`` (every host runs the same number of ranks) needs every
rank's local size: it is exchanged once, at ``init()``, through an init hook.
"""

from __future__ import annotations

from typing import Any

from unison.common import runtime

__all__ = [
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
    "ddl_built", "ccl_built", "cuda_built", "rocm_built", "is_homogeneous", "check_num_rank_power_of_2",
]

mpi_built = runtime.mpi_built
mpi_threads_supported = runtime.mpi_threads_supported


def mpi_enabled() -> bool:
    """Whether collectives run over MPI (always, when mpi4py is installed)."""
    return runtime.mpi_built()


def _no() -> bool:
    return False


def gloo_built() -> bool:
    """False: Unison has no Gloo transport."""
    return _no()


def gloo_enabled() -> bool:
    """False: Unison has no Gloo transport."""
    return _no()


def nccl_built() -> bool:
    """False: this build moves CPU tensors over MPI (Horovod returns 0 or the NCCL version)."""
    return _no()


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return _no()


def ccl_built() -> bool:
    """False: no oneCCL."""
    return _no()


def cuda_built() -> bool:
    """False: this build reduces CPU tensors only."""
    return _no()


def rocm_built() -> bool:
    """False: this build reduces CPU tensors only."""
    return _no()


def check_num_rank_power_of_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (Horovod's helper of the same name)."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def _exchange_local_sizes(st: runtime.State, _process_sets: Any = None) -> None:
    """Init hook (collective, every rank): remember whether every host runs as many ranks."""
    if st.comm is None or st.size == 1:
        st.cache["homogeneous"] = True
        return
    sizes = st.comm.allgather(st.local_size)
    st.cache["homogeneous"] = all(s == sizes[0] for s in sizes)


runtime.add_init_hook(_exchange_local_sizes)


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks (Horovod's query; known from ``init()``).

    Raises:
        NotInitializedError: ``init()`` was not called.
    """
    st = runtime.state("is_homogeneous()")
    if "homogeneous" not in st.cache:  # (importing unison registers the hook: every init() ran it)
        raise RuntimeError("is_homogeneous(): unison.init() did not record the hosts' rank counts (its init hook "
                           "was not registered); import unison before calling unison.init()")
    return bool(st.cache["homogeneous"])
