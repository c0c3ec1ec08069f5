"""Commits spilled to each host's disk, so a job the driver restarts carries on from the last one.

[Note: the restart tier's commits]
In the restart tier (no ULFM, a lost host's daemon, a host added or removed) ``unisonrun``'s
driver ends the MPI job and starts a new one; no process survives, so the last commit must
outlive them without a shared disk and without a checkpoint the user wrote. Under the driver
(``UNISON_ELASTIC_STATE_DIR`` set), every ``commit()`` therefore also writes the committed
state to a folder of *this host* (``<dir>/<hostname>/commit-<job>-<id>.bin``), from a background
thread (the copy ``commit()`` took is written; training goes on meanwhile; the next commit
waits for the previous write), atomically and durably (``unison.common.files``: fsync, rename,
fsync of the folder). Only each host's first local rank writes: in data-parallel training every
rank's commit is the same state (``sync()`` makes every rank adopt rank 0's), so one copy per
host gives as many copies as hosts, and the loss of any one host keeps every committed byte
while another host lives. Each host keeps its last two commits.

At the start of a restarted job, :func:`resume` finds the newest commit on any host (every
rank looks in its host's folder; an all-gather of the ids): ranks on a host that holds it read
it there, and when some host lacks it the lowest rank that holds it broadcasts it. Every rank
then holds the same commit, so the ``run`` loop skips its first ``sync()``. When no host
holds a commit although this is a restart (every host that held one was lost), it says so in
a warning and the program starts from its own initial state or checkpoint.

Commit ids count commits since the job's first start and travel with the state, so they keep
increasing across restarts; a commit is named by (the job attempt that wrote it, its id), compared
in that order, so a job that had to start over from nothing (no host kept a commit) still outranks
an older job's folder on a host that returns later. Before anything is sent, every rank learns which
holders could read the newest commit; if none could, each holder offers its next newest.

A commit file starts with a magic string and the SHA-256 of the pickled state. A holder reads
the file, checks both and unpickles it before it says it could read it, so a torn file (a host
that lost power mid-write on a file system without ordered writes), a flipped bit or a file
this version cannot unpickle counts as unreadable on every rank alike, and the ranks fall back
to another holder's copy or the next newest commit (before, the check was only that the file
opened: a truncated file raised on the rank that read it while the others went on, and a
flipped bit loaded silently).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import hashlib
import logging
import os
import pickle
import re
import socket
from pathlib import Path
from typing import Any

from unison.common import files, runtime
from unison.common.config import IntRange, parse_env, register_env

__all__ = ["CommitStore", "store_from_env", "resume", "mark_finished", "mark_entered", "ENV_STATE_DIR",
           "ENV_ATTEMPT", "ENV_NOTICE",
           "ENV_RESET_LIMIT", "reset_limit"]

logger = logging.getLogger(__name__)

#: ``UNISON_ELASTIC_STATE_DIR``: the folder (on every host) the driver gave this job for commits
ENV_STATE_DIR = "ELASTIC_STATE_DIR"
#: ``UNISON_ELASTIC_ATTEMPT``: how many times the driver started the job before this one
ENV_ATTEMPT = "ELASTIC_ATTEMPT"
#: ``UNISON_ELASTIC_NOTICE``: a file the driver writes when the hosts changed (see state.py)
ENV_NOTICE = "ELASTIC_NOTICE"
#: ``UNISON_ELASTIC_RESET_LIMIT``: how many resets in place this job may make (what is left of the driver's
#: ``--reset-limit``); unset: no limit
ENV_RESET_LIMIT = "ELASTIC_RESET_LIMIT"
register_env(ENV_STATE_DIR, ENV_ATTEMPT, ENV_NOTICE, ENV_RESET_LIMIT)

_NAME = re.compile(r"^commit-(\d{6})-(\d{12})\.bin$")
KEEP = 2


class CommitStore:
    """This host's folder of spilled commits; :meth:`write_async` writes one in the background."""

    def __init__(self, root: str | os.PathLike[str], host: str | None = None, writer: bool | None = None,
                 name: str | None = None) -> None:
        self.root = Path(root)
        self.folder = self.root / (host or socket.gethostname())
        if name is not None:  # one state's commits (a program with two states keeps them apart)
            self.folder = self.folder / name
        self._writer = writer
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[Path] | None = None
        #: a background write's error, until a commit takes it (see :meth:`settle`)
        self.failed: Exception | None = None

    @property
    def writer(self) -> bool:
        """Whether this rank writes its host's copies: the host's first local rank (asked again after a
        reset, which renumbers the ranks), or what the constructor was told."""
        if self._writer is not None:
            return self._writer
        st = runtime._state
        return st is None or st.local_rank == 0

    def path(self, key: tuple[int, int]) -> Path:
        """The file of commit ``key`` = (the job attempt that wrote it, the commit id)."""
        return self.folder / f"commit-{key[0]:06d}-{key[1]:012d}.bin"

    def ids(self) -> list[tuple[int, int]]:
        """The complete commits on this host as (attempt, commit id), oldest first.

        The attempt comes first: when no host kept a commit, a restarted job counts commits from 0
        again, and a host that returns later with an older job's folder must not win with a larger id.
        """
        if not self.folder.is_dir():
            return []
        return sorted((int(m.group(1)), int(m.group(2))) for p in self.folder.iterdir()
                      if (m := _NAME.match(p.name)))

    def newest(self) -> tuple[int, int] | None:
        found = self.ids()
        return found[-1] if found else None

    def write(self, commit_id: int, payload: bytes, job: int | None = None) -> Path:
        """Write one commit atomically and durably; drop all but the newest :data:`KEEP`."""
        files.makedirs_durable(self.folder)  # (a new folder's entry flushed too: a power loss kept no commit)
        # every commit has a new name: a write killed mid-way left its temporary (the whole state) for good
        files.remove_leftovers(self.folder, "commit-*.bin")
        target = self.path((attempt() if job is None else job, commit_id))
        with files.atomic_path(target) as tmp, open(tmp, "wb") as f:
            f.write(_MAGIC)
            f.write(hashlib.sha256(payload).digest())
            f.write(payload)
        for old in self.ids()[:-KEEP]:
            self.path(old).unlink(missing_ok=True)
        return target

    def write_async(self, commit_id: int, payload: Any) -> None:
        """Pickle ``payload`` and write it in the background, after the previous write finished (whose
        error is raised here). ``payload`` must not change afterwards: a state's commit copies are
        replaced by the next commit, never changed in place."""
        if not self.writer:
            return
        self.settle()
        if self.failed is not None:
            return  # (the commit that called this raises it on every rank)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="unison-commit-spill")
        self._pending = self._pool.submit(lambda: self.write(commit_id, pickle.dumps(payload, protocol=5)))

    def wait(self) -> None:
        """Block until the last write is on disk."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def settle(self) -> None:
        """:meth:`wait`, keeping a failed write's error in :attr:`failed` instead of raising it here: the next
        commit raises it on every rank ([Note: a failed spill stops every rank] in state.py). Any error, not only
        an ``OSError``: a value ``copy.deepcopy`` takes but ``pickle`` cannot (a class defined in a function)
        failed in the background with an ``AttributeError``, raised on the writing rank alone while the others
        waited in the commit's agreement (before 2026-12-07; an audit)."""
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - agreed at the next commit, then raised on every rank
            self.failed = exc

    def read(self, key: tuple[int, int]) -> bytes:
        """The pickled state of commit ``key``, checked against the digest written with it.

        Raises:
            OSError: the file cannot be read.
            CorruptCommitError: the file is not a whole commit (torn, changed, or not one of ours).
        """
        data = self.path(key).read_bytes()
        head = len(_MAGIC) + _DIGEST_BYTES
        if not data.startswith(_MAGIC[:8]):  # written before the digest (2026-12-04): the pickle alone, which
            return data  # the caller unpickles; a torn one fails there and counts as unreadable all the same
        if len(data) < head or not data.startswith(_MAGIC):
            raise CorruptCommitError(f"{self.path(key)} was cut short ({len(data)} bytes, not even its "
                                     "header)")
        payload = data[head:]
        if hashlib.sha256(payload).digest() != data[len(_MAGIC):head]:
            raise CorruptCommitError(f"{self.path(key)}: the state's SHA-256 differs from the one written with "
                                     "it (a torn or changed file)")
        return payload


class CorruptCommitError(ValueError):
    """A commit file that is not a whole commit written by :meth:`CommitStore.write`."""


#: the start of every commit file, then the SHA-256 of the pickled state that follows
_MAGIC = b"UNISON-COMMIT-1\n"
_DIGEST_BYTES = 32


def mark_finished(store: CommitStore) -> None:
    """A call of the training function returned: once its commit is on disk, this rank's record says so
    (unison/common/liveness.py). The driver learns that the training finished at the program's exit,
    not here: rank 0 prints :data:`~unison.run.report.ELASTIC_FINISHED` in an ``atexit`` handler, so a
    program that calls its training function more than once (once per epoch, or in two phases) is not
    done after the first call. Before 2026-12-05 the line came at every return, and a rank that died in
    a later call ended the job with status 0 and no restart."""
    from unison.common import liveness

    store.wait()
    st = runtime._state
    liveness.returned(st.rank if st is not None else 0)
    global _exit_said, _size
    _size = st.size if st is not None else 1  # (the world at the last return: a reset in place may shrink it)
    if not _exit_said:  # once, however often the training function returns
        _exit_said = True
        atexit.register(_say_exiting)


def mark_entered() -> None:
    """A call of the training function begins: a death from here is one inside the training again."""
    from unison.common import liveness

    st = runtime._state
    liveness.entered(st.rank if st is not None else 0)


_exit_said = False
_size = 1


def _say_exiting() -> None:
    """At the exit of a rank whose last call of the training function returned (after the program's own
    code): rank 0 (as it was numbered then) says the training finished, and every rank that it exits (the
    driver ends an mpirun that outlives every rank that said it, see [Note: a prterun that outlives its
    ranks]). A rank that leaves from inside a call (``SystemExit`` for a host change) says nothing here."""
    from unison.common import liveness
    from unison.run.report import ELASTIC_FINISHED, exiting_line

    if liveness.phase() not in (liveness.RETURNED, None):
        return
    rank = liveness.last_rank()
    try:
        if rank == 0:
            print(ELASTIC_FINISHED, flush=True)
        print(exiting_line(0, rank, _size), flush=True)
    except (OSError, ValueError):  # stdout already closed: mpirun is left to end the job itself
        pass


def store_from_env(name: str | None = None) -> CommitStore | None:
    """The store of a job started by ``unisonrun``'s elastic driver, or None; ``name``: the state's folder."""
    from unison.common.config import env_value

    found = env_value(ENV_STATE_DIR)
    if found is None:
        return None
    return CommitStore(found[1], name=name)


def attempt() -> int:
    """How many times the driver started this job before (0: the first start)."""
    return int(parse_env(ENV_ATTEMPT, IntRange(0, 1 << 30).parse, 0))


def reset_limit() -> int | None:
    """How many resets in place this job may make (``UNISON_ELASTIC_RESET_LIMIT``); None: no limit."""
    return parse_env(ENV_RESET_LIMIT, IntRange(0, 1 << 30).parse, None)


def resume(state: Any, store: CommitStore) -> int:
    """Load the newest commit any host holds into ``state`` (collective); returns its id, or -1.

    See [Note: the restart tier's commits]. The ranks that hold the newest commit read it and every
    rank learns which of them could, before anything is sent; a copy no holder can read is skipped
    on every rank alike, for the next newest.
    """
    st = runtime.state("elastic resume")
    comm = st.comm

    def everyone(value: Any) -> list[Any]:
        return [value] if comm is None else comm.allgather(value)

    candidates = sorted(store.ids(), reverse=True)  # this host's commits, newest first
    unreadable = 0  # commits that some host held and none could read
    while True:
        offers = everyone(candidates[0] if candidates else None)
        held = [k for k in offers if k is not None]
        if not held:
            if attempt() > 0 and st.rank == 0:
                why = (f"the hosts held {unreadable} commit(s) but none could be read (see the warnings "
                       "above)" if unreadable else "every host that held one was lost, or the last job failed "
                       "before this state's first commit")
                logger.warning("elastic: this is restart %d of the job but no host holds a readable committed "
                               "state (%s); starting from the program's initial state or its own checkpoint",
                               attempt(), why)
            return -1
        best = max(held)
        payload = loaded = None
        if offers[st.rank] == best:
            try:
                payload = store.read(best)
                loaded = pickle.loads(payload)  # noqa: S301 - written by this job's own ranks, digest checked
            except Exception as exc:  # noqa: BLE001 - unreadable for any reason: every rank must learn it
                logger.warning("elastic: commit %s on this host cannot be read: %s", best, exc)
                payload = loaded = None
        readable = everyone(payload is not None)
        if any(readable):
            break
        unreadable += 1
        if candidates and candidates[0] == best:  # nobody could read it: each holder offers its next newest
            candidates.pop(0)
    holder = readable.index(True)
    if comm is not None and not all(readable):  # some rank lacks it: the holder sends it
        sent = comm.bcast(payload if st.rank == holder else None, root=holder)
        if loaded is None:
            payload, loaded = sent, pickle.loads(sent)  # noqa: S301 - checked by the holder
    if loaded is None:
        raise RuntimeError(f"elastic: rank {holder} could read commit {best} but sent nothing")
    state.load_commit(loaded)
    state.restore()
    if st.rank == 0:
        logger.warning("elastic: resumed from commit %d (written by job %d, held by rank %d's host; restart %d)",
                       best[1], best[0], holder, attempt())
    return int(best[1])
