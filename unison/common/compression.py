"""Gradient compression: what travels on the wire, Horovod's ``Compression`` API.

``Compression.fp16`` and ``Compression.bf16`` cast floating-point tensors to a
16-bit type before the collective and back afterwards, halving the bytes moved
at the cost of precision (float16 keeps ~3 decimal digits and overflows above
65504; bfloat16 keeps float32's range with ~2 digits). Other dtypes pass through.

[Note: one Compression for every framework] The compressors are framework
neutral: they only ask a *caster* whether a tensor is floating point and to cast
it. numpy arrays use the built-in caster; a backend registers its own for its
tensor type (``register_caster(torch.Tensor, TorchCaster())`` in the PyTorch
backend), so ``Compression.fp16.compress(t)`` returns a tensor of ``t``'s own
framework and ``decompress`` restores its original dtype, while the core keeps
passing numpy arrays through the very same objects::

    compress(t)  ->  caster_for(t).cast(t, "float16"), original dtype as ctx
    decompress(t, ctx)  ->  caster_for(t).cast_back(t, ctx)

This module never imports a framework (see docs/architecture.md).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from unison.common.dtypes import bfloat16_dtype

__all__ = [
    "Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Caster",
    "register_caster", "caster_for",
]


class Caster(Protocol):
    """How a compressor inspects and casts one framework's tensors."""

    def compressible(self, tensor: Any) -> bool:
        """Whether ``tensor`` is floating point (the only kind a cast compressor touches)."""

    def cast(self, tensor: Any, wire: str) -> Any:
        """``tensor`` cast to the wire dtype named ``wire`` ("float16" or "bfloat16")."""

    def dtype(self, tensor: Any) -> Any:
        """``tensor``'s dtype, handed back to :meth:`cast_back`."""

    def cast_back(self, tensor: Any, dtype: Any) -> Any:
        """``tensor`` cast back to ``dtype``."""


class _NumpyCaster:
    """numpy arrays: float32 and float64 travel compressed (what the core always did)."""

    def compressible(self, tensor: Any) -> bool:
        return np.asarray(tensor).dtype in (np.float32, np.float64)

    def cast(self, tensor: Any, wire: str) -> Any:
        return np.asarray(tensor).astype(np.dtype(np.float16) if wire == "float16" else bfloat16_dtype())

    def dtype(self, tensor: Any) -> Any:
        return np.asarray(tensor).dtype

    def cast_back(self, tensor: Any, dtype: Any) -> Any:
        return np.asarray(tensor).astype(dtype)


_NUMPY = _NumpyCaster()
_casters: list[tuple[type, Caster]] = []


def register_caster(tensor_type: type, caster: Caster) -> None:
    """Make the compressors use ``caster`` for instances of ``tensor_type`` (a backend calls this)."""
    for i, (known, _) in enumerate(_casters):
        if known is tensor_type:
            _casters[i] = (tensor_type, caster)
            return
    _casters.append((tensor_type, caster))


def caster_for(tensor: Any) -> Caster:
    """The registered caster of ``tensor``'s type; numpy's for anything else."""
    for known, caster in _casters:
        if isinstance(tensor, known):
            return caster
    return _NUMPY


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


def _cast_compressor(wire: str, name: str) -> type[Compressor]:
    class _Cast(Compressor):
        @staticmethod
        def compress(tensor: Any) -> tuple[Any, Any]:
            caster = caster_for(tensor)
            if caster.compressible(tensor):
                return caster.cast(tensor, wire), caster.dtype(tensor)
            return tensor, None

        @staticmethod
        def decompress(tensor: Any, ctx: Any) -> Any:
            return tensor if ctx is None else caster_for(tensor).cast_back(tensor, ctx)

    _Cast.__name__ = _Cast.__qualname__ = name
    _Cast.__doc__ = f"Floating-point tensors travel as {wire}; ``decompress`` restores their dtype."
    return _Cast


FP16Compressor = _cast_compressor("float16", "FP16Compressor")
BF16Compressor = _cast_compressor("bfloat16", "BF16Compressor")


class Compression:
    """The compressors, under Horovod's names: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
