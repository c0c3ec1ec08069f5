"""Writing files so that a crash never leaves a torn one: through a temporary file, then a rename."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["atomic_path"]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """Yield a temporary path next to ``path``; on success rename it over ``path``, else remove it.

    The temporary name ends with ``path``'s own name, so writers that pick a format from
    the suffixes (Keras's ``.keras`` / ``.weights.h5``, matplotlib's ``.png``) see the
    same ones. It lives in the same folder, so the rename is atomic.
    """
    folder, name = os.path.split(os.fspath(path))
    tmp = os.path.join(folder, f".unison-tmp-{os.getpid()}-{name}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
