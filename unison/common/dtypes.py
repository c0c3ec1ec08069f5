"""The dtypes Unison moves and reduces, with a stable code for each.

Codes travel in the per-call header that ranks exchange, so their order never
changes; new dtypes are appended.

[Note: bfloat16 without importing ml_dtypes]
numpy's bfloat16 comes from ``ml_dtypes``, whose import took 0.5 s of CPU per process here
(its extension registering casts), paid by every rank at every start, restarts included.
So it is imported on first use (:func:`bfloat16_dtype`). Nothing needs it before: an array
whose dtype is bfloat16 exists only once ``ml_dtypes`` is imported (by Unison or by whoever
made the array), and such a dtype is recognised by its name (:func:`is_bfloat16`), which no
other numpy dtype has. ``bfloat16`` and ``SUPPORTED_DTYPES`` remain attributes of this module
(importing them imports ``ml_dtypes``); Unison's own modules use the functions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["bfloat16_dtype", "dtype_code", "dtype_from_code", "dtype_name", "is_bfloat16",
           "is_bool", "is_float"]

#: the supported dtypes by code; code 1 is bfloat16 (None here: see bfloat16_dtype)
_BY_CODE: tuple[np.dtype | None, ...] = (
    np.dtype(np.float16),
    None,  # bfloat16
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
_BF16_CODE = 1
_CODES = {dt: i for i, dt in enumerate(_BY_CODE) if dt is not None}
_bfloat16: np.dtype | None = None


def bfloat16_dtype() -> np.dtype:
    """numpy's bfloat16 (``ml_dtypes.bfloat16``), imported on the first call."""
    global _bfloat16
    if _bfloat16 is None:
        import ml_dtypes

        _bfloat16 = np.dtype(ml_dtypes.bfloat16)
    return _bfloat16


def is_bfloat16(dtype: Any) -> bool:
    """Whether ``dtype`` is bfloat16, without importing ``ml_dtypes``.

    Runs for every tensor a backend hands over or gets back, so numpy's own dtypes are answered
    from a set (``dtype.name`` is computed in Python: 2 us a call).
    """
    dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
    return dt not in _CODES and dt.name == "bfloat16"


def dtype_code(dtype: np.dtype) -> int:
    """Return the wire code of ``dtype``, or -1 when Unison does not support it."""
    dt = np.dtype(dtype)
    code = _CODES.get(dt, -1)
    if code < 0 and dt.name == "bfloat16" and dt == bfloat16_dtype():
        return _BF16_CODE
    return code


def dtype_from_code(code: int) -> np.dtype:
    dt = _BY_CODE[code]
    return bfloat16_dtype() if dt is None else dt


def dtype_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name


def is_bool(dtype: np.dtype) -> bool:
    return np.dtype(dtype) == np.bool_


def is_float(dtype: np.dtype) -> bool:
    dt = np.dtype(dtype)
    return dt.name == "bfloat16" or np.issubdtype(dt, np.floating)


def supported_names() -> str:
    return ", ".join("bfloat16" if dt is None else dt.name for dt in _BY_CODE)


def __getattr__(name: str) -> Any:
    if name == "bfloat16":
        return bfloat16_dtype()
    if name == "SUPPORTED_DTYPES":
        return tuple(dtype_from_code(code) for code in range(len(_BY_CODE)))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
