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

import operator
from collections.abc import Callable
from typing import Any

from unison.common.engine.handles import Handle
from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.ops import Adasum, is_adasum, resolve_op

__all__ = ["TorchHandle", "SparseHandle", "ListHandle", "raise_now", "set_or_none", "root_in_set",
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
            self._result, self._done = self.convert(self.inner.wait(timeout)), True
        return self._result


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
            self._result, self._done = self.convert([h.wait(timeout) for h in self.members]), True
        return self._result


class SparseHandle(ListHandle):
    """``sparse_allreduce_async``'s handle: call it (Horovod's way) or synchronize it."""

    __slots__ = ()

    def __call__(self) -> Any:
        return self.wait()

#: Horovod's ``average=`` / ``op=`` pair: a ReduceOp (``Adasum`` included).
reduce_op = resolve_op
