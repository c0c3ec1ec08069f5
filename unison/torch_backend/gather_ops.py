"""All-gather, broadcast, all-to-all and reduce-scatter on CPU tensors, and the sparse all-reduce.

See :mod:`unison.torch_backend.mpi_ops` for the table of gradients (Horovod 0.28's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from unison.common.compression import Compression
from unison.common.engine import frontend
from unison.common.engine.handles import Handle
from unison.common.engine.process_sets import ProcessSet, set_rank, set_size
from unison.common.ops import Average, ReduceOp, Sum, parse_op
from unison.common.runtime import rank
from unison.torch_backend.allreduce_ops import _Allreduce, _dense, _GroupedAllreduce
from unison.torch_backend.handles import (
    InPlaceHandle,
    ListHandle,
    SparseHandle,
    TorchHandle,
    raise_now,
    reduce_op,
    root_in_set,
    set_or_none,
    synchronize,
)
from unison.torch_backend.tensors import is_view, result_tensor

__all__ = [
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
]


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: Any,
                           process_set: ProcessSet | None = None) -> SparseHandle:
    """Reduce a sparse COO tensor by all-gathering its indices and values (Horovod's way).

    The handle is callable (``handle()``, as in Horovod) and ``synchronize(handle)``
    also works; both give a sparse tensor of the same size holding every rank's
    entries (not coalesced), the values divided by the set size when ``op`` is Average.

    Raises:
        ValueError: ``tensor`` is not sparse.
    """
    ps = set_or_none(process_set)
    error: Exception | None = None
    try:
        average = reduce_op(None, op) == Average
    except ValueError as exc:  # an unknown op: raised on every rank, as the dense refusal below (before
        error = exc  # 2026-12-07 on this rank alone, the others waiting in the gathers)
    if error is None and not tensor.is_sparse:
        error = ValueError(f"sparse_allreduce_async takes a sparse COO tensor; got a dense {tensor.dtype} tensor. "
                           "Use allreduce_async for dense tensors")
    if error is not None:  # submitted with the error in place of the rows: every rank raises it
        refused = SparseHandle(str(name), [frontend.allgather_async(frontend.Refused(error), f"{name}.{part}", ps)
                                           for part in ("indices", "values")])
        return refused.wait()  # raises here, as Horovod's does, once the others' calls have met it
    indices = allgather_async(tensor._indices().t().contiguous(), f"{name}.indices", ps)
    values = allgather_async(tensor._values().contiguous(), f"{name}.values", ps)

    def build(results: list) -> torch.Tensor:
        idx, vals = results
        if average:
            vals = vals / set_size(ps)
        return torch.sparse_coo_tensor(idx.t(), vals, tensor.size())

    return SparseHandle(str(name), [indices, values], build)

# ----------------------------------------------------------------- allgather

def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet | None = None) -> Handle:
    """Start an all-gather along dim 0 (which may differ per rank)."""
    src = _dense(tensor, "allgather")
    inner = raise_now(frontend.allgather_async(src, name, set_or_none(process_set)))
    return TorchHandle(inner, lambda arr: result_tensor(arr, src))


def _my_rows(grads: list[torch.Tensor], dims: list[int], ps: ProcessSet | None) -> list[torch.Tensor]:
    """Horovod's allgather gradient: this rank's rows of the average over ranks of each gradient."""
    averaged = _GroupedAllreduce.apply(None, Average, 1.0, 1.0, ps, *[g.contiguous() for g in grads])
    counts = frontend.allgather(np.asarray(dims, dtype=np.int64).reshape(1, -1), process_set=ps)
    start = counts[:set_rank(ps)].sum(axis=0)
    return [g.narrow(0, int(s), d).clone() for g, s, d in zip(averaged, start, dims, strict=True)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: Any) -> torch.Tensor:
        ctx.process_set = set_or_none(process_set)
        ctx.dim0 = tensor.shape[0] if tensor.dim() else 1
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _my_rows([grad], [ctx.dim0], ctx.process_set)[0], None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet | None = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (which may differ); differentiable."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet | None = None) -> Handle:
    """Start all-gathers of several tensors at once; ``synchronize`` returns a list."""
    base = frontend._auto_name("grouped_allgather", name, process_set)
    count = frontend.group_size_agreement(base, len(tensors), set_or_none(process_set))  # waited first
    return ListHandle(base, [count] + [allgather_async(t, f"{base}.{i}", process_set)
                                       for i, t in enumerate(tensors)], _members)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: Any, *tensors: torch.Tensor) -> tuple:
        ctx.process_set = set_or_none(process_set)
        ctx.dims = [t.shape[0] if t.dim() else 1 for t in tensors]
        return tuple(synchronize(grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return (None, None, *_my_rows(list(grads), ctx.dims, ctx.process_set))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet | None = None) -> list[torch.Tensor]:
    """All-gather a list of tensors together; differentiable. Returns a list."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# ----------------------------------------------------------------- broadcast

def _broadcast_submit(tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet | None,
                      in_place: bool) -> tuple[Handle, Any, np.ndarray | None]:
    """Submit a broadcast of ``tensor``: ``(engine handle, the array submitted, the array the result lands
    in or None)``. ``in_place``: a contiguous tensor's own memory is the result's ``out=`` (the engine
    broadcasts into it: no result array, no copy back)."""
    ps = set_or_none(process_set)
    src = _dense(tensor, "broadcast")
    try:
        root = root_in_set(root_rank, ps)
    except ValueError as exc:  # submitted with the error in place of the data: every rank raises it
        src, root = frontend.Refused(exc), 0  # (a placeholder root no peer sees: the error comes first)
    lands = src if in_place and isinstance(src, np.ndarray) and is_view(src, tensor) else None
    return raise_now(frontend.broadcast_async(src, root, name, ps, out=lands)), src, lands


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet | None = None) -> Handle:
    """Start a broadcast from ``root_rank`` (a global rank, as in Horovod)."""
    inner, src, _ = _broadcast_submit(tensor, root_rank, name, process_set, in_place=False)
    return TorchHandle(inner, lambda arr: result_tensor(arr.reshape(src.shape), src))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Handle:
    """Start an in-place broadcast: ``tensor`` receives the root's values when it completes (a contiguous
    one is broadcast into where it lies; another gets the result copied in)."""
    inner, src, lands = _broadcast_submit(tensor, root_rank, name, process_set, in_place=True)

    def copy_in(result: np.ndarray) -> None:
        if lands is not None and result is lands:  # written through numpy, unseen by autograd: bump the
            torch.autograd.graph.increment_version(tensor)  # version as an in-place torch op would
            return
        with torch.no_grad():
            tensor.copy_(result_tensor(result.reshape(src.shape), src))

    return InPlaceHandle(inner, copy_in, tensor)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet | None = None) -> torch.Tensor:
    """In-place broadcast; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, name: str | None, process_set: Any) -> torch.Tensor:
        ctx.root, ctx.process_set = root, set_or_none(process_set)
        return synchronize(broadcast_async(tensor, root, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        averaged = _Allreduce.apply(grad.contiguous(), None, Average, 1.0, 1.0, ctx.process_set)
        if rank() != ctx.root:
            averaged = torch.zeros_like(averaged)
        return averaged, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet | None = None) -> torch.Tensor:
    """Return ``root_rank``'s tensor on every rank; differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# ----------------------------------------------------------------- alltoall

def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet | None = None) -> Handle:
    """Start an all-to-all; ``synchronize`` returns ``(received, received_splits)`` as Horovod's does.

    ``received_splits`` has ``splits``' dtype when ``splits`` is a tensor, int32 otherwise.
    """
    split_list = splits.tolist() if isinstance(splits, torch.Tensor) else splits
    split_dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32
    src = _dense(tensor, "alltoall")
    inner = frontend.alltoall_async(src, split_list, name, set_or_none(process_set))
    return TorchHandle(raise_now(inner), lambda res: (result_tensor(res[0], src),
                                                      torch.as_tensor(np.asarray(res[1])).to(split_dtype)))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: Any) -> Any:
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple:
        back, _splits = synchronize(alltoall_async(grad.contiguous(), ctx.received, None, ctx.process_set))
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet | None = None) -> Any:
    """Send ``splits[i]`` rows to rank i (equal parts without ``splits``); differentiable.

    Returns:
        The received rows; ``(received rows, received splits)`` when ``splits`` is given (Horovod's rule).
    """
    return _Alltoall.apply(tensor, splits, name, process_set)


# ----------------------------------------------------------------- reducescatter

def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """Start a reduce-scatter: this rank's rows (dim 0 split as evenly as possible) of the reduction."""
    src = _dense(tensor, "reducescatter")
    # (op unparsed: the frontend carries a bad one in the request, so every rank raises it; parsed here, it
    # raised on this rank alone and the others' call paired with this rank's next one)
    inner = frontend.reducescatter_async(src, op, name, prescale_factor, postscale_factor,
                                         set_or_none(process_set))
    return TorchHandle(raise_now(inner), lambda arr: result_tensor(arr, src))


def _scatter_grads(grads: Sequence[torch.Tensor], op: ReduceOp, ps: Any, pre: float, post: float) -> list:
    """Horovod's reducescatter gradient before its allgather: times the set size for Sum, times the factors."""
    factor = (set_size(ps) if op == Sum else 1) * pre * post
    return [g.contiguous() * factor if factor != 1 else g.contiguous() for g in grads]


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, process_set: Any,
                pre: float, post: float) -> torch.Tensor:
        ctx.args = (op, set_or_none(process_set), pre, post)
        return synchronize(reducescatter_async(tensor, name, op, process_set, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        op, ps, pre, post = ctx.args
        return (allgather(_scatter_grads([grad], op, ps, pre, post)[0], process_set=ps),) + (None,) * 5


def _op_or_as_given(op: Any) -> Any:
    """``op`` parsed; a bad one as given, for the frontend to carry in the request so that every rank raises it
    (raised here, on one rank alone, the others' call paired with its next one)."""
    try:
        return parse_op(op)
    except ValueError:
        return op


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: Any = Average, process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over ranks and keep this rank's rows of dim 0; differentiable."""
    compressed, cctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, _op_or_as_given(op), process_set, prescale_factor,
                               postscale_factor)
    return compression.decompress(out, cctx)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = Average, process_set: ProcessSet | None = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start reduce-scatters of several tensors at once; ``synchronize`` returns a list."""
    base = frontend._auto_name("grouped_reducescatter", name, process_set)
    count = frontend.group_size_agreement(base, len(tensors), set_or_none(process_set),  # waited first
                                          "reducescatter")
    return ListHandle(base, [count] + [reducescatter_async(t, f"{base}.{i}", op, process_set, prescale_factor,
                                                           postscale_factor) for i, t in enumerate(tensors)],
                      _members)


def _members(results: list) -> list:
    """A grouped op's results without its count agreement's (``frontend.group_size_agreement``)."""
    return results[1:]


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, process_set: Any, pre: float, post: float,
                *tensors: torch.Tensor) -> tuple:
        ctx.args = (op, set_or_none(process_set), pre, post)
        return tuple(synchronize(grouped_reducescatter_async(tensors, name, op, process_set, pre, post)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op, ps, pre, post = ctx.args
        return (None,) * 5 + tuple(grouped_allgather(_scatter_grads(grads, op, ps, pre, post), process_set=ps))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: Any = Average,
                          process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce-scatter a list of tensors together; differentiable. Returns a list."""
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(name, _op_or_as_given(op), process_set, prescale_factor, postscale_factor,
                                       *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs, strict=True)]
