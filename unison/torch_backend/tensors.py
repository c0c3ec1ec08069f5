"""Zero-copy conversion between CPU torch tensors and numpy arrays, and their compression caster.

numpy has no bfloat16, so bfloat16 tensors travel as int16 views reinterpreted
as ``ml_dtypes.bfloat16`` (the core's bfloat16), and back.
"""

from __future__ import annotations

import numpy as np
import torch

from unison.common.compression import register_caster
from unison.common.dtypes import bfloat16_dtype, is_bfloat16

__all__ = ["to_numpy", "from_numpy", "result_tensor", "TorchCaster"]


class _Memory:
    """Exposes a CPU tensor's memory through numpy's array interface, and keeps its storage alive
    (the array made from it refers to this object)."""

    __slots__ = ("__array_interface__", "storage")

    def __init__(self, tensor: torch.Tensor, typestr: str) -> None:
        self.storage = tensor.untyped_storage()
        self.__array_interface__ = {"data": (tensor.data_ptr(), False), "shape": tuple(tensor.shape),
                                    "typestr": typestr, "version": 3}


#: torch dtype -> numpy's type string, for the dtypes :func:`to_numpy` reads without a torch op
_TYPESTR = {torch.float32: "<f4", torch.float64: "<f8", torch.float16: "<f2", torch.int64: "<i8",
            torch.int32: "<i4", torch.int16: "<i2", torch.int8: "|i1", torch.uint8: "|u1",
            torch.bool: "|b1", torch.bfloat16: "<i2"}

#: numpy dtypes torch.from_numpy takes as they are: those of the tensors :func:`to_numpy` reads directly
_NUMPY_NATIVE = frozenset(np.dtype(typestr) for typestr in _TYPESTR.values())


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of ``tensor``'s data (a contiguous copy first if needed).

    [Note: no torch op on the submit path] Torch's bindings release the GIL around almost
    every call that makes a tensor or an array (``numpy()``, ``detach()``, ``view()``,
    ``from_numpy``), and taking it back waits for whichever thread took it meanwhile --
    during a training step, the engine's, which then runs on for up to the interpreter's
    switch interval. Measured at np 2 on 1000 tensors of 1000 floats, those calls made a
    torch submission cost 5x a numpy one. A contiguous CPU tensor of a common dtype is
    therefore read through numpy's array interface from attribute reads alone
    (``data_ptr``, ``shape``, ``untyped_storage``: none of them gives up the GIL); the
    view keeps the tensor's storage alive, as ``Tensor.numpy()``'s does.

    Raises:
        TypeError: ``tensor`` is not on the CPU (GPU tensors arrive with the GPU issue).
    """
    if not tensor.is_cpu:
        raise TypeError(f"unison.torch_backend handles CPU tensors; got a tensor on {tensor.device}. "
                        "Move it with .cpu() first")
    typestr = _TYPESTR.get(tensor.dtype)
    if typestr is None or not tensor.is_contiguous() or tensor.numel() == 0:
        return _to_numpy_slow(tensor)
    arr = np.asarray(_Memory(tensor, typestr))
    return arr.view(bfloat16_dtype()) if tensor.dtype is torch.bfloat16 else arr


def _to_numpy_slow(tensor: torch.Tensor) -> np.ndarray:
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16_dtype())
    return t.numpy(force=True)


def result_tensor(array: np.ndarray, source: np.ndarray) -> torch.Tensor:
    """A collective's result as a tensor of its own: shares ``array``'s memory unless that
    memory may be ``source``'s (the input), which a job of size 1 can hand back; then a copy.

    Every result the engine makes is a fresh or recycled array (recycled only once nothing
    refers to it, :mod:`unison.common.pool`), so the usual case copies nothing.
    """
    if np.may_share_memory(array, source):
        array = np.array(array, copy=True)
    return from_numpy(array)


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing ``array``'s memory."""
    if type(array) is np.ndarray and array.dtype in _NUMPY_NATIVE and array.flags.c_contiguous:
        return torch.from_numpy(array)  # the engine's results: the common case, a few calls short
    arr = np.ascontiguousarray(array)
    if is_bfloat16(arr.dtype):
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


class TorchCaster:
    """Lets the framework-neutral compressors cast torch tensors (see [Note: one Compression for
    every framework] in unison/common/compression.py).

    Like Horovod's ``horovod.torch.Compression.fp16``, every floating-point dtype
    (float64 and bfloat16 included) travels as the wire type and comes back in its own dtype.
    """

    _WIRE = {"float16": torch.float16, "bfloat16": torch.bfloat16}

    def compressible(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype.is_floating_point

    def cast(self, tensor: torch.Tensor, wire: str) -> torch.Tensor:
        return tensor.to(self._WIRE[wire])

    def dtype(self, tensor: torch.Tensor) -> torch.dtype:
        return tensor.dtype

    def cast_back(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return tensor.to(dtype)


register_caster(torch.Tensor, TorchCaster())
