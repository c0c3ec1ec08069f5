"""Handles of the PyTorch backend's asynchronous ops, and the rules ops share.

A :class:`TorchHandle` wraps an engine handle and converts its numpy result to
torch tensors once, on first ``synchronize``. A :class:`SparseHandle` is what
``sparse_allreduce_async`` returns: like Horovod's, it is callable and gives the
reduced sparse tensor; ``synchronize`` and ``poll`` accept it too.

Process sets follow Horovod: ``root_rank`` is always a *global* rank (as
``hvd.rank()`` gives), also when a ``process_set`` is passed; it is translated
here to the rank within the set that the engine works with.
"""

from __future__ import annotations

import concurrent.futures
import operator
import threading
from collections.abc import Callable
from typing import Any

import torch

from unison.common.engine.handles import POSTING, Handle, wait_all
from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.ops import Adasum, is_adasum, resolve_op

__all__ = ["TorchHandle", "InPlaceHandle", "SparseHandle", "ListHandle", "raise_now", "set_or_none", "root_in_set",
           "Adasum", "is_adasum", "reduce_op", "poll", "synchronize"]




def poll(handle: Handle) -> bool:
    """Whether the collective behind ``handle`` has finished."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle`` and return its result (a tensor, a list for grouped ops, a tuple for alltoall)."""
    return handle.wait()




def raise_now(inner: Handle) -> Handle:
    """Raise at once an error the engine recorded at submission (a duplicate name: Horovod's ValueError)."""
    if inner.done() and getattr(inner, "_error", None) is not None:
        inner.wait()
    return inner


def set_or_none(process_set: ProcessSet | None) -> ProcessSet | None:
    """None for the global set (Horovod's default argument), the set otherwise."""
    if process_set is None or process_set is global_process_set:
        return None
    return process_set


def root_in_set(root_rank: Any, process_set: ProcessSet | None) -> Any:
    """Horovod's global ``root_rank`` as a rank of ``process_set`` (unchanged for the global set).

    Raises:
        ValueError: ``root_rank`` is not a member of the set.
    """
    if process_set is None or process_set.ranks is None:
        return root_rank
    try:  # any integer type (numpy's too: it reached the engine untranslated, a rank within the set)
        root_rank = operator.index(root_rank)
    except TypeError:
        return root_rank  # (refused by the op's own check)
    if root_rank not in process_set.ranks:
        raise ValueError(f"root_rank={root_rank} is not a member of {process_set!r}; as in Horovod, "
                         "root_rank is a global rank (hvd.rank()) of a member of the process set")
    return process_set.ranks.index(root_rank)


class TorchHandle(Handle):
    """Wraps an engine handle; ``synchronize`` returns torch tensors."""

    __slots__ = ("inner", "convert")

    def __init__(self, inner: Handle, convert: Callable[[Any], Any]) -> None:
        super().__init__(inner.name)
        self.inner, self.convert = inner, convert

    def done(self) -> bool:
        return self.inner.done()

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            result = self.inner.wait(timeout)
            with POSTING:  # (one conversion, one result object, whatever the threads waiting)
                if not self._done:
                    self._result, self._done = self.convert(result), True
        return self._result


class InPlaceHandle(Handle):
    """An in-place op whose result is copied into its tensors: the copy runs when the collective
    completes, on a worker thread (not the engine's: its next cycle would wait for the copy), and
    ``poll()`` is True only once the tensors hold the result (Horovod's op writes its output then).
    Before 2026-12-05 ``broadcast_async_`` and ``grouped_allreduce_async_`` copied only in
    ``synchronize``: after ``poll()`` the tensor held its old values, a change made before
    ``synchronize`` was overwritten, and a handle never synchronized never landed.
    """

    __slots__ = ("inner", "write", "target", "_lock", "_landed", "_left", "_write_error", "_inference")

    def __init__(self, inner: Handle, write: Callable[[Any], None], target: Any) -> None:
        super().__init__(inner.name)
        self.inner, self.write, self.target = inner, write, target
        # the copy runs under the caller's inference mode, which is per thread: the landing thread's is off, and
        # writing into an inference tensor there raised (before 2026-12-07: on the rank whose result landed on
        # that thread, metrics reduced in torch.inference_mode() half written and the ranks apart)
        targets = target if isinstance(target, (list, tuple)) else [target]
        self._inference = torch.is_inference_mode_enabled() or any(
            isinstance(t, torch.Tensor) and t.is_inference() for t in targets)
        self._lock = threading.Lock()
        self._landed = False
        self._write_error: BaseException | None = None
        leaves = _leaves(inner)
        self._left = len(leaves)
        if not leaves:  # an empty group: nothing to wait for
            self._land()
        for leaf in leaves:
            leaf.add_done_callback(self._leaf_done)

    def _leaf_done(self, leaf: Handle) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            _LANDERS.submit(self._land)

    def _land(self) -> None:
        with self._lock:
            if self._landed:
                return
            try:
                with torch.inference_mode(self._inference):
                    self.write(self.inner.wait())
            except BaseException as exc:  # noqa: BLE001 - the collective's error, or the copy's: wait() raises it
                self._write_error = exc
            self._landed = True

    def done(self) -> bool:
        return self._landed

    def wait(self, timeout: float | None = None) -> Any:
        if not self._landed:
            self.inner.wait(timeout)  # (raises its error, or TimeoutError)
            self._land()
        if self._write_error is not None:
            raise self._write_error
        return self.target


#: the thread that copies completed in-place results into their tensors (see InPlaceHandle)
_LANDERS = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="unison-inplace")


def _leaves(handle: Handle) -> list[Handle]:
    """The engine handles whose completion completes ``handle`` (through wrappers and groups)."""
    inner = getattr(handle, "inner", None)
    if isinstance(handle, (TorchHandle, InPlaceHandle)) and inner is not None:
        return _leaves(inner)
    members = getattr(handle, "members", None)
    if members is not None:
        return [leaf for m in members for leaf in _leaves(m)]
    return [handle]


class ListHandle(Handle):
    """Completes when every member does; its result is the list of the members' results."""

    __slots__ = ("members", "convert")

    def __init__(self, name: str, members: list[Handle], convert: Callable[[list], Any] = list) -> None:
        super().__init__(name)
        self.members, self.convert = members, convert

    def done(self) -> bool:
        return all(h.done() for h in self.members)

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            # every member done before an error is raised: [Note: a group waits for all its members]
            results = wait_all(self.members, timeout)
            with POSTING:  # (see TorchHandle.wait)
                if not self._done:
                    self._result, self._done = self.convert(results), True
        return self._result


class SparseHandle(ListHandle):
    """``sparse_allreduce_async``'s handle: call it (Horovod's way) or synchronize it."""

    __slots__ = ()

    def __call__(self) -> Any:
        return self.wait()

#: Horovod's ``average=`` / ``op=`` pair: a ReduceOp (``Adasum`` included).
reduce_op = resolve_op
