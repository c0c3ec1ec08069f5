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
    """``FLAG_STALL_CHECK`` when this rank's oldest pending request is due a check, else 0."""
    global _limit_of
    if cfg.stall_check_disable or not ctl.pending:
        return 0
    if _limit_of[0] is not cfg:  # (asked every cycle; a config never changes)
        _limit_of = (cfg, _first_limit(cfg))
    limit = _limit_of[1]
    if not limit:
        return 0
    now = time.monotonic()
    oldest = min(req.submitted for req in ctl.pending.values())
    if now - oldest >= limit and now - last_report >= limit:
        return FLAG_STALL_CHECK
    shutdown = cfg.stall_shutdown_time_seconds
    if shutdown and now - oldest >= shutdown and last_report < oldest + shutdown:
        # due now, not at the next check: spaced by the check time alone, the rounds let a shutdown
        # time between two of them wait for the later one (check 60 s, shutdown 90 s: failed at 120 s)
        return FLAG_STALL_CHECK
    return 0


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
    mine = [{name: now - req.submitted for name, req in ctl.pending.items()}, ctl.joined_ranks, abandon or ""]
    everyone = [_decode(raw, r) for r, raw in
                enumerate(allgather_bytes(ctl.comm, mpi, json.dumps(mine).encode()))]
    gave_up = [(r, reason) for r, (_, _, reason) in enumerate(everyone) if reason]
    to_job = job_ranks or (lambda ranks: ranks)
    me = ctl.rank if job_rank is None else job_rank
    verdict = _abandoned(everyone, gave_up, ctl.size, to_job) if gave_up else _judge(
        everyone, ctl.size, cfg, log=ctl.rank == 0, to_job=to_job, me=me)
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


def _decode(raw: bytes, rank: int) -> tuple[dict[str, float], list[int], str]:
    try:
        pending, joined, abandon = json.loads(raw)
        if not (isinstance(pending, dict) and isinstance(joined, list) and isinstance(abandon, str)):
            raise ValueError("expected [pending, joined, abandon]")
        return {str(k): float(v) for k, v in pending.items()}, [int(r) for r in joined], abandon
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
