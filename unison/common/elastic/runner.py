"""The retry loop of the elastic ``run`` decorator, shared by the backends.

    while True:
        sync the state from rank 0 (unless a host update said there is no need)
        call the training function -> its return value ends the loop
        a rank failed (UnisonInternalError): restore the last commit, rebuild Unison on the
            survivors (reset: recover(), which shrinks the world; needs ULFM)
        the hosts changed (HostsUpdatedInterrupt): keep the live state, rebuild Unison on the
            same ranks (rebuild(): every rank lives, so no shrink; see [Note: a host update
            without a failure] in recovery.py)
        run the reset callbacks (a rank failing meanwhile: restore and recover again)

Without elastic mode (``UNISON_ELASTIC`` unset) a failure is raised as it is, and the job
ends as it always did.

[Note: resuming once]
Under ``unisonrun``'s elastic driver a state resumes from the spilled commits at its first call of
an ``elastic.run`` function, and only in a restarted job (``UNISON_ELASTIC_ATTEMPT`` above 0): the
first job has nothing to resume, and a later call of the same function (a program that calls it
once per epoch) carries on from the live state. Before 2026-12-05 every call resumed, in the first
job too, and loaded the newest commit of any state: a second state (a program's second phase)
took the first one's values.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from unison.common import runtime
from unison.common.elastic.recovery import enabled, rebuild, ulfm_enabled
from unison.common.elastic.state import settle_last_spill
from unison.common.elastic.store import attempt as job_attempt
from unison.common.elastic.store import mark_entered, mark_finished, reset_limit, resume
from unison.common.engine.errors import process_failure
from unison.common.exceptions import HostsUpdatedInterrupt

__all__ = ["run_fn", "RESTART_STATUS"]

logger = logging.getLogger(__name__)


def _failure(exc: BaseException) -> BaseException | None:
    st = runtime._state
    return process_failure(exc, st.mpi if st is not None else None)


def run_fn(func: Callable[..., Any], reset: Callable[[], Any],
           rebuild_on_update: Callable[[], Any] = rebuild) -> Callable[..., Any]:
    """Wrap ``func(state, *args, **kwargs)`` in the elastic retry loop.

    ``reset()`` rebuilds after a rank failed (the backends pass :func:`recover`); ``rebuild_on_update()``
    after a host update, when every rank lives (:func:`rebuild`).
    """

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        if state.store is not None:
            mark_entered()
            if not getattr(state, "_resumed", False):  # the state's first call under unisonrun's elastic driver
                state._resumed = True
                skip_sync = job_attempt() > 0 and resume(state, state.store) >= 0  # see [Note: resuming once]
            if skip_sync:  # a new world for that commit: what depends on the size (the learning rate the commit
                # brought back was the old world's) is set again, as after a reset; a rank failing meanwhile
                # is recovered from like any other failure (before 2026-12-05 the callbacks ran again on
                # the same world: under ULFM it never shrank)
                _reset(state, lambda: None, reset)
        while True:
            rebuilder = reset
            try:
                if not skip_sync:
                    state.sync()
                result = func(state, *args, **kwargs)
                if state.store is not None:
                    settle_last_spill(state.store)  # (every rank raises if the last commit is not on disk)
                    mark_finished(state.store)
                return result
            except HostsUpdatedInterrupt as exc:
                if state.store is not None:
                    _restart_on_new_hosts(state)
                skip_sync = exc.skip_sync
                rebuilder = rebuild_on_update  # every rank is alive and here: no shrink (it needs ULFM)
            except Exception as exc:
                failure = _failure(exc)
                if failure is None:
                    raise
                if not enabled():
                    logger.error("a rank failed and elastic mode is off (set UNISON_ELASTIC=1 or use "
                                 "unisonrun --elastic to recover in place); ending the job")
                    raise
                if not ulfm_enabled():  # a shrink would never return on any rank (before 2026-12-05: a hang)
                    logger.error("elastic: %s, and this job's MPI runs without ULFM (mpirun --with-ft ulfm, as "
                                 "unisonrun --elastic's in-place tier starts it), so the ranks cannot go on in "
                                 "place; ending the job (under unisonrun --elastic's restart tier it starts again "
                                 "from the last commit)", failure)
                    raise
                logger.warning("elastic: %s; rolling back to the last commit", failure)
                state.restore()
                skip_sync = False
            _reset(state, rebuilder, reset)
            _count_reset(state)

    return wrapper


#: resets in place this process made (every rank of a job makes the same ones: see _count_reset)
_resets_in_place = 0


def _count_reset(state: Any) -> None:
    """Count a reset in place, and end the job once there are more than it may make.

    [Note: --reset-limit in place]
    ``unisonrun --reset-limit N`` bounds resets of every kind, as Horovod's does. The driver counts
    the jobs it starts again; the resets a job makes in place (a rank died and ULFM let the rest go
    on, or the hosts changed without the driver) it hears of from rank 0's :data:`ELASTIC_RESET`
    line after each, and it gives the next job what is left in ``UNISON_ELASTIC_RESET_LIMIT``. Every
    rank of the job went through the same resets (a recovery is collective), so every rank counts
    the same number and, past the limit, every rank says so and exits with
    :data:`RESET_LIMIT_STATUS` after the reset completed (a clean exit from a whole world: an exit
    before the recovery would leave the failed rank in it); the driver then gives up. Before
    2026-12-07 only restarted jobs were counted, and a rank failing again and again reset in place
    for ever under ``--reset-limit 0``.
    """
    global _resets_in_place
    from unison.run.report import ELASTIC_RESET, RESET_LIMIT_STATUS

    _resets_in_place += 1
    st = runtime._state
    if (st is None or st.rank == 0) and state.store is not None:  # (under unisonrun's driver)
        print(f"{ELASTIC_RESET} {_resets_in_place}", flush=True)
    limit = reset_limit()
    if limit is None or _resets_in_place <= limit:
        return
    logger.error("elastic: giving up: this job has reset in place %d time(s), more than the %d its share of "
                 "unisonrun's --reset-limit allows (UNISON_ELASTIC_RESET_LIMIT); ending the job with status %d",
                 _resets_in_place, limit, RESET_LIMIT_STATUS)
    _end_job(state, RESET_LIMIT_STATUS)


#: the exit status of every rank that stops so the driver restarts the job on the new hosts
RESTART_STATUS = 76  # unison.run.report.RESTART_STATUS (a test checks)


def _restart_on_new_hosts(state: Any) -> None:
    """The driver saw the hosts change: the commit just made is on disk; end this job so the
    driver starts the next one on the new hosts (it resumes from that commit)."""
    _end_job(state, RESTART_STATUS, f"elastic: the hosts changed; commit {state.commit_id} is saved, ending this "
             "job so unisonrun starts it on the new hosts")


def _end_job(state: Any, status: int, saved: str | None = None) -> None:
    """Every rank of the job ends it together with ``status`` (a collective), its commit on disk first;
    ``saved`` is logged once every rank's is."""
    from unison.run.report import exiting_line

    if state.store is not None:
        settle_last_spill(state.store)
    st = runtime._state
    # this rank's part of the commit is on disk and it will exit: once every rank said so, the driver ends an
    # mpirun that outlives them all (see supervise.py). Said before the barrier, so before any rank can exit
    # (through the mpi4py wrapper's MPI_Abort, which may take the others down before they could say it).
    rank, size = (st.rank, st.size) if st is not None else (0, 1)
    print(exiting_line(status, rank, size), flush=True)
    if st is not None and st.comm is not None:
        st.comm.Barrier()  # every host's writer has its copy on disk before any rank exits (and aborts the rest)
    if saved is not None:
        logger.warning("%s", saved)
    runtime.shutdown()
    raise SystemExit(status)


#: how many times a reset is repeated when ranks keep failing during it
MAX_RESETS = 5


def _reset(state: Any, reset: Callable[[], Any], again: Callable[[], Any] | None = None) -> None:
    """Rebuild with ``reset()`` and run the reset callbacks; if a rank fails meanwhile, restore the commit
    and rebuild with ``again()`` (a recovery; ``reset`` by default).

    A failure during the recovery's own steps is handled inside it; one in a reset callback
    (a collective on the new world, say) or in a rebuild after a host update lands here.
    """
    for attempt in range(1, MAX_RESETS + 1):
        try:
            (reset if attempt == 1 or again is None else again)()
            state.on_reset()
            return
        except Exception as exc:
            if _failure(exc) is None or not enabled() or attempt == MAX_RESETS:
                raise
            if again is not None and not ulfm_enabled():  # recovering needs ULFM (see run_fn)
                logger.error("elastic: %s during the reset, and this job's MPI runs without ULFM, so the "
                             "ranks cannot go on in place; ending the job", exc)
                raise
            logger.warning("elastic: a rank failed during the reset (%s); rebuilding again", exc)
            state.restore()
