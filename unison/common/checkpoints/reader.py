"""Load any checkpoint, sharded or consolidated, on any number of ranks, reading only what is asked.

[Note: what a load checks]
* Every rank reads the manifest, and the ranks agree they found the same save (its save id): a
  rank looking at another folder, or at a checkpoint replaced mid-way, raises on every rank.
* Each requested range is read with ``seek`` + ``readinto`` straight into the result, touching
  only the runs it overlaps. A run read whole is checked against its CRC-32. A range that covers
  only part of a run reads and checks every block of the run it touches (each 1 MiB block has a
  CRC of its own, [Note: a partial read checks its blocks]), or, for a run of one block, the whole
  run; ``verify="all"`` reads and checks every run it touches in full. Checkpoints written before
  2026-12-07 have no block CRCs: their partial reads of longer runs are checked only with
  ``verify="all"`` (sizes are still checked).
* A data file that is missing, of the wrong size or truncated, an unknown entry, a range outside
  its entry and a newer format version each raise a :class:`CheckpointError` naming the file and
  the entry; under MPI the outcome is agreed, so every rank raises the same error.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Mapping
from typing import Any, BinaryIO

import numpy as np

from unison.common.checkpoints import agree, storage
from unison.common.checkpoints.format import (
    CRC_BLOCK_BYTES,
    MANIFEST_NAME,
    CheckpointError,
    Entry,
    Manifest,
    Run,
    decode_header,
    little,
)

__all__ = ["load", "read_manifest"]

FULL = "full"


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of the checkpoint at ``path`` (a folder of :func:`save_sharded` or a file of
    :func:`save_consolidated`): entries with shapes and dtypes, world size, metadata.

    Raises:
        CheckpointError: nothing there, not a Unison checkpoint, malformed, or a newer version.
    """
    return _open_manifest(os.fspath(path))[0]


def _open_manifest(path: str) -> tuple[Manifest, int, tuple[int, int] | None]:
    """The manifest, for a single file where its data section starts (0 for a folder), and the file's
    identity (device, inode; None for a folder), so that its data is read from the same file."""
    if os.path.isdir(path):
        where = os.path.join(path, MANIFEST_NAME)
        try:
            with open(where, encoding="utf-8") as f:
                doc = json.load(f)
        except FileNotFoundError as exc:
            raise CheckpointError(f"{path!r} has no {MANIFEST_NAME}: it is not a checkpoint folder, or no save "
                                  "into it has committed yet") from exc
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(f"cannot read {where!r} ({type(exc).__name__}: {exc}); the manifest is "
                                  "damaged") from exc
        return Manifest.from_json(doc, repr(where)), 0, None
    try:
        with open(path, "rb") as f:
            manifest, base = decode_header(f, repr(path))
            st = os.fstat(f.fileno())
            return manifest, base, (st.st_dev, st.st_ino)
    except FileNotFoundError as exc:
        raise CheckpointError(f"no checkpoint at {path!r} (no such file or folder)") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read {path!r}: {type(exc).__name__}: {exc}") from exc


def load(path: str | os.PathLike[str], wanted: Mapping[str, Any], comm: Any = None,
         verify: str = "read") -> dict[str, Any]:
    """Read the entries (or parts of them) this rank wants from the checkpoint at ``path``.

    Collective over ``comm`` when given (every rank calls it; each may want different parts).
    See [Note: what a load checks].

    Args:
        path: a checkpoint folder or single file, saved on any number of ranks.
        wanted: entry name -> ``"full"`` (the whole array, shaped) or a list of
            ``(flat_start, length)`` ranges of the row-major flattened entry.
        comm: an mpi4py communicator, or None for one process.
        verify: ``"read"`` checks every byte it reads (a run read whole by its CRC, part of a run by
            the CRCs of the blocks it touches); ``"all"`` reads every run a range touches in full and
            checks it.

    Returns:
        name -> array (for ``"full"``) or list of 1-D arrays (one per range, in order).

    Raises:
        CheckpointError: on every rank: ranks that see different checkpoints, a missing,
            truncated or corrupt file, an unknown entry, a range outside its entry.
    """
    target = os.fspath(path)
    manifest, problem, base, identity = None, None, 0, None
    try:
        manifest, base, identity = _open_manifest(target)
    except CheckpointError as exc:
        problem = str(exc)
    views = agree.allgather(comm, (None if manifest is None else manifest.save_id, problem, target))
    _check_same_save(views)
    out: dict[str, Any] = {}
    cause: Exception | None = None
    try:
        if verify not in ("read", "all"):
            raise CheckpointError(f"verify={verify!r} must be 'read' (check runs read whole) or 'all' (read and "
                                  "check every run touched)")
        if manifest is None:  # unreachable: _check_same_save raised on every rank
            raise CheckpointError(f"no manifest read from {target!r}")
        with _Files(target, manifest, base, identity) as files:
            out = {name: _load_entry(files, manifest, name, spec, verify == "all")
                   for name, spec in _items(wanted)}
    except CheckpointError as exc:
        problem, cause = str(exc), exc
    except Exception as exc:  # an I/O error or out of memory: every rank must hear of it
        problem, cause = f"loading {target!r} failed: {type(exc).__name__}: {exc}", exc
    agree.raise_together(comm, problem, cause)
    return out


def _items(wanted: Any) -> list[tuple[str, Any]]:
    if not isinstance(wanted, Mapping):
        raise CheckpointError(f"wanted must be a dict of entry name -> 'full' or [(flat_start, length), ...]; got "
                              f"{type(wanted).__name__}")
    return list(wanted.items())


def _check_same_save(views: list[tuple[Any, ...]]) -> None:
    bad = [r for r, v in enumerate(views) if v[1] is not None]
    if bad:
        also = f" ({agree.ranks_text(bad[1:])} could not either)" if len(bad) > 1 else ""
        raise CheckpointError(f"rank {bad[0]}: {views[bad[0]][1]}{also}" if len(views) > 1 else views[0][1])
    groups: dict[str, list[int]] = {}
    for r, (save_id, _, where) in enumerate(views):
        groups.setdefault(f"save {save_id} in {where!r}", []).append(r)
    if len({v[0] for v in views}) > 1:
        found = "; ".join(f"{agree.ranks_text(rs)} {'sees' if len(rs) == 1 else 'see'} {what}"
                          for what, rs in groups.items())
        raise CheckpointError(f"the ranks found different checkpoints ({found}), so they would load different "
                              "values; pass every rank the same path, on a shared filesystem")


def _load_entry(files: _Files, manifest: Manifest, name: str, spec: Any, verify_all: bool) -> Any:
    entry = manifest.entries.get(name)
    if entry is None:
        known = sorted(manifest.entries)
        raise CheckpointError(f"entry {name!r} is not in the checkpoint at {files.path!r}; it has {len(known)} "
                              f"entries: {known[:20]}{' ...' if len(known) > 20 else ''}")
    if isinstance(spec, str) and spec == FULL:
        return _native(_read_range(files, name, entry, 0, entry.numel, verify_all)).reshape(entry.shape)
    ranges = _check_ranges(name, entry, spec)
    return [_native(_read_range(files, name, entry, s, n, verify_all)) for s, n in ranges]


def _check_ranges(name: str, entry: Entry, spec: Any) -> list[tuple[int, int]]:
    fix = "ask for 'full' or a list of (flat_start, length) pairs"
    try:
        ranges = [(s, n) for s, n in spec]
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"entry {name!r}: wanted {spec!r} is neither 'full' nor a list of ranges; "
                              f"{fix}") from exc
    for s, n in ranges:
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (s, n)) or s < 0 or n < 0:
            raise CheckpointError(f"entry {name!r}: range ({s!r}, {n!r}) must be two integers >= 0; {fix}")
        if s + n > entry.numel:
            raise CheckpointError(f"entry {name!r}: range [{s}, {s + n}) is outside the entry's {entry.numel} "
                                  f"elements (shape {entry.shape}, flattened row-major)")
    return [(int(s), int(n)) for s, n in ranges]


def _read_range(files: _Files, name: str, entry: Entry, first: int, count: int, verify_all: bool) -> np.ndarray:
    """Elements ``[first, first + count)`` of ``entry``, read from the runs they lie in."""
    out = np.empty(count, little(entry.np_dtype))
    runs = sorted(entry.runs, key=lambda run: run.start)
    i = max(0, bisect.bisect_right([r.start for r in runs], first) - 1)
    covered = first
    for run in runs[i:]:
        lo, hi = max(first, run.start), min(first + count, run.start + run.length)
        if run.start >= first + count:
            break
        if lo >= hi:
            continue
        if lo != covered:
            break
        files.read(name, entry, run, lo, out[lo - first:hi - first], verify_all)
        covered = hi
    if covered != first + count:
        raise CheckpointError(f"entry {name!r}: the manifest at {files.path!r} names no run holding elements "
                              f"[{covered}, {first + count}); the manifest is damaged")
    return out


def _native(arr: np.ndarray) -> np.ndarray:
    native = arr.dtype.newbyteorder("=")
    return arr if arr.dtype == native else arr.astype(native)


class _Files:
    """The data files of one checkpoint, opened on first use, sizes checked, closed at the end."""

    def __init__(self, path: str, manifest: Manifest, base: int, identity: tuple[int, int] | None = None) -> None:
        self.path, self.manifest, self.base, self.identity = path, manifest, base, identity
        self.open: dict[str | None, BinaryIO] = {}

    def __enter__(self) -> _Files:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self.open.values():
            f.close()

    def read(self, name: str, entry: Entry, run: Run, lo: int, dest: np.ndarray, verify_all: bool) -> None:
        """Fill ``dest`` with elements ``[lo, lo + len(dest))`` of ``run``, checking what can be checked."""
        f, where = self._file(run.file, name)
        size = dest.dtype.itemsize
        whole = lo == run.start and len(dest) == run.length
        if not whole and not verify_all and run.blocks:
            self._read_blocks(f, where, name, run, run.length * size, (lo - run.start) * size,
                              storage.as_bytes(dest))
            return
        if not whole and run.length * size <= CRC_BLOCK_BYTES:  # a run of one block: check it whole, cheaply
            verify_all = True
        if whole or verify_all:
            buf = dest if whole else np.empty(run.length, dest.dtype)
            self._fill(f, where, name, run, run.offset, buf)
            if storage.crc32(buf) != run.crc32:
                raise CheckpointError(f"{where} is corrupt: entry {name!r}, elements [{run.start}, "
                                      f"{run.start + run.length}) at byte {run.offset} fail their CRC-32 check; "
                                      "restore the checkpoint from a good copy")
            if not whole:
                dest[:] = buf[lo - run.start:lo - run.start + len(dest)]
            return
        self._fill(f, where, name, run, run.offset + (lo - run.start) * size, dest)

    def _read_blocks(self, f: BinaryIO, where: str, name: str, run: Run, total: int, first: int,
                     dest: np.ndarray) -> None:
        """Fill the bytes ``dest`` with bytes ``[first, first + len(dest))`` of ``run`` (``total`` bytes long),
        reading and checking
        every block of :data:`CRC_BLOCK_BYTES` they touch.

        [Note: a partial read checks its blocks] A shard that reads part of a run (a ZeRO rank's segment
        after a change of rank count, any sharded reader of a consolidated file, whose entries are one
        run each) checked no CRC before 2026-12-07: a flipped byte in a consolidated file loaded as
        -7.45e+35 at every rank count, and a save after it wrote the bad value under a fresh, valid CRC
        (found by an audit). Blocks wholly inside the range are read straight into ``dest``; the first
        and last, where the range cuts them, through a block-sized buffer.
        """
        end = first + dest.nbytes
        for k in range(first // CRC_BLOCK_BYTES, -(-end // CRC_BLOCK_BYTES)):
            lo, hi = k * CRC_BLOCK_BYTES, min((k + 1) * CRC_BLOCK_BYTES, total)
            inside = first <= lo and hi <= end
            buf = dest[lo - first:hi - first] if inside else np.empty(hi - lo, np.uint8)
            self._fill(f, where, name, run, run.offset + lo, buf)
            if k >= len(run.blocks) or storage.crc32(buf) != run.blocks[k]:
                raise CheckpointError(f"{where} is corrupt: entry {name!r}, bytes [{lo}, {hi}) of its run of "
                                      f"elements [{run.start}, {run.start + run.length}) at byte {run.offset} "
                                      "fail their CRC-32 check; restore the checkpoint from a good copy")
            if not inside:
                a, b = max(first, lo), min(end, hi)
                dest[a - first:b - first] = buf[a - lo:b - lo]

    def _fill(self, f: BinaryIO, where: str, name: str, run: Run, offset: int, dest: np.ndarray) -> None:
        f.seek(self.base + offset)
        want = dest.nbytes
        got = f.readinto(storage.buffer(dest)) if want else 0  # type: ignore[attr-defined]
        if got != want:
            raise CheckpointError(f"{where} is truncated: entry {name!r} needs bytes [{self.base + offset}, "
                                  f"{self.base + offset + want}), the file ends before them; restore the "
                                  "checkpoint from a good copy")

    def _file(self, file: str | None, name: str) -> tuple[BinaryIO, str]:
        where = os.path.join(self.path, file) if file is not None else self.path
        if file not in self.open:
            self.open[file] = self._open(file, where, name)
        return self.open[file], repr(where)

    def _open(self, file: str | None, where: str, name: str) -> BinaryIO:
        if file is not None and (os.sep in file or file in (os.curdir, os.pardir)):
            raise CheckpointError(f"the manifest at {self.path!r} names data file {file!r} outside its folder")
        try:
            f = open(where, "rb")
        except OSError as exc:
            raise CheckpointError(f"cannot open data file {where!r} of entry {name!r} ({type(exc).__name__}: "
                                  f"{exc}); the checkpoint is incomplete: restore it, or load an earlier "
                                  "one") from exc
        expected = self.manifest.files.get(file) if file is not None else None
        st = os.fstat(f.fileno())
        if file is None and self.identity is not None and (st.st_dev, st.st_ino) != self.identity:
            f.close()  # a save replaced the file since its header was read: its data are another save's
            raise CheckpointError(f"{where!r} was replaced by another save while this load read it; load it "
                                  "again once that save is done (a single-file checkpoint is read by "
                                  "opening it twice: its header, then its data)")
        found = st.st_size
        if expected is not None and found != expected:
            f.close()
            state = "truncated" if found < expected else "longer than written"
            raise CheckpointError(f"data file {where!r} of entry {name!r} is {state}: it has {found} bytes, the "
                                  f"manifest says {expected}; restore the checkpoint from a good copy")
        return f
