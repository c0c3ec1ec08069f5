"""Save a checkpoint as a folder: one data file per rank, and a manifest whose rename commits it.

[Note: sharded commit protocol]
::

    every rank                               rank 0
    ----------                               ------
    describe entries --allgather-->          (every rank checks: same path, same declarations,
                                              runs cover each entry exactly; save id from rank 0)
    write data-<id>-rank<r>.bin, fsync it
    and the folder
    agree: did every rank write?  ---------  (no: every rank removes its file, raises the same error)
    allgather run CRCs                       check every rank's file is there with its size
                                             (no: "the folder is not shared ...")
                                             write manifest.json by atomic rename  <- COMMIT
                                             remove data files no manifest names
    agree: committed? ----------------------  every rank returns, or raises the same error

Why this order: the data files carry a name unique to this save, so writing them never touches
the checkpoint already in the folder; until the manifest's rename the old manifest still names
the old files, and a crash at any point before it leaves the previous checkpoint loadable. The
rename is atomic and both the file and the folder are fsynced (``unison.common.files``), so after
it the new checkpoint survives a power loss. Files of older or crashed saves are removed only
after the commit, by the next successful save. One writer per folder at a time.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from unison.common import files
from unison.common.checkpoints import agree, storage
from unison.common.checkpoints.format import MANIFEST_NAME, CheckpointError, Entry, Manifest, Run
from unison.common.checkpoints.reader import read_manifest
from unison.common.checkpoints.start import Start, begin
from unison.common.files import atomic_path

__all__ = ["save_sharded"]

logger = logging.getLogger(__name__)

DATA_FILE = re.compile(r"data-[0-9a-f]+-rank\d+\.bin\Z")


def data_file(save_id: str, rank: int) -> str:
    return f"data-{save_id}-rank{rank:05d}.bin"


def save_sharded(path: str | os.PathLike[str], entries: Mapping[str, Any], comm: Any = None,
                 metadata: dict[str, Any] | None = None) -> Manifest:
    """Save ``entries`` into the folder ``path``: a data file per rank and ``manifest.json``.

    Collective over ``comm`` (every rank calls it, with the same ``path``). See
    [Note: sharded commit protocol] and docs/checkpoints.md.

    Args:
        path: the checkpoint folder, on a filesystem every rank sees; created if missing.
        entries: name -> :class:`LocalShard` (this rank's runs), :class:`Replicated` or a numpy
            array (replicated). A rank may leave out entries it holds nothing of.
        comm: an mpi4py communicator, or None for one process.
        metadata: JSON-serializable user data (rank 0's is stored).

    Returns:
        The committed manifest (on every rank).

    Raises:
        CheckpointError: on every rank, naming the rank, entry or file: bad input, runs with a gap
            or an overlap, a file a rank could not write, a folder rank 0 does not share.
    """
    start = begin(path, entries, comm, metadata, "save_sharded")
    me = agree.rank(comm)
    name = data_file(start.save_id, me)
    problem, crcs = None, []
    try:
        files.makedirs_durable(start.path)
        crcs = storage.write_data_file(os.path.join(start.path, name), start.layout.writes[me], start.local)
    except Exception as exc:  # reported to every rank (disk full, permissions, out of memory)
        problem = f"could not write its data file {os.path.join(start.path, name)!r}: {type(exc).__name__}: {exc}"
    _agree_or_clean(comm, problem, start)
    manifest = _manifest(start, agree.allgather(comm, crcs), agree.size(comm))
    problem, committed = _commit(start, manifest) if me == 0 else (None, False)
    committed = agree.bcast(comm, committed)  # every rank: whether its file belongs to a committed save
    _agree_or_clean(comm, problem, start, clean=not committed)
    return manifest


def _agree_or_clean(comm: Any, problem: str | None, start: Start, clean: bool = True) -> None:
    """Agree on ``problem``; on failure every rank removes its own file of this save (unless the save
    was committed after all: ``clean`` False), then raises."""
    try:
        agree.raise_together(comm, problem)
    except CheckpointError:
        if clean:
            storage.remove_quietly(os.path.join(start.path, data_file(start.save_id, agree.rank(comm))))
        raise


def _manifest(start: Start, crcs: list[list[tuple[int, tuple[int, ...]]]], world: int) -> Manifest:
    """The manifest every rank derives from the layout and every rank's CRCs."""
    runs: dict[str, list[Run]] = {name: [] for name in start.layout.entries}
    files = {}
    for r in range(world):
        name, offset = data_file(start.save_id, r), 0
        for slot, crc in zip(start.layout.writes[r], crcs[r], strict=True):
            itemsize = storage.itemsize(start.layout.entries[slot.name][1])
            runs[slot.name].append(Run(name, slot.start, slot.length, offset, crc[0], tuple(crc[1])))
            offset += slot.length * itemsize
        files[name] = offset
    entries = {name: Entry(shape, dtype, tuple(sorted(runs[name], key=lambda run: run.start)))
               for name, (shape, dtype) in start.layout.entries.items()}
    return Manifest(start.save_id, world, "sharded", entries, start.metadata, files)


def _commit(start: Start, manifest: Manifest) -> tuple[str | None, bool]:
    """Rank 0: check every data file is visible, write the manifest (the commit), clean up.

    Returns:
        A problem or None, and whether the manifest naming this save is in place: a failure after
        the rename (the folder's fsync) leaves the save committed, so its data files must stay.
    """
    blind, wrong = [], []
    for r, (name, size) in enumerate(manifest.files.items()):
        try:
            found = os.path.getsize(os.path.join(start.path, name))
        except OSError:
            blind.append(r)
            continue
        if found != size:
            wrong.append(f"{name!r} has {found} bytes, rank {r} wrote {size}")
    if blind:
        return (f"the folder is not shared: rank 0 cannot see files written by {agree.ranks_text(blind)} in "
                f"{start.path!r}; save to a shared filesystem or save consolidated (save_consolidated)"), False
    if wrong:
        return (f"data files changed size after they were written ({'; '.join(wrong)}); is another job saving "
                "there?"), False
    where = os.path.join(start.path, MANIFEST_NAME)
    try:
        write_manifest(where, manifest)
    except Exception as exc:  # reported to every rank
        problem = f"could not write {where!r}: {type(exc).__name__}: {exc}"
        if _names_save(start.path, start.save_id):
            return (problem + "; the manifest was renamed into place before that, so this save is committed "
                    "and loads, but it may not survive a crash of this machine: check the disk, then save "
                    "again"), True
        return problem, False
    try:  # (the save is committed: tidying up must not fail it, nor leave the others waiting for this rank)
        remove_unreferenced(start.path, manifest)
    except OSError as exc:
        logger.warning("the save to %s is committed, but removing older data files failed (%s); the next save "
                       "tries again", start.path, exc)
    return None, True


def _names_save(folder: str, save_id: str) -> bool:
    """Whether the manifest in ``folder`` is the one of save ``save_id``."""
    try:
        return read_manifest(folder).save_id == save_id
    except CheckpointError:
        return False


def write_manifest(path: str, manifest: Manifest) -> None:
    """Write ``manifest`` at ``path`` atomically and durably (the commit point of a sharded save)."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest.to_json(), f, indent=1, sort_keys=True)


def remove_unreferenced(folder: str, manifest: Manifest) -> list[str]:
    """Remove data files of older or failed saves in ``folder`` (those ``manifest`` does not name)."""
    removed = []
    for name in sorted(os.listdir(folder)):
        if DATA_FILE.match(name) and name not in manifest.files:
            storage.remove_quietly(os.path.join(folder, name))
            removed.append(name)
    if removed:
        logger.info("removed %d data file(s) of earlier saves from %s", len(removed), folder)
    return removed
