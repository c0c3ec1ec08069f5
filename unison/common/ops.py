"""Reduction operations, as module-level constants like Horovod's ``hvd.Sum``."""

from __future__ import annotations

import enum

import numpy as np

__all__ = ["ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Adasum", "Band", "Bor", "Bxor", "BITWISE",
           "parse_op", "resolve_op", "is_adasum"]


class ReduceOp(enum.IntEnum):
    """How the values of all ranks are combined."""

    AVERAGE = 0
    SUM = 1
    MIN = 2
    MAX = 3
    PRODUCT = 4
    ADASUM = 5  # Horovod's scale-invariant combination (unison.collectives.adasum)
    BAND = 6  # bitwise and/or/xor of integers (logical ones of bools), as torch.distributed's ReduceOp
    BOR = 7
    BXOR = 8

    def __repr__(self) -> str:
        return f"unison.{self.name.capitalize()}"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM
Band = ReduceOp.BAND
Bor = ReduceOp.BOR
Bxor = ReduceOp.BXOR

#: The ops defined on integers and bools only.
BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})


def parse_op(op: object) -> ReduceOp:
    """Return ``op`` as a :class:`ReduceOp`.

    Accepts the constants, their integer values (numpy's integers too: an op read back from an array or a
    config), or names such as ``"sum"``.

    Raises:
        ValueError: ``op`` names no reduction.
    """
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        key = op.strip().upper()
        if key in ReduceOp.__members__:
            return ReduceOp[key]
    elif not isinstance(op, (bool, np.bool_)) and isinstance(op, (int, np.integer)):
        try:
            return ReduceOp(int(op))
        except ValueError:
            pass
    valid = ", ".join(f"unison.{m.capitalize()}" for m in ReduceOp.__members__)
    raise ValueError(f"unknown reduce op {op!r}; valid ops are {valid}")


def resolve_op(average: bool | None, op: object) -> ReduceOp:
    """Horovod's two spellings: the deprecated ``average=`` flag or ``op=`` (default Average).

    Raises:
        ValueError: both are given, or ``op`` names no reduction.
    """
    if average is not None:
        if op is not None:
            raise ValueError("pass either average= (deprecated) or op=, not both")
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    return ReduceOp.AVERAGE if op is None else parse_op(op)


def is_adasum(op: object) -> bool:
    """Whether ``op`` asks for Adasum (``unison.Adasum``, its value or the name ``"adasum"``)."""
    try:
        return parse_op(op) is ReduceOp.ADASUM
    except ValueError:
        return False
