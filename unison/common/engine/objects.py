"""Moving picklable Python objects between ranks, for every backend.

This is the one place where Unison unpickles what another rank sent, because the
caller asks for exactly that: ``pickle.loads`` can run arbitrary code, so use these
functions only among ranks of the same trusted job (as with Horovod's
``broadcast_object``). The engine's own traffic never uses pickle (controller
[Note: wire records]).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from unison.common import runtime
from unison.common.engine import frontend
from unison.common.engine.process_sets import ProcessSet

__all__ = ["broadcast_object", "allgather_object"]


def _set_root(root_rank: int, process_set: ProcessSet | None) -> int:
    """Horovod's rule: ``root_rank`` is a rank of the job; the engine wants its rank in the set.

    Raises:
        ValueError: ``root_rank`` is not a member of ``process_set``.
    """
    if process_set is None or process_set.ranks is None:
        return root_rank
    if root_rank not in process_set.ranks:
        raise ValueError(f"root_rank={root_rank} is not a member of {process_set!r}: as in Horovod, "
                         "broadcast_object's root_rank is a rank of the job (unison.rank()) that "
                         "belongs to the process set")
    return process_set.ranks.index(root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Any:
    """Return ``root_rank``'s ``obj`` (pickled) on every rank (of ``process_set``).

    Args:
        obj: the object to send (read on the root only).
        root_rank: the sending rank, a rank of the job even with a process set
            (Horovod's rule, as the backends' ``broadcast``).
        name: the collective's name (auto-named when None).
        process_set: the ranks taking part (every rank when None).

    Raises:
        ValueError: ``root_rank`` is not a member of ``process_set``.
    """
    name = name or frontend._auto_name("broadcast_object", None, process_set)
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    root = _set_root(int(root_rank), process_set)
    size = frontend.broadcast(np.array([payload.size], dtype=np.int64), root, f"{name}.size", process_set)
    buf = np.zeros(int(size[0]), dtype=np.uint8)
    if runtime.rank() == int(root_rank):
        buf[:] = payload
    data = frontend.broadcast(buf, root, f"{name}.data", process_set)
    return pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet | None = None) -> list:
    """Return the list of every rank's ``obj`` (pickled), in rank order."""
    name = name or frontend._auto_name("allgather_object", None, process_set)
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = frontend.allgather(np.array([payload.size], dtype=np.int64), f"{name}.sizes", process_set)
    data = frontend.allgather(payload, f"{name}.data", process_set)
    out, start = [], 0
    for size in sizes.tolist():
        out.append(pickle.loads(data[start:start + size].tobytes()))
        start += size
    return out
