"""Which ranks a table is created on: every rank that creates it must name the same ones.

[Note: agreeing on a table's ranks]
A table over a process set builds its communicator from the set's ranks (``MPI_Comm_create_group``,
collective over those ranks only); a table over every rank runs its checks on the job's
communicator. Ranks that passed different ``process_set`` values met in different calls: at 2 ranks,
rank 0 giving ``ProcessSet([0, 1])`` and rank 1 none, one rank waited in ``Create_group`` while the
other waited in an allgather on the same communicator, a hang or a segfault in Open MPI's shared-memory
transport (an audit, 2026-12-06). So before either, the ranks exchange what they were given, point to
point on the job's communicator under a tag of their own: each rank sends its description (the ranks it
names, and whether a set was given) to every rank it knows takes part and waits for theirs; a
description that names a rank it did not know of adds that rank (it sends its own there too). Once a
rank has heard from every rank it knows of, it compares: any difference raises a :class:`TableError`
on every rank that heard it, before any collective, so nobody is left in one.

[Note: a description for a later table]
A rank that is not one of this table's names it (it heard of this rank from nobody) is received all the
same, to catch a rank whose set names this one. But a rank of another set may be creating its *next*
table already, one over every rank, whose description names this rank too: at 3 ranks, ranks 0 and 1
agreeing on a table over ``[0, 1]`` took rank 2's description of its next table (over every rank) for
theirs and raised "ranks disagree" (seen once in 7 runs of the tests, 2026-12-07). So each description
carries a hash of the table's name: one from a rank this one does not know of, for another name, is
kept for a later call (in the order it came: MPI keeps each sender's messages in order) and not
compared. From a rank this one knows takes part, the next message is this table's (it cannot have
gone on without this rank's description), so another name there is a disagreement.

Left undetected (a rank cannot wait for a rank it has no word of): a rank whose set leaves out a rank
that names it, and that hears of that rank from nobody else, creates its table; the rank that named it
waits, as in any collective that a rank skips.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import numpy as np

__all__ = ["TAG", "describe", "agree_members"]

#: the tag of the descriptions, on the job's communicator (the table's own communicators do not exist yet)
TAG = 32017


def describe(given: list[int] | None, size: int) -> list[int]:
    """``[1 if a set was given else 0] + the sorted ranks it names`` (every rank for none)."""
    return [0] + list(range(size)) if given is None else [1] + sorted(given)


def _text(desc: list[int]) -> str:
    return f"process_set ranks {desc[1:]}" if desc[0] else "no process_set (every rank)"


#: descriptions received for a later table ([Note: a description for a later table]): sender -> in order
_later: dict[int, list[list[int]]] = {}


def agree_members(comm: Any, mpi: Any, me: int, mine: list[int], error: type[Exception],
                  name: str | None = None) -> None:
    """Exchange descriptions (:func:`describe`) with every rank taking part; raise ``error`` on a difference.
    ``name``: the table's name as given (None: unnamed), which each description carries as a hash."""
    tag = zlib.crc32((name or "").encode("utf-8"))
    known = set(mine[1:]) - {me}
    heard: dict[int, list[int]] = {}
    names: dict[int, int] = {}
    sent: set[int] = set()
    sends = []
    buf = np.array([tag, *mine], np.int64)
    status = mpi.Status()
    idle = 0.0

    def take(source: int, got: list[int]) -> None:
        nonlocal known
        names[source], heard[source] = got[0], got[1:]
        known |= (set(heard[source][1:]) | {source}) - {me}

    while True:
        for r in sorted(known - sent):
            sends.append(comm.Isend([buf, mpi.INT64_T], r, TAG))
            sent.add(r)
        waiting = sorted(known - set(heard))
        if not waiting:
            break
        kept = next((r for r in waiting if _later.get(r)), None)  # (came before anything still in MPI's queue)
        if kept is not None:
            take(kept, _later[kept].pop(0))
            continue
        # the ranks it waits for, then anyone (a rank that names this one unknown to it); a rank already heard
        # is not received again (its message is for a later table)
        source = next((r for r in waiting if comm.Iprobe(r, TAG, status)), None)
        if source is None and comm.Iprobe(mpi.ANY_SOURCE, TAG, status) and status.Get_source() not in heard:
            source = status.Get_source()
        if source is None:
            time.sleep(idle)
            idle = min(1e-3, idle * 2 + 2e-5)
            continue
        idle = 0.0
        got = np.empty(status.Get_count(mpi.INT64_T), np.int64)
        comm.Recv([got, mpi.INT64_T], source, TAG)
        if source not in known and int(got[0]) != tag:  # another table's, from a rank not of this one: later
            _later.setdefault(source, []).append(got.tolist())
            continue
        take(source, got.tolist())
    mpi.Request.Waitall(sends)
    differ = sorted(r for r, d in heard.items() if d != mine or names[r] != tag)
    if differ:
        shown = ", ".join(f"rank {r} gives {_text(heard[r])}" + ("" if names[r] == tag else " for another "
                          "table name") for r in differ[:3])
        raise error(
            f"ShardedTable(process_set=...): ranks disagree about the table's ranks: rank {me} gives "
            f"{_text(mine)}, {shown}; pass the same process_set (and name) on every rank of the table"
        )
