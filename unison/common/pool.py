"""A recycling allocator for the result arrays of collectives.

Every collective without ``out=`` returns a new array. On this kind of host a
fresh large array costs a page fault per 4 KiB touched, which for ResNet-50's
100 MB of gradients is a third of the step. Like PyTorch's caching allocator,
the pool keeps the arrays it handed out and gives one back out when the caller
has dropped every reference to it: ``sys.getrefcount`` then sees only the pool's
own. A view keeps its base alive, and ``torch.from_numpy`` keeps a reference
too, so an array still visible anywhere is never handed out twice.

Pooled arrays start on a 64-byte boundary. TensorFlow adopts a returned numpy
array without copying only when it is aligned that way (``numpy_function``
outputs); a large ``np.empty`` lands 16 bytes past a page boundary, which
would cost TensorFlow a fresh allocation and a copy per gradient.
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np

__all__ = ["ResultPool", "results", "size_class"]

#: Smaller arrays come from malloc's free lists anyway.
MIN_BYTES = 256 << 10
#: Start of every pooled array: TensorFlow's (Eigen's) alignment for zero-copy adoption.
ALIGN = 64
#: After a full pool's scan found nothing free, the buffers that do not fit without a scan
SCAN_AFTER = 64


def size_class(nbytes: int) -> int:
    """The bytes of the buffer that holds an array of ``nbytes``: rounded up to one of eight steps per power of
    two (at most 12.5% more), so arrays whose shapes change from step to step share buffers."""
    step = 1 << max(nbytes.bit_length() - 4, 0)
    return -(-nbytes // step) * step


class ResultPool:
    """Hands out arrays of any shape and dtype, reusing buffers nobody references any more.

    [Note: the pool's buffers] Buffers are kept by size class (:func:`size_class`), not by shape, and at most
    ``max_bytes`` of them: when a new buffer would pass that, free buffers are let go, those of the size
    classes used least recently first, until it fits (a scan that finds none free is not repeated for the
    next :data:`SCAN_AFTER` buffers that do not fit: a job whose live results exceed the limit pays no scan
    per result). Before 2026-12-06 (a leak audit) they were kept by exact shape and never let go: a job whose
    result shapes changed each step (all-reduces of 256 KiB and more, of varying shapes) filled its pools
    with buffers it never used again, to 1 GiB per process set (2 GB of memory for 0.5 MB in use), and
    added a table entry per shape forever.
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self.held = 0
        self._arrays: dict[int, list[np.ndarray]] = {}  # by size class, the least recently used first
        self._skip = 0  # buffers not to scan for (see the class's docstring)
        #: where each held buffer's aligned array starts (by the buffer's id), found once when it is made
        self._starts: dict[int, int] = {}
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised array of ``shape`` and ``dtype``, recycled when possible."""
        dt = np.dtype(dtype)
        nbytes = math.prod(shape) * dt.itemsize
        if nbytes < MIN_BYTES:
            return np.empty(shape, dtype=dt)
        size = size_class(nbytes)
        with self._lock:
            # the pool keeps each array's raw buffer: every view handed out (and every
            # view of those) refers to it, so only the pool's reference left means free
            buffers = self._arrays.pop(size, None)
            if buffers is not None:
                self._arrays[size] = buffers  # (now the most recently used class)
                for i in range(len(buffers)):
                    # the list's reference and the argument's (an indexed argument is a new reference on every
                    # Python; a loop variable may be lent without one from 3.14 on, which would count a buffer
                    # one live array holds as free)
                    if sys.getrefcount(buffers[i]) == 2:
                        raw = buffers[i]
                        return np.ndarray(shape, dt, raw, self._starts[id(raw)])
            raw = np.empty(size + ALIGN, dtype=np.uint8)
            start = -raw.ctypes.data % ALIGN
            if self.held + size > self.max_bytes:
                self._make_room(size)
            if self.held + size <= self.max_bytes:
                self._arrays.setdefault(size, []).append(raw)
                self._starts[id(raw)] = start
                self.held += size
            return np.ndarray(shape, dt, raw, start)

    def _make_room(self, size: int) -> None:
        """Let go of free buffers, the least recently used classes first, until ``size`` more bytes fit (the
        caller holds the lock)."""
        if self._skip:
            self._skip -= 1
            return
        for key in list(self._arrays):
            buffers = self._arrays[key]
            i = 0
            while i < len(buffers) and self.held + size > self.max_bytes:
                if sys.getrefcount(buffers[i]) == 2:  # the list's reference and the argument's: free
                    del self._starts[id(buffers[i])]
                    del buffers[i]
                    self.held -= key
                else:
                    i += 1
            if not buffers:
                del self._arrays[key]
            if self.held + size <= self.max_bytes:
                return
        self._skip = SCAN_AFTER

    def clear(self) -> None:
        """Forget every array (the ones still in use stay valid; their memory is freed with them)."""
        with self._lock:
            self._arrays.clear()
            self._starts.clear()
            self.held = 0


#: The process-wide pool of the direct collectives (the engine keeps its own per process set).
results = ResultPool()
