"""Committed training state, held in memory on every rank (Horovod's elastic ``State``).

``commit()`` keeps a copy of the state in this process's memory; after a failure the
``run`` wrapper calls ``restore()`` (back to that copy) and, once Unison is rebuilt on the
survivors, ``sync()`` (rank 0's copy to every rank). A commit costs one copy and, on more
than one rank, one all-reduce of two numbers (every rank learns whether any rank was told
the hosts changed: :meth:`State.check_host_updates`), so committing every few steps is cheap;
as in Horovod, every rank commits at the same steps. Because ``sync()`` makes
every rank adopt the new rank 0's commit, ranks whose last commits differ (one committed a
step that another never finished) still continue from the same state.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import queue
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from unison.common import runtime
from unison.common.config import env_value
from unison.common.elastic.store import ENV_NOTICE, store_from_env
from unison.common.engine import frontend
from unison.common.engine.objects import agree_on_names, allgather_object, broadcast_object
from unison.common.exceptions import HostsUpdatedInterrupt, MismatchError, UnisonError
from unison.common.ops import Max

__all__ = ["State", "ObjectState", "agree_structure"]

logger = logging.getLogger(__name__)


def agree_structure(what: str, entries: list[tuple[Any, tuple[int, ...], str]]) -> None:
    """Collective: raise :class:`MismatchError` on every rank unless every rank holds the same
    ``entries`` ((name or index, shape, dtype) of each tensor ``sync()`` broadcasts from rank 0).

    A sync broadcasts rank 0's tensors one by one under their names; before 2026-12-05 a rank whose
    model held a tensor the others lacked (a layer more, a buffer less) left every rank waiting for
    ever on the broadcast it alone made (only a shape that differed under one name raised).
    """
    every = allgather_object(entries, name=f"elastic.structure.{what}")
    ref = every[0]
    bad = [r for r, mine in enumerate(every) if mine != ref]
    if not bad:
        return
    theirs = every[bad[0]]
    ref_by, their_by = {e[0]: e[1:] for e in ref}, {e[0]: e[1:] for e in theirs}
    lacks = [k for k in ref_by if k not in their_by]
    extra = [k for k in their_by if k not in ref_by]
    differ = [f"{k}: {ref_by[k]} on rank 0, {their_by[k]} there" for k in ref_by
              if k in their_by and their_by[k] != ref_by[k]]
    parts = [f"it lacks {lacks[:5]}" if lacks else "", f"it has {extra[:5]}, which rank 0 lacks" if extra else "",
             f"{'; '.join(differ[:3])}" if differ else ""]
    detail = "; ".join(p for p in parts if p) or "the same tensors in another order"
    raise MismatchError(
        f"elastic sync of the {what}: rank(s) {bad} hold other tensors than rank 0 ({len(theirs)} against "
        f"{len(ref)}); on rank {bad[0]} {detail}. Every rank must build the same {what} before the state "
        "syncs (rank 0's values are then broadcast to every rank)")


class State:
    """The base of every elastic state: commits, host updates and reset callbacks.

    Subclasses implement :meth:`save`, :meth:`restore` and :meth:`sync`.
    """

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._host_messages: queue.Queue[tuple[float, bool]] = queue.Queue()
        self._last_host_update = float("-inf")  # the newest update's timestamp taken so far
        self.commit_id = 0  # commits since the job's first start (restarts continue the count)
        #: the commit store of a job run by ``unisonrun``'s elastic driver, else None (store.py): one folder per
        #: state, named by the order in which the program made its states (the same in every job it starts)
        self.store = store_from_env(f"state-{next(_made)}")
        self._resumed = False  # whether the run wrapper has resumed this state (see [Note: resuming once])

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Call each of ``callbacks`` (no arguments) after every reset, in order.

        Use them for what depends on the number of ranks: the learning rate, a
        ``ProcessSet`` (registered sets are dropped at a reset), data loaders.
        """
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by the ``run`` wrapper once Unison runs on the new world."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, skip_sync: bool = False) -> None:
        """Note that the hosts changed (a program's own discovery may call it; ``unisonrun``'s driver
        posts its changes through a notice file instead, see :func:`notice_file_exists`).

        ``timestamp`` is kept as a float, on one rank as on several (where the ranks agree on it as a
        float64): an integer past 2^53 (``time.time_ns()``) rounds alike on every path, so the same
        update never compares as newer on another rank ([Note: one host update, one reset]).
        """
        self._host_messages.put((float(timestamp), skip_sync))

    def commit(self) -> None:
        """Save the state in memory, then check for host changes (Horovod's ``commit``).

        Under ``unisonrun``'s elastic driver the commit is also written to this host's disk in the
        background ([Note: the restart tier's commits] in store.py).
        """
        self.save()
        self.commit_id += 1
        store = self.store
        if store is not None and store.writer:
            store.write_async(self.commit_id, self.commit_payload())  # (after the last spill: see settle)
        spill = None if store is None else store.failed
        if store is not None:
            store.failed = None
        self.check_host_updates(spill)

    def wait_for_spill(self) -> None:
        """Block until the last commit's spill to disk is written: it reads the copies that a save made
        then, and the backends' next save copies into them (no fresh memory per commit)."""
        store = getattr(self, "store", None)  # a subclass may save before State.__init__ ran
        if store is not None:
            store.settle()  # (a failed write is raised at the commit, on every rank alike)

    def commit_payload(self) -> dict[str, Any]:
        """The last commit as picklable values (subclasses add theirs)."""
        return {"commit_id": self.commit_id, "kind": type(self).__qualname__}

    def load_commit(self, payload: dict[str, Any]) -> None:
        """Make ``payload`` (from :meth:`commit_payload`) the last commit; :meth:`restore` applies it.

        Raises:
            ValueError: ``payload`` is another kind of state's commit.
        """
        kind = payload.get("kind", type(self).__qualname__)  # (commits written before 2026-12-05 have none)
        if kind != type(self).__qualname__:
            raise ValueError(f"elastic: the commit to resume from is a {kind}'s, not this "
                             f"{type(self).__qualname__}'s: did the program make its elastic states in another "
                             "order than in the job that wrote it? Make them in the same order in every run")
        self.commit_id = int(payload["commit_id"])

    def check_host_updates(self, spill: Exception | None = None) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank alike when any rank learnt that the hosts
        changed: an update given to :meth:`on_hosts_updated` newer than the last one taken (as in
        Horovod), or the notice file of ``unisonrun``'s elastic driver.

        Collective on more than one rank: an all-reduce of (changed, needs a sync, the newest update's
        timestamp) tells every rank what any rank saw, so all of them raise at the same commit with the
        same ``skip_sync`` (it is True only when no rank's update asked for a sync). A rank that raised
        alone went into the reset while the others trained on, and one that skipped the sync while
        another synced left both waiting in it.

        [Note: one host update, one reset]
        Every rank takes the newest timestamp any rank was given as its last one taken (as Horovod shares
        it), so one update that the ranks learn at different commits resets the job once: the first rank
        to learn it interrupts every rank, and the same timestamp reaching another rank later is no longer
        newer there. Before 2026-12-05 the last timestamp was each rank's own, and such an update reset the
        job again at each rank's later commit.
        """
        changed = need_sync = False
        newest = self._last_host_update
        while not self._host_messages.empty():
            timestamp, skip = self._host_messages.get()
            if timestamp > self._last_host_update:
                newest = max(newest, timestamp)
                changed, need_sync = True, need_sync or not skip
        if notice_file_exists():
            changed = need_sync = True
        level = 2 if need_sync else int(changed)  # (a sync is only ever needed for a change)
        st = runtime._state
        failed = spill is not None
        if st is not None and st.comm is not None and st.size > 1:
            # [Note: the commit's agreement goes through the engine] a named all-reduce, not MPI's own call on
            # the job's communicator: a commit that some ranks skip (a commit under `if rank == 0:`, a loop that
            # commits every k steps of a count that differs) left those that did blocked in MPI for ever while
            # the others waited in their next step's collectives (before 2026-12-06). Through the engine both
            # sides are waits it knows, so its deadlock check fails them on every rank, naming the commit.
            agreed = frontend.allreduce(np.array([level, newest, failed], dtype=np.float64),  # (-inf: none yet)
                                        op=Max, name=COMMIT_AGREEMENT)
            level, newest, failed = int(agreed[0]), float(agreed[1]), bool(agreed[2])
        if failed:
            # [Note: a failed spill stops every rank] one rank per host writes the commits to disk; its error
            # (a full disk) was raised on it alone, and the others waited in their next commit's collective
            # for ever (before 2026-12-06; found by an audit)
            raise spill_error(spill)
        self._last_host_update = newest
        if level:
            raise HostsUpdatedInterrupt(level < 2)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Adjust to a new world (subclasses; nothing by default)."""


#: the engine name of every commit's agreement ([Note: the commit's agreement goes through the engine])
COMMIT_AGREEMENT = "elastic.commit"
#: the engine name of the agreement on the last commit's spill, when the training function returns
SPILL_AGREEMENT = "elastic.last_spill"


def spill_error(spill: Exception | None) -> UnisonError:
    """The error every rank raises when a rank could not write a commit to its host's disk (``spill``: this
    rank's own error, or None on the others)."""
    mine = f" (this rank: {type(spill).__name__}: {spill})" if spill is not None else ""
    return UnisonError(f"elastic: a rank could not write the last commit to its host's disk{mine}; every rank "
                       "stops, so that none trains on without a commit to restart from. Free space under "
                       "UNISON_ELASTIC_STATE_DIR (or point it at a larger disk), or, for an error other than the "
                       "disk's, make every value the state holds picklable (a class defined at module level)")


def settle_last_spill(store: Any) -> None:
    """Wait for the last commit's spill (``store``: the state's CommitStore, or None) and raise
    :func:`spill_error` on every rank if any rank's failed. Collective on more than one rank.

    Before 2026-12-07 the training function's return and the job's end waited with ``store.wait()``, which
    raised the last spill's error on the writing rank alone: the others returned normally (one logged
    "exiting with status 0") with the last commit missing from the disk (an audit)."""
    spill = None
    if store is not None:
        store.settle()
        spill, store.failed = store.failed, None
    failed = spill is not None
    st = runtime._state
    if st is not None and st.comm is not None and st.size > 1:
        failed = bool(frontend.allreduce(np.array([failed], dtype=np.float64), op=Max, name=SPILL_AGREEMENT)[0])
    if failed:
        raise spill_error(spill) from spill

_made = itertools.count()  # the states this process made, in order

#: attributes every state sets itself (a value of the user's under one of these names was overwritten)
_RESERVED = ("commit_id", "store")


class ObjectState(State):
    """Picklable values, kept as attributes: ``ObjectState(epoch=0, batch=0)``.

    ``state.epoch += 1`` changes the live value; ``commit()`` copies every attribute
    named at construction (a deep copy: an array changed in place later does not
    change the commit); ``restore()`` puts the copies back; ``sync()`` makes every
    rank's committed values rank 0's.

    Args:
        bcast_object: ``f(obj, root_rank=0)`` returning rank 0's object on every rank;
            Unison's ``broadcast_object`` by default.
        **kwargs: the attributes and their initial values.
    """

    def __init__(self, bcast_object: Callable[..., Any] | None = None, **kwargs: Any) -> None:
        self._refuse_taken_names(kwargs)
        self._bcast_object = bcast_object or broadcast_object
        # a sync through Unison's own broadcast first agrees on what it syncs (a user's bcast_object may not
        # be collective over Unison's engine: a test's identity, another framework's)
        self._agrees_before_sync = bcast_object is None
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__()

    @classmethod
    def _refuse_taken_names(cls, names: Iterable[str]) -> None:
        """Raise ValueError when one of ``names`` (the keywords of a state) is reserved or names a method:
        the value would be overwritten, or hide the method (``save=...`` made ``commit()`` call it)."""
        taken = sorted(name for name in names if name in _RESERVED or callable(getattr(cls, name, None)))
        if taken:
            raise ValueError(f"elastic state: {taken} name what the state itself uses ({', '.join(_RESERVED)} and "
                             f"its methods), so the value would be overwritten or hide them; use other names")

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def commit_payload(self) -> dict[str, Any]:
        return {**super().commit_payload(), "values": self._saved_state}

    def load_commit(self, payload: dict[str, Any]) -> None:
        """Raises ValueError when ``payload`` names other values than this state's."""
        names, mine = sorted(payload["values"]), sorted(self._saved_state)
        if names != mine:
            raise ValueError(f"elastic: the commit to resume from holds the values {names}, but this state has "
                             f"{mine}: it is another state's commit (make the program's elastic states in the "
                             "same order, with the same names, in every run)")
        super().load_commit(payload)
        self._saved_state = dict(payload["values"])

    def restore(self) -> None:
        self._set_attrs()

    def sync_structure(self) -> list[str]:
        """What every rank must hold alike for a sync: the committed values' names (subclasses add what they
        track: objects and their kinds, a sampler's settings)."""
        return [f"value {name!r}" for name in sorted(self._saved_state)]

    def agree_before_sync(self) -> None:
        """Collective: raise :class:`MismatchError` on every rank unless every rank's :meth:`sync_structure`
        is the same (one 16-byte all-gather when it is).

        [Note: a sync agrees on what it syncs] A sync broadcasts rank 0's values and objects one by one. Before
        2026-12-05 a rank tracking an object the others did not (a scheduler on rank 0 only) waited in a
        broadcast nobody else made, while the others waited in the next one: the first ``sync()`` of
        ``run`` hung. A value only some ranks had was dropped silently from their commits (rank 0's names
        replaced theirs), and samplers with different seeds dealt overlapping samples (6 of 10 seen, 3 twice,
        with no error).
        """
        if self._agrees_before_sync:
            agree_on_names(f"elastic sync of a {type(self).__name__} (its values and tracked objects)",
                           self.sync_structure(), name="elastic.state.structure")

    def sync(self) -> None:
        self.agree_before_sync()
        self._sync_values()

    def _sync_values(self) -> None:
        # the commit count travels too: ranks that committed a different number of times before a
        # failure would number their next commits apart (the restart tier's files of one commit id
        # holding different states on different hosts)
        synced = self._bcast_object({"values": self._saved_state, "commit_id": self.commit_id}, root_rank=0)
        self._saved_state, self.commit_id = synced["values"], int(synced["commit_id"])
        self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))


def notice_file_exists() -> bool:
    """Whether ``unisonrun``'s elastic driver posted that the hosts changed, as this rank sees it
    (``UNISON_ELASTIC_NOTICE`` names the file, written on the driver's host); False without the driver."""
    found = env_value(ENV_NOTICE)
    return found is not None and os.path.exists(found[1])
