"""Committed training state, held in memory on every rank (Horovod's elastic ``State``).

``commit()`` keeps a copy of the state in this process's memory; after a failure the
``run`` wrapper calls ``restore()`` (back to that copy) and, once Unison is rebuilt on the
survivors, ``sync()`` (rank 0's copy to every rank). A commit is local: it costs one copy
and no communication, so committing every few steps is cheap. Because ``sync()`` makes
every rank adopt the new rank 0's commit, ranks whose last commits differ (one committed a
step that another never finished) still continue from the same state.
"""

from __future__ import annotations

import copy
import logging
import queue
from collections.abc import Callable, Iterable
from typing import Any

from unison.common.engine.objects import broadcast_object
from unison.common.exceptions import HostsUpdatedInterrupt

__all__ = ["State", "ObjectState"]

logger = logging.getLogger(__name__)


class State:
    """The base of every elastic state: commits, host updates and reset callbacks.

    Subclasses implement :meth:`save`, :meth:`restore` and :meth:`sync`.
    """

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._host_messages: queue.Queue[tuple[float, bool]] = queue.Queue()

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
        """Note that the hosts changed (called by host discovery; a later slice)."""
        self._host_messages.put((timestamp, skip_sync))

    def commit(self) -> None:
        """Save the state in memory, then check for host changes (Horovod's ``commit``)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` when host discovery reported a change.

        Without host discovery (this release) nothing is ever reported, so this makes
        no collective call.
        """
        updates = []
        while not self._host_messages.empty():
            updates.append(self._host_messages.get())
        if updates:
            raise HostsUpdatedInterrupt(all(skip for _, skip in updates))

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Adjust to a new world (subclasses; nothing by default)."""


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
        self._bcast_object = bcast_object or broadcast_object
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__()

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state, root_rank=0)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))
