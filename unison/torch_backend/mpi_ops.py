"""Horovod's ``horovod.torch`` collectives on CPU tensors, through Unison's engine.

Every call converts the tensor to a numpy view (no copy for contiguous CPU
tensors), submits it to the engine and converts the result back. The ``_``
variants work in place: the engine writes the result straight into the
tensor's memory. The blocking, out-of-place ops are autograd functions:

=============== ===========================================================
forward         backward (the gradient of the sum of every rank's loss)
=============== ===========================================================
allreduce(op)   allreduce of the gradients with the same op and factors
allgather       this rank's rows of the sum of all ranks' gradients
broadcast       sum of all ranks' gradients on the root, zeros elsewhere
reducescatter   allgather of the gradients (divided by size for Average)
alltoall        alltoall of the gradients back with the received splits
=============== ===========================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from unison.common.compression import Compression
from unison.common.engine import frontend
from unison.common.engine.handles import Handle
from unison.common.engine.process_sets import ProcessSet, set_rank, set_size
from unison.common.ops import Average, ReduceOp, Sum, parse_op, resolve_op
from unison.torch_backend.tensors import from_numpy, to_numpy

__all__ = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "barrier", "join",
    "poll", "synchronize",
]


class TorchHandle(Handle):
    """Wraps an engine handle; ``synchronize`` returns torch tensors."""

    __slots__ = ("inner", "convert")

    def __init__(self, inner: Handle, convert: Callable[[Any], Any]) -> None:
        super().__init__(inner.name)
        self.inner, self.convert = inner, convert

    def done(self) -> bool:
        return self.inner.done()

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            self._result, self._done = self.convert(self.inner.wait(timeout)), True
        return self._result


def poll(handle: Handle) -> bool:
    """Whether the collective behind ``handle`` has finished."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle`` and return its result (a tensor, or a list for grouped ops)."""
    return handle.wait()


# ----------------------------------------------------------------- allreduce

def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet | None = None,
                    compression: Any = Compression.none) -> Handle:
    """Start an all-reduce of ``tensor``; ``synchronize(handle)`` returns a new tensor."""
    rop = resolve_op(average, op)
    inner = frontend.allreduce_async(to_numpy(tensor), rop, name, prescale_factor, postscale_factor,
                                     process_set, compression)
    return TorchHandle(inner, lambda arr: from_numpy(np.array(arr, copy=True)).view(tensor.shape))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet | None = None) -> Handle:
    """Start an in-place all-reduce: the result lands in ``tensor``'s memory."""
    rop = resolve_op(average, op)
    if not tensor.is_contiguous():
        raise ValueError("allreduce_ needs a contiguous tensor (it writes the result in place); "
                         "call .contiguous() first or use allreduce")
    arr = to_numpy(tensor)
    inner = frontend.allreduce_async(arr, rop, name, prescale_factor, postscale_factor, process_set,
                                     out=arr)
    return TorchHandle(inner, lambda _: tensor)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet | None = None) -> torch.Tensor:
    """In-place all-reduce; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float, post: float,
                process_set: ProcessSet | None, compression: Any) -> torch.Tensor:
        ctx.args = (op, pre, post, process_set)
        return synchronize(allreduce_async(tensor, None, name, op, pre, post, process_set, compression))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        op, pre, post, ps = ctx.args
        g = synchronize(allreduce_async(grad.contiguous(), None, None, op, pre, post, ps))
        return (g,) + (None,) * 6


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet | None = None) -> torch.Tensor:
    """All-reduce ``tensor`` over the ranks (of ``process_set``); differentiable.

    Args:
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        compression: ``Compression.none`` or ``Compression.fp16`` (what travels on the wire).
    """
    return _Allreduce.apply(tensor, name, resolve_op(average, op), prescale_factor, postscale_factor,
                            process_set, compression)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: ProcessSet | None = None,
                            compression: Any = Compression.none) -> Handle:
    rop = resolve_op(average, op)
    inner = frontend.grouped_allreduce_async([to_numpy(t) for t in tensors], rop, name, prescale_factor,
                                             postscale_factor, process_set, compression)
    return TorchHandle(inner, lambda arrs: [from_numpy(np.array(a, copy=True)).view(t.shape)
                                            for a, t in zip(arrs, tensors, strict=True)])


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet | None = None) -> Handle:
    base = frontend._auto_name("grouped_allreduce", name)
    handles = [allreduce_async_(t, average, f"{base}.{i}", op, prescale_factor, postscale_factor,
                                process_set) for i, t in enumerate(tensors)]
    return frontend._GroupHandle(base, handles)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet | None = None) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                               postscale_factor, process_set, compression))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet | None = None) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# ----------------------------------------------------------------- allgather

def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet | None = None) -> Handle:
    inner = frontend.allgather_async(to_numpy(tensor), name, process_set)
    return TorchHandle(inner, lambda arr: from_numpy(arr))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet | None) -> torch.Tensor:
        ctx.process_set = process_set
        ctx.dim0 = tensor.shape[0] if tensor.dim() else 1
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        total = synchronize(allreduce_async(grad.contiguous(), None, None, Sum, 1.0, 1.0, ctx.process_set))
        rows = frontend.allgather(np.array([ctx.dim0], dtype=np.int64), process_set=ctx.process_set)
        me = set_rank(ctx.process_set)
        start = int(rows[:me].sum())
        return total[start:start + ctx.dim0].clone(), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet | None = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (which may differ); differentiable."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet | None = None) -> Handle:
    base = frontend._auto_name("grouped_allgather", name)
    return frontend._GroupHandle(base, [allgather_async(t, f"{base}.{i}", process_set)
                                        for i, t in enumerate(tensors)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet | None = None) -> list[torch.Tensor]:
    return synchronize(grouped_allgather_async(tensors, name, process_set))


# ----------------------------------------------------------------- broadcast

def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet | None = None) -> Handle:
    inner = frontend.broadcast_async(to_numpy(tensor), root_rank, name, process_set)
    return TorchHandle(inner, lambda arr: from_numpy(arr).view(tensor.shape))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Handle:
    inner = frontend.broadcast_async(to_numpy(tensor), root_rank, name, process_set)

    def copy_in(arr: np.ndarray) -> torch.Tensor:
        with torch.no_grad():
            tensor.copy_(from_numpy(arr).view(tensor.shape))
        return tensor

    return TorchHandle(inner, copy_in)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet | None = None) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, name: str | None,
                process_set: ProcessSet | None) -> torch.Tensor:
        ctx.root, ctx.process_set = root, process_set
        return synchronize(broadcast_async(tensor, root, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        total = synchronize(allreduce_async(grad.contiguous(), None, None, Sum, 1.0, 1.0, ctx.process_set))
        if set_rank(ctx.process_set) != ctx.root:
            total = torch.zeros_like(total)
        return total, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet | None = None) -> torch.Tensor:
    """Return ``root_rank``'s tensor on every rank; differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# ----------------------------------------------------------------- alltoall / reducescatter

def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet | None = None) -> Handle:
    s = splits.tolist() if isinstance(splits, torch.Tensor) else splits
    inner = frontend.alltoall_async(to_numpy(tensor), s, name, process_set)
    return TorchHandle(inner, lambda res: (from_numpy(res[0]), torch.from_numpy(res[1].astype(np.int32))))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: ProcessSet | None) -> tuple[torch.Tensor, torch.Tensor]:
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple:
        back, _splits = synchronize(alltoall_async(grad.contiguous(), ctx.received, None, ctx.process_set))
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter ``splits[i]`` rows to rank i; returns (received rows, received splits); differentiable."""
    return _Alltoall.apply(tensor, splits, name, process_set)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, compression: Any = Compression.none) -> Handle:
    compressed, ctx = compression.compress(to_numpy(tensor))
    inner = frontend.reducescatter_async(compressed, parse_op(op), name, prescale_factor, postscale_factor,
                                         process_set)
    return TorchHandle(inner, lambda arr: from_numpy(compression.decompress(arr, ctx)))


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, process_set: Any,
                pre: float, post: float, compression: Any) -> torch.Tensor:
        ctx.args = (op, process_set, pre, post)
        return synchronize(reducescatter_async(tensor, name, op, process_set, pre, post, compression))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        op, ps, pre, post = ctx.args
        g = synchronize(allgather_async(grad.contiguous(), None, ps)) * (pre * post)
        if op == Average:
            g = g / set_size(ps)
        return (g,) + (None,) * 6


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: Any = Average, process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over ranks and keep this rank's rows of dim 0; differentiable."""
    return _Reducescatter.apply(tensor, name, parse_op(op), process_set, prescale_factor, postscale_factor,
                                compression)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = Average, process_set: ProcessSet | None = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    base = frontend._auto_name("grouped_reducescatter", name)
    return frontend._GroupHandle(base, [
        reducescatter_async(t, f"{base}.{i}", op, process_set, prescale_factor, postscale_factor)
        for i, t in enumerate(tensors)])


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: Any = Average,
                          process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    return synchronize(grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor,
                                                   postscale_factor))


def barrier(process_set: ProcessSet | None = None) -> None:
    frontend.barrier(process_set)


def join(device: int = -1) -> int:
    """Keep contributing identity values until every rank joins; returns the last rank to join."""
    return frontend.join()
