"""The ``Work`` objects of the ``torch.distributed`` backend (unison/torch_backend/process_group.py).

A collective's ``Work`` completes through the engine's handles: each handle's done-callback
(run on the engine thread) records its result; after the last one, a completion thread writes
PyTorch's output tensors and completes the future ([Note: completing off the engine thread]).
A point-to-point ``Work`` wraps an MPI request.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from unison.common.engine.handles import Handle
from unison.torch_backend.tensors import from_numpy, to_numpy

__all__ = ["host", "copy_into", "collective_work", "P2PWork"]


def host(tensor: torch.Tensor, what: str) -> np.ndarray:
    """``tensor``'s memory as a numpy array (no copy for a contiguous CPU tensor)."""
    if tensor.device.type != "cpu":
        raise NotImplementedError(f"the unison backend takes CPU tensors only; {what} got one on "
                                  f"{tensor.device}. Move it with .cpu(), or use the gloo backend")
    return to_numpy(tensor)


def copy_into(target: torch.Tensor, values: Any) -> None:
    with torch.no_grad():
        target.copy_(from_numpy(np.asarray(values)).reshape(target.shape))


def collective_work(handles: Sequence[Handle], finish: Callable[[list[Any]], Any]) -> dist.Work:
    """A ``Work`` done when every handle is: ``finish(results)`` writes the outputs (on the
    engine thread) and its value completes the future."""
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
    return _Work(fut)


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

    def __init__(self, fut: Future) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: Any = None) -> bool:
        self._fut.wait()
        return True

    def get_future(self) -> Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()


class P2PWork(dist.Work):
    """A send or receive in flight: ``wait()`` completes it (and fills the tensor received into)."""

    def __init__(self, request: Any, buffer: np.ndarray, into: torch.Tensor | None = None) -> None:
        super().__init__()
        self._request, self._buffer, self._into = request, buffer, into
        self._source = -1

    def wait(self, timeout: Any = None) -> bool:
        if self._request is not None:
            from mpi4py import MPI

            status = MPI.Status()
            self._request.Wait(status)
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
        self.wait()
        fut: Future = Future()
        fut.set_result([self._into] if self._into is not None else [])
        return fut
