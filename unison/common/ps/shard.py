"""One shard of a table: its rows in storage order, the optimizer's per-row state, the clocks.

The shard's lock guards rows, state and clocks: the owning rank's worker thread reads and
updates its own shard directly, while the server thread (SSP/ASP) serves the other workers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from unison.common.ps.optimizers import Optimizer, rows_of
from unison.common.ps.sharding import Sharding

__all__ = ["Shard", "merge", "initial_rows"]

#: Most bytes of float64 random numbers drawn at once by the initializers.
_DRAW_BYTES = 4 << 20
_CHUNK = 1 << 16  # rows per random-number block: the initial table is the same on any number of ranks


def merge(storage: np.ndarray, grads: np.ndarray,
          counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sum the gradient rows that several sources sent for the same storage index.

    ``counts``: rows per source, in order; each source's indices are unique (a worker combines its
    duplicates before sending). Returns unique indices and their summed rows. Rows are added source
    by source into the union of the indices (a fancy-indexed add per source: no duplicates within
    one), several times faster than a sort and ``np.add.reduceat`` over many small groups.

    Each source's indices arrive sorted (a worker's are ``np.unique``'s output, grouped by shard),
    so the concatenation is ``len(counts)`` sorted runs, which a stable sort (a merge sort that
    finds runs) orders in linear time: the union costs ~1/50 of ``np.unique``'s introsort on 2x10k
    indices (still correct, only slower, for unsorted sources).
    """
    if counts is None or np.count_nonzero(counts) <= 1:
        return storage, grads
    ordered = np.sort(storage, kind="stable")
    first = np.empty(len(ordered), bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    union = ordered[first]
    if len(union) == len(storage):  # disjoint sources
        return storage, grads
    out = np.zeros((len(union),) + grads.shape[1:], grads.dtype)
    start = 0
    for n in counts:
        part = slice(start, start + int(n))
        out[np.searchsorted(union, storage[part])] += grads[part]
        start += int(n)
    return union, out


def initial_rows(
    initializer: Any, sharding: Sharding, lo: int, hi: int, dim: int, dtype: np.dtype, seed: int
) -> np.ndarray:
    """Rows ``[lo, hi)`` (storage order) of the initial table, the same whatever the sharding's shard count.

    ``initializer``: ``"zeros"``, ``"uniform"`` (U(-1/sqrt(dim), 1/sqrt(dim))), ``"normal"``
    (N(0, 1/dim)), or a callable ``keys -> rows`` given int64 keys.
    """
    n = hi - lo
    if callable(initializer):
        rows = np.asarray(initializer(sharding.keys_of(np.arange(lo, hi, dtype=np.int64))))
        if rows.shape != (n, dim):
            raise ValueError(
                f"the initializer returned shape {rows.shape} for {n} keys; it must return "
                f"(len(keys), dim) = ({n}, {dim})"
            )
        return np.ascontiguousarray(rows, dtype=dtype)
    if initializer == "zeros":
        return np.zeros((n, dim), dtype)
    if initializer not in ("uniform", "normal"):
        raise ValueError(
            f"initializer={initializer!r} is not 'zeros', 'uniform', 'normal' or a callable keys -> rows"
        )
    out = np.empty((n, dim), dtype)
    scale = 1.0 / np.sqrt(dim)
    # Each chunk of _CHUNK rows is one stream, drawn row after row from its first row; drawing it
    # in pieces of at most _DRAW_BYTES and stopping at the shard's last row gives the same values
    # as drawing the whole chunk at once (numpy's uniform and ziggurat normal keep no state
    # between calls), without a whole chunk in memory (10 rows of 2048 took 1 GiB).
    # [Note: one random stream per chunk] Philox's 256-bit counter moves up by one for every four
    # numbers drawn, so the chunk number goes in its third word: chunk c's stream starts 2^128
    # steps after chunk c - 1's and no two overlap. Before 2026-12-05 the chunk was the counter's
    # low word, so chunk c's numbers were chunk 0's shifted by 4c: with dim 4 row i of chunk 1
    # equalled row i + 1 of chunk 0, and a 10M x 64 table started with about 90% of its keys
    # sharing their row with another key.
    per_draw = max(1, _DRAW_BYTES // (8 * dim))
    for chunk in range(lo // _CHUNK, (hi + _CHUNK - 1) // _CHUNK):
        c0 = chunk * _CHUNK
        rng = np.random.Generator(np.random.Philox(key=seed, counter=[0, 0, chunk, 0]))
        a, b = max(lo, c0), min(hi, c0 + _CHUNK)
        row = c0
        while row < b:
            k = min(per_draw, b - row)
            if initializer == "uniform":
                block = rng.uniform(-scale, scale, (k, dim))
            else:
                block = rng.normal(0.0, scale, (k, dim))
            s0, s1 = max(a, row), row + k
            if s1 > s0:
                out[s0 - lo : s1 - lo] = block[s0 - row : s1 - row]
            row += k
    return out


class Shard:
    """Rows ``[lo, hi)`` of storage order, with the optimizer state and the workers' clocks."""

    def __init__(
        self,
        sharding: Sharding,
        index: int,
        dim: int,
        dtype: np.dtype,
        optimizer: Optimizer,
        initializer: Any,
        seed: int,
        workers: int,
        scale: float,
    ) -> None:
        self.lo, self.hi = sharding.block(index)
        self.dim, self.dtype = dim, np.dtype(dtype)
        self.optimizer = optimizer
        self.weights = initial_rows(initializer, sharding, self.lo, self.hi, dim, self.dtype, seed)
        self.state = optimizer.init_state(self.hi - self.lo, dim, self.dtype)
        self.scale = scale
        self.clocks = np.zeros(workers, np.int64)
        #: workers waiting in a barrier, save or load: they hold nobody back ([Note: clocks meet at a barrier])
        self.parked = np.zeros(workers, bool)
        self.cond = threading.Condition()

    def read(self, storage: np.ndarray) -> np.ndarray:
        with self.cond:
            return rows_of(self.weights, storage - self.lo)

    def apply(self, storage: np.ndarray, grads: np.ndarray, counts: np.ndarray | None = None,
              scale: float | None = None) -> None:
        """Apply gradient rows, times ``scale`` (default: the shard's).

        ``counts``: rows per source when several sources' rows are concatenated (see :func:`merge`);
        None: one source, whose indices are unique.
        """
        s, g = merge(storage, grads, counts)
        factor = self.scale if scale is None else scale
        with self.cond:
            self.optimizer.apply(self.weights, self.state, s - self.lo, g.astype(self.dtype, copy=False), factor)

    def advance(self, worker: int, clock: int) -> None:
        with self.cond:
            if clock > self.clocks[worker]:
                self.clocks[worker] = clock
                self.cond.notify_all()

    def slowest(self) -> int:
        """The slowest clock of the workers not parked in a barrier (call with the lock held).

        With every worker parked, the slowest of all: nobody is held back then (see :meth:`ready`).
        """
        active = self.clocks[~self.parked]
        return int(active.min() if active.size else self.clocks.min())

    def ready(self, need: int) -> bool:
        """Whether every worker not parked in a barrier has clock at least ``need`` (call with the lock held)."""
        return bool(self.parked.all()) or self.slowest() >= need

    def wait_ready(self, need: int, check: Callable[[], None] | None = None) -> int:
        """Block until :meth:`ready`; return the slowest clock seen."""
        with self.cond:
            while not self.ready(need):
                self.cond.wait(0.05)
                if check is not None:
                    check()
            return self.slowest()

    def park(self, worker: int) -> None:
        """``worker`` entered a barrier: until the barrier ends it holds nobody back."""
        with self.cond:
            self.parked[worker] = True
            self.cond.notify_all()

    def unpark(self, worker: int) -> None:
        """``worker`` left a barrier that could not complete (a worker closed the table instead of joining it)."""
        with self.cond:
            self.parked[worker] = False
            self.cond.notify_all()

    def meet(self) -> int:
        """Every worker has entered the barrier: each parked worker's clock becomes the largest of theirs.

        Returns that clock. [Note: clocks meet at a barrier] (table.py) says why.
        """
        with self.cond:
            met = int(self.clocks[self.parked].max()) if self.parked.any() else int(self.clocks.min())
            self.clocks[self.parked] = np.maximum(self.clocks[self.parked], met)
            self.parked[:] = False
            self.cond.notify_all()
            return met
