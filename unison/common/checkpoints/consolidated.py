"""Save a checkpoint as one file: rank 0 gathers every run and writes it atomically.

[Note: consolidated save]
After the common opening (``start.begin``: same checks as a sharded save), rank 0 allocates every
entry in full and the ranks agree that it could (so no sender waits on a rank 0 that ran out of
memory). Then each rank sends the runs the layout gives it, in layout order, cut into messages of
at most :data:`CHUNK_BYTES` (MPI counts are 32-bit and large messages strain transports); rank 0
receives them rank by rank straight into the full arrays, over a duplicate of ``comm`` so no user
message can match. Rank 0 writes the file through ``unison.common.files.atomic_path`` (the rename
is the commit; the previous file stays until then), and the outcome is agreed: every rank returns
or raises the same error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from unison.common import files
from unison.common.checkpoints import agree, storage
from unison.common.checkpoints.format import ALIGN, Entry, Manifest, Run, dtype_from_name, encode_header, little
from unison.common.checkpoints.layout import Slot
from unison.common.checkpoints.start import Start, begin
from unison.common.files import atomic_path

__all__ = ["save_consolidated"]

CHUNK_BYTES = 1 << 30  # the most bytes one message carries
TAG = 0x5C


def save_consolidated(path: str | os.PathLike[str], entries: Mapping[str, Any], comm: Any = None,
                      metadata: dict[str, Any] | None = None) -> Manifest:
    """Gather ``entries`` on rank 0 and write them to the single file ``path``.

    Collective over ``comm``; see [Note: consolidated save]. Rank 0 needs memory for every entry.

    Args:
        path: the file to write (its folder is created if missing); only rank 0 writes.
        entries: as for :func:`save_sharded`.
        comm: an mpi4py communicator, or None for one process.
        metadata: JSON-serializable user data (rank 0's is stored).

    Returns:
        The manifest stored in the file's header (on every rank).

    Raises:
        CheckpointError: on every rank: bad input, runs with a gap or overlap, rank 0 out of
            memory, or the file could not be written (naming the rank and the file).
    """
    start = begin(path, entries, comm, metadata, "save_consolidated")
    me = agree.rank(comm)
    full, problem = {}, None
    if me == 0:
        try:
            full = {name: np.empty(storage_numel(shape), little(dtype_from_name(dtype)))
                    for name, (shape, dtype) in start.layout.entries.items()}
        except MemoryError as exc:
            problem = f"save_consolidated: rank 0 cannot allocate the whole checkpoint ({exc}); use save_sharded"
    agree.raise_together(comm, problem)
    _gather(start, full, comm)
    problem = None
    manifest = _manifest(start, full, agree.size(comm)) if me == 0 else None
    if manifest is not None:
        try:
            write_file(start.path, manifest, full)
        except Exception as exc:  # reported to every rank
            problem = f"could not write {start.path!r}: {type(exc).__name__}: {exc}"
    agree.raise_together(comm, problem)
    return agree.bcast(comm, manifest)


def storage_numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _chunks(slot: Slot, itemsize: int) -> list[tuple[int, int]]:
    """``(first element, count)`` of each message carrying ``slot`` (relative to the slot)."""
    step = max(1, CHUNK_BYTES // itemsize)
    return [(i, min(step, slot.length - i)) for i in range(0, slot.length, step)]


def _gather(start: Start, full: dict[str, np.ndarray], comm: Any) -> None:
    """Move every run into rank 0's ``full`` arrays (see [Note: consolidated save])."""
    me = agree.rank(comm)
    if me == 0:
        for slot in start.layout.writes[0]:
            full[slot.name][slot.start:slot.start + slot.length] = start.local[slot.name].pieces[slot.start]
    if comm is None or comm.Get_size() == 1:
        return
    from mpi4py import MPI

    wire = comm.Dup()
    try:
        for r in range(1, wire.Get_size()):
            if me not in (0, r):
                continue
            for slot in start.layout.writes[r]:
                size = storage.itemsize(start.layout.entries[slot.name][1])
                for first, count in _chunks(slot, size):
                    if me == 0:
                        dest = full[slot.name][slot.start + first:slot.start + first + count]
                        wire.Recv([storage.as_bytes(dest), MPI.BYTE], source=r, tag=TAG)
                    else:
                        src = start.local[slot.name].pieces[slot.start][first:first + count]
                        wire.Send([storage.as_bytes(src), MPI.BYTE], dest=0, tag=TAG)
    finally:
        wire.Free()


def _manifest(start: Start, full: dict[str, np.ndarray], world: int) -> Manifest:
    entries, offset = {}, 0
    for name, (shape, dtype) in start.layout.entries.items():
        data = full[name]
        runs = (Run(None, 0, len(data), offset, *storage.crcs(data)),) if len(data) else ()
        entries[name] = Entry(shape, dtype, runs)
        offset += data.nbytes + (-data.nbytes % ALIGN)
    return Manifest(start.save_id, world, "consolidated", entries, start.metadata, {})


def write_file(path: str, manifest: Manifest, full: dict[str, np.ndarray]) -> None:
    """Write the single-file checkpoint at ``path`` atomically and durably.

    Raises:
        OSError: the folder cannot be created or the file written.
    """
    files.makedirs_durable(os.path.dirname(path) or os.curdir)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(encode_header(manifest))
        for name in manifest.entries:
            data = full[name]
            f.write(storage.buffer(data))
            f.write(b"\0" * (-data.nbytes % ALIGN))
