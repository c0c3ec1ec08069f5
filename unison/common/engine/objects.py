"""Moving picklable Python objects between ranks, for every backend."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from unison.common.engine import frontend
from unison.common.engine.process_sets import ProcessSet, set_rank

__all__ = ["broadcast_object", "allgather_object"]


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Any:
    """Return ``root_rank``'s ``obj`` (pickled) on every rank."""
    name = name or frontend._auto_name("broadcast_object", None)
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    size = frontend.broadcast(np.array([payload.size], dtype=np.int64), root_rank, f"{name}.size",
                              process_set)
    buf = np.zeros(int(size[0]), dtype=np.uint8)
    if set_rank(process_set) == root_rank:
        buf[:] = payload
    data = frontend.broadcast(buf, root_rank, f"{name}.data", process_set)
    return pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet | None = None) -> list:
    """Return the list of every rank's ``obj`` (pickled), in rank order."""
    name = name or frontend._auto_name("allgather_object", None)
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = frontend.allgather(np.array([payload.size], dtype=np.int64), f"{name}.sizes", process_set)
    data = frontend.allgather(payload, f"{name}.data", process_set)
    out, start = [], 0
    for size in sizes.tolist():
        out.append(pickle.loads(data[start:start + size].tobytes()))
        start += size
    return out
