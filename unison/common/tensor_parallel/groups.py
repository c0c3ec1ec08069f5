"""Where this rank sits in a tensor group (a registered process set); both backends' layers ask."""

from __future__ import annotations

from unison.common import runtime
from unison.common.engine.process_sets import ProcessSet, set_rank, set_size

__all__ = ["group_position"]


def group_position(process_set: ProcessSet, owner: str) -> tuple[int, int]:
    """``(tp, shard index)`` of this rank in the tensor group ``process_set``.

    Raises:
        ValueError: this rank is not a member of ``process_set``.
    """
    tp, index = set_size(process_set), set_rank(process_set)
    if index < 0:
        raise ValueError(f"{owner}: this rank ({runtime.rank()}) is not in the tensor group {process_set!r}; "
                         "build tensor-parallel layers only on the ranks of their group")
    return tp, index
