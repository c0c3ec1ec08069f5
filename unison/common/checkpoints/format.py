"""What a checkpoint is on disk: entries, runs, the manifest and the single-file container.

[Note: checkpoint format]
A checkpoint holds named *entries*, each a global array (shape, dtype). Its bytes are stored as
*runs*: consecutive elements of the row-major flattened entry, each in one data file at a byte
offset, with the CRC-32 of its bytes and, when it spans more than one block of
:data:`CRC_BLOCK_BYTES`, the CRC-32 of each such block of its bytes (counted from the run's first
byte), so that a read of part of a run checks the blocks it touches. Every element of every entry
is in exactly one run.

Two forms share one manifest schema (``Manifest.to_json``)::

    sharded (a folder)                      consolidated (one file)
      manifest.json   <- the commit point     b"UNISONCK" | u32 version | u64 header bytes
      data-<save id>-rank00000.bin            header (the manifest, JSON, utf-8)
      data-<save id>-rank00001.bin            zero padding to a multiple of 64
      ...                                     data: each entry's bytes, 64-byte aligned

In the folder form a run names its data file; in the single file ``file`` is null and
``offset`` counts from the start of the data section. Data is little-endian raw bytes.

A reader refuses a ``version`` newer than :data:`VERSION`: a newer writer may have changed what
the fields mean, and guessing would load wrong numbers without an error.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from unison.common.exceptions import UnisonError

__all__ = ["CheckpointError", "LocalShard", "Replicated", "Run", "Entry", "Manifest", "FORMAT_NAME", "VERSION",
           "MANIFEST_NAME", "reshard_ranges"]

FORMAT_NAME = "unison-checkpoint"
#: The block of a run's bytes that has a CRC of its own ([Note: checkpoint format]); a partial read reads and
#: checks every block it touches, at most two blocks more than it needs.
CRC_BLOCK_BYTES = 1 << 20
VERSION = 1
MANIFEST_NAME = "manifest.json"
MAGIC = b"UNISONCK"
PREFIX = struct.Struct("<8sIQ")  # magic, format version, header length in bytes
ALIGN = 64


class CheckpointError(UnisonError, ValueError):
    """A checkpoint cannot be saved or loaded; under MPI raised on every rank with the same message."""


@dataclass
class LocalShard:
    """This rank's part of an entry: runs of the row-major flattened global array.

    Attributes:
        shape: the entry's global shape.
        dtype: the entry's dtype (a numpy dtype or name; ``"bfloat16"`` included).
        runs: ``(flat_start, 1-D array)`` pairs; the array holds ``len(array)`` elements starting at
            ``flat_start`` of the flattened entry. A rank may hold no run of an entry.
    """

    shape: Sequence[int]
    dtype: Any
    runs: list[tuple[int, np.ndarray]] = field(default_factory=list)


@dataclass
class Replicated:
    """An entry every holding rank has in full; the lowest such rank writes it.

    Attributes:
        array: the whole entry.
    """

    array: np.ndarray


@dataclass(frozen=True)
class Run:
    """Where a run of an entry's flattened elements is stored.

    Attributes:
        file: the data file's name in the checkpoint folder; None inside a single-file checkpoint.
        start: the first element (of the flattened entry). length: number of elements.
        offset: byte offset in ``file`` (single file: in its data section). crc32: of the run's bytes.
        blocks: the CRC-32 of each :data:`CRC_BLOCK_BYTES` of the run's bytes, the last block
            shorter; empty for a run of one block or less, and in checkpoints written before
            2026-12-07, whose partial reads only ``verify="all"`` checks.
    """

    file: str | None
    start: int
    length: int
    offset: int
    crc32: int
    blocks: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"file": self.file, "start": self.start, "length": self.length,
                               "offset": self.offset, "crc32": self.crc32}
        if self.blocks:
            doc["block_crc32"] = list(self.blocks)
        return doc


@dataclass(frozen=True)
class Entry:
    """One named array of a checkpoint.

    Attributes:
        shape: global shape. dtype: numpy dtype name (``"bfloat16"`` for bfloat16).
        runs: sorted by ``start``, covering ``[0, numel)`` exactly.
    """

    shape: tuple[int, ...]
    dtype: str
    runs: tuple[Run, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def np_dtype(self) -> np.dtype:
        return dtype_from_name(self.dtype)


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's table of contents, as :func:`read_manifest` returns it.

    Attributes:
        save_id: unique to the save that wrote it. world: ranks that saved it.
        layout: ``"sharded"`` (a folder) or ``"consolidated"`` (one file).
        entries: name -> :class:`Entry`. metadata: the user's JSON metadata.
        files: sharded form: data file name -> its size in bytes. version: format version.
    """

    save_id: str
    world: int
    layout: str
    entries: dict[str, Entry]
    metadata: dict[str, Any]
    files: dict[str, int]
    version: int = VERSION

    def refuse_unexpected(self, path: Any, prefix: str, keys: Any, fix: str) -> None:
        """Raise :class:`CheckpointError` when an entry named ``<prefix><key>`` has a key not in ``keys``:
        weights the model loading it does not have (a checkpoint of another, larger model). Loaders
        refused only missing keys before 2026-12-06, so such a checkpoint loaded without a word, as
        ``load_state_dict(strict=True)`` would not (found by an audit)."""
        known = {f"{prefix}{k}" for k in keys}
        extra = sorted(e for e in self.entries if e.startswith(prefix) and e not in known)
        if extra:
            raise CheckpointError(f"the checkpoint at {os.fspath(path)!r} holds weights this model does not have: "
                                  f"{extra[:5]}{' and more' if len(extra) > 5 else ''}; {fix}")

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_NAME, "version": self.version, "save_id": self.save_id, "world": self.world,
                "layout": self.layout, "files": self.files, "metadata": self.metadata,
                "entries": {name: {"shape": list(e.shape), "dtype": e.dtype, "runs": [r.to_json() for r in e.runs]}
                            for name, e in self.entries.items()}}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> Manifest:
        """Parse a manifest read from ``where`` (named in errors).

        Raises:
            CheckpointError: not a Unison checkpoint manifest, a newer version, or a malformed field.
        """
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{where} is not a Unison checkpoint manifest (its 'format' is "
                                  f"{doc.get('format') if isinstance(doc, dict) else type(doc).__name__!r}, "
                                  f"expected {FORMAT_NAME!r}); point at a folder or file written by save_sharded "
                                  "or save_consolidated")
        check_version(doc.get("version"), where)
        try:
            entries = {name: _entry_from_json(e) for name, e in doc["entries"].items()}
            return cls(str(doc["save_id"]), int(doc["world"]), str(doc["layout"]), entries,
                       dict(doc.get("metadata") or {}), {str(k): int(v) for k, v in doc["files"].items()},
                       int(doc["version"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"the manifest in {where} is malformed ({type(exc).__name__}: {exc}); "
                                  "it was damaged or not written by Unison") from exc


def _entry_from_json(e: dict[str, Any]) -> Entry:
    runs = tuple(Run(r["file"], int(r["start"]), int(r["length"]), int(r["offset"]), int(r["crc32"]),
                     tuple(int(c) for c in r.get("block_crc32", ())))
                 for r in e["runs"])
    dtype_from_name(str(e["dtype"]))
    shape = tuple(int(d) for d in e["shape"])
    # the runs must tile the entry exactly: one damaged digit of the shape ([3, 4] read as [2, 4]) loaded the
    # first 8 of 12 elements as the whole entry, silently (a partial read checks no CRC; before 2026-12-05)
    numel, end = math.prod(shape), 0  # (Python ints: a damaged huge dimension must not wrap around)
    if any(d < 0 for d in shape) or any(r.length < 0 or r.offset < 0 for r in runs):
        raise ValueError(f"negative sizes in shape {list(shape)} or runs")
    for r in sorted(runs, key=lambda r: (r.start, r.length)):
        if r.length and r.start != end:
            raise ValueError(f"its runs leave a gap or overlap at element {min(r.start, end)} of {numel}")
        end = r.start + r.length if r.length else end
    if end != numel:
        raise ValueError(f"its runs cover {end} elements but its shape {list(shape)} has {numel}")
    return Entry(shape, str(e["dtype"]), runs)


def check_version(version: Any, where: str) -> None:
    """Raise unless ``version`` is one this reader understands."""
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{where} has format version {version!r}, which is not a positive integer; "
                              "the checkpoint is damaged")
    if version > VERSION:
        raise CheckpointError(f"{where} was written in checkpoint format version {version}, newer than this "
                              f"Unison reads (up to {VERSION}); upgrade Unison to load it")


_NUMPY_NAMES = frozenset(np.dtype(t).name for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8,
                                                     np.uint16, np.uint32, np.uint64, np.float16, np.float32,
                                                     np.float64, np.complex64, np.complex128))


def dtype_from_name(name: str) -> np.dtype:
    """The numpy dtype called ``name`` (``"bfloat16"`` and other ml_dtypes included).

    Raises:
        CheckpointError: no such fixed-size numeric dtype.
    """
    try:
        if name in _NUMPY_NAMES:  # without importing ml_dtypes (see [Note: bfloat16 without importing ml_dtypes])
            dt = np.dtype(name)
        else:
            import ml_dtypes

            dt = np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)
    except TypeError as exc:
        raise CheckpointError(f"dtype {name!r} is not a numpy or ml_dtypes dtype name") from exc
    if dt.hasobject or dt.fields is not None or dt.itemsize == 0 or dt.subdtype is not None:
        raise CheckpointError(f"dtype {name!r} cannot be stored as raw bytes; use a fixed-size numeric dtype")
    return dt


def dtype_to_name(dtype: Any) -> str:
    """The stored name of ``dtype``; raises CheckpointError for a dtype that cannot be stored."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise CheckpointError(f"dtype {dtype!r} is not a numpy dtype") from exc
    name = dt.newbyteorder("=").name if dt.byteorder not in "=|" else dt.name
    dtype_from_name(name)
    return name


def little(dtype: np.dtype) -> np.dtype:
    """``dtype`` in little-endian byte order (how data is stored)."""
    return dtype.newbyteorder("<") if dtype.byteorder not in "|" else dtype


def numel(shape: Sequence[int]) -> int:
    return int(np.prod(tuple(shape), dtype=np.int64))


def encode_header(manifest: Manifest) -> bytes:
    """The single-file prefix, header and padding; the data section starts right after."""
    header = json.dumps(manifest.to_json(), sort_keys=True).encode()
    head = PREFIX.pack(MAGIC, manifest.version, len(header)) + header
    return head + b"\0" * (-len(head) % ALIGN)


def decode_header(f: Any, where: str) -> tuple[Manifest, int]:
    """Read a single-file checkpoint's header from the open binary file ``f``.

    Returns:
        The manifest and the byte offset of the data section.

    Raises:
        CheckpointError: not a Unison checkpoint file, a newer version, or a truncated header.
    """
    prefix = f.read(PREFIX.size)
    if len(prefix) < PREFIX.size or prefix[:len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{where} is not a Unison checkpoint (it does not start with {MAGIC!r}); point at "
                              "a file written by save_consolidated or a folder written by save_sharded")
    _, version, size = PREFIX.unpack(prefix)
    check_version(version, where)
    try:
        available = os.fstat(f.fileno()).st_size - PREFIX.size
    except (AttributeError, OSError, ValueError):  # (not a real file: read and see)
        available = size
    if size > available:  # (a damaged length: reading 2**62 bytes raised a bare MemoryError)
        raise CheckpointError(f"{where} is truncated: its header needs {size} bytes, the file holds "
                              f"{max(available, 0)} after its prefix (or its length is damaged)")
    raw = f.read(size)
    if len(raw) < size:
        raise CheckpointError(f"{where} is truncated: its header needs {size} bytes, found {len(raw)}")
    try:
        doc = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"the header of {where} is not valid JSON ({exc}); the file is damaged") from exc
    start = PREFIX.size + size
    return Manifest.from_json(doc, where), start + (-start % ALIGN)


def reshard_ranges(shape: Sequence[int], world: int, rank: int) -> list[tuple[int, int]]:
    """Rank ``rank``'s even share of an entry of ``shape`` split over ``world`` ranks.

    The first ``numel % world`` ranks get one element more. Pass the result as ``wanted[name]`` to
    :func:`load` to read a checkpoint into a new layout.

    Returns:
        ``[(flat_start, length)]`` (length may be 0).

    Raises:
        ValueError: ``world`` < 1 or ``rank`` outside ``[0, world)``.
    """
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or world < 1:
        raise ValueError(f"world={world!r} must be a positive number of ranks")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world:
        raise ValueError(f"rank={rank!r} must be in [0, {world})")
    base, extra = divmod(numel(shape), int(world))
    start = rank * base + min(rank, extra)
    return [(start, base + (1 if rank < extra else 0))]
