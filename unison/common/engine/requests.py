"""Requests: one rank's submission of a named tensor to a collective."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from unison.collectives.header import Collective as Kind
from unison.common.dtypes import dtype_code, dtype_from_code, dtype_name, is_float
from unison.common.engine.handles import Handle
from unison.common.ops import ReduceOp

__all__ = ["Kind", "Request", "Signature", "describe", "identity_like"]


#: What every rank must agree on for one name: (kind, dtype code, shape, op, root,
#: prescale, postscale, error, algorithm). For allgather and alltoall the shape
#: omits the first dimension, which may differ per rank. A rank whose arguments
#: were invalid submits its error text instead, so every rank can raise it.
Signature = tuple


@dataclass(eq=False, slots=True)
class Request:
    """A named collective submitted on this rank, waiting for the others."""

    name: str
    kind: Kind
    array: np.ndarray
    handle: Handle
    op: int = -1
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] | None = None
    process_set: int = 0
    out: np.ndarray | None = None
    #: a local argument error to report on every rank: "T:<message>" for a TypeError
    #: (bad dtype or op), "V:<message>" for a ValueError (bad root, splits, shape)
    error: str = ""
    algorithm: str = "auto"
    #: for BARRIER requests: run by the engine thread when every rank has submitted
    #: (at the same point of the same cycle on every rank)
    action: Callable[[], Any] | None = None
    submitted: float = field(default_factory=time.monotonic)

    def signature(self) -> Signature:
        if self.error:
            return (int(self.kind), -1, (), -1, -1, 1.0, 1.0, self.error, "")
        shape = self.array.shape
        if self.kind in (Kind.ALLGATHER, Kind.ALLTOALL):
            shape = shape[1:]
        return (int(self.kind), dtype_code(self.array.dtype), tuple(shape), self.op, self.root,
                self.prescale, self.postscale, "", self.algorithm)


def describe(sig: Signature, dim0: int | None = None) -> str:
    """A human-readable form of a signature for error messages."""
    kind, dtc, shape, op, root, pre, post, error, algorithm = sig
    if error:
        return f"error: {error[2:]}"
    if dim0 is not None and Kind(kind) in (Kind.ALLGATHER, Kind.ALLTOALL):
        shape = (dim0,) + tuple(shape)
    parts = [f"{Kind(kind).name.lower()}", f"shape={tuple(shape)}",
             f"dtype={dtype_name(dtype_from_code(dtc)) if dtc >= 0 else '?'}"]
    if op >= 0:
        parts.append(f"op={ReduceOp(op)!r}")
    if root >= 0:
        parts.append(f"root_rank={root}")
    if pre != 1.0 or post != 1.0:
        parts.append(f"prescale_factor={pre}, postscale_factor={post}")
    if algorithm != "auto":
        parts.append(f"algorithm={algorithm}")
    return " ".join(parts)


def identity_like(sig: Signature, dim0: int = 0) -> np.ndarray:
    """What a joined rank contributes in place of data it never submitted."""
    kind, dtc, shape, op, *_ = sig
    dtype = dtype_from_code(dtc)
    if Kind(kind) in (Kind.ALLGATHER, Kind.ALLTOALL):
        return np.zeros((dim0,) + tuple(shape), dtype=dtype)
    arr = np.zeros(shape, dtype=dtype)
    if op == ReduceOp.PRODUCT or (op == ReduceOp.MIN and dtype == np.bool_):
        arr[...] = 1
    elif op == ReduceOp.MIN:
        arr[...] = np.inf if is_float(dtype) else np.iinfo(dtype).max
    elif op == ReduceOp.MAX and dtype != np.bool_:
        arr[...] = -np.inf if is_float(dtype) else np.iinfo(dtype).min
    return arr
