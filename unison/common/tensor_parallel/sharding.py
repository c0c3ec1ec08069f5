"""Sharding math for tensor-parallel layers: which slice of a dimension each shard holds.

A tensor-parallel layer splits one dimension (output features, attention heads, vocabulary
rows) into ``tp`` equal, contiguous pieces; shard ``i`` of the tensor group holds piece ``i``::

    total = 12, tp = 3      shard 0: [0, 4)   shard 1: [4, 8)   shard 2: [8, 12)

Equal pieces keep every collective of the group the same shape on every rank, so the
layers require ``total % tp == 0`` and say how to pad when it is not.
:func:`shard_range` also splits uneven totals (the first ``total % parts`` pieces one
longer) for callers that can handle ragged shards.
"""

from __future__ import annotations

__all__ = ["shard_range", "padded_size", "check_divisible", "divisible_shard"]


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer; received {name}={value!r}")
    return value


def shard_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """The half-open range ``[start, stop)`` of ``total`` items that piece ``index`` of ``parts`` holds.

    Pieces are contiguous, in index order, and cover ``[0, total)``; when ``parts`` does not
    divide ``total`` the first ``total % parts`` pieces are one item longer.

    Raises:
        ValueError: ``total`` negative, ``parts`` not positive, or ``index`` outside ``[0, parts)``.
    """
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"shard_range: total must be a non-negative integer; received total={total!r}")
    _positive("shard_range: parts", parts)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < parts:
        raise ValueError(f"shard_range: index must be in [0, parts={parts}); received index={index!r}")
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def padded_size(total: int, tp: int) -> int:
    """The smallest multiple of ``tp`` that is at least ``total``."""
    return -(-_positive("total", total) // _positive("tp", tp)) * tp


def check_divisible(what: str, total: int, tp: int) -> int:
    """Require ``tp`` to divide ``total``; returns the piece size ``total // tp``.

    Args:
        what: the size, as the user knows it (``"ColumnParallelLinear out_features"``).
        total: its value. tp: the tensor group's size.

    Raises:
        ValueError: naming ``what``, both values and the fix (pad to a multiple of ``tp``).
    """
    _positive(what, total)
    _positive("the tensor group size", tp)
    if total % tp:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor group size ({tp}); every shard "
                         f"must hold an equal piece. Pad {what} to a multiple of {tp} "
                         f"({padded_size(total, tp)}) or use a tensor group whose size divides {total}")
    return total // tp


def divisible_shard(what: str, total: int, tp: int, index: int) -> tuple[int, int]:
    """Shard ``index``'s range of ``total`` split evenly ``tp`` ways (see :func:`check_divisible`)."""
    check_divisible(what, total, tp)
    return shard_range(total, tp, index)
