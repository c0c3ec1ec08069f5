"""Requests: one rank's submission of a named tensor to a collective."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from unison.collectives.header import Collective as Kind
from unison.common.dtypes import dtype_code, dtype_from_code, dtype_name, is_float
from unison.common.engine.handles import Handle
from unison.common.ops import ReduceOp

__all__ = ["Kind", "Request", "Signature", "ACTION", "AUTO_NAME_MARK", "AUTO_NAME_SLOTS", "describe",
           "describe_member", "identity", "identity_like"]

#: In every name the frontend makes for an unnamed call (``<op>.noname.<k>``)
AUTO_NAME_MARK = ".noname."
#: Unnamed calls of one op and process set cycle through this many names
#: ([Note: unnamed calls reuse names] in frontend.py)
AUTO_NAME_SLOTS = 128


class Signature(NamedTuple):
    """What every rank must agree on for one name; compared field by field across ranks.

    A rank whose arguments were invalid submits its error text instead (``dtype`` is
    then -1), so every rank can raise it.
    """

    kind: int
    #: :func:`~unison.common.dtypes.dtype_code` of the array's dtype
    dtype: int
    #: for allgather and alltoall without the first dimension, which may differ per rank
    shape: tuple[int, ...]
    op: int
    root: int
    prescale: float
    postscale: float
    #: "" or "<kind>:<message>", kind "T" (a TypeError), "U" (an UnsupportedError) or "V" (a ValueError):
    #: [Note: refusal kinds] in errors.py
    error: str
    #: the requested algorithm; :data:`ACTION` for a barrier that runs an engine action
    algorithm: str
    #: a grouped all-reduce's members, ``((dtype code, shape), ...)`` in order; ``()`` for one
    #: tensor (see [Note: grouped requests] in executor.py)
    layout: tuple[tuple[int, tuple[int, ...]], ...] = ()


#: ``Signature.dtype`` of an empty grouped all-reduce, a code no dtype has (an error's is -1). Described as a
#: plain all-reduce of its empty placeholder array, it paired with a plain all-reduce of 0 uint8 under the same
#: name and returned that array where a group returns a list (before 2026-12-07; found by an audit).
EMPTY_GROUP = -2


def is_group(sig: Signature) -> bool:
    """Whether ``sig`` is a grouped all-reduce's ([Note: grouped requests] in executor.py)."""
    return bool(sig.layout) or sig.dtype == EMPTY_GROUP


#: ``Signature.algorithm`` of a barrier whose engine action is itself collective on every
#: rank (``add_process_set`` creates a communicator): a joined rank cannot take part.
ACTION = "action"

_ROWS_MAY_DIFFER = frozenset((Kind.ALLGATHER, Kind.ALLTOALL))
#: builds a Signature from a prepared tuple without the generated ``__new__``'s call
#: (``signature()`` runs for every submission)
_make_signature = tuple.__new__


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
    #: a local argument error to report on every rank: "<kind>:<message>", kind "T" for a TypeError
    #: (bad dtype or op), "U" for an UnsupportedError, "V" for a ValueError (bad root, splits, shape)
    error: str = ""
    #: "" until :meth:`Engine.submit` sets the job's setting for the op (``UNISON_<OP>_ALGORITHM``)
    algorithm: str = ""
    #: for BARRIER requests: run by the engine thread when every rank has submitted
    #: (at the same point of the same cycle on every rank)
    action: Callable[[], Any] | None = None
    #: a grouped all-reduce's member arrays (``array`` is then empty); see [Note: grouped requests]
    members: tuple[np.ndarray, ...] | None = None
    #: their ``((dtype code, shape), ...)``, computed once by the frontend
    layout: tuple[tuple[int, tuple[int, ...]], ...] = ()
    submitted: float = field(default_factory=time.monotonic)

    def signature(self) -> Signature:
        if self.error:
            return _make_signature(Signature, (int(self.kind), -1, (), -1, -1, 1.0, 1.0, self.error, "", ()))
        if self.members is not None:  # a group, an empty one too (its own dtype code: is_group)
            dtype = self.layout[0][0] if self.layout else EMPTY_GROUP
            return _make_signature(Signature, (int(self.kind), dtype, (len(self.layout),), self.op,
                                               self.root, self.prescale, self.postscale, "", self.algorithm,
                                               self.layout))
        shape = self.array.shape
        if self.kind in _ROWS_MAY_DIFFER:
            shape = shape[1:]
        algorithm = self.algorithm if self.action is None else ACTION
        return _make_signature(Signature, (int(self.kind), dtype_code(self.array.dtype), shape, self.op,
                                           self.root, self.prescale, self.postscale, "", algorithm, ()))


def describe(sig: Signature, dim0: int | None = None) -> str:
    """A human-readable form of a signature for error messages."""
    if sig.error:
        return f"error: {sig.error[2:]}"
    kind, shape = Kind(sig.kind), sig.shape
    if dim0 is not None and kind in _ROWS_MAY_DIFFER:
        shape = (dim0, *shape)
    dtype = dtype_name(dtype_from_code(sig.dtype)) if sig.dtype >= 0 else "?"
    parts = [kind.name.lower(), f"shape={tuple(shape)}", f"dtype={dtype}"]
    if is_group(sig):
        parts[1:] = [f"of a group of {len(sig.layout)} tensors"]
    if sig.op >= 0:
        parts.append(f"op={ReduceOp(sig.op)!r}")
    if sig.root >= 0:
        parts.append(f"root_rank={sig.root}")
    if sig.prescale != 1.0 or sig.postscale != 1.0:
        parts.append(f"prescale_factor={sig.prescale}, postscale_factor={sig.postscale}")
    if sig.algorithm not in ("auto", ACTION):
        parts.append(f"algorithm={sig.algorithm}")
    return " ".join(parts)


def describe_member(member: tuple[int, tuple[int, ...]] | None) -> str:
    """One member of a grouped request's layout, for error messages."""
    if member is None:
        return "no such member"
    return f"shape={tuple(member[1])} dtype={dtype_name(dtype_from_code(member[0]))}"


def identity_like(sig: Signature) -> np.ndarray:
    """What a joined rank contributes to an allreduce it never submitted: the op's identity."""
    return identity(dtype_from_code(sig.dtype), sig.shape, sig.op)


def identity(dtype: np.dtype, shape: tuple[int, ...], op: int) -> np.ndarray:
    """An array of ``shape`` filled with reduction ``op``'s identity element in ``dtype``."""
    arr = np.zeros(shape, dtype=dtype)
    if op == ReduceOp.PRODUCT or (op in (ReduceOp.MIN, ReduceOp.BAND) and dtype == np.bool_):
        arr[...] = 1
    elif op == ReduceOp.BAND:  # every bit set
        arr[...] = -1 if np.issubdtype(dtype, np.signedinteger) else np.iinfo(dtype).max
    elif op == ReduceOp.MIN:
        arr[...] = np.inf if is_float(dtype) else np.iinfo(dtype).max
    elif op == ReduceOp.MAX and dtype != np.bool_:
        arr[...] = -np.inf if is_float(dtype) else np.iinfo(dtype).min
    return arr
