"""Handles: what an async submission returns, completed by the engine thread.

A training step submits hundreds of tensors, so a handle must be cheap: it is a
slotted object with a flag, not a ``threading.Event`` (which allocates a
condition and a lock). Waiters sleep on one condition shared by all handles;
the engine sets results without locking and wakes the waiters once per batch
(:func:`wake_waiters`), taking the lock only when some thread is blocked (a
count waiters keep under it). The flag is set before the wake-up reads the
count, and a waiter counts itself in before it checks the flag under the lock,
so no wake-up is lost.

A waiter also re-checks every ``LIVENESS_S`` that the engine that took its request
still runs: should a handle ever outlive its engine thread without being
completed, ``wait`` raises the engine's exit error instead of blocking forever
(engine [Note: no handle left behind]).

``add_done_callback`` lets a caller be told instead of waiting (the ``torch.distributed``
backend completes its futures that way). Completing a handle nobody registered a callback on
takes no lock; the callback list is handed over under one small lock, after the done flag is
set on the completing side and after the callback is appended on the registering side, so a
callback is neither lost nor run twice.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["Handle", "wake_waiters", "wait_all", "blocked_waits", "waiting_on", "POSTING"]

logger = logging.getLogger(__name__)

_completion = threading.Condition(threading.Lock())
#: held while a completed handle's result is converted (its ``_post``: the torch adapter's ``from_numpy``),
#: and by the adapters' wrappers while they convert theirs: two threads synchronizing one handle at once both
#: saw the conversion pending and ran it, so they got different result objects, and a conversion could run on
#: a result already converted (before 2026-12-07; an audit). Re-entrant: a conversion may wait on a handle.
POSTING = threading.RLock()
#: seconds between a blocked waiter's checks that its engine is alive
LIVENESS_S = 1.0


_callback_lock = threading.Lock()


def _call(fn: Callable[[Handle], Any], handle: Handle) -> None:
    try:
        fn(handle)
    except Exception:  # noqa: BLE001 - a callback's failure must not stop the engine thread
        logger.exception("a done-callback of %r failed", handle)


#: threads inside :meth:`Handle.wait`'s blocking part (changed under ``_completion``)
_blocked = 0
#: waits that found their handle done only when the liveness timeout woke them (changed under ``_completion``)
_lost_wakeups = 0
#: thread id -> (the handles it is blocked on, since when): what the deadlock check reads (under ``_completion``)
_waiting: dict[int, tuple[tuple[Handle, ...], float]] = {}


def blocked_waits() -> list[tuple[Handle, float]]:
    """The handles threads of this process are blocked on for good (an untimed :meth:`Handle.wait`, or
    :func:`waiting_on`), each with the ``time.monotonic()`` the wait blocked at (the stall inspector's
    deadlock check, stalls [Note: a deadlock is a stall nobody can end]). A wait with a timeout is left
    out: its thread comes back at the timeout and may submit what the others wait for."""
    if not _waiting:  # (read without the lock: a wait that begins meanwhile is seen next time)
        return []
    with _completion:
        return [(h, since) for handles, since in _waiting.values() for h in handles]


@contextlib.contextmanager
def waiting_on(handles: Iterable[Handle]) -> Iterator[None]:
    """Count the calling thread as blocked on ``handles`` while the block runs: for a wait that is not
    :meth:`Handle.wait`'s (a ``torch.distributed`` work's, on an event the handles' callbacks set) and whose
    timeout, if any, is an error's deadline rather than a return to other work."""
    me = threading.get_ident()
    with _completion:
        outer = _waiting.get(me)
        _waiting[me] = (tuple(handles) + (outer[0] if outer else ()), time.monotonic())
    try:
        yield
    finally:
        with _completion:
            if outer is None:
                _waiting.pop(me, None)
            else:
                _waiting[me] = outer


def lost_wakeups() -> int:
    """How many blocked waits in this process found their handle done when the liveness timeout (not the
    completion's wake-up) woke them: a wake-up lost to :func:`wake_waiters`'s lock-free shortcut, or a
    completion that landed in the instant the timeout fired. A test's exact check where a latency bound
    would be a guess (a slow network's tail reaches a second too)."""
    return _lost_wakeups


def wake_waiters() -> None:
    """Wake every thread blocked in :meth:`Handle.wait` to re-check its handle.

    No lock is taken when no thread is blocked (a lone blocking call completes its own handle in
    its own cycle). That read is safe: a waiter counts itself in before it first checks its flag,
    and the flag was set before this read, so a waiter this read missed sees the flag set and
    does not block."""
    if _blocked:
        with _completion:
            _completion.notify_all()


class Handle:
    """The future result of one submitted collective.

    ``unison.poll(handle)`` says whether it finished; ``unison.synchronize(handle)``
    waits and returns the result, or raises the error the engine recorded (with
    its original traceback).
    """

    __slots__ = ("name", "_done", "_result", "_error", "_post", "_engine", "_callbacks", "__weakref__")

    def __init__(self, name: str, post: Callable[[Any], Any] | None = None) -> None:
        self.name = name
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._post = post
        #: the engine that accepted the request (set by ``Engine.submit``), for liveness checks
        self._engine: Any = None
        self._callbacks: list[Callable[[Handle], Any]] | None = None

    def done(self) -> bool:
        return self._done

    def add_done_callback(self, fn: Callable[[Handle], Any]) -> None:
        """Call ``fn(handle)`` once the handle is done: at once if it already is, else on the
        thread that completes it (the engine's: keep ``fn`` short, and never wait on another
        handle inside it). An exception ``fn`` raises is logged, not propagated."""
        with _callback_lock:
            self._callbacks = (self._callbacks or []) + [fn]
        if self._done:  # done meanwhile: whoever takes the list first runs it, so fn runs once
            self._run_callbacks()

    def _finish(self) -> None:
        self._done = True
        if self._callbacks is not None:  # the engine's common case takes no lock
            self._run_callbacks()

    def _run_callbacks(self) -> None:
        with _callback_lock:
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            _call(fn, self)

    def set_result(self, value: Any) -> None:
        """Record the result; the caller then calls :func:`wake_waiters` (once per batch)."""
        if not self._done:
            self._result = value
            self._finish()

    def set_error(self, error: BaseException) -> None:
        if not self._done:
            self._error = error
            self._finish()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; return the result or raise the recorded error.

        Raises:
            TimeoutError: not done within ``timeout`` seconds.
        """
        global _blocked, _lost_wakeups
        if not self._done:
            engine = self._engine
            if engine is not None and timeout is None:  # run the cycle here when no other thread
                engine.progress(self)  # is in one (engine [Note: a waiter runs the cycle])
        if not self._done:
            deadline = None if timeout is None else time.monotonic() + timeout
            with _completion:
                _blocked += 1  # before the flag's check: see wake_waiters
                me = threading.get_ident()
                outer = _waiting.get(me)  # (a wait nested on this thread: a signal handler's collective)
                if deadline is None:  # (a timed wait returns at its timeout: see blocked_waits)
                    _waiting[me] = ((self,) + (outer[0] if outer else ()), time.monotonic())
                try:
                    while not self._done:
                        left = LIVENESS_S if deadline is None else min(deadline - time.monotonic(), LIVENESS_S)
                        if deadline is not None and left <= 0:
                            raise TimeoutError(f"collective {self.name!r} did not finish within {timeout} s")
                        if not _completion.wait(left):
                            if self._done:
                                _lost_wakeups += 1
                            else:
                                self._check_engine()
                finally:
                    _blocked -= 1
                    if deadline is None:
                        if outer is None:
                            _waiting.pop(me, None)
                        else:
                            _waiting[me] = outer
        if self._error is not None:
            raise self._error
        if self._post is not None:
            with POSTING:  # (two threads waiting on one handle: see POSTING)
                post = self._post
                if post is not None:
                    self._result, self._post = post(self._result), None
        return self._result

    def _check_engine(self) -> None:
        engine = self._engine
        if engine is not None and not engine.alive():
            self.set_error(engine.exit_error())

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<unison.Handle {self.name!r} {state}>"


def wait_all(handles: Any, timeout: float | None = None) -> list[Any]:
    """The results of ``handles``, in order, once every one of them is done; the first error (in
    order) is raised only after the rest completed too.

    [Note: a group waits for all its members] A group's members are separate requests: raising at
    the first failed member (a refusal, a count mismatch) left the later ones in flight on this
    rank, and the same names submitted again at once (a graph run again, a retry) raised
    ``DuplicateNameError`` on this rank alone while the others waited. Every member of a group
    completes (each pairs with the other ranks' member, or with the refusal a rank with fewer
    members submits in its place: frontend [Note: a longer group's extra members]), so waiting
    for all cannot hang where waiting for the first did not. A timeout is raised at once; it bounds
    the whole wait (before 2026-12-07 each member's: members finishing one after another could take
    that many times it).
    """
    results: list[Any] = []
    first: Exception | None = None
    deadline = None if timeout is None else time.monotonic() + timeout
    for h in handles:  # (a timeout is raised at once: the first error instead, when a member failed)
        try:
            results.append(h.wait(None if deadline is None else max(0.0, deadline - time.monotonic())))
        except TimeoutError:
            if first is not None:  # (the real cause, not the wait for the rest)
                raise first from None
            raise
        except Exception as exc:  # noqa: BLE001 - kept, raised once every member is done
            if first is None:
                first = exc
            results.append(None)
    if first is not None:
        raise first
    return results
