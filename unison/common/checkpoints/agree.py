"""How the ranks of a save or load agree, so that one rank's failure is every rank's error.

Every function takes an mpi4py communicator or None (one process, nothing to agree with).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from unison.common import agreement, runtime
from unison.common.agreement import ranks_text
from unison.common.checkpoints.format import CheckpointError
from unison.common.engine import frontend

__all__ = ["ranks_text"]

T = TypeVar("T")


def size(comm: Any) -> int:
    return 1 if comm is None else int(comm.Get_size())


def rank(comm: Any) -> int:
    return 0 if comm is None else int(comm.Get_rank())


def allgather(comm: Any, obj: Any) -> list[Any]:
    return [obj] if comm is None else comm.allgather(obj)


def gather(comm: Any, obj: Any) -> list[Any] | None:
    return [obj] if comm is None else comm.gather(obj, root=0)


def bcast(comm: Any, obj: Any) -> Any:
    return obj if comm is None else comm.bcast(obj, root=0)


def enter(comm: Any, what: str) -> None:
    """Return when every rank of ``comm`` has entered ``what`` (a collective save or load); one engine
    all-reduce named ``checkpoint.<what>``. Nothing for one process or a communicator other than the job's.

    [Note: a collective save is entered through the engine] The saves and loads agree over MPI's own calls on
    the job's communicator, which the engine does not see. A save that some ranks skip (Horovod's habit,
    ``if hvd.rank() == 0: save(...)``, applied to a sharded save, which every rank must make) left those in it
    blocked in MPI for ever while the others waited in their next step's collectives (before 2026-12-06).
    Now it is entered through the engine (frontend [Note: entered through the engine]); once every rank is
    in, the MPI calls that follow pair up. The cost is one small collective per save or load.
    """
    st = runtime._state
    if comm is None or st is None or st.size <= 1 or comm is not st.comm:
        return
    frontend.enter(f"checkpoint.{what}")


def raise_together(comm: Any, problem: str | None, cause: BaseException | None = None) -> None:
    """:func:`unison.common.agreement.raise_together` raising :class:`CheckpointError`."""
    agreement.raise_together(comm, problem, CheckpointError, cause)


def agreed(comm: Any, step: Callable[[], T],
           errors: tuple[type[BaseException], ...] = (Exception,)) -> T:
    """``step()``, whose ``errors`` (bad input, an unreadable manifest, any other failure by default) are
    raised on every rank as a :class:`CheckpointError` naming the first rank that failed (raised on that
    rank alone, the others waited in the save's or load's collectives for ever). On that rank the original
    exception is the ``__cause__``.

    A ``ValueError`` or ``TypeError`` speaks for itself; any other error's message is prefixed with its type
    (``"KeyError: 'kernel'"``). Until 2026-12-07 only ``ValueError`` was agreed by default: a Keras
    ``save_sharded`` whose entries raised a ``TypeError`` or ``KeyError`` on one rank hung the others.
    """
    result, problem, cause = None, None, None
    try:
        result = step()
    except errors as exc:
        plain = isinstance(exc, (ValueError, TypeError))
        problem, cause = (str(exc) if plain else f"{type(exc).__name__}: {exc}"), exc
    agreement.raise_together(comm, problem, CheckpointError, cause)
    return result  # type: ignore[return-value]  # (set: raise_together raised otherwise)
