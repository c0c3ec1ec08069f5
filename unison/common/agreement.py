"""One rank's problem is every rank's error: the agreement step that saves, loads and pre-flight
checks share, so that bad input raises the same message on every rank instead of hanging some.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["raise_together", "ranks_text"]


def ranks_text(ranks: list[int]) -> str:
    """``"rank 2"`` or ``"ranks [1, 3]"``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def raise_together(comm: Any, problem: str | None, error: type[Exception] = RuntimeError,
                   cause: BaseException | None = None) -> None:
    """Agree over ``comm`` whether any rank has a ``problem``; if so raise it on every rank.

    Collective: one small Allreduce when no rank has a problem, an allgather of the messages
    otherwise. ``comm`` None is one process: its own problem is raised as is.

    Raises:
        error: ``"rank r: <problem>"`` of the lowest rank with one (naming the others that had
            one too), the same on every rank.
    """
    if problem is not None and not isinstance(problem, str):  # still take part, so nobody waits
        problem = f"a pre-flight check must give a message (str) or None; it gave {type(problem).__name__}"
    if comm is None:
        if problem is not None:
            raise error(problem) from cause
        return
    from mpi4py import MPI

    flag = np.array([problem is not None], np.int64)
    comm.Allreduce(MPI.IN_PLACE, [flag, MPI.INT64_T], op=MPI.MAX)
    if not flag[0]:
        return
    problems = comm.allgather(problem)
    bad = [r for r, text in enumerate(problems) if text is not None]
    also = f" ({ranks_text(bad[1:])} reported problems too)" if len(bad) > 1 else ""
    raise error(f"rank {bad[0]}: {problems[bad[0]]}{also}") from cause
