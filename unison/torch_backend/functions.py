"""Broadcasting model and optimizer state, and exchanging picklable objects."""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from unison.common.engine import frontend
from unison.common.engine.process_sets import ProcessSet
from unison.torch_backend.mpi_ops import broadcast_async_, synchronize

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int, prefix: str | None = None) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place.

    Args:
        params: ``model.state_dict()`` or ``model.named_parameters()``.
        root_rank: the rank whose values win.
        prefix: prepended to the names the broadcasts are negotiated under.

    Raises:
        ValueError: ``params`` holds something other than tensors.
    """
    items = sorted(params.items()) if isinstance(params, Mapping) else list(params)
    handles = []
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters expects tensors; {name!r} is a {type(p).__name__}. "
                             "Pass model.state_dict() or model.named_parameters()")
        target = p.data if isinstance(p, torch.nn.Parameter) else p
        handles.append(broadcast_async_(target, root_rank, f"broadcast.{prefix or ''}{name}"))
    for h in handles:
        synchronize(h)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              prefix: str | None = None, model: Any = None) -> None:
    """Make every rank's optimizer state (moments, step counts, hyperparameters) ``root_rank``'s.

    Works whether or not the other ranks' optimizers have taken a step yet: the
    root's ``state_dict()`` travels whole and is loaded everywhere.
    """
    opt = optimizer  # a DistributedOptimizer is an instance of the original class: same state_dict
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    state = broadcast_object(buf.getvalue(), root_rank, name=f"broadcast_optimizer_state.{prefix or ''}")
    if frontend.engine() is None or root_rank != _rank():
        opt.load_state_dict(torch.load(io.BytesIO(state), weights_only=False))


def _rank() -> int:
    from unison.common import runtime

    return runtime.rank()


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Any:
    """Return ``root_rank``'s ``obj`` (pickled) on every rank."""
    name = name or frontend._auto_name("broadcast_object", None)
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    size = frontend.broadcast(np.array([payload.size], dtype=np.int64), root_rank, f"{name}.size",
                              process_set)
    buf = np.zeros(int(size[0]), dtype=np.uint8)
    if _set_rank(process_set) == root_rank:
        buf[:] = payload
    data = frontend.broadcast(buf, root_rank, f"{name}.data", process_set)
    return pickle.loads(data.tobytes())


def _set_rank(process_set: ProcessSet | None) -> int:
    return _rank() if process_set is None or process_set.ranks is None else process_set.rank()


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
