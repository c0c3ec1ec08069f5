"""Handles: what an async submission returns, completed by the engine thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Handle"]


class Handle:
    """The future result of one submitted collective.

    ``unison.poll(handle)`` says whether it finished; ``unison.synchronize(handle)``
    waits and returns the result, or raises the error the engine recorded (with
    its original traceback).
    """

    __slots__ = ("name", "_event", "_result", "_error", "_post", "__weakref__")

    def __init__(self, name: str, post: Callable[[Any], Any] | None = None) -> None:
        self.name = name
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._post = post

    def done(self) -> bool:
        return self._event.is_set()

    def set_result(self, value: Any) -> None:
        if not self._event.is_set():
            self._result = value
            self._event.set()

    def set_error(self, error: BaseException) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; return the result or raise the recorded error.

        Raises:
            TimeoutError: not done within ``timeout`` seconds.
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"collective {self.name!r} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        if self._post is not None:
            self._result, self._post = self._post(self._result), None
        return self._result

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<unison.Handle {self.name!r} {state}>"
