"""Gradient compression: what travels on the wire, Horovod's ``Compression`` API.

``Compression.fp16`` and ``Compression.bf16`` cast floating-point arrays to a
16-bit type before the collective and back afterwards, halving the bytes moved
at the cost of precision (float16 keeps ~3 decimal digits and overflows above
65504; bfloat16 keeps float32's range with ~2 digits). Other dtypes pass through.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from unison.common.dtypes import bfloat16

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor"]


class Compressor:
    """Interface: ``compress(array) -> (array, ctx)`` and ``decompress(array, ctx) -> array``."""

    @staticmethod
    def compress(tensor: np.ndarray) -> tuple[np.ndarray, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: np.ndarray, ctx: Any) -> np.ndarray:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression."""

    @staticmethod
    def compress(tensor: np.ndarray) -> tuple[np.ndarray, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: np.ndarray, ctx: Any) -> np.ndarray:
        return tensor


def _cast_compressor(wire: np.dtype) -> type[Compressor]:
    class _Cast(Compressor):
        @staticmethod
        def compress(tensor: np.ndarray) -> tuple[np.ndarray, Any]:
            arr = np.asarray(tensor)
            if arr.dtype in (np.float32, np.float64):
                return arr.astype(wire), arr.dtype
            return arr, None

        @staticmethod
        def decompress(tensor: np.ndarray, ctx: Any) -> np.ndarray:
            return tensor if ctx is None else tensor.astype(ctx)

    return _Cast


FP16Compressor = _cast_compressor(np.dtype(np.float16))
FP16Compressor.__name__ = FP16Compressor.__qualname__ = "FP16Compressor"
BF16Compressor = _cast_compressor(bfloat16)
BF16Compressor.__name__ = BF16Compressor.__qualname__ = "BF16Compressor"


class Compression:
    """The compressors, under Horovod's names: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
