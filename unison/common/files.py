"""Writing files so that a crash or a power loss never leaves a torn, empty or missing one.

[Note: atomic and durable writes]
:func:`atomic_path` hands the writer a path inside a fresh private folder next to
the target, ``.unison-tmp-<pid>-<random>-<name>/<name>``:

* ``mkdtemp`` creates that folder exclusively (``O_EXCL`` semantics, mode 0700),
  so nothing can have been planted at the writer's path (a symlink there would
  redirect the write), and the writer still sees the target's own name: writers
  pick formats from the suffixes (Keras's ``.keras`` / ``.weights.h5``,
  matplotlib's ``.png``).
* Writers write by path and close the file themselves, so when they return the
  result is opened again and fsynced (a folder, such as a SavedModel, file by
  file and folder by folder), renamed over the target (same filesystem: atomic)
  and the target's folder is fsynced. Without the first fsync a power loss after
  the rename can leave an empty file where the good one was (delayed
  allocation); without the second, the rename itself may be lost.

A process killed mid-write leaves its private folder behind. The next save of the
same name in that folder removes such leftovers when they are older than this
process (newer ones may belong to a writer still running); :func:`remove_leftovers`
does the same for a pattern of names.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["atomic_path", "remove_leftovers", "makedirs_durable"]

logger = logging.getLogger(__name__)

PREFIX = ".unison-tmp-"
_STARTED = time.time()  # every temporary this process makes is newer than this
_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}  # fsync refused by the filesystem
_MAX_TAG = 180  # keeps <prefix><pid>-<random>-<tag> within NAME_MAX (255)


def _tag(name: str) -> str:
    """The last ``_MAX_TAG`` bytes of ``name`` (bytes: NAME_MAX counts them; 180 characters of emoji made a
    name the filesystem refused, before 2026-12-05)."""
    raw = os.fsencode(name)[-_MAX_TAG:]
    while raw and raw[0] & 0xC0 == 0x80:  # (not from the middle of a UTF-8 character)
        raw = raw[1:]
    return os.fsdecode(raw)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """Yield a private temporary path for ``path``; on success make it ``path`` durably, else remove it.

    See [Note: atomic and durable writes]. The writer may create a file or a
    folder at the yielded path. On an exception nothing at ``path`` changes and the
    temporary is removed.

    Args:
        path: the file (or folder) to write.

    Yields:
        The path to write to; it ends with ``path``'s own name.

    Raises:
        ValueError: ``path`` has no file name (it ends with a separator).
        FileNotFoundError: the writer returned without creating anything at the path.
    """
    target = os.fspath(path)
    folder, name = os.path.split(target)
    if not name:
        raise ValueError(f"atomic_path needs a file path, got {target!r} (it ends with a separator); "
                         "name the file to write")
    folder = folder or os.curdir
    if not os.path.isdir(folder):  # (mkdtemp's error named the temporary path, not this folder)
        raise FileNotFoundError(errno.ENOENT, f"cannot write {target!r}: its folder {folder!r} does not exist; "
                                "create it first (os.makedirs)", folder)
    remove_leftovers(folder, _escape(name))
    private = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", suffix=f"-{_tag(name)}", dir=folder)
    tmp = os.path.join(private, name)
    try:
        yield tmp
        _commit(tmp, target, folder)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _commit(tmp: str, target: str, folder: str) -> None:
    """fsync what the writer left at ``tmp``, rename it to ``target``, fsync ``folder``."""
    if not os.path.lexists(tmp):
        raise FileNotFoundError(errno.ENOENT, f"the writer returned without creating {target!r} (nothing "
                                "at its temporary path); write to the path atomic_path yields", tmp)
    _sync_tree(tmp)
    os.replace(tmp, target)
    fsync(folder, directory=True)


def _sync_tree(path: str) -> None:
    """fsync a file, or every file and folder under a folder (deepest first) and the folder itself."""
    if os.path.islink(path) or not os.path.isdir(path):
        fsync(path, directory=False)
        return
    for root, _dirs, names in os.walk(path, topdown=False):
        for n in names:
            p = os.path.join(root, n)
            if not os.path.islink(p):
                fsync(p, directory=False)
        fsync(root, directory=True)


def makedirs_durable(path: str | os.PathLike[str]) -> None:
    """``os.makedirs(path, exist_ok=True)``, with each folder it creates made durable: the parent's
    entry for it is flushed (fsync of the parent), so a power loss cannot take a new folder, and
    the files committed into it, away after the save returned."""
    path = os.path.abspath(os.fspath(path))
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder)
        except FileExistsError:  # made meanwhile (another rank): its creator flushes the parent
            if not os.path.isdir(folder):  # (a file where a folder should be: os.makedirs's own error)
                raise NotADirectoryError(errno.ENOTDIR, "a file is in the way of a folder", folder) from None
            continue
        fsync(os.path.dirname(folder), directory=True)


def fsync(path: str, directory: bool) -> None:
    """Flush ``path``'s data (a folder: its entries) to the disk; skip where the filesystem cannot.

    Raises:
        OSError: the flush failed (an I/O error: the data may not be on the disk).
    """
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if directory:  # some systems (Windows) cannot open a folder: nothing to flush there
            logger.debug("cannot open folder %s to fsync it: %s", path, exc)
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise
        logger.debug("filesystem refuses fsync of %s: %s", path, exc)
    finally:
        os.close(fd)


def _escape(name: str) -> str:
    """``name`` as an fnmatch pattern matching only itself."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def remove_leftovers(folder: str | os.PathLike[str], pattern: str) -> list[str]:
    """Remove temporaries of :func:`atomic_path` for names matching ``pattern``, left by dead writers.

    Only entries of ``folder`` named like our temporaries of such a name and older
    than this process are removed: a newer one may belong to a writer still running.

    Args:
        folder: the folder the targets live in.
        pattern: an fnmatch pattern of target names (``"model.keras"``, ``"weights-*.h5"``).

    Returns:
        The names removed.
    """
    regex = re.compile(re.escape(PREFIX) + r"\d+-(?:[a-z0-9_]{8}-)?" + fnmatch.translate(_tag(pattern)))
    try:
        entries = os.listdir(folder)
    except FileNotFoundError:
        return []
    removed = []
    for entry in entries:
        if regex.match(entry) and _remove_if_stale(os.path.join(folder, entry)):
            removed.append(entry)
    if removed:
        logger.info("removed %d leftover temporary file(s) of killed writers in %s: %s", len(removed),
                    folder, removed)
    return removed


def _remove_if_stale(path: str) -> bool:
    try:
        st = os.lstat(path)
        if st.st_mtime >= _STARTED:
            return False
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    except FileNotFoundError:  # another process removed it first
        return False
    return True


def atomic_keras_save(save: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
    """``save(filepath, ...)`` (a Keras ``save``/``save_weights``) through :func:`atomic_path`.

    Written in place instead: a file object (the caller owns it), sharded weights
    (``max_shard_size``: Keras writes the shards next to the index file) and
    ``overwrite=False`` over an existing file (Keras asks first, as it does anyway).
    """
    if not isinstance(filepath, (str, os.PathLike)) or kwargs.get("max_shard_size") is not None:
        return save(filepath, *args, **kwargs)
    overwrite = kwargs.get("overwrite", args[0] if args else True)
    if not overwrite and os.path.exists(filepath):
        return save(filepath, *args, **kwargs)
    name = os.fspath(filepath)
    if name.endswith((".h5", ".hdf5")) and not name.endswith(".weights.h5"):  # Keras's legacy saver makes
        os.makedirs(os.path.dirname(name) or os.curdir, exist_ok=True)  # the folder: so do we, before the temp
    with atomic_path(filepath) as tmp:
        return save(tmp, *args, **kwargs)
