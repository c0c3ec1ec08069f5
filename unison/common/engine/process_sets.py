"""Process sets: collectives over a subset of ranks.

A :class:`ProcessSet` names ranks of the job; once registered (given to
``unison.init(process_sets=[...])`` or passed to ``unison.add_process_set``, on
every rank, in the same order) it gets its own communicator and its own
negotiation, so data-parallel groups of a data x pipeline grid reduce
independently. ``unison.global_process_set`` is every rank.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

__all__ = ["ProcessSet", "global_process_set", "set_rank", "set_size", "not_registered"]


class ProcessSet:
    """A set of ranks; ``process_set_id`` is assigned at registration."""

    def __init__(self, ranks: Iterable[int] | Any | None = None) -> None:
        """``ranks``: ranks of the job, or (as Horovod) an MPI communicator whose ranks form the set.

        Raises:
            ValueError: a rank that is not an integer (``1.7`` became 1, ``'2'`` was taken), or
                the same rank twice.
        """
        if ranks is not None and hasattr(ranks, "Get_group"):
            ranks = _communicator_ranks(ranks)
        listed = None if ranks is None else list(ranks)
        if listed is not None:
            try:
                listed = [operator.index(r) for r in listed]
            except TypeError:
                raise ValueError(f"ProcessSet ranks must be integers (ranks of the job); got {listed!r}") from None
        self.ranks: list[int] | None = None if listed is None else sorted(listed)
        if self.ranks is not None and len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"ProcessSet ranks must be distinct; got {listed}")
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


def not_registered(process_set: ProcessSet | None) -> ValueError:
    """The error for a set that was never added, or was removed (the same wherever the set is refused)."""
    return ValueError(f"{process_set!r} is not registered; pass it to unison.init(process_sets=[...]) or "
                      "unison.add_process_set() on every rank first")


def _communicator_ranks(comm: Any) -> list[int]:
    """The ranks of the job (the runtime's communicator, else ``MPI_COMM_WORLD``) that form ``comm``."""
    from mpi4py import MPI

    from unison.common import runtime

    st = runtime._state
    world = st.comm if st is not None and st.comm is not None else MPI.COMM_WORLD
    group, world_group = comm.Get_group(), world.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world_group)
    finally:
        group.Free()
        world_group.Free()
    if any(r == MPI.UNDEFINED for r in ranks):
        raise ValueError("ProcessSet(communicator): the communicator holds processes outside this job")
    return list(ranks)


global_process_set = ProcessSet()


def set_rank(process_set: ProcessSet | None) -> int:
    """This process's rank in ``process_set`` (None or the global set: the job)."""
    from unison.common import runtime

    return runtime.rank() if process_set is None or process_set.ranks is None else process_set.rank()


def set_size(process_set: ProcessSet | None) -> int:
    """The number of ranks in ``process_set`` (None or the global set: the job)."""
    from unison.common import runtime

    return runtime.size() if process_set is None or process_set.ranks is None else process_set.size()
