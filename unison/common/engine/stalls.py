"""The stall inspector: names tensors some ranks submitted and others did not, for too long.

When the oldest pending request of a process set is older than
``UNISON_STALL_CHECK_TIME_SECONDS`` (or ``UNISON_STALL_SHUTDOWN_TIME_SECONDS``), the
rank raises ``FLAG_STALL_CHECK`` in its next negotiation; every rank of the set then
runs :func:`stall_round` in the same cycle: one all-gather of every rank's pending
names and their ages (JSON: controller [Note: wire records]). Every rank receives the
same data and judges it the same way, so no decision needs broadcasting. Rank 0 logs
the report. Past the shutdown time, every rank fails its pending handles of the set
with :class:`StallError`, logs why, and remembers the stalled names it never
submitted: its own late submission of such a name then fails at once with the same
message instead of waiting for ranks that have moved on.

A round is also due when a thread of this rank has been blocked in ``Handle.wait`` on one of the
set's pending requests for ``UNISON_DEADLOCK_TIME_SECONDS`` (default 60): when every rank of the
set is in that state and none submitted anything meanwhile, no rank can ever make progress, and
the round fails the pending handles the same way, with a message naming what each rank waits for
([Note: a deadlock is a stall nobody can end]).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from unison.common.config import Config
from unison.common.engine.controller import FLAG_STALL_CHECK, Controller, allgather_bytes
from unison.common.engine.errors import StallError
from unison.common.engine.handles import blocked_waits

__all__ = ["stall_flags", "stall_round"]

logger = logging.getLogger(__name__)


_limit_of: tuple[Config | None, float] = (None, 0.0)  # the last config asked about, and its limit


def _first_limit(cfg: Config) -> float:
    """The age at which a pending request is first judged: the check time, or the shutdown time
    when that is shorter (0: neither is set). Judged at the check time alone, a shutdown time
    below it did nothing until the check time."""
    limits = [t for t in (cfg.stall_check_time_seconds, cfg.stall_shutdown_time_seconds) if t]
    return min(limits) if limits else 0.0


def stall_flags(ctl: Controller, cfg: Config, last_report: float, others: Sequence[Controller] = ()) -> int:
    """``FLAG_STALL_CHECK`` when this rank's oldest pending request is due a check, or this rank has
    been blocked on one of them long enough to judge a deadlock, else 0.

    ``others``: for the job's own set, this rank's other sets, whose waits count for the job-wide
    deadlock check ([Note: a deadlock is a stall nobody can end])."""
    global _limit_of
    if cfg.stall_check_disable:
        return 0
    if _limit_of[0] is not cfg:  # (asked every cycle; a config never changes)
        _limit_of = (cfg, _first_limit(cfg))
    limit = _limit_of[1]
    now = time.monotonic()
    if ctl.pending and limit:
        oldest = min(req.submitted for req in ctl.pending.values())
        if now - oldest >= limit and now - last_report >= limit:
            return FLAG_STALL_CHECK
        shutdown = cfg.stall_shutdown_time_seconds
        if shutdown and now - oldest >= shutdown and last_report < oldest + shutdown:
            # due now, not at the next check: spaced by the check time alone, the rounds let a shutdown
            # time between two of them wait for the later one (check 60 s, shutdown 90 s: failed at 120 s)
            return FLAG_STALL_CHECK
    deadlock = cfg.deadlock_time_seconds
    if not deadlock:
        return 0
    ctls = (ctl, *others)
    if not any(c.pending for c in ctls):
        return 0
    last_add = max(c.last_add for c in ctls)
    if now - last_add < deadlock or now - min(r.submitted for c in ctls for r in c.pending.values()) < deadlock:
        return 0
    waits = _blocked_on(ctls)  # (only read once a request is that old: a stall, not a step)
    if waits:
        since = min(waits.values())
        if now - since >= deadlock and last_report < max(since, last_add) + deadlock:
            return FLAG_STALL_CHECK  # once per blocked spell: the round judges every rank's
    return 0


def _blocked_on(ctls: Sequence[Controller]) -> dict[tuple[int, str], float]:
    """{(set id, name): when a thread blocked on it} for the pending requests of ``ctls`` that a thread of
    this process waits on."""
    waits = blocked_waits()
    if not waits:
        return {}
    pending = {id(req.handle): (c.set_id, name) for c in ctls for name, req in c.pending.items()}
    out: dict[tuple[int, str], float] = {}
    for handle, since in waits:
        key = pending.get(id(handle))
        if key is not None:
            out[key] = min(since, out.get(key, since))
    return out


def stall_round(ctl: Controller, mpi: Any, cfg: Config, abandon: str | None = None,
                job_ranks: Callable[[list[int]], list[int]] | None = None,
                job_rank: int | None = None, others: Sequence[Controller] = ()) -> str | None:
    """Collective over the set: judge stalls alike on every rank; fail them past the shutdown time,
    or at once when a rank abandons its collectives (``abandon``: its reason; see [Note: abandoned
    collectives] in :mod:`.engine`).

    ``job_ranks`` turns ranks of the set into ranks of the job and ``job_rank`` is this rank's: the
    reports name those (the set's own numbering named another process than the one stalled).
    ``others``: on the job's own set, this rank's other sets: the deadlock check then judges the whole
    job, and a deadlock fails their pending handles too.

    Returns:
        The failure message when the set's pending handles were failed, else None.
    """
    now = time.monotonic()
    to_job = job_ranks or (lambda ranks: ranks)
    me = ctl.rank if job_rank is None else job_rank
    ctls = (ctl, *others)
    mine = [{name: now - req.submitted for name, req in ctl.pending.items()}, ctl.joined_ranks, abandon or "",
            [[sid, name, now - since] for (sid, name), since in _blocked_on(ctls).items()],
            now - max(c.last_add for c in ctls),
            {str(c.set_id): [list(c.job_ranks or range(c.size)), sorted(c.pending)] for c in others}]
    everyone = [_decode(raw, r) for r, raw in
                enumerate(allgather_bytes(ctl.comm, mpi, json.dumps(mine).encode()))]
    gave_up = [(r, report[2]) for r, report in enumerate(everyone) if report[2]]
    reports = [(report[0], report[1], report[2]) for report in everyone]
    if gave_up:
        verdict = _abandoned(reports, gave_up, ctl.size, to_job)
    else:
        stuck = _deadlocked(everyone, ctl.set_id, ctl.size, cfg.deadlock_time_seconds, to_job)
        if stuck is not None:
            message, absent = stuck
            for c in ctls:
                c.fail_all(StallError(message))
                c.mark_stalled({name: message for (sid, name), ranks in absent.items()
                                if sid == c.set_id and me in ranks})
            logger.error("[unison rank %d] the stall inspector failed the pending collectives of every rank "
                         "(process set %d%s): %s", me, ctl.set_id, " and this rank's other sets" if others else "",
                         message)
            return message
        verdict = _judge(reports, ctl.size, cfg, log=ctl.rank == 0, to_job=to_job, me=me)
    if verdict is None:
        return None
    message, missing = verdict
    ctl.fail_all(StallError(message))
    if not gave_up:
        # (an abandon fails every member's pending handles in each of its cycles while it lasts, late ones
        # too; remembered past it, a name the giving-up rank never submitted failed its next step's call at
        # once while its peers' waited: a deadlock, before 2026-12-05)
        ctl.mark_stalled({name: message for name, ranks in missing.items() if ctl.rank in ranks})
    logger.error("[unison rank %d] the stall inspector failed the pending collectives of every rank "
                 "(process set %d): %s", me, ctl.set_id, message)
    return message


#: one rank's stall report: {pending name: age}, joined ranks, abandon reason, [[set id, name, seconds a
#: thread has been blocked on it]], seconds since its last submission (to any of the sets judged), and for
#: the job's own set {other set id: [its job ranks, its pending names]}
_Report = tuple[dict[str, float], list[int], str, list[tuple[int, str, float]], float,
                dict[int, tuple[list[int], list[str]]]]


def _decode(raw: bytes, rank: int) -> _Report:
    try:
        pending, joined, abandon, waits, quiet, sets = json.loads(raw)
        if not (isinstance(pending, dict) and isinstance(joined, list) and isinstance(abandon, str)
                and isinstance(waits, list) and isinstance(sets, dict)):
            raise ValueError("expected [pending, joined, abandon, waits, quiet, sets]")
        return ({str(k): float(v) for k, v in pending.items()}, [int(r) for r in joined], abandon,
                [(int(sid), str(name), float(age)) for sid, name, age in waits], float(quiet),
                {int(sid): ([int(r) for r in ranks], [str(n) for n in names])
                 for sid, (ranks, names) in sets.items()})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"malformed stall report from rank {rank} ({exc}): every rank must run the "
                         "same Unison version") from None


def _abandoned(everyone: list[tuple[dict[str, float], list[int], str]], gave_up: list[tuple[int, str]],
               size: int, to_job: Callable[[list[int]], list[int]]) -> tuple[str, dict[str, list[int]]] | None:
    """(message, {pending name: ranks missing it}) when any rank has something pending, else None."""
    have: dict[str, set[int]] = {}
    for r, (pending, _, _) in enumerate(everyone):
        for name in pending:
            have.setdefault(name, set()).add(r)
    if not have:
        return None
    missing = {name: [r for r in range(size) if r not in ranks] for name, ranks in have.items()}
    reasons = "; ".join(f"rank {to_job([r])[0]}: {reason}" for r, reason in gave_up)
    return (f"collective(s) {sorted(have)} failed on every rank of the process set: rank(s) "
            f"{to_job([r for r, _ in gave_up])} gave up on them and will not submit them ({reasons})"), missing


def _deadlocked(everyone: list[_Report], set_id: int, size: int, limit: float,
                to_job: Callable[[list[int]], list[int]]) -> tuple[str, dict[tuple[int, str], list[int]]] | None:
    """(message, {(set id, pending name): job ranks that never submitted it}) when no rank of the set can
    make progress, else None.

    [Note: a deadlock is a stall nobody can end] The stall inspector alone only warns (Horovod's
    default): ranks that wait on collectives the others never submit wait for ever. That case is
    certain when every rank of a set has a thread blocked in ``Handle.wait`` on one of its own
    pending requests of that set, for ``limit`` seconds, and has submitted nothing to it in that
    time: a pending request lacks some rank's submission (one every rank submitted is negotiated
    within a cycle), and a rank whose thread is blocked submits no more. On the job's own set the
    same holds for the whole job with each rank blocked on a pending request of *any* of its sets
    (rank 0 waiting in the job's set for a rank that waits in a data-parallel set for another that
    waits in the job's set: no single set sees every rank blocked). A rank that is elsewhere
    (computing, in an MPI call of its own, in a wait with a timeout, which returns to other work) does
    not count as blocked, so the inspector only warns about it as before; a joined rank is left out
    (it submits nothing more, and the others' collectives do not need it). What this cannot see is
    another thread of a blocked process that would submit the missing collective after more than
    ``limit`` seconds of work of its own: ``UNISON_DEADLOCK_TIME_SECONDS`` above that, or 0, for such
    a program (docs/engine.md, "Deadlocks").
    """
    joined = set(everyone[0][1])  # (a joined rank submits nothing more: it waits in join() for the others)
    if not limit or size - len(joined) < 2:
        return None
    members = {set_id: to_job(list(range(size)))}
    holders: dict[tuple[int, str], set[int]] = {}
    for r, (pending, _, _, waits, quiet, sets) in enumerate(everyone):
        if r not in joined and (quiet < limit or not waits or max(age for _, _, age in waits) < limit):
            return None
        job_rank = to_job([r])[0]
        for name in pending:
            holders.setdefault((set_id, name), set()).add(job_rank)
        for sid, (ranks, names) in sets.items():
            members[sid] = ranks
            for name in names:
                holders.setdefault((sid, name), set()).add(job_rank)
    gone = set(to_job(sorted(joined)))  # (joined in every set it belongs to)
    absent = {key: [r for r in members[key[0]] if r not in have and r not in gone]
              for key, have in holders.items()}
    absent = {key: ranks for key, ranks in absent.items() if ranks}
    lines = []
    for r, (_, _, _, waits, _, _) in enumerate(everyone):
        if r in joined:
            continue
        sid, name, age = max(waits, key=lambda w: (w[2], w[0], w[1]))
        if (sid, name) not in absent:
            return None  # (every rank of its set submitted it: it runs in the next cycle)
        where = "" if sid == set_id else f" on process set {sid} (ranks {members[sid]})"
        lines.append(f"rank {to_job([r])[0]} waits for {name!r}{where} ({age:.1f} s), which rank(s) "
                     f"{absent[(sid, name)]} never submitted")
    if gone:
        lines.append(f"rank(s) {sorted(gone)} joined")
    scope = "the job" if set_id == 0 else f"process set {set_id} (ranks {members[set_id]})"
    return (f"deadlock: every rank of {scope} has waited at least {limit:g} s for a collective that "
            f"another rank has not submitted, and none has submitted anything since: {'; '.join(lines)}. "
            "Every rank must run the same collectives (names, and the order it waits on them); a rank "
            "that runs out of batches before the others calls join(). UNISON_DEADLOCK_TIME_SECONDS sets "
            "this limit (0: never fail, only warn)"), absent


def _judge(everyone: list[tuple[dict[str, float], list[int], str]], size: int, cfg: Config, log: bool,
           to_job: Callable[[list[int]], list[int]], me: int) -> tuple[str, dict[str, list[int]]] | None:
    """(message, {stalled name: ranks missing it}) when past the shutdown time, else None."""
    ages: dict[str, float] = {}
    have: dict[str, set[int]] = {}
    joined = set(everyone[0][1])
    for r, (pending, _, _) in enumerate(everyone):
        for name, age in pending.items():
            ages[name] = max(ages.get(name, 0.0), age)
            have.setdefault(name, set()).add(r)
    lines, missing = [], {}
    worst = 0.0
    for name in sorted(have, key=lambda k: (-ages[k], k)):
        absent = [r for r in range(size) if r not in have[name] and r not in joined]
        if not absent:
            continue
        missing[name] = absent
        if ages[name] >= (_first_limit(cfg) or ages[name]):
            lines.append(f"{name!r} (waiting {ages[name]:.1f} s) missing on rank(s) {to_job(absent)}")
            worst = max(worst, ages[name])
    if not lines:
        return None
    report = "; ".join(lines)
    if log:
        logger.warning("[unison rank %d] stalled collectives: %s. Some ranks submitted these tensors and "
                       "others have not: check that every rank runs the same collectives.", me, report)
    if cfg.stall_shutdown_time_seconds and worst >= cfg.stall_shutdown_time_seconds:
        # every pending handle fails, so every name some rank has not submitted is remembered there, the
        # young ones too: a late rank's call of a name submitted after the oldest stalled one paired with
        # its peers' next-step call, silently (110 for 200, before 2026-12-05)
        return (f"stalled for more than UNISON_STALL_SHUTDOWN_TIME_SECONDS="
                f"{cfg.stall_shutdown_time_seconds:g} s: {report}"), missing
    return None
