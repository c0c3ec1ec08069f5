"""The engine's own exceptions (``unison.StallError`` and friends are these classes), and the kinds a
rank's refusal of a call travels as.

They live apart from :mod:`.engine` so that the controller and the executor, which
the engine imports, can raise them too.

[Note: refusal kinds] A rank whose own checks refuse a call still submits it, carrying the error, so
that every rank of the call raises (the engine's negotiation, a ``torch.distributed`` sub-group's
agreement). Only plain data crosses ranks ([Note: wire records] in :mod:`.controller`), so the error
travels as one letter and its message: ``"T"`` a ``TypeError`` (a bad dtype or op), ``"U"`` an
:class:`~unison.common.exceptions.UnsupportedError` (a call Unison does not implement; a ``TypeError``
too), ``"V"`` anything else (a ``ValueError``: a bad root, splits, shape). Every rank then raises one
class, whose message lists each refusing rank's text, by this precedence over the kinds sent:

* any ``"T"``: :class:`~unison.common.exceptions.CollectiveError`. A plain ``TypeError`` is a fault in
  the call that no fallback to another backend cures, so it wins over a rank's ``"U"``;
* else any ``"U"``: :class:`~unison.common.exceptions.UnsupportedError`, also when other ranks sent
  ``"V"`` (what one rank cannot run at all is the first thing to fix);
* else (only ``"V"``): :class:`~unison.common.exceptions.InvalidArgumentError`.

An ``UnsupportedError`` is a ``CollectiveError`` (a ``TypeError``), so any rank's ``TypeError`` still
gives every rank a ``CollectiveError``, as before the third kind: until a second change of 2026-12-06
an ``UnsupportedError`` travelled as ``"T"``, and the ``torch.distributed`` backend made the
``CollectiveError`` an ``UnsupportedError`` again when its message held "unsupported by the unison
backend: ", so one without those words arrived as a plain ``CollectiveError``, and a ``TypeError``
quoting them as an ``UnsupportedError``.
"""

from __future__ import annotations

from typing import Any

from unison.common.exceptions import (
    REFUSALS,
    InvalidArgumentError,
    UnisonError,
    UnisonInternalError,
    refusal_class,
    refusal_kind,
    winning_kind,
)

__all__ = ["StallError", "ShutdownError", "DuplicateNameError", "JoinError", "process_failure", "REFUSALS",
           "refusal_kind", "winning_kind", "refusal_class"]

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
