"""The ``Work`` objects of the ``torch.distributed`` backend (unison/torch_backend/process_group.py).

A collective's ``Work`` completes through the engine's handles: each handle's done-callback
(run on the engine thread) records its result; after the last one, a completion thread writes
PyTorch's output tensors and completes the future ([Note: completing off the engine thread]).
A point-to-point ``Work`` wraps the MPI requests of one send or receive.

[Note: what the backend does not support] A tensor that is not on the CPU, a collective of a dtype
the engine does not carry (uint32, uint64, the float8 dtypes: :data:`CARRIED` lists those it does),
a bitwise op of floating-point or complex tensors, PREMUL_SUM of integers or bools, AVG of bools,
the functional collectives' bare "premul_sum" (it needs a factor): each raises
:class:`UnsupportedError` on every rank of the call, a ``NotImplementedError`` (so a
``RuntimeError``, which gloo raises for the same calls: "Cannot use ReduceOp.BAND with non-integral
dtype") that is also Unison's ``CollectiveError`` (a ``TypeError``, what these calls raised before
2026-12-06, and what docs/torch_distributed.md had promised otherwise). The refusing rank submits
the call carrying the error (``frontend.Refused``); the engine, and a sub-group's agreement, hand
the others its text and its kind, ``"U"`` for an ``UnsupportedError`` ([Note: refusal kinds] in
unison/common/engine/errors.py, which also says what wins when ranks refused differently), so
``wait()`` raises ``UnsupportedError`` on every rank alike. A job of one rank runs each call at once
on the caller's thread, some through the direct collectives (:mod:`unison.collectives`), which know
a ``TypeError``'s kind and a ``ValueError``'s only: there the call raises the ``UnsupportedError``
it carried itself (:class:`OwnRefusals`). The message starts with :data:`UNSUPPORTED` for people to
read; nothing matches it (until a second change of 2026-12-06 the kind was ``TypeError``'s, and a
``CollectiveError`` whose message held those words was made an ``UnsupportedError`` here).

[Note: point-to-point messages over 2 GiB] Open MPI refuses a count of 2**31 bytes or more
(``MPI_ERR_ARG``: before 2026-12-05 ``dist.send`` of a 2 GiB tensor failed so). A send or receive
buffer larger than :data:`P2P_TYPED_BYTES` therefore travels as ONE message of one element of a
derived datatype (blocks of :data:`P2P_BLOCK_BYTES` bytes, then the rest), whose count MPI takes.
Both sides' datatypes are sequences of bytes, so a message may still be shorter than the tensor
received into (PyTorch allows it; ``Get_elements`` counts its bytes), and, being one message, it
matches receives exactly as a small one does: concurrent receives from one sender with one tag,
from any source, a truncated receive. (A first version sent pieces as separate messages: the
receiver had to post them one at a time, and concurrent receives could take each other's pieces.)
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

from unison.common.engine import frontend
from unison.common.engine.handles import Handle, waiting_on
from unison.common.exceptions import CollectiveError, UnsupportedError
from unison.torch_backend import process_group_callbacks as callbacks
from unison.torch_backend.tensors import from_numpy, to_numpy

__all__ = ["host", "copy_into", "collective_work", "P2PWork", "isend_bytes", "irecv_bytes", "seconds", "timed_out",
           "UnsupportedError", "UNSUPPORTED", "unsupported", "OwnRefusals"]

#: Point-to-point buffers larger than this travel as one element of a derived datatype (see the Note).
P2P_TYPED_BYTES = (1 << 31) - 1
#: The block of that datatype.
P2P_BLOCK_BYTES = 1 << 30


#: How the message of every :class:`UnsupportedError` of the backend starts, for people to read (see [Note: what
#: the backend does not support]).
UNSUPPORTED = "unsupported by the unison backend: "


def unsupported(text: str) -> UnsupportedError:
    """An :class:`UnsupportedError` whose message is :data:`UNSUPPORTED` and ``text``."""
    return UnsupportedError(UNSUPPORTED + text)


class OwnRefusals:
    """The collectives of a group (a process set's engine calls, a sub-group's ``CommOps``) whose calls that
    carried this rank's :class:`UnsupportedError` (a ``frontend.Refused``) and raised at once raise it itself:
    only a job of one rank raises at submission, and its direct collectives report the refusal as a plain
    ``CollectiveError`` (see [Note: what the backend does not support]). A call made inside a callback of one
    of the backend's futures gets its name there ([Note: collectives from future callbacks])."""

    def __init__(self, ops: Any) -> None:
        self._inner = ops

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_inner":  # (a copy or unpickling looks these up before __init__)
            raise AttributeError(name)
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            run = callbacks.current()
            if run is not None and name.endswith("_async"):
                kwargs.setdefault("name", run.call_name())
            try:
                return attr(*args, **kwargs)
            except CollectiveError as error:
                own = next((a.error for a in args if isinstance(a, frontend.Refused)), None)
                if isinstance(own, UnsupportedError) and own is not error:
                    raise own from error
                raise

        self.__dict__[name] = call  # made once per name: later calls find it without __getattr__
        return call


#: the dtypes the collectives carry (the engine's, unison/common/dtypes.py, as torch names them)
CARRIED = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
           torch.int64, torch.uint8, torch.uint16, torch.bool)
_CARRIED = frozenset(CARRIED)


def host(tensor: torch.Tensor, what: str, any_dtype: bool = False) -> np.ndarray:
    """``tensor``'s memory as a numpy array (no copy for a contiguous CPU tensor).

    Args:
        any_dtype: the caller moves bytes (a send or receive), so any dtype numpy has will do.

    Raises:
        UnsupportedError: ``tensor`` is not on the CPU, or (unless ``any_dtype``) its dtype is not one the
            collectives carry (the collectives submit the error in the data's place, so every rank raises it).
            Before 2026-12-06 uint32 and uint64 raised the engine's ``CollectiveError``, and float8 dtypes a
            ``CollectiveError`` quoting numpy ("Got unsupported ScalarType Float8_e4m3fn") that named no call.
    """
    if tensor.device.type != "cpu":
        raise unsupported(f"a tensor on {tensor.device}: it takes CPU tensors only ({what} got one on "
                          f"{tensor.device}). Move it with .cpu(), or use the gloo backend")
    if not any_dtype and tensor.dtype not in _CARRIED:
        hint = ("view it as real and imaginary parts with torch.view_as_real" if tensor.is_complex()
                else "cast it (e.g. .to(torch.int64) or .to(torch.float32))")
        raise unsupported(f"{what} of {str(tensor.dtype).replace('torch.', '')} tensors: its collectives carry "
                          f"{', '.join(str(d).replace('torch.', '') for d in CARRIED)}; {hint}, or use the gloo "
                          "backend")
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


def timed_out(what: str, limit: float) -> Exception:
    return dist.DistBackendError(
        f"unison: {what} did not complete within {limit:g} s (the timeout given to wait(), or the process "
        "group's: init_process_group(timeout=...)); a rank may not have called it, or be much slower")


def collective_work(handles: Sequence[Handle], finish: Callable[[list[Any]], Any],
                    timeout_s: float | None = None, family: str = "") -> dist.Work:
    """A ``Work`` done when every handle is: ``finish(results)`` writes the outputs (on a
    completion thread) and its value completes the future. ``wait()`` without a timeout of its own
    gives up after ``timeout_s`` (the process group's) with ``DistBackendError``. ``family`` names the
    collectives its future's callbacks issue ([Note: collectives from future callbacks]); a work made
    inside such a callback completes on the pool of those (``callbacks.NESTED``)."""
    fut: Future = callbacks.ChainFuture(callbacks.Family(family))
    completer = callbacks.NESTED if callbacks.current() is not None else _COMPLETER
    left = [len(handles)]
    results: list[Any] = [None] * len(handles)

    errors: list[tuple[int, BaseException]] = []

    def one_done(index: int, handle: Handle) -> None:
        try:
            results[index] = handle.wait()
        except BaseException as error:  # noqa: BLE001 - handed to the future, raised by wait()
            errors.append((index, error))
        left[0] -= 1
        if left[0] == 0 and not fut.done():  # (an error only once every handle is done: engine
            if errors:                       # [Note: a group waits for all its members])
                # the first handle's error, whichever finished first: the same on every rank (a coalesced
                # call's count agreement comes first, and its error explains its members')
                fut.set_exception(min(errors, key=lambda e: e[0])[1])
            else:
                completer.submit(_complete, fut, finish, results)

    if not handles:
        fut.set_result(finish([]))
    for i, handle in enumerate(handles):
        handle.add_done_callback(lambda h, i=i: one_done(i, h))
    return _Work(fut, timeout_s, handles)


#: threads that complete futures; a callback that waits for another collective (PowerSGD's hook does)
#: holds one, and that collective completes on ``callbacks.NESTED`` ([Note: collectives from future callbacks])
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

    def __init__(self, fut: Future, timeout_s: float | None = None, handles: Sequence[Handle] = ()) -> None:
        super().__init__()
        self._fut, self._timeout_s = fut, timeout_s
        #: the engine's requests behind it: a blocked wait() counts for the deadlock check (engine
        #: stalls [Note: a deadlock is a stall nobody can end]; its timeout ends it with an error)
        self._handles = tuple(handles)
        self._done = threading.Event()
        fut.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout: Any = None) -> bool:
        limit = _limit(timeout, self._timeout_s)
        if not self._done.is_set():
            with waiting_on(self._handles):
                if limit is not None and not self._done.wait(limit):
                    raise timed_out("a collective", limit)
                self._done.wait()
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


def _bytes_type(mpi: Any, nbytes: int) -> Any:
    """A committed datatype of ``nbytes`` bytes: blocks of :data:`P2P_BLOCK_BYTES`, then the rest."""
    blocks, rest = divmod(nbytes, P2P_BLOCK_BYTES)
    if not blocks:
        return mpi.BYTE.Create_contiguous(rest).Commit()
    block = mpi.BYTE.Create_contiguous(P2P_BLOCK_BYTES)
    try:
        return mpi.Datatype.Create_struct([blocks, rest], [0, blocks * P2P_BLOCK_BYTES],
                                          [block, mpi.BYTE]).Commit()
    finally:
        block.Free()


def _post(post: Callable[..., Any], buf: np.ndarray, **where: int) -> Any:
    """``post(buffer, **where)`` (``comm.Isend`` or ``comm.Irecv``) for the bytes ``buf`` (uint8,
    contiguous) of any size: ``buf`` itself, or over 2 GiB one element of a derived datatype (see
    the Note), freed once posted (MPI keeps it until the transfer completes)."""
    if buf.size <= P2P_TYPED_BYTES:
        return post(buf, **where)
    from mpi4py import MPI

    kind = _bytes_type(MPI, buf.size)
    try:
        return post([buf, 1, kind], **where)
    finally:
        kind.Free()


def isend_bytes(comm: Any, data: np.ndarray, dest: int, tag: int) -> Any:
    """``Isend`` of the bytes ``data`` (uint8, contiguous), of any size (see the Note)."""
    return _post(comm.Isend, data, dest=dest, tag=tag)


def irecv_bytes(comm: Any, buf: np.ndarray, source: int, tag: int) -> Any:
    """``Irecv`` into the bytes ``buf`` (uint8, contiguous), of any size (see the Note)."""
    return _post(comm.Irecv, buf, source=source, tag=tag)


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
                        raise timed_out("a send or receive", limit)
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
