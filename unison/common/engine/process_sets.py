"""Process sets: collectives over a subset of ranks.

A :class:`ProcessSet` names ranks of the job; once registered (given to
``unison.init(process_sets=[...])`` or passed to ``unison.add_process_set``, on
every rank, in the same order) it gets its own communicator and its own
negotiation, so data-parallel groups of a data x pipeline grid reduce
independently. ``unison.global_process_set`` is every rank.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ProcessSet", "global_process_set", "set_rank", "set_size"]


class ProcessSet:
    """A set of ranks; ``process_set_id`` is assigned at registration."""

    def __init__(self, ranks: Iterable[int] | None = None) -> None:
        self.ranks: list[int] | None = None if ranks is None else sorted(int(r) for r in ranks)
        if self.ranks is not None and len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"ProcessSet ranks must be distinct; got {list(ranks or [])}")
        self.process_set_id: int | None = 0 if ranks is None else None

    def included(self) -> bool:
        """Whether this process belongs to the set (after registration)."""
        from unison.common import runtime

        return self.ranks is None or runtime.rank() in self.ranks

    def size(self) -> int:
        from unison.common import runtime

        return runtime.size() if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set (-1 when it is not a member)."""
        from unison.common import runtime

        if self.ranks is None:
            return runtime.rank()
        me = runtime.rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def __repr__(self) -> str:
        who = "all ranks" if self.ranks is None else f"ranks={self.ranks}"
        return f"ProcessSet(id={self.process_set_id}, {who})"


global_process_set = ProcessSet()


def set_rank(process_set: ProcessSet | None) -> int:
    """This process's rank in ``process_set`` (None or the global set: the job)."""
    from unison.common import runtime

    return runtime.rank() if process_set is None or process_set.ranks is None else process_set.rank()


def set_size(process_set: ProcessSet | None) -> int:
    """The number of ranks in ``process_set`` (None or the global set: the job)."""
    from unison.common import runtime

    return runtime.size() if process_set is None or process_set.ranks is None else process_set.size()
