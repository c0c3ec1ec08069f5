"""PyTorch's reduce ops and tensors as the collectives of the ``torch.distributed`` backend take them.

The group's collective methods (process_group_collectives.py) turn each ``dist.ReduceOp`` into Unison's op
and a PREMUL_SUM factor, refuse the ops a dtype has no meaning for ([Note: what the backend does not
support] in process_group_work.py), view complex tensors as real ones, cut a whole tensor into one piece
per rank and copy results back into PyTorch's tensors: the tensor-side work, apart from the calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from unison.common.dtypes import dtype_name, is_bool, is_float
from unison.common.ops import BITWISE, Average, Band, Bor, Bxor, Max, Min, Product, Sum
from unison.torch_backend.process_group_work import copy_into, unsupported
from unison.torch_backend.tensors import is_view, to_numpy

__all__ = ["unison_op", "check_op", "premul", "real_view", "Pieces", "pieces_of", "whole_view", "is_view", "into"]

_OPS = {dist.ReduceOp.SUM: Sum, dist.ReduceOp.AVG: Average, dist.ReduceOp.PRODUCT: Product,
        dist.ReduceOp.MIN: Min, dist.ReduceOp.MAX: Max, dist.ReduceOp.BAND: Band, dist.ReduceOp.BOR: Bor,
        dist.ReduceOp.BXOR: Bxor}


def unison_op(reduce_op: Any) -> tuple[Any, float | None]:
    """(Unison's op, the PREMUL_SUM factor or None) of PyTorch's ``reduce_op``."""
    if reduce_op == dist.ReduceOp.PREMUL_SUM:  # dist._make_nccl_premul_sum(factor): sum of factor * x
        factor = reduce_op.__getstate__()[1]
        return Sum, float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    for theirs, ours in _OPS.items():
        if reduce_op == theirs:
            return ours, None
    raise unsupported(f"reduce op {reduce_op}; it supports SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM (floating "
                      "point) and BAND, BOR, BXOR (integers and bools)")


def check_op(dtype: np.dtype, op: Any, factor: float | None, what: str) -> None:
    """Refuse an op with no meaning for ``dtype`` ([Note: what the backend does not support]); the caller
    submits the error, so every rank raises it. Before 2026-12-06 PREMUL_SUM of integers raised ValueError
    on its own rank only, and bitwise ops of floats the engine's CollectiveError."""
    if factor is None and op is not Average and op not in BITWISE:  # (the common case: nothing to refuse)
        return
    name = dtype_name(dtype)
    if op in BITWISE and (is_float(dtype) or np.dtype(dtype).kind == "c"):
        raise unsupported(f"{what} with ReduceOp.{op.name} of {name} tensors: BAND, BOR and BXOR are a bitwise "
                          "operation on integers or bools. Cast the tensor to an integer dtype, or use another op")
    if factor is not None and not is_float(dtype):
        raise unsupported(f"{what} with PREMUL_SUM of {name} tensors: PREMUL_SUM scales floating-point "
                          "tensors. Use SUM, or cast the tensor to a floating-point dtype")
    if op is Average and is_bool(dtype):
        raise unsupported(f"{what} with AVG of bool tensors, which has no meaning: use SUM or MAX (logical or), "
                          "MIN or PRODUCT (logical and)")


def premul(arr: np.ndarray, factor: float | None) -> np.ndarray:
    """``arr`` times a PREMUL_SUM factor (a new array, same dtype; floating point: see :func:`check_op`), or
    ``arr`` itself."""
    if factor is None:
        return arr
    return (arr.astype(np.float64) * factor).astype(arr.dtype)


def real_view(t: torch.Tensor, op: Any, what: str, written: bool = False) -> torch.Tensor:
    """A complex tensor as its real view (sums and averages add the parts alike; ``allreduce`` gets them so
    from PyTorch itself), any other as it is. ``written``: results land in it, so a lazily conjugated one
    is refused (by ``view_as_real``) rather than resolved into a copy. Before 2026-12-05 a complex
    ``reduce_scatter`` or ``reduce`` raised (in a sub-group, a bare ``KeyError``)."""
    if not t.is_complex():
        return t
    if op is not Sum and op is not Average:
        raise unsupported(f"{what} of complex tensors takes SUM, AVG or PREMUL_SUM (as gloo); got {op}. Reduce "
                          "the real and imaginary parts (torch.view_as_real) yourself for another op")
    if written and t.is_conj():  # (view_as_real's own RuntimeError was raised on this rank alone: a review)
        raise ValueError(f"{what} cannot write into a lazily conjugated complex tensor (a .conj() view); "
                         "pass t.resolve_conj(), or a tensor of its own")
    return torch.view_as_real(t if written else t.resolve_conj())


class Pieces(list):
    """One tensor per rank cut from one tensor, ``whole``: the collective may then read or write
    ``whole``'s memory at once (no stacking, no copy per piece) when :func:`whole_view` allows it."""

    __slots__ = ("whole",)

    def __init__(self, pieces: Sequence[torch.Tensor], whole: torch.Tensor) -> None:
        super().__init__(pieces)
        self.whole = whole


def pieces_of(whole: torch.Tensor, like: torch.Tensor, size: int) -> Pieces:
    """``whole`` as one piece per rank shaped like ``like``: PyTorch's concatenation (``size`` times the
    rows) or its stack (a new first axis of ``size``), which raised before 2026-12-05."""
    if whole.dim() == like.dim() + 1 and whole.shape[0] == size and whole.shape[1:] == like.shape:
        return Pieces(whole.unbind(0), whole)
    return Pieces(torch.chunk(whole, size), whole)


def whole_view(pieces: Any, like: torch.Tensor, size: int) -> np.ndarray | None:
    """The memory of ``pieces``' whole tensor as ``(size, like.numel())``, when the pieces are exactly that
    (``size`` pieces shaped like ``like``, of its dtype, cut from one contiguous CPU tensor of
    ``size x like.numel()`` elements that numpy views without a copy, not complex); else None, and the
    caller goes piece by piece."""
    whole = getattr(pieces, "whole", None)
    if (whole is None or len(pieces) != size or whole.device.type != "cpu" or not whole.is_contiguous()
            or whole.dtype != like.dtype or whole.is_complex() or whole.is_conj() or whole.is_neg()
            or whole.numel() != size * like.numel() or whole.numel() == 0
            or any(p.shape != like.shape for p in pieces)):
        return None
    try:
        arr = to_numpy(whole)
    except TypeError:
        return None
    if not is_view(arr, whole):  # (a dtype numpy lacks, or one the view would copy)
        return None
    return arr.reshape(size, -1)


def into(targets: list[torch.Tensor], keep: bool | Sequence[bool] = True,
         landed: Sequence[np.ndarray | None] | None = None) -> Callable[[list[Any]], list[torch.Tensor]]:
    """A ``finish`` that copies each result into its target tensor (when ``keep``, or its entry of ``keep``),
    unless the result is the target's own memory that was passed as ``out=`` (its entry of ``landed``: the
    engine wrote it in place, [Note: out= beyond the all-reduce] in common/engine/executor.py)."""
    keeps = [keep] * len(targets) if isinstance(keep, bool) else list(keep)
    outs = list(landed) if landed is not None else [None] * len(targets)

    def finish(results: list[Any]) -> list[torch.Tensor]:
        for target, result, needed, out in zip(targets, results, keeps, outs, strict=True):
            if needed and (out is None or result is not out):
                copy_into(target, result)
        return targets

    return finish
