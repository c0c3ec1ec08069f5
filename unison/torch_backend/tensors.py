"""Zero-copy conversion between CPU torch tensors and numpy arrays.

numpy has no bfloat16, so bfloat16 tensors travel as int16 views reinterpreted
as ``ml_dtypes.bfloat16`` (the core's bfloat16), and back.
"""

from __future__ import annotations

import numpy as np
import torch

from unison.common.dtypes import bfloat16

__all__ = ["to_numpy", "from_numpy"]


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
