"""The dtypes Unison moves and reduces, with a stable code for each.

Codes travel in the per-call header that ranks exchange, so their order never
changes; new dtypes are appended.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["SUPPORTED_DTYPES", "dtype_code", "dtype_from_code", "dtype_name", "is_bool", "is_float"]

bfloat16 = np.dtype(ml_dtypes.bfloat16)

SUPPORTED_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(np.float16),
    bfloat16,
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(np.int8),
    np.dtype(np.int16),
    np.dtype(np.int32),
    np.dtype(np.int64),
    np.dtype(np.uint8),
    np.dtype(np.bool_),
    np.dtype(np.uint16),  # (code 10: appended, as every new dtype is)
)
_CODES = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}


def dtype_code(dtype: np.dtype) -> int:
    """Return the wire code of ``dtype``, or -1 when Unison does not support it."""
    return _CODES.get(np.dtype(dtype), -1)


def dtype_from_code(code: int) -> np.dtype:
    return SUPPORTED_DTYPES[code]


def dtype_name(dtype: np.dtype) -> str:
    return "bfloat16" if np.dtype(dtype) == bfloat16 else np.dtype(dtype).name


def is_bool(dtype: np.dtype) -> bool:
    return np.dtype(dtype) == np.bool_


def is_float(dtype: np.dtype) -> bool:
    dt = np.dtype(dtype)
    return dt == bfloat16 or np.issubdtype(dt, np.floating)


def supported_names() -> str:
    return ", ".join(dtype_name(dt) for dt in SUPPORTED_DTYPES)
