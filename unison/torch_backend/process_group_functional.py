"""PyTorch's functional collectives (``torch.ops._c10d_functional``) on a group written in Python.

[Note: functional collectives on a Python group]
DTensor, DeviceMesh's collectives, FSDP2's and tensor parallelism's helpers and code compiled with
``torch.compile`` do not call a group's methods: they call the dispatcher operators
``_c10d_functional.all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_to_all_single``, ``broadcast`` ... whose one kernel (registered by PyTorch for every device,
in C++) asks the group for its C++ ``Backend`` of the tensor's device. A group written in Python,
like ours, has none ("No backend type associated with device type cpu"), and PyTorch offers no
way to give it one from Python (``Backend`` has no Python constructor). So Unison registers its
own kernels for these operators for CPU tensors (a kernel for a device key takes precedence over
PyTorch's device-neutral one; other devices keep PyTorch's). Each does what PyTorch's C++ kernel
does, through the group's *Python-visible* methods (``allreduce``, ``all_gather_single``,
``reduce_scatter_single``, ``all_to_all_single``, ``broadcast``, ``send``, ``recv``), which every
group has: ours runs them on Unison's engine or the sub-group's communicator, gloo's go to its
C++ backend exactly as PyTorch's kernel would. The output tensor is registered with its ``Work``
(``_register_work``), so PyTorch's own ``wait_tensor`` (and ``AsyncCollectiveTensor``) waits for it.

The kernels are installed when the first "unison" group is created, never merely by importing
Unison, so a program that only uses gloo keeps PyTorch's kernels untouched.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from unison.torch_backend.process_group_work import unsupported

__all__ = ["install", "installed", "OPERATORS"]

_lock = threading.Lock()
_library: Any = None
_keep: dict[int, Any] = {}  # id(work) -> work: a Python Work lives until PyTorch waited for it


def _group(group_name: Any) -> Any:
    if isinstance(group_name, dist.ProcessGroup):
        return group_name
    return c10d._resolve_process_group(group_name)


def _reduce_op(name: str, what: str) -> Any:
    """PyTorch's op named ``name`` (the functional collectives pass a string).

    Raises:
        UnsupportedError: "premul_sum", which needs a factor that a string cannot carry (before 2026-12-06
            a pybind ``TypeError`` about ``AllreduceOptions``), on every rank (each passes the same string).
        ValueError: a name PyTorch has no op for.
    """
    op = getattr(dist.ReduceOp, str(name).upper(), None)
    if op is None or not isinstance(op, dist.ReduceOp.RedOpType):
        raise ValueError(f"{what}: unknown reduce op {name!r}; use sum, avg, product, min, max, "
                         "band, bor or bxor")
    if op == dist.ReduceOp.PREMUL_SUM:
        raise unsupported(f"{what} with reduce op {name!r}: PREMUL_SUM needs a factor, which the functional "
                          "collectives' op name cannot carry. Multiply the tensor by the factor and use 'sum', or "
                          "call dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor))")
    return op


class _Hold(dist.Work):
    """Keeps a Python ``Work`` referenced until it has been waited for (PyTorch's registry holds only
    the C++ side, and a Python subclass's methods must outlive their Python object)."""

    def __init__(self, work: Any) -> None:
        super().__init__()
        self._work = work
        _keep[id(self)] = self

    def wait(self, timeout: Any = None) -> bool:
        try:
            if timeout is None:
                return bool(self._work.wait())
            return bool(self._work.wait(timeout))
        finally:
            _keep.pop(id(self), None)

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def get_future(self) -> Any:
        return self._work.get_future()


def _register(tensors: Sequence[torch.Tensor], work: Any) -> None:
    if work is None:  # a group that completed the call synchronously
        return
    held = _Hold(work) if type(work) is not dist.Work and not isinstance(work, _Hold) else work
    for t in tensors:
        c10d._register_work(t, held)


def _gathered_shape(tensor: torch.Tensor, factor: int, what: str, divide: bool = False) -> list[int]:
    if tensor.dim() == 0:
        raise ValueError(f"{what}: a 0-d tensor has no first dimension to gather or scatter along; reshape it "
                         "to (1,)")
    shape = list(tensor.shape)
    if divide:
        if shape[0] % factor:
            raise ValueError(f"{what}: the first dimension {shape[0]} does not divide by the group size {factor}")
        shape[0] //= factor
    else:
        shape[0] *= factor
    return shape


# --------------------------------------------------------------------------- the kernels


def all_reduce_(tensor: torch.Tensor, reduce_op: str, group_name: Any) -> torch.Tensor:
    opts = c10d.AllreduceOptions()
    opts.reduceOp = _reduce_op(reduce_op, "all_reduce")
    _register([tensor], _group(group_name).allreduce([tensor], opts))
    return tensor


def all_reduce(tensor: torch.Tensor, reduce_op: str, group_name: Any) -> torch.Tensor:
    return all_reduce_(tensor.clone(memory_format=torch.contiguous_format), reduce_op, group_name)


def all_reduce_coalesced_(tensors: list[torch.Tensor], reduce_op: str, group_name: Any) -> list[torch.Tensor]:
    opts = c10d.AllreduceCoalescedOptions()
    opts.reduceOp = _reduce_op(reduce_op, "all_reduce_coalesced")
    _register(tensors, _group(group_name).allreduce_coalesced(tensors, opts))
    return tensors


def all_reduce_coalesced(tensors: list[torch.Tensor], reduce_op: str, group_name: Any) -> list[torch.Tensor]:
    return all_reduce_coalesced_([t.clone(memory_format=torch.contiguous_format) for t in tensors],
                                 reduce_op, group_name)


def all_gather_into_tensor_out(tensor: torch.Tensor, group_size: int, group_name: Any, *,
                               out: torch.Tensor) -> torch.Tensor:
    _register([out], _group(group_name).all_gather_single(out, tensor.contiguous(), c10d.AllgatherOptions()))
    return out


def all_gather_into_tensor(tensor: torch.Tensor, group_size: int, group_name: Any) -> torch.Tensor:
    out = tensor.new_empty(_gathered_shape(tensor, group_size, "all_gather_into_tensor"))
    return all_gather_into_tensor_out(tensor, group_size, group_name, out=out)


def _unison(group_name: Any) -> Any:
    """The group's Unison backend (its coalesced calls are not methods of PyTorch's group)."""
    group = _group(group_name)
    return group if hasattr(group, "_coalesced") else group._get_backend(torch.device("cpu"))


def all_gather_into_tensor_coalesced(tensors: list[torch.Tensor], group_size: int,
                                     group_name: Any) -> list[torch.Tensor]:
    """One all-gather per tensor beside the ranks' agreement on their number, as one ``Work`` (process_group_
    collectives.py [Note: coalesced calls do not block]): it returns at once, the results wait."""
    outs = [t.new_empty(_gathered_shape(t, group_size, "all_gather_into_tensor_coalesced")) for t in tensors]
    work = _unison(group_name).all_gather_single_coalesced(outs, [t.contiguous() for t in tensors])
    _register(outs, work)
    return outs


def reduce_scatter_tensor_out(tensor: torch.Tensor, reduce_op: str, group_size: int, group_name: Any, *,
                              out: torch.Tensor) -> torch.Tensor:
    opts = c10d.ReduceScatterOptions()
    opts.reduceOp = _reduce_op(reduce_op, "reduce_scatter_tensor")
    _register([out], _group(group_name).reduce_scatter_single(out, tensor.contiguous(), opts))
    return out


def reduce_scatter_tensor(tensor: torch.Tensor, reduce_op: str, group_size: int, group_name: Any) -> torch.Tensor:
    out = tensor.new_empty(_gathered_shape(tensor, group_size, "reduce_scatter_tensor", divide=True))
    return reduce_scatter_tensor_out(tensor, reduce_op, group_size, group_name, out=out)


def reduce_scatter_tensor_coalesced(tensors: list[torch.Tensor], reduce_op: str, group_size: int,
                                    group_name: Any) -> list[torch.Tensor]:
    """One reduce-scatter per tensor beside the ranks' agreement on their number, as one ``Work`` (as
    :func:`all_gather_into_tensor_coalesced`)."""
    opts = c10d.ReduceScatterOptions()
    opts.reduceOp = _reduce_op(reduce_op, "reduce_scatter_tensor_coalesced")
    outs = [t.new_empty(_gathered_shape(t, group_size, "reduce_scatter_tensor_coalesced", divide=True))
            for t in tensors]
    work = _unison(group_name).reduce_scatter_single_coalesced(outs, [t.contiguous() for t in tensors], opts)
    _register(outs, work)
    return outs


def all_to_all_single(tensor: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                      group_name: Any) -> torch.Tensor:
    shape = list(tensor.shape)
    if not shape:
        raise ValueError("all_to_all_single: a 0-d tensor cannot be split; reshape it to (1,)")
    shape[0] = int(sum(output_split_sizes)) if output_split_sizes else shape[0]
    out = tensor.new_empty(shape)
    work = _group(group_name).all_to_all_single(out, tensor.contiguous(), [int(s) for s in output_split_sizes],
                                                [int(s) for s in input_split_sizes], c10d.AllToAllOptions())
    _register([out], work)
    return out


def broadcast_(tensor: torch.Tensor, src: int, group_name: Any) -> torch.Tensor:
    opts = c10d.BroadcastOptions()
    opts.rootRank = int(src)
    opts.rootTensor = 0
    _register([tensor], _group(group_name).broadcast([tensor], opts))
    return tensor


def broadcast(tensor: torch.Tensor, src: int, group_name: Any) -> torch.Tensor:
    return broadcast_(tensor.clone(memory_format=torch.contiguous_format), src, group_name)


def isend(tensor: torch.Tensor, dst: int, tag: int, group_name: str) -> torch.Tensor:
    _register([tensor], _group(group_name).send([tensor], int(dst), int(tag)))
    return tensor


def irecv(tensor: torch.Tensor, src: int, tag: int, group_name: str) -> torch.Tensor:
    _register([tensor], _group(group_name).recv([tensor], int(src), int(tag)))
    return tensor


def batch_p2p_ops(op_list: list[str], peer_list: list[int], tag_list: list[int], tensors: list[torch.Tensor],
                  group_name: str) -> list[torch.Tensor]:
    if not len(op_list) == len(peer_list) == len(tag_list) == len(tensors):
        raise ValueError(f"batch_p2p_ops: {len(op_list)} ops, {len(peer_list)} peers, {len(tag_list)} tags and "
                         f"{len(tensors)} tensors; give one of each per operation")
    group = _group(group_name)
    for op, peer, tag, t in zip(op_list, peer_list, tag_list, tensors, strict=True):
        if op == "isend":
            _register([t], group.send([t], int(peer), int(tag)))
        elif op == "irecv":
            _register([t], group.recv([t], int(peer), int(tag)))
        else:
            raise ValueError(f"batch_p2p_ops: unknown operation {op!r}; use 'isend' or 'irecv'")
    return tensors


OPERATORS = {
    "all_reduce": all_reduce,
    "all_reduce_": all_reduce_,
    "all_reduce_coalesced": all_reduce_coalesced,
    "all_reduce_coalesced_": all_reduce_coalesced_,
    "all_gather_into_tensor": all_gather_into_tensor,
    "all_gather_into_tensor_out": all_gather_into_tensor_out,
    "all_gather_into_tensor_coalesced": all_gather_into_tensor_coalesced,
    "reduce_scatter_tensor": reduce_scatter_tensor,
    "reduce_scatter_tensor_out": reduce_scatter_tensor_out,
    "reduce_scatter_tensor_coalesced": reduce_scatter_tensor_coalesced,
    "all_to_all_single": all_to_all_single,
    "broadcast": broadcast,
    "broadcast_": broadcast_,
    "isend": isend,
    "irecv": irecv,
    "batch_p2p_ops": batch_p2p_ops,
}


def installed() -> bool:
    return _library is not None


def install() -> None:
    """Register the kernels above for CPU tensors (once per process); see the module's note."""
    global _library
    with _lock:
        if _library is not None:
            return
        library = torch.library.Library("_c10d_functional", "IMPL")
        for name, kernel in OPERATORS.items():
            if torch._C._dispatch_has_kernel(f"_c10d_functional::{name}"):
                library.impl(name, kernel, "CPU")
        _library = library
