"""The engine's own exceptions (``unison.StallError`` and friends are these classes).

They live apart from :mod:`.engine` so that the controller and the executor, which
the engine imports, can raise them too.
"""

from __future__ import annotations

from typing import Any

from unison.common.exceptions import InvalidArgumentError, UnisonError, UnisonInternalError

__all__ = ["StallError", "ShutdownError", "DuplicateNameError", "JoinError", "process_failure"]

#: ULFM error classes (MPI 4 FT proposal): a peer died, a receive from any source may have
#: missed a dead peer, the communicator was revoked by some rank
_FAILURE_CLASSES = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")


class StallError(UnisonError):
    """Some ranks submitted a tensor that others never did, for too long."""


class ShutdownError(UnisonError):
    """The engine stopped (this or another rank shut down) with the request pending.

    When a rank's ``shutdown()`` (or its exit) stopped the engine, the message names that rank.
    """


class DuplicateNameError(UnisonError, ValueError):
    """A name was submitted again while the first submission is still in flight."""


class JoinError(InvalidArgumentError):
    """A collective that needs every rank's data ran while some rank had called ``join()``.

    Only allreduce and barrier work with joined ranks (a joined rank contributes the
    op's identity); broadcast, allgather, alltoall, reducescatter, ``add_process_set``
    and ``remove_process_set`` raise this on the ranks that submitted them. The joined
    ranks' ``join()`` returns normally (as in Horovod) and logs a warning naming them.
    """


def process_failure(exc: BaseException, mpi: Any) -> UnisonInternalError | None:
    """``exc`` as a :class:`UnisonInternalError` when it reports a dead rank or a revoked
    communicator (only MPI with ULFM, ``mpirun --with-ft ulfm``, raises those); else None."""
    if isinstance(exc, UnisonInternalError):
        return exc
    if mpi is None or not isinstance(exc, mpi.Exception):
        return None
    classes = {getattr(mpi, name) for name in _FAILURE_CLASSES if hasattr(mpi, name)}
    if exc.Get_error_class() not in classes:
        return None
    error = UnisonInternalError(f"a rank of the job failed or left ({exc.Get_error_string()}); in elastic "
                                "mode the elastic run wrapper recovers on the surviving ranks")
    error.__cause__ = exc
    return error
