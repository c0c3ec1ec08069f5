"""Writing the raw bytes of runs: sequentially, with their CRC-32, fsynced before anyone relies on them."""

from __future__ import annotations

import logging
import os
import zlib

import numpy as np

from unison.common import files
from unison.common.checkpoints.format import CRC_BLOCK_BYTES, dtype_from_name
from unison.common.checkpoints.layout import LocalEntry, Slot

__all__: list[str] = []

logger = logging.getLogger(__name__)


def itemsize(dtype: str) -> int:
    return dtype_from_name(dtype).itemsize


def as_bytes(arr: np.ndarray) -> np.ndarray:
    """A 1-D uint8 view of the contiguous array ``arr`` (any dtype, bfloat16 and bool included)."""
    return arr.reshape(-1).view(np.uint8)


def buffer(arr: np.ndarray) -> memoryview:
    """The bytes of the contiguous array ``arr``, as a buffer file and zlib calls take."""
    return memoryview(as_bytes(arr))  # type: ignore[arg-type]


def crc32(arr: np.ndarray) -> int:
    return zlib.crc32(buffer(arr)) & 0xFFFFFFFF


def crcs(arr: np.ndarray) -> tuple[int, tuple[int, ...]]:
    """The CRC-32 of ``arr``'s bytes and, when they span more than one :data:`CRC_BLOCK_BYTES`, of each block
    (a run's ``crc32`` and ``blocks``; [Note: checkpoint format]). Two passes over the bytes, both cached."""
    data = as_bytes(arr)
    if data.nbytes <= CRC_BLOCK_BYTES:
        return crc32(data), ()
    blocks = tuple(crc32(data[k:k + CRC_BLOCK_BYTES]) for k in range(0, data.nbytes, CRC_BLOCK_BYTES))
    return crc32(data), blocks


def write_data_file(path: str, slots: list[Slot],
                    local: dict[str, LocalEntry]) -> list[tuple[int, tuple[int, ...]]]:
    """Write this rank's runs, in ``slots`` order, to a new file at ``path``; fsync it and its folder.

    Returns:
        The CRC-32 of each run and of its blocks (:func:`crcs`), in order.

    Raises:
        OSError: the file exists already or cannot be written or flushed.
    """
    out = []
    with open(path, "xb") as f:
        for slot in slots:
            data = local[slot.name].pieces[slot.start]
            f.write(buffer(data))
            out.append(crcs(data))
        f.flush()
        os.fsync(f.fileno())
    fsync_folder(os.path.dirname(path) or os.curdir)
    return out


def fsync_folder(folder: str) -> None:
    """Make a new entry of ``folder`` durable; skipped where folders cannot be opened or the filesystem
    refuses to flush one.

    Raises:
        OSError: the flush failed (an I/O error: the save is not durable). Before 2026-12-05 every error
            was dropped here, so a save whose folder entry failed to reach the disk committed anyway.
    """
    files.fsync(folder, directory=True)


def remove_quietly(path: str) -> None:
    """Remove the file at ``path`` if it is there (best effort: cleanup never hides the real error)."""
    try:
        os.remove(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        logger.warning("could not remove %s: %s", path, exc)
