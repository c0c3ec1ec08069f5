"""The ``Work`` objects of the ``torch.distributed`` backend (unison/torch_backend/process_group.py).

A collective's ``Work`` completes through the engine's handles: each handle's done-callback
(run on the engine thread) records its result; after the last one, a completion thread writes
PyTorch's output tensors and completes the future ([Note: completing off the engine thread]).
A point-to-point ``Work`` wraps the MPI requests of one send or receive.

[Note: point-to-point messages in pieces] Open MPI refuses a count of 2**31 bytes or more
(``MPI_ERR_ARG``: before 2026-12-05 ``dist.send`` of a 2 GiB tensor failed so). A send goes as
pieces of :data:`P2P_PIECE_BYTES`, then one shorter piece (perhaps empty) that ends it; a message
under the piece size is one message, as before. The receiver cannot know the length in advance
(PyTorch lets a message be shorter than the tensor received into), so it posts one piece at a
time, from the first piece's sender: a full piece means more follow, a shorter one is the end.
Messages of one sender, tag and communicator arrive in the order sent, so pieces never mix.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from unison.common.engine.handles import Handle
from unison.torch_backend.tensors import from_numpy, to_numpy

__all__ = ["host", "copy_into", "collective_work", "P2PWork", "PiecedSend", "PiecedRecv", "seconds"]

#: The most bytes one point-to-point MPI message carries (see the Note).
P2P_PIECE_BYTES = 1 << 30


def host(tensor: torch.Tensor, what: str) -> np.ndarray:
    """``tensor``'s memory as a numpy array (no copy for a contiguous CPU tensor)."""
    if tensor.device.type != "cpu":
        raise NotImplementedError(f"the unison backend takes CPU tensors only; {what} got one on "
                                  f"{tensor.device}. Move it with .cpu(), or use the gloo backend")
    return to_numpy(tensor)


def copy_into(target: torch.Tensor, values: Any, what: str = "the collective") -> None:
    """Write ``values`` into ``target`` (its shape).

    Raises:
        ValueError: ``target`` does not hold as many elements as arrived (this rank's output is the
            wrong size for what the other ranks sent).
    """
    arr = np.asarray(values)
    if arr.size != target.numel():
        raise ValueError(f"{what}: this rank's output tensor of shape {tuple(target.shape)} ({target.numel()} "
                         f"elements) does not fit the {arr.size} elements that arrived; size the output for "
                         "what the other ranks send")
    with torch.no_grad():
        target.copy_(from_numpy(arr).reshape(target.shape))


def seconds(timeout: Any) -> float | None:
    """A ``timedelta`` (PyTorch's timeouts), a number of seconds or None, as seconds or None."""
    if timeout is None:
        return None
    return float(timeout.total_seconds()) if hasattr(timeout, "total_seconds") else float(timeout)


def _limit(timeout: Any, default: float | None) -> float | None:
    """The seconds a ``wait(timeout)`` may take: its own timeout, else the group's (None: no limit)."""
    own = seconds(timeout)
    return default if own is None or own <= 0 else own


def _timed_out(what: str, limit: float) -> Exception:
    return dist.DistBackendError(
        f"unison: {what} did not complete within {limit:g} s (the timeout given to wait(), or the process "
        "group's: init_process_group(timeout=...)); a rank may not have called it, or be much slower")


def collective_work(handles: Sequence[Handle], finish: Callable[[list[Any]], Any],
                    timeout_s: float | None = None) -> dist.Work:
    """A ``Work`` done when every handle is: ``finish(results)`` writes the outputs (on the
    engine thread) and its value completes the future. ``wait()`` without a timeout of its own
    gives up after ``timeout_s`` (the process group's) with ``DistBackendError``."""
    fut: Future = Future()
    left = [len(handles)]
    results: list[Any] = [None] * len(handles)

    def one_done(index: int, handle: Handle) -> None:
        try:
            results[index] = handle.wait()
        except BaseException as error:  # noqa: BLE001 - handed to the future, raised by wait()
            if not fut.done():
                fut.set_exception(error)
            return
        left[0] -= 1
        if left[0] == 0 and not fut.done():
            _COMPLETER.submit(_complete, fut, finish, results)

    if not handles:
        fut.set_result(finish([]))
    for i, handle in enumerate(handles):
        handle.add_done_callback(lambda h, i=i: one_done(i, h))
    return _Work(fut, timeout_s)


#: threads that complete futures: a callback may wait for another collective (PowerSGD's hook does),
#: whose completion then runs on another of them; that nests this many deep
COMPLETERS = 4
#: started on the first completion (see [Note: completing off the engine thread])
_COMPLETER = concurrent.futures.ThreadPoolExecutor(COMPLETERS, thread_name_prefix="unison-pg-complete")


def _complete(fut: Future, finish: Callable[[list[Any]], Any], results: list[Any]) -> None:
    """[Note: completing off the engine thread] A future's callbacks run inside ``set_result``: DDP's
    copy of each reduced bucket back into the gradients (25 MB by default), FSDP's unsharding. Run on
    the engine thread they would hold up the next collective, and a callback that waits for another
    collective would wait for ever; on these threads they overlap the engine's work
    (benchmarks/ddp_breakdown.py; docs/torch_distributed.md). Futures are independent: no order among
    completions is promised (an error is set at once, on the thread that saw it)."""
    try:
        fut.set_result(finish(results))
    except BaseException as error:  # noqa: BLE001 - handed to the future
        fut.set_exception(error)


class _Work(dist.Work):
    """A ``Work`` whose ``wait()`` raises the collective's error.

    [Note: errors reach wait()] PyTorch's ``_create_work_from_future`` makes a ``Work`` whose
    ``wait()`` returns True even when its future holds an exception, and a future handed out
    again through C++ loses the Python wrapper that re-raises it: a mismatch between ranks would
    pass silently. This ``Work`` keeps the one Python future and waits on it, so the error the
    engine recorded (the same on every rank) is raised by ``wait()`` and ``get_future().wait()``.
    """

    def __init__(self, fut: Future, timeout_s: float | None = None) -> None:
        super().__init__()
        self._fut, self._timeout_s = fut, timeout_s
        self._done = threading.Event()
        fut.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout: Any = None) -> bool:
        limit = _limit(timeout, self._timeout_s)
        if limit is not None and not self._done.wait(limit):
            raise _timed_out("a collective", limit)
        self._fut.wait()
        return True

    def get_future(self) -> Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def result(self) -> Any:
        """The output tensors (PyTorch's deprecated ``Work.result``), after waiting."""
        self.wait()
        return self._fut.value()

    def exception(self) -> Any:
        """The collective's error once it finished with one, else None."""
        if not self._fut.done():
            return None
        try:
            self._fut.value()
        except BaseException as error:  # noqa: BLE001 - the error is the answer
            return error
        return None

    def is_success(self) -> bool:
        return self._fut.done() and self.exception() is None


class PiecedSend:
    """The ``Test``/``Wait`` of an MPI request over the pieces of one send of ``data`` (bytes; see the Note)."""

    def __init__(self, comm: Any, data: np.ndarray, dest: int, tag: int) -> None:
        step = P2P_PIECE_BYTES  # full pieces, then a shorter one (perhaps empty): range's stop is size + 1
        self._requests = [comm.Isend(data[lo:lo + step], dest=dest, tag=tag)
                          for lo in range(0, data.size + 1, step)]

    def Test(self, status: Any = None) -> bool:  # noqa: N802 - MPI's name
        from mpi4py import MPI

        return bool(MPI.Request.Testall(self._requests))

    def Wait(self, status: Any = None) -> None:  # noqa: N802 - MPI's name
        from mpi4py import MPI

        MPI.Request.Waitall(self._requests)


class PiecedRecv:
    """The ``Test``/``Wait`` of an MPI request over the pieces of one receive into ``buf`` (see the Note).

    A receive into a buffer of a piece or more may get a full piece and then post the next: an
    unfinished one of those (in ``pending``, the communicator's list) holds back a later receive
    that could match its pieces (same tag; same source, or either from any source), whose first
    piece is posted only after it: otherwise that receive would match the continuation.
    """

    def __init__(self, comm: Any, buf: np.ndarray, source: int, tag: int, pending: list[PiecedRecv]) -> None:
        from mpi4py import MPI

        self._comm, self._buf, self._source, self._tag = comm, buf, source, tag
        self._step, self._any = P2P_PIECE_BYTES, MPI.ANY_SOURCE
        self._offset, self._pending = 0, pending
        self._lock = threading.Lock()  # a later receive may drive this one from another thread
        self._done = False
        self._before = [r for r in pending if r._matches(source, tag)]
        self._request = None if self._before else self._post(source)
        if buf.size >= self._step:
            pending.append(self)

    def _matches(self, source: int, tag: int) -> bool:
        return tag == self._tag and (source == self._source or self._any in (source, self._source))

    def _post(self, source: int) -> Any:
        return self._comm.Irecv(self._buf[self._offset:self._offset + self._step], source=source, tag=self._tag)

    def _last(self, status: Any) -> bool:
        """Whether the piece just received ended the message; if not, the next one is posted."""
        from mpi4py import MPI

        got = status.Get_count(MPI.BYTE)
        if got < self._step:
            self._done = True
            if self in self._pending:
                self._pending.remove(self)
            return True
        self._offset += got
        self._request = self._post(status.Get_source())  # the rest from the same sender
        return False

    def Test(self, status: Any) -> bool:  # noqa: N802 - MPI's name
        from mpi4py import MPI

        with self._lock:
            if self._done:
                return True
            if self._request is None:
                if not all(r.Test(MPI.Status()) for r in self._before):
                    return False
                self._request = self._post(self._source)
            while self._request.Test(status):
                if self._last(status):
                    return True
            return False

    def Wait(self, status: Any) -> None:  # noqa: N802 - MPI's name
        from mpi4py import MPI

        with self._lock:
            if self._done:
                return
            if self._request is None:
                for r in self._before:
                    r.Wait(MPI.Status())
                self._request = self._post(self._source)
            self._request.Wait(status)
            while not self._last(status):
                self._request.Wait(status)


class P2PWork(dist.Work):
    """A send or receive in flight: ``wait()`` completes it (and fills the tensor received into)."""

    def __init__(self, request: Any, buffer: np.ndarray, into: torch.Tensor | None = None,
                 timeout_s: float | None = None) -> None:
        super().__init__()
        self._request, self._buffer, self._into = request, buffer, into
        self._source = -1
        self._timeout_s = timeout_s
        self._lock = threading.Lock()  # wait() and a get_future() thread may both complete it

    def wait(self, timeout: Any = None) -> bool:
        limit = _limit(timeout, self._timeout_s)
        with self._lock:
            if self._request is None:
                return True
            from mpi4py import MPI

            status = MPI.Status()
            if limit is None:
                self._request.Wait(status)
            else:  # MPI_Wait cannot give up: test, spinning briefly, then sleeping with backoff
                deadline, delay, spins = time.monotonic() + limit, 2e-5, 0
                while not self._request.Test(status):
                    if time.monotonic() > deadline:
                        raise _timed_out("a send or receive", limit)
                    spins += 1
                    if spins > 200:  # a transfer then ends at most 0.2 ms before this notices
                        time.sleep(delay)
                        delay = min(delay * 2, 2e-4)
            self._done(status)
        return True

    def is_completed(self) -> bool:
        if self._request is not None:
            from mpi4py import MPI

            status = MPI.Status()
            if self._request.Test(status):
                self._done(status)
        return self._request is None

    def _done(self, status: Any) -> None:
        self._source = status.Get_source()
        if self._into is not None:
            copy_into(self._into, self._buffer)
        self._request = None

    def _source_rank(self) -> int:
        self.wait()
        return self._source

    def get_future(self) -> Future:
        """A future completed when the transfer is (by a thread that waits for it, so that getting
        the futures of an ``isend`` and its peer's ``irecv`` before waiting on either cannot hang)."""
        fut: Future = Future()

        def complete() -> None:
            try:
                self.wait()
                fut.set_result([self._into] if self._into is not None else [])
            except BaseException as error:  # noqa: BLE001 - handed to the future
                fut.set_exception(error)

        if self._request is None:
            complete()
        else:
            _P2P_WAITERS.submit(complete)
        return fut


#: threads that complete point-to-point futures (each waits for one transfer; MPI progresses all)
_P2P_WAITERS = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="unison-pg-p2p")
