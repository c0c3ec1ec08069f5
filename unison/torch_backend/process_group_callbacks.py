"""Collectives issued from a collective's future callbacks (DDP comm hooks such as PowerSGD's) pair by name.

[Note: collectives from future callbacks]
PowerSGD's DDP hook chains callbacks on each bucket's all-reduce future, and each callback issues
another all-reduce and waits for it (``fut.then(allreduce_ps).then(compute_qs)...``). Those callbacks
run on the threads that complete futures ([Note: completing off the engine thread] in
process_group_work.py), one bucket's chain beside another's and beside the main thread's next bucket,
so their collectives reach a group in a different order on each rank. Unnamed engine calls pair by
their order: before 2026-12-06 PowerSGD with several buckets raised ``MismatchError`` where shapes
differed, hung where the chains used up the completion threads, and would have reduced one bucket's
matrix with another rank's other bucket where shapes agreed (an audit of issue 20).

So a collective issued while a callback of one of our futures runs is named after that future, not
after the order of arrival: every ``Work`` made outside such a callback takes the next number of its
group (``torch.<group>.cb<seq>``: ranks make those calls in the same order, as PyTorch requires),
each callback registered on its future, or on a future ``then()`` made from it, the next index of
that family (registration is in program order), and each call of a running callback the next index
of that run. A call's name is thus ``torch.<group>.cb<seq>.<callback>.<call>`` on every rank,
whichever thread runs the callback and whenever; a ``Work`` made in a callback starts a family
named after its place (``...<callback>.w<k>``). The engine pairs named calls by name (negotiation),
so the order of arrival no longer matters. A sub-group's collectives run in submission order on
its own thread (process_group_sub.py) and cannot reorder: there the name is part of the compared
signature, so calls that meet out of order raise ``MismatchError`` on every member instead of
combining the wrong tensors.

Completions of works made inside callbacks run on a pool of their own (:data:`NESTED`): a callback
that waits for its child collective holds a completion thread, and with more buckets than threads
the children's completions queued behind other buckets' callbacks, which were waiting too (a hang).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
from collections.abc import Callable
from typing import Any

from torch.futures import Future

__all__ = ["ChainFuture", "Family", "current", "NESTED"]

#: the callback run (a :class:`_Run`) active on this thread, if any
_active = threading.local()

#: completes futures of works made inside callbacks: grows to this many threads while others are blocked
NESTED = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="unison-pg-nested")


class _Run:
    """One run of one registered callback: names the collectives and families it makes."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._calls = itertools.count()
        self._works = itertools.count()

    def call_name(self) -> str:
        return f"{self.prefix}.{next(self._calls)}"

    def family_prefix(self) -> str:
        return f"{self.prefix}.w{next(self._works)}"


def current() -> _Run | None:
    """The callback run on this thread, or None outside our futures' callbacks."""
    return getattr(_active, "run", None)


class Family:
    """The futures of one ``Work`` and those ``then()`` made from them: numbers their callbacks."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._callbacks = itertools.count()

    def wrap(self, callback: Callable[[Future], Any]) -> Callable[[Future], Any]:
        """``callback`` run with its calls named ``<prefix>.<index>.<call>`` (index: registration order)."""
        prefix = f"{self.prefix}.{next(self._callbacks)}"

        def run(fut: Future) -> Any:
            outer = current()
            _active.run = _Run(prefix)
            try:
                return callback(fut)
            finally:
                _active.run = outer

        return run


class ChainFuture(Future):
    """A ``torch.futures.Future`` whose ``then`` and ``add_done_callback`` callbacks name their collectives
    after this future's family (see the Note), and whose ``then`` futures do the same."""

    def __init__(self, family: Family) -> None:
        super().__init__()
        self._family = family

    def then(self, callback: Callable[[Future], Any]) -> Future:
        child = ChainFuture(self._family)
        run = self._family.wrap(callback)

        def done(fut: Future) -> None:
            try:
                child.set_result(run(fut))
            except BaseException as error:  # noqa: BLE001 - handed to the child, as torch's then() does
                child.set_exception(error)

        super().add_done_callback(done)
        return child

    def add_done_callback(self, callback: Callable[[Future], None]) -> None:
        super().add_done_callback(self._family.wrap(callback))
