"""From what each rank passes to a save, to who writes which run: checked the same way on every rank.

Every rank describes its entries (shapes, dtypes, run bounds: no data), the descriptions are
all-gathered, and every rank derives the same :class:`Layout` from them, so a conflict, a gap or
an overlap raises the same error everywhere before any byte is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from unison.common.checkpoints.agree import ranks_text
from unison.common.checkpoints.format import (
    CheckpointError,
    LocalShard,
    Replicated,
    dtype_from_name,
    dtype_to_name,
    little,
    numel,
)

__all__: list[str] = []

REPLICATED, SHARDED = "replicated", "sharded"


class Slot(NamedTuple):
    """A run one rank writes: ``length`` elements of ``name`` from flat element ``start``."""

    name: str
    start: int
    length: int


@dataclass
class LocalEntry:
    """One rank's contribution to an entry, checked: data little-endian, contiguous, 1-D."""

    shape: tuple[int, ...]
    dtype: str
    kind: str
    pieces: dict[int, np.ndarray]  # flat start -> 1-D data

    def describe(self) -> tuple[tuple[int, ...], str, str, list[tuple[int, int]]]:
        return self.shape, self.dtype, self.kind, sorted((s, len(a)) for s, a in self.pieces.items())


@dataclass
class Layout:
    """Every entry's shape and dtype, and per rank the runs it writes, in write order."""

    entries: dict[str, tuple[tuple[int, ...], str]]
    writes: list[list[Slot]]

    def file_bytes(self, rank: int) -> int:
        return sum(s.length * dtype_from_name(self.entries[s.name][1]).itemsize for s in self.writes[rank])


def prepare(entries: Mapping[str, Any]) -> dict[str, LocalEntry]:
    """Check and normalize what this rank passed.

    Raises:
        CheckpointError: a bad name, type, shape, dtype or run (naming the entry and the fix).
    """
    if not isinstance(entries, Mapping):
        raise CheckpointError(f"entries must be a dict of name -> LocalShard, Replicated or numpy array; got "
                              f"{type(entries).__name__}")
    return {_check_name(name): _prepare_one(name, value) for name, value in entries.items()}


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"entry names must be non-empty strings; got {name!r}")
    return name


def _prepare_one(name: str, value: Any) -> LocalEntry:
    if isinstance(value, Replicated):
        value = value.array
    if isinstance(value, np.ndarray) or np.isscalar(value):
        arr = np.asarray(value)
        dtype = dtype_to_name(arr.dtype)
        return LocalEntry(tuple(arr.shape), dtype, REPLICATED, {0: _flat(arr)})
    if not isinstance(value, LocalShard):
        raise CheckpointError(f"entry {name!r} is a {type(value).__name__}; pass a LocalShard, a Replicated or a "
                              "numpy array")
    shape = _check_shape(name, value.shape)
    dtype = dtype_to_name(value.dtype)
    total = numel(shape)
    pieces: dict[int, np.ndarray] = {}
    for start, data in value.runs:
        arr = np.asarray(data)
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
            raise CheckpointError(f"entry {name!r}: a run starts at {start!r}; flat starts are integers >= 0")
        if arr.ndim != 1 or dtype_to_name(arr.dtype) != dtype:
            raise CheckpointError(f"entry {name!r}: the run at {start} is {arr.dtype} of shape {arr.shape}; runs "
                                  f"are 1-D arrays of the entry's dtype {dtype} (flatten with .ravel())")
        if start + len(arr) > total:
            raise CheckpointError(f"entry {name!r}: the run [{start}, {start + len(arr)}) ends past the entry's "
                                  f"{total} elements (shape {shape})")
        if int(start) in pieces and len(arr) and len(pieces[int(start)]):  # (an empty run holds no place)
            raise CheckpointError(f"entry {name!r}: two runs start at {start} on this rank")
        if len(arr) or int(start) not in pieces:
            pieces[int(start)] = _flat(arr)
    return LocalEntry(shape, dtype, SHARDED, pieces)


def _check_shape(name: str, shape: Any) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        dims = (shape,)
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise CheckpointError(f"entry {name!r}: shape {shape!r} must be a tuple of integers >= 0")
    return tuple(int(d) for d in dims)


def _flat(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr.reshape(-1), dtype=little(arr.dtype))


def plan(described: list[dict[str, Any]]) -> Layout:
    """The layout every rank derives from every rank's ``describe()`` output (same on all).

    Raises:
        CheckpointError: ranks declare an entry differently, or its runs leave a gap or overlap.
    """
    names = sorted({n for d in described for n in d})
    entries: dict[str, tuple[tuple[int, ...], str]] = {}
    writes: list[list[Slot]] = [[] for _ in described]
    for name in names:
        holders = [(r, d[name]) for r, d in enumerate(described) if name in d]
        shape, dtype, kind = _agreed_declaration(name, holders)
        entries[name] = (shape, dtype)
        if kind == REPLICATED:
            writes[holders[0][0]].append(Slot(name, 0, numel(shape)))
            continue
        runs = sorted((start, length, r) for r, desc in holders for start, length in desc[3] if length)
        _check_cover(name, numel(shape), runs)
        for start, length, r in runs:
            writes[r].append(Slot(name, start, length))
    return Layout(entries, writes)


def _agreed_declaration(name: str, holders: list[tuple[int, Any]]) -> tuple[tuple[int, ...], str, str]:
    groups: dict[tuple[Any, ...], list[int]] = {}
    for r, (shape, dtype, kind, _) in holders:
        groups.setdefault((tuple(shape), dtype, kind), []).append(r)
    if len(groups) > 1:
        found = "; ".join(f"{ranks_text(rs)}: {kind} shape {shape} {dtype}"
                          for (shape, dtype, kind), rs in groups.items())
        raise CheckpointError(f"entry {name!r} is declared differently across ranks ({found}); every rank "
                              "holding an entry must give the same global shape, dtype and kind")
    (shape, dtype, kind), = groups
    return shape, dtype, kind


def _check_cover(name: str, total: int, runs: list[tuple[int, int, int]]) -> None:
    """Raise unless ``runs`` ((start, length, rank), sorted) cover ``[0, total)`` exactly once."""
    end, last_rank = 0, -1
    for start, length, r in runs:
        if start > end:
            _gap(name, total, end, start)
        if start < end:
            raise CheckpointError(f"entry {name!r} ({total} elements): elements "
                                  f"[{start}, {min(end, start + length)}) "
                                  f"are given by both rank {last_rank} and rank {r} (the runs overlap); every "
                                  "element must be given by exactly one rank (or pass the entry as Replicated)")
        end, last_rank = start + length, r
    if end < total:
        _gap(name, total, end, total)


def _gap(name: str, total: int, lo: int, hi: int) -> None:
    raise CheckpointError(f"entry {name!r} ({total} elements): elements [{lo}, {hi}) are given by no rank (a gap "
                          "in the runs); every element must be given by exactly one rank")
