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
from collections.abc import Callable
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


def stall_flags(ctl: Controller, cfg: Config, last_report: float) -> int:
    """``FLAG_STALL_CHECK`` when this rank's oldest pending request is due a check, or this rank has
    been blocked on one of them long enough to judge a deadlock, else 0."""
    global _limit_of
    if cfg.stall_check_disable or not ctl.pending:
        return 0
    if _limit_of[0] is not cfg:  # (asked every cycle; a config never changes)
        _limit_of = (cfg, _first_limit(cfg))
    limit = _limit_of[1]
    deadlock = cfg.deadlock_time_seconds
    if not (limit or deadlock):
        return 0
    now = time.monotonic()
    oldest = min(req.submitted for req in ctl.pending.values())
    if limit and now - oldest >= limit and now - last_report >= limit:
        return FLAG_STALL_CHECK
    shutdown = cfg.stall_shutdown_time_seconds
    if shutdown and now - oldest >= shutdown and last_report < oldest + shutdown:
        # due now, not at the next check: spaced by the check time alone, the rounds let a shutdown
        # time between two of them wait for the later one (check 60 s, shutdown 90 s: failed at 120 s)
        return FLAG_STALL_CHECK
    if deadlock and now - oldest >= deadlock and now - ctl.last_add >= deadlock:
        since = _blocked_since(ctl)  # (only read once a request is that old: a stall, not a step)
        if since is not None and now - since >= deadlock and last_report < max(since, ctl.last_add) + deadlock:
            return FLAG_STALL_CHECK  # once per blocked spell: the round judges every rank's
    return 0


def _blocked_since(ctl: Controller) -> float | None:
    """When this rank's longest-blocked wait on one of ``ctl``'s pending requests blocked (None: no
    thread is blocked on one)."""
    mine = _blocked_on(ctl)
    return min(mine.values()) if mine else None


def _blocked_on(ctl: Controller) -> dict[str, float]:
    """{name: when a thread blocked on it} for this set's pending requests some thread waits on."""
    waits = blocked_waits()
    if not waits:
        return {}
    pending = {id(req.handle): name for name, req in ctl.pending.items()}
    out: dict[str, float] = {}
    for handle, since in waits:
        name = pending.get(id(handle))
        if name is not None:
            out[name] = min(since, out.get(name, since))
    return out


def stall_round(ctl: Controller, mpi: Any, cfg: Config, abandon: str | None = None,
                job_ranks: Callable[[list[int]], list[int]] | None = None,
                job_rank: int | None = None) -> str | None:
    """Collective over the set: judge stalls alike on every rank; fail them past the shutdown time,
    or at once when a rank abandons its collectives (``abandon``: its reason; see [Note: abandoned
    collectives] in :mod:`.engine`).

    ``job_ranks`` turns ranks of the set into ranks of the job and ``job_rank`` is this rank's: the
    reports name those (the set's own numbering named another process than the one stalled).

    Returns:
        The failure message when the set's pending handles were failed, else None.
    """
    now = time.monotonic()
    mine = [{name: now - req.submitted for name, req in ctl.pending.items()}, ctl.joined_ranks, abandon or "",
            {name: now - since for name, since in _blocked_on(ctl).items()}, now - ctl.last_add]
    everyone = [_decode(raw, r) for r, raw in
                enumerate(allgather_bytes(ctl.comm, mpi, json.dumps(mine).encode()))]
    gave_up = [(r, report[2]) for r, report in enumerate(everyone) if report[2]]
    to_job = job_ranks or (lambda ranks: ranks)
    me = ctl.rank if job_rank is None else job_rank
    reports = [(pending, joined, reason) for pending, joined, reason, _, _ in everyone]
    if gave_up:
        verdict = _abandoned(reports, gave_up, ctl.size, to_job)
    else:
        verdict = _deadlocked(everyone, ctl.size, cfg.deadlock_time_seconds, to_job) or _judge(
            reports, ctl.size, cfg, log=ctl.rank == 0, to_job=to_job, me=me)
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


#: one rank's stall report: {pending name: age}, joined ranks, abandon reason, {name a thread is blocked
#: on: for how long}, seconds since its last submission to the set
_Report = tuple[dict[str, float], list[int], str, dict[str, float], float]


def _decode(raw: bytes, rank: int) -> _Report:
    try:
        pending, joined, abandon, waits, quiet = json.loads(raw)
        if not (isinstance(pending, dict) and isinstance(joined, list) and isinstance(abandon, str)
                and isinstance(waits, dict)):
            raise ValueError("expected [pending, joined, abandon, waits, quiet]")
        return ({str(k): float(v) for k, v in pending.items()}, [int(r) for r in joined], abandon,
                {str(k): float(v) for k, v in waits.items()}, float(quiet))
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


def _deadlocked(everyone: list[_Report], size: int, limit: float,
                to_job: Callable[[list[int]], list[int]]) -> tuple[str, dict[str, list[int]]] | None:
    """(message, {pending name: ranks missing it}) when no rank of the set can make progress, else None.

    [Note: a deadlock is a stall nobody can end] The stall inspector alone only warns (Horovod's
    default): ranks that wait on collectives the others never submit wait for ever. That case is
    certain when every rank of the set has a thread blocked in ``Handle.wait`` on one of its own
    pending requests of this set, for ``limit`` seconds, and has submitted nothing to the set in
    that time: a pending request lacks some rank's submission (one every rank submitted is
    negotiated within a cycle), and a rank whose thread is blocked submits no more. A rank that
    is elsewhere (computing, in an MPI call of its own, joined) does not count as blocked, so the
    inspector only warns about it as before. What this cannot see is another thread of a blocked
    process that would submit the missing collective after more than ``limit`` seconds of work of
    its own: ``UNISON_DEADLOCK_TIME_SECONDS`` above that, or 0, for such a program.
    """
    if not limit or size < 2 or any(joined for _, joined, _, _, _ in everyone):
        return None
    for _, _, _, waits, quiet in everyone:
        if quiet < limit or not waits or max(waits.values()) < limit:
            return None
    have: dict[str, set[int]] = {}
    for r, (pending, _, _, _, _) in enumerate(everyone):
        for name in pending:
            have.setdefault(name, set()).add(r)
    missing = {name: [r for r in range(size) if r not in ranks] for name, ranks in have.items()
               if len(ranks) < size}
    lines = []
    for r, (_, _, _, waits, _) in enumerate(everyone):
        name = max(waits, key=lambda k: (waits[k], k))
        if name not in missing:
            return None  # (every rank submitted it: it runs in the next cycle)
        lines.append(f"rank {to_job([r])[0]} waits for {name!r} ({waits[name]:.1f} s), which rank(s) "
                     f"{to_job(missing[name])} never submitted")
    return (f"deadlock: every rank of the process set has waited at least {limit:g} s for a collective that "
            f"another rank has not submitted, and none has submitted anything since: {'; '.join(lines)}. "
            "Every rank must run the same collectives (names, and the order it waits on them); a rank "
            "that runs out of batches before the others calls join(). UNISON_DEADLOCK_TIME_SECONDS sets "
            "this limit (0: never fail, only warn)"), missing


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
