"""How the ranks of a save or load agree, so that one rank's failure is every rank's error.

Every function takes an mpi4py communicator or None (one process, nothing to agree with).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from unison.common import agreement
from unison.common.agreement import ranks_text
from unison.common.checkpoints.format import CheckpointError

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


def raise_together(comm: Any, problem: str | None, cause: BaseException | None = None) -> None:
    """:func:`unison.common.agreement.raise_together` raising :class:`CheckpointError`."""
    agreement.raise_together(comm, problem, CheckpointError, cause)


def agreed(comm: Any, step: Callable[[], T],
           errors: tuple[type[BaseException], ...] = (ValueError,)) -> T:
    """``step()``, whose ``errors`` (bad input, an unreadable manifest) are raised on every rank as a
    :class:`CheckpointError` naming the first rank that failed (raised on that rank alone, the others
    waited in the load's collectives for ever)."""
    result, problem, cause = None, None, None
    try:
        result = step()
    except errors as exc:
        problem, cause = str(exc), exc
    agreement.raise_together(comm, problem, CheckpointError, cause)
    return result  # type: ignore[return-value]  # (set: raise_together raised otherwise)
