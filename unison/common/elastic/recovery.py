"""In-place recovery on ULFM: revoke, shrink, agree, rebuild Unison on the survivors.

[Note: in-place recovery]
Under ``mpirun --with-ft ulfm`` a rank's death does not end the job: the survivors' next
operation that involves the dead rank fails with ``ERR_PROC_FAILED``. The engine thread
turns that into :class:`~unison.common.exceptions.UnisonInternalError` for every pending
handle and revokes its communicators, so that survivors waiting only on each other are
released too (engine [Note: process failure]). The elastic ``run`` wrapper then calls
:func:`recover` on every survivor::

    revoke   the runtime's communicator and the engine's (every survivor's pending and
             later operations on them fail: nobody keeps waiting on the old world)
    shrink   MPI_Comm_shrink of the runtime's communicator: a new one of the survivors,
             ranks renumbered in the old order (fault-tolerant, collective)
    quorum   across hosts, survivors that are not a majority of the old world leave the job
             (see [Note: a partitioned job])
    agree    MPI_Comm_agree on "I can go on" (this rank's count >= UNISON_ELASTIC_MIN_NP):
             every survivor raises, or none does
    rebuild  runtime.shutdown() (stops the engine thread, drops ``State.cache``: the
             response cache, fusion buffers, negotiators, topologies), every registered
             process set forgets its id, unnamed-call counters restart, then
             runtime.init(comm=shrunk) with the same settings: new rank/size/local/cross
             values, a new engine thread on a duplicate of the shrunk communicator

Communicators of the old world are revoked, never freed: freeing one that a dead rank
belonged to is not safe everywhere, and a few of them per failure cost nothing.

[Note: a partitioned job]
When a link between hosts goes down and nothing has died, each side's failure detector
(``unisonrun --detect-lost-hosts``) declares the other side's ranks failed, and both sides
shrink: two jobs would go on, each with its own rank 0, writing the same checkpoints and logs
(seen on test hosts: both halves of a 2 x 2 job finished and wrote the same outcome file). So
the survivors go on only when they are a *quorum* of the world they shrank from: more than
half of its ranks, or exactly half holding its rank 0. Two disjoint sides cannot both be one,
so at most one side goes on. A side that is not one leaves the job: each of its ranks prints
:data:`unison.run.report.ELASTIC_LEFT` and ends its process at once with status 0. Not an
exception, which user code could catch and go on with; not ``MPI_Abort``, which would end the
other side's job wherever ``mpirun`` still reaches both; not a non-zero status, which ends a
ULFM job too (measured: ``mpirun --with-ft ulfm`` killed the other ranks 0.5 s after two
exited with status 3, and let them go on after status 0). Should the side that went away have
really died, nobody is left: under ``unisonrun``'s elastic driver the line makes the job count
as failed (the training function never returned) and it restarts from the commit on disk.

Each side can only count: it cannot tell a partition from a death. So when more than half
of the ranks die at once (or exactly half, rank 0 among them), the survivors leave too. A
partition can only cut a job that spans hosts: on one host a rank's death is reported by the
host's own daemon and nothing can split the ranks, so there the rule is off.
``UNISON_ELASTIC_QUORUM``: ``auto`` (the default; on when the job spans hosts), ``on``,
``off`` (any count of survivors >= ``UNISON_ELASTIC_MIN_NP`` goes on, as before).

[Note: a failure during recovery]
Another rank can die while the survivors shrink, agree or rebuild. Shrink and agree are fault
tolerant; agree, the rebuild's collectives (``init``'s agreement, the engine's first cycle) or
the reset callbacks then fail with ``ERR_PROC_FAILED``/``ERR_REVOKED`` on the survivors. So
:func:`recover` repeats: it revokes the communicator it got so far and shrinks *that* one again
(the runtime may already be shut down), up to ``MAX_ATTEMPTS`` times; and the elastic ``run``
loop repeats the whole reset (recovery and reset callbacks) when a rank fails during it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Collection
from typing import Any

from unison.common import runtime
from unison.common.config import ENV_ELASTIC, ENV_ELASTIC_MIN_NP, ENV_ELASTIC_QUORUM, SETTINGS, env_only_value
from unison.common.engine import frontend
from unison.common.engine.errors import process_failure
from unison.common.exceptions import UnisonError

__all__ = ["Recovery", "enabled", "min_np", "quorum_mode", "has_quorum", "recover", "rebuild", "last_recovery",
           "ENV_ELASTIC", "ENV_MIN_NP", "ENV_QUORUM"]

logger = logging.getLogger(__name__)

#: ``UNISON_ELASTIC_MIN_NP`` (defined, checked at init() and compared across ranks in the config)
ENV_MIN_NP = ENV_ELASTIC_MIN_NP
#: ``UNISON_ELASTIC_QUORUM`` (auto, on, off; see [Note: a partitioned job])
ENV_QUORUM = ENV_ELASTIC_QUORUM


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What one in-place recovery did, on this rank."""

    old_rank: int
    old_size: int
    rank: int
    size: int
    #: seconds from the start of :func:`recover` to the rebuilt runtime and engine
    seconds: float


_last: Recovery | None = None


def ulfm_enabled() -> bool:
    """Whether this job's MPI runs with ULFM, so survivors of a failure can go on in place: Open MPI
    reads ``OMPI_MCA_mpi_ft_enable``, which ``mpirun --with-ft ulfm`` (``unisonrun --elastic``'s in-place
    tier) and ``--mca mpi_ft_enable 1`` set in every rank's environment."""
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true", "yes", "on", "enabled")


def enabled() -> bool:
    """Whether elastic mode is on (``UNISON_ELASTIC=1``; ``unisonrun --elastic`` sets it).

    Raises:
        ValueError: the variable is set to something other than a boolean.
    """
    return bool(env_only_value(ENV_ELASTIC))


def min_np() -> int:
    """The fewest ranks the job may shrink to (``UNISON_ELASTIC_MIN_NP``, default 1)."""
    return int(env_only_value(ENV_ELASTIC_MIN_NP))


def quorum_mode() -> str:
    """``UNISON_ELASTIC_QUORUM``: ``auto`` (default), ``on`` or ``off`` (see [Note: a partitioned job])."""
    return str(env_only_value(ENV_ELASTIC_QUORUM))


def has_quorum(old_size: int, survivors: Collection[int]) -> bool:
    """Whether ``survivors`` (their ranks in the world of ``old_size`` ranks they shrank from) may go on:
    more than half of that world, or exactly half holding its rank 0. Two disjoint sets of ranks of
    one world cannot both have it (see [Note: a partitioned job])."""
    count = len(survivors)
    return 2 * count > old_size or (2 * count == old_size and 0 in survivors)


def last_recovery() -> Recovery | None:
    """The most recent recovery of this process (None before the first)."""
    return _last


def _revoke(comm: Any) -> None:
    try:
        comm.Revoke()
    except Exception:  # noqa: BLE001 - already revoked: the aim is reached
        logger.debug("revoke failed", exc_info=True)


def _settings(config: Any) -> dict[str, Any]:
    """The running configuration's settings that were set, as ``init()`` arguments, so a rebuild keeps every
    setting; the ones left at their defaults stay unset, so that what depends on a setting having been set
    (autotune keeps set values, a set log level gets a handler) is as it was (the defaults passed as
    arguments counted as set: autotune tuned nothing after a reset)."""
    sources = getattr(config, "sources", {}) or {}
    return {s.field: getattr(config, s.field) for s in SETTINGS if sources.get(s.field, "default") != "default"}


def _shrink(st: runtime.State) -> Any:
    """Revoke the old world's communicators; return the survivors' communicator."""
    eng = st.cache.get("engine")
    if eng is not None:
        eng.revoke()
    return _shrink_again(st.comm, st.mpi)


def _survivors(shrunk: Any, world: Any, mpi: Any) -> list[int]:
    """The ranks in ``world`` (the communicator before the failure) of ``shrunk``'s members."""
    group, old = shrunk.Get_group(), world.Get_group()
    try:
        return [r for r in mpi.Group.Translate_ranks(group, list(range(group.Get_size())), old)
                if r != mpi.UNDEFINED]
    finally:
        group.Free()
        old.Free()


def _leave_the_job(old_rank: int, old_size: int, survivors: list[int]) -> None:
    """This rank is on the side of a split (or of a mass death) that may not go on: say so, end the process."""
    from unison.run.report import ELASTIC_LEFT

    sys.stderr.write(
        f"{ELASTIC_LEFT}: rank {old_rank} of {old_size} is with only {len(survivors)} of the {old_size} ranks "
        f"(ranks {', '.join(map(str, survivors))}), not more than half of them nor half holding rank 0. The "
        f"others may still be alive behind a cut link and go on without these ranks, so these ranks end their "
        f"processes now (status 0, so that mpirun does not end the others' job) instead of training as a second "
        f"job beside them. If the others died, restart the job from its last checkpoint (unisonrun --elastic "
        f"does that itself). UNISON_{ENV_ELASTIC_QUORUM}=off lets any number of survivors go on.\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(0)  # [Note: a partitioned job]: not an exception, not MPI_Abort, not a non-zero status


def _needs_quorum(st: runtime.State) -> bool:
    mode = quorum_mode()
    return mode == "on" or (mode == "auto" and st.local_size < st.size)


def _agree_to_continue(shrunk: Any, st: runtime.State, world: Any = None) -> None:
    """A side without a quorum of the world before the failure (``st``; its ranks in ``world``, by default
    ``st.comm``) leaves the job; then every survivor raises, or none does (``MPI_Comm_agree`` is fault
    tolerant)."""
    if _needs_quorum(st):
        survivors = _survivors(shrunk, st.comm if world is None else world, st.mpi)
        if not shrunk.Agree(1 if has_quorum(st.size, survivors) else 0):
            _leave_the_job(st.rank, st.size, survivors)
    need = min_np()
    ok = shrunk.Agree(1 if shrunk.Get_size() >= need else 0)
    if not ok:
        from unison.run.report import exiting_line

        # every survivor ends the job (MPI_Abort, through the excepthook): say so first, so that unisonrun
        # ends an mpirun that outlives them (seen: [Note: a prterun that outlives its ranks] in supervise.py)
        print(exiting_line(1, shrunk.Get_rank(), shrunk.Get_size()), flush=True)
        raise UnisonError(f"elastic: {shrunk.Get_size()} rank(s) survived, fewer than the minimum of "
                          f"{need} (UNISON_ELASTIC_MIN_NP / unisonrun --min-np); ending the job. Restart "
                          "it on more hosts, or lower --min-np")


def _shrink_again(comm: Any, mpi: Any) -> Any:
    """Revoke ``comm`` (the old world, or a recovery's own communicator that lost a rank too) and shrink it."""
    _revoke(comm)
    shrunk = comm.Shrink()
    shrunk.Set_errhandler(mpi.ERRORS_RETURN)
    return shrunk


def _rebuild(st: runtime.State, shrunk: Any, sets: list[Any]) -> None:
    """Shut the old runtime and engine down (unless an earlier attempt did) and start them on ``shrunk``."""
    if runtime.is_initialized():
        runtime.state().owns_comm = False  # revoked, never freed (see [Note: in-place recovery])
        runtime.shutdown(rebuild=True)
    for ps in sets:  # their ranks named the old world: re-register them in a reset callback
        ps.process_set_id = None
    frontend.reset_auto_names()
    runtime.init(comm=shrunk, **_settings(st.config))


def _go_on_without_the_failed(st: runtime.State, world: Any, sets: list[Any], shrink: Callable[[], Any]) -> None:
    """Shrink ``world`` (``shrink()``: the survivors' communicator), agree to go on, and start Unison on the
    survivors; shrink again when more ranks fail meanwhile (see [Note: a failure during recovery])."""
    comm = world
    for attempt in range(1, MAX_ATTEMPTS + 1):
        shrunk = shrink() if attempt == 1 else _shrink_again(comm, st.mpi)
        try:
            _agree_to_continue(shrunk, st, world)
            _rebuild(st, shrunk, sets)
            return
        except Exception as exc:
            if process_failure(exc, st.mpi) is None or attempt == MAX_ATTEMPTS:
                raise
            logger.warning("elastic: another rank failed during recovery (%s); shrinking again", exc)
            comm = shrunk


def rebuild() -> None:
    """Rebuild Unison on the same ranks after a host update (collective over every rank; no rank failed).

    [Note: a host update without a failure]
    A ``HostsUpdatedInterrupt`` comes from a commit at which every rank agreed that the hosts
    changed ([Note: one host update, one reset] in state.py), so every rank is alive and here. The
    world itself cannot grow in place (under ``unisonrun``'s elastic driver a host change restarts
    the job instead), so this rebuild keeps the ranks: ``runtime.shutdown()`` and ``runtime.init()``
    on a duplicate of the current communicator, with the same settings, every registered process set
    forgetting its id, as after a recovery. No Revoke and no Shrink: they need ULFM, and without it
    (plain ``mpirun``) ``MPI_Comm_shrink`` never returned on any rank; before 2026-12-05 a host update
    went through :func:`recover` and hung every rank of a job without ULFM. A rank that fails during
    the rebuild is met like any failure: the ``run`` loop restores the commit and calls :func:`recover`.
    """
    st = runtime.state("elastic reset")
    eng = st.cache.get("engine")
    sets = eng.registered_sets()[1:] if eng is not None else []
    base = st.comm.Dup() if st.comm is not None else None  # (shutdown frees the runtime's own)
    runtime.shutdown(rebuild=True)
    for ps in sets:  # as in _rebuild: a reset callback registers them again
        ps.process_set_id = None
    frontend.reset_auto_names()
    revoked = False
    try:
        runtime.init(comm=base, **_settings(st.config))
    except Exception as exc:
        # a rank failed during the rebuild: its failed init() shut the runtime down again, so the run loop's
        # recover() had no runtime to start from and the survivors ended with MPI_ERR_PROC_FAILED (before
        # 2026-12-07). They go on without it from ``base``, which every one of them holds, as recover() does
        if base is None or process_failure(exc, st.mpi) is None or not ulfm_enabled():
            raise
        logger.warning("elastic: a rank failed while rebuilding after a host update (%s); going on without it",
                       exc)
        revoked = True
        start = time.monotonic()
        _go_on_without_the_failed(st, base, sets, lambda: _shrink_again(base, st.mpi))
        global _last
        _last = Recovery(st.rank, st.size, runtime.rank(), runtime.size(), time.monotonic() - start)
        return
    finally:
        if base is not None and not revoked:
            base.Free()  # (init works on a duplicate of it; freed when init fails too; a revoked one is not)
    logger.warning("elastic: the hosts changed; rebuilt on the same %d rank(s), no rank failed", runtime.size())


#: how many times :func:`recover` shrinks again when more ranks fail during it
MAX_ATTEMPTS = 5


def recover() -> Recovery:
    """Rebuild Unison on the ranks that survived a failure (collective over the survivors).

    A rank that fails during the recovery makes the survivors shrink again (see
    [Note: a failure during recovery]).

    Returns:
        The old and new rank and size, and how long it took.

    Raises:
        UnisonError: not running under MPI, or fewer ranks survived than the minimum.
    """
    global _last
    start = time.monotonic()
    st = runtime.state("elastic recovery")
    if st.comm is None:
        raise UnisonError("elastic recovery needs MPI with ULFM: launch with unisonrun --elastic "
                          "(mpirun --with-ft ulfm)")
    eng = st.cache.get("engine")
    sets = eng.registered_sets()[1:] if eng is not None else []
    _go_on_without_the_failed(st, st.comm, sets, lambda: _shrink(st))
    _last = Recovery(st.rank, st.size, runtime.rank(), runtime.size(), time.monotonic() - start)
    logger.warning("elastic: recovered after a failure in %.3f s: rank %d of %d is now rank %d of %d",
                   _last.seconds, _last.old_rank, _last.old_size, _last.rank, _last.size)
    return _last
