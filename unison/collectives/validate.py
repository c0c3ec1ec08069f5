"""Argument checks shared by the direct API and the engine front end."""

from __future__ import annotations

from typing import Any

import numpy as np

from unison.common.dtypes import dtype_code, supported_names

__all__ = ["as_array", "check_root", "check_splits", "rows_split"]


def as_array(tensor: Any) -> np.ndarray:
    """``tensor`` as a numpy array of a supported dtype.

    Raises:
        TypeError: the dtype is not supported.
    """
    arr = np.asarray(tensor)
    if dtype_code(arr.dtype) < 0:
        raise TypeError(f"dtype {arr.dtype} is not supported by Unison's collectives; "
                        f"supported dtypes: {supported_names()}. Cast the array first.")
    return arr


def check_root(root: Any, size: int, within: str = "this job") -> None:
    """Raises ValueError unless ``root`` is a rank of ``within`` (a job or process set of ``size``)."""
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(f"root_rank={root!r} is not a rank of {within}; "
                         f"pass an integer in [0, {size})")


def rows_split(rows: int, size: int) -> list[int]:
    """Horovod's split of ``rows`` over ``size`` ranks: the first ``rows % size`` get one more."""
    base, extra = divmod(rows, size)
    return [base + (1 if i < extra else 0) for i in range(size)]


def check_splits(splits: Any, dim0: int, size: int) -> list[int]:
    """Validate alltoall ``splits`` (None: an equal split).

    Raises:
        ValueError: wrong length, negative counts, a sum other than ``dim0``, or no
            splits when ``dim0`` does not divide by ``size``.
    """
    if splits is None:
        if dim0 % size:
            raise ValueError(f"alltoall without splits needs the first dimension ({dim0}) to be "
                             f"divisible by the number of ranks ({size}); pass splits=[...] "
                             "with one row count per rank")
        return [dim0 // size] * size
    given = np.asarray(splits).reshape(-1).tolist()
    if any(isinstance(v, bool) or not isinstance(v, int) and not (isinstance(v, float) and v.is_integer())
           for v in given):  # (2.9 was truncated to 2: rows sent that nobody asked for, before 2026-12-05)
        raise ValueError(f"splits={given!r} must hold whole row counts (integers), one per rank")
    s = [int(v) for v in given]
    if len(s) != size or any(v < 0 for v in s) or sum(s) != dim0:
        raise ValueError(f"splits={s!r} must hold {size} non-negative row counts (one per rank) "
                         f"summing to the first dimension ({dim0})")
    return s
