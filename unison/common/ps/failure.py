"""What a sharded table does when a rank of it dies (elastic mode, ULFM).

[Note: a table that loses a rank]
A table's rows live on its ranks, and a dead rank's shard is gone: the table cannot go on. What
it must not do is hang, or fail in a way the elastic ``run`` wrapper does not recognise. Under
``mpirun --with-ft ulfm`` an operation that involves the dead rank fails with
``ERR_PROC_FAILED``, but survivors waiting only on each other (a BSP round's exchange between
two live ranks, a worker held back for a live server's answer that never comes because that
server's thread failed) would wait on. So the first survivor operation that meets the failure
*loses* the table on that rank:

    revoke   the table's three communicators: every survivor's pending and later operation on
             them fails (``ERR_REVOKED``) and loses the table there too; the server threads
             stop (their probe fails, and they are told to)
    forget   the table is closed (``close()`` does nothing, every operation raises a
             ``TableError`` that says it was lost) and its name is free again
    raise    :class:`~unison.common.ps.table.TableLostError`, a ``HorovodInternalError`` (which the
             elastic ``run`` wrapper takes as a failure: it restores the last commit, shrinks the job
             to the survivors and calls the reset callbacks) and a ``TableError``

Every later operation of the lost table raises the same, and so does a handle of an operation
that was queued behind the one that lost it (``push_async`` whose handle is waited a step later,
as ``ShardedEmbedding`` does, then a ``pull``: the pull must be taken for a failure too, or the
job ends), until Unison is rebuilt on the survivors; from then on a plain ``TableError``, so code
that goes on using the old table is told so instead of rolling back again and again.

A table the survivors did not touch after the failure (the failure reached them through the
engine first) is lost by the runtime's shutdown hook when the recovery rebuilds Unison: any open
table whose communicator has a failed rank (``MPI_Comm_get_failed``). The communicators are
revoked, never freed, as the engine's are (elastic [Note: in-place recovery]).

To go on, a reset callback creates the table again on the survivors (the same name is free) and
loads the checkpoint saved with the last commit: ``load()`` reads it on any number of ranks. The
rows pushed after that checkpoint are lost with the rest of the rolled-back steps, which the
training loop then makes again. Tested in ``tests/test_ps_mpi.py::test_a_table_survives_a_rank_killed``
(BSP and SSP: the survivors' table equals a replay of the kept steps).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from unison.common import runtime
from unison.common.elastic.recovery import ulfm_enabled
from unison.common.engine.errors import process_failure
from unison.common.exceptions import UnisonError, UnisonInternalError

if TYPE_CHECKING:
    from unison.common.ps.table import ShardedTable

__all__ = ["failure_of", "lose", "lost_error", "FAILURE_NEWS_S"]

logger = logging.getLogger(__name__)

#: How long an ``MPI_ERR_OTHER`` (or ``MPI_ERR_IN_STATUS``) on a table's communicator waits, under ULFM, for
#: this rank to hear that a rank failed before it is taken for what it says (see :func:`failure_of`), at
#: least: with ULFM's failure detector on (``unisonrun --detect-lost-hosts``), twice its timeout and a second.
FAILURE_NEWS_S = 3.0


def failure_news_s() -> float:
    """:data:`FAILURE_NEWS_S`, or longer when the failure detector's timeout would bring the news later."""
    try:
        detector = float(os.environ.get("OMPI_MCA_mpi_ft_detector_timeout", "0"))
    except ValueError:
        detector = 0.0
    return max(FAILURE_NEWS_S, 2.0 * detector + 1.0)
#: Runtime shutdowns so far (an elastic rebuild is one): a table lost before the last one belongs to an old world.
_generation = 0


def failure_of(table: ShardedTable, exc: BaseException) -> UnisonInternalError | None:
    """``exc`` as the failure of a rank of ``table``, else None: an MPI process failure or revocation, or any
    other MPI error on a communicator with a failed rank (Open MPI 5's ``MPI_Alltoall`` was seen to report a
    dead peer as ``MPI_ERR_OTHER``)."""
    lost = process_failure(exc, table.mpi)
    if lost is not None or table.mpi is None or not isinstance(exc, table.mpi.Exception) or not ulfm_enabled():
        return lost
    if exc.Get_error_class() not in (table.mpi.ERR_OTHER, table.mpi.ERR_IN_STATUS):
        return None  # (only those were seen to stand for a failure this rank had not heard of yet)
    # the error can come before this rank hears of the failure (a broken connection first): wait for the news
    deadline = time.monotonic() + failure_news_s()
    while not (failed := failed_ranks(table)) and time.monotonic() < deadline:
        time.sleep(0.02)
    if not failed:
        return None
    error = UnisonInternalError(f"a rank of the table failed ({exc.Get_error_string()})")
    error.__cause__ = exc
    return error


def failed_ranks(table: ShardedTable) -> int:
    """How many ranks of the table's communicator this rank knows failed, or 1 if another survivor revoked one
    of its communicators (it lost the table); 0 without ULFM."""
    if table.comm is None:
        return 0
    try:
        group = table.comm.Get_failed()
        failed = int(group.Get_size())
        group.Free()
        revoked = any(c is not None and c.Is_revoked() for c in (table.comm, table._rep, table._err))
    except Exception:  # noqa: BLE001 - an MPI without ULFM: no rank can have failed and left us here
        return 0
    return failed or int(revoked)


def lost_error(table: ShardedTable) -> UnisonError:
    """What an operation of the lost ``table`` raises (see the Note)."""
    from unison.common.ps.table import TableError, TableLostError

    text = (f"table {table.name!r} was lost when a rank of it failed ({table._lost}); create it again on the "
            "survivors (in an elastic reset callback) and load() the checkpoint of the last commit")
    if table._lost_generation == _generation:
        return TableLostError(text)
    return TableError(text + "; Unison has been rebuilt since: this table belongs to the world before")


def lose(table: ShardedTable, failure: BaseException) -> UnisonError:
    """Lose ``table`` on this rank (see the Note) and return the error to raise."""
    if table._lost is None:
        table._lost = str(failure)
        table._lost_generation = _generation
        for comm in (table.comm, table._rep, table._err):
            if comm is not None:
                try:
                    comm.Revoke()
                except Exception:  # noqa: BLE001 - revoked already, or no ULFM: nothing more to release
                    logger.debug("table %r: revoke failed", table.name, exc_info=True)
        if table._server is not None:
            table._server.stop.set()
        table._forget()
        logger.warning("table %r: lost, a rank of it failed (%s)", table.name, failure)
    error = lost_error(table)
    error.__cause__ = failure
    return error


def _lose_broken_tables(state: Any) -> None:
    """At a shutdown (an elastic rebuild's too): lose every open table a failed rank belonged to; from then on
    the tables lost so far raise a plain ``TableError``."""
    global _generation
    from unison.common.ps.table import open_tables

    for table in open_tables():
        if table._lost is not None:
            continue
        failed = failed_ranks(table)
        if failed:
            lose(table, UnisonInternalError(f"{failed} rank(s) of the table failed"))
    _generation += 1


runtime.add_shutdown_hook(_lose_broken_tables)
