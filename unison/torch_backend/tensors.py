"""Zero-copy conversion between CPU torch tensors and numpy arrays, and their compression caster.

numpy has no bfloat16, so bfloat16 tensors travel as int16 views reinterpreted
as ``ml_dtypes.bfloat16`` (the core's bfloat16), and back.
"""

from __future__ import annotations

import numpy as np
import torch

from unison.common.compression import register_caster
from unison.common.dtypes import bfloat16

__all__ = ["to_numpy", "from_numpy", "TorchCaster"]


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of ``tensor``'s data (a contiguous copy first if needed).

    Raises:
        TypeError: ``tensor`` is not on the CPU (GPU tensors arrive with the GPU issue).
    """
    if tensor.device.type != "cpu":
        raise TypeError(f"unison.torch_backend handles CPU tensors; got a tensor on {tensor.device}. "
                        "Move it with .cpu() first")
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16)
    return t.numpy()


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing ``array``'s memory."""
    arr = np.ascontiguousarray(array)
    if arr.dtype == bfloat16:
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
