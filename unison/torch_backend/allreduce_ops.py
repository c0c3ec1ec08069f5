"""All-reduce on CPU tensors (plain, in place, grouped; differentiable), Horovod's ``horovod.torch`` way.

See :mod:`unison.torch_backend.mpi_ops` for the table of gradients. ``op=Adasum``
follows Horovod's rules (power-of-two ranks, global set only); until the
engine's ReduceOp knows ADASUM it runs as a blocking, agreement-checked
reduction (:func:`unison.collectives.adasum.allreduce_direct`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from unison.collectives import adasum
from unison.common.compression import Compression
from unison.common.engine import frontend
from unison.common.engine.handles import Handle
from unison.common.engine.process_sets import ProcessSet, set_size
from unison.common.ops import ReduceOp
from unison.torch_backend.handles import (
    Adasum,
    InPlaceHandle,
    ListHandle,
    TorchHandle,
    raise_now,
    reduce_op,
    set_or_none,
    synchronize,
)
from unison.torch_backend.tensors import from_numpy, result_tensor, to_numpy

__all__ = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
]

_ENGINE_ADASUM = hasattr(ReduceOp, "ADASUM")


def _copy_out(source: np.ndarray) -> Any:
    return lambda arr: result_tensor(arr, source)


def _tensor_handle(inner: Handle, source: np.ndarray) -> Handle:
    """A handle whose ``synchronize`` gives the result as a new tensor: the engine's own handle,
    converting once (its result is never ``source``), or a wrapper that copies where needed."""
    if inner._engine is not None and inner._post is None:
        inner._post = from_numpy
        return inner
    return TorchHandle(inner, _copy_out(source))


def _dense(tensor: torch.Tensor, what: str) -> Any:
    """``tensor``'s numpy view; a tensor refused here (sparse, not on the CPU, not a tensor) comes back as a
    :class:`frontend.Refused`, submitted in its place, so that every rank of the collective raises the
    error (raised on this rank alone, the others' call paired with this rank's next one: another
    step's data there, or a hang)."""
    if not isinstance(tensor, torch.Tensor):
        return frontend.Refused(TypeError(f"{what} takes a torch.Tensor; got {type(tensor).__name__} "
                                          f"{_short(tensor)}. Convert it first (torch.as_tensor)"))
    if tensor.is_sparse:
        return frontend.Refused(ValueError(
            f"{what} takes dense tensors; got a sparse {tensor.dtype} tensor (Horovod refuses it too). Use "
            "hvd.sparse_allreduce_async, or tensor.to_dense()"))
    try:
        return to_numpy(tensor)
    except TypeError as exc:
        return frontend.Refused(exc)

def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _op_or_refused(average: bool | None, op: Any) -> Any:
    """The reduction ``average``/``op`` ask for, or a :class:`frontend.Refused` carrying why they name none
    (an unknown op, both given), for the submit to put in the tensor's place: every rank raises it. Raised
    here, on one rank alone (before 2026-12-07), the others' call met this rank's next one: its data
    added to another call's, then a hang."""
    try:
        return reduce_op(average, op)
    except ValueError as exc:
        return frontend.Refused(exc)


def _compressor_or_refused(compression: Any) -> tuple[Any, frontend.Refused | None]:
    """``compression`` when it is a compressor (``compress``/``decompress``), else ``Compression.none`` and the
    refusal every rank raises (a string such as ``"fp16"`` on one rank failed there alone)."""
    if callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None)):
        return compression, None
    return Compression.none, frontend.Refused(TypeError(
        f"compression={_short(compression)} is not a compressor; pass hvd.Compression.none, "
        "hvd.Compression.fp16 or hvd.Compression.bf16 (or a class with compress and decompress)"))


def _check_adasum(process_set: ProcessSet | None) -> None:
    """Horovod's rules (and error types) for op=Adasum on CPU tensors."""
    if process_set is not None:
        raise NotImplementedError("Adasum does not support non-global process sets yet (as in Horovod); "
                                  "use op=Average with a process set, or Adasum on the global set")
    adasum.check_size(set_size(None))


def _adasum_now(tensor: torch.Tensor, name: str | None, pre: float, post: float,
                out: torch.Tensor | None) -> Handle:
    """Adasum before the engine knows it: a blocking, agreement-checked reduction (finished handle)."""
    result = from_numpy(adasum.allreduce_direct(to_numpy(tensor), pre, post)).view(tensor.shape)
    if out is not None:
        with torch.no_grad():
            out.copy_(result)
        result = out
    done = Handle(name or "adasum")
    done.set_result(result)
    return done


def _allreduce_submit(tensor: torch.Tensor, rop: Any, name: str | None, pre: float, post: float,
                      process_set: ProcessSet | None, in_place: bool) -> Handle:
    ps = set_or_none(process_set)
    arr = _dense(tensor, "allreduce")
    if isinstance(rop, frontend.Refused):  # (see _op_or_refused)
        arr, rop = rop, ReduceOp.AVERAGE
    if rop is Adasum:
        _check_adasum(ps)
        if not _ENGINE_ADASUM:
            return _adasum_now(tensor, name, pre, post, tensor if in_place else None)
    if in_place:
        if not isinstance(arr, frontend.Refused) and (not tensor.is_contiguous() or tensor.is_neg()):
            arr = frontend.Refused(ValueError(
                "allreduce_ needs a contiguous tensor without a lazy negation (it writes the result in place); "
                "call .contiguous() (or .resolve_neg()) first, or use allreduce"))
        inner = raise_now(frontend.allreduce_async(arr, rop, name, pre, post, ps,
                                                   out=None if isinstance(arr, frontend.Refused) else arr))
        # the engine writes through a numpy view, unseen by autograd: bump the version as an in-place
        # torch op would, so a backward that saved the old values raises (not gradients of the sum)
        torch.autograd.graph.increment_version(tensor)
        return TorchHandle(inner, lambda _: tensor)
    return _tensor_handle(raise_now(frontend.allreduce_async(arr, rop, name, pre, post, ps)), arr)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet | None = None) -> Handle:
    """Start an all-reduce of ``tensor``; ``synchronize(handle)`` returns a new tensor.

    Raises:
        ValueError: a name already in flight on this rank (Horovod's rule), a sparse tensor.
        NotImplementedError: op=Adasum on a process set or a non-power-of-two job (Horovod's).
    """
    if (average is None and process_set is None and prescale_factor == 1.0 and postscale_factor == 1.0
            and type(tensor) is torch.Tensor and (op is None or type(op) is ReduceOp)):
        # the common case, with the fewest Python calls per tensor (a loop over 1000 small
        # tensors pays each microsecond here a millisecond: benchmarks/fusion.py's small1000)
        rop = ReduceOp.AVERAGE if op is None else op
        if rop is not ReduceOp.ADASUM and tensor.layout is torch.strided:
            try:
                arr = to_numpy(tensor)  # [Note: the submit path's tensor view]
            except TypeError as exc:  # (not on the CPU) every rank raises it, as _dense says
                arr = frontend.Refused(exc)
            return _tensor_handle(raise_now(frontend.allreduce_async(arr, rop, name)), arr)
    return _allreduce_submit(tensor, _op_or_refused(average, op), name, prescale_factor, postscale_factor,
                             process_set, in_place=False)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet | None = None) -> Handle:
    """Start an in-place all-reduce: the result lands in ``tensor``'s memory."""
    return _allreduce_submit(tensor, _op_or_refused(average, op), name, prescale_factor, postscale_factor,
                             process_set, in_place=True)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet | None = None) -> torch.Tensor:
    """In-place all-reduce; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: Any, pre: float, post: float,
                process_set: ProcessSet | None) -> torch.Tensor:
        ctx.args = (op, pre, post, process_set)
        return frontend._now(_allreduce_submit, tensor, op, name, pre, post, process_set, False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        op, pre, post, ps = ctx.args
        return (_Allreduce.apply(grad.contiguous(), None, op, pre, post, ps),) + (None,) * 5


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet | None = None) -> torch.Tensor:
    """All-reduce ``tensor`` over the ranks (of ``process_set``); differentiable.

    Args:
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``.
        compression: ``Compression.none`` or ``Compression.fp16`` (what travels on the wire).
    """
    if compression is Compression.none and type(tensor) is torch.Tensor and not (
            tensor.requires_grad and torch.is_grad_enabled()):  # nothing to differentiate: no autograd node
        return frontend._now(allreduce_async, tensor, average, name, op, prescale_factor, postscale_factor,
                             process_set)
    rop = _op_or_refused(average, op)
    compression, refused = _compressor_or_refused(compression)
    if refused is not None or not isinstance(tensor, torch.Tensor):  # submitted, to raise on every rank
        return frontend._now(_allreduce_submit, tensor, refused or rop, name, prescale_factor, postscale_factor,
                             process_set, False)
    compressed, cctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, name, rop, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, cctx)


def _grouped_submit(tensors: Sequence[torch.Tensor], rop: Any, name: str | None, pre: float, post: float,
                    process_set: ProcessSet | None, refused: tuple[int, Exception] | None = None) -> Handle:
    """One grouped request; ``refused`` (a member's index and the error an in-place check raised for it) puts
    that error in the member's place, so that every rank raises it (see :func:`_dense`)."""
    ps = set_or_none(process_set)
    if isinstance(rop, frontend.Refused):  # (see _op_or_refused): in the first member's place
        rop, refused = ReduceOp.AVERAGE, refused or (0, rop.error)
    if rop is Adasum and not _ENGINE_ADASUM:
        _check_adasum(ps)
        base = frontend._auto_name("grouped_allreduce", name, process_set)
        return ListHandle(base, [_adasum_now(t, f"{base}.{i}", pre, post, None) for i, t in enumerate(tensors)])
    sources = [_dense(t, "grouped_allreduce") for t in tensors]
    if refused is not None and sources:
        sources[refused[0]] = frontend.Refused(refused[1])
    inner = frontend.grouped_allreduce_async(sources, rop, name, pre, post, ps)
    for member in getattr(inner, "members", [inner]):  # one request, or one per member (Adasum, size 1)
        raise_now(member)
    return TorchHandle(inner, lambda arrs: [result_tensor(a, src) for a, src in zip(arrs, sources, strict=True)])


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: ProcessSet | None = None) -> Handle:
    """Start all-reduces of several tensors at once (they negotiate and fuse together)."""
    return _grouped_submit(list(tensors), _op_or_refused(average, op), name, prescale_factor, postscale_factor,
                           process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet | None = None) -> Handle:
    """Start in-place all-reduces of several tensors; ``synchronize`` returns the same tensors.

    One grouped request, as ``grouped_allreduce_async`` (ranks whose groups differ in length or
    layout get a mismatch error alike; one request per member left the longer group waiting for
    ever), whose results are copied into the tensors when it completes (``copy_``: autograd sees
    an in-place change; see :class:`~unison.torch_backend.handles.InPlaceHandle`).
    """
    tensors = list(tensors)
    bad = next((i for i, t in enumerate(tensors)
                if isinstance(t, torch.Tensor) and (not t.is_contiguous() or t.is_neg())), None)
    refused = None if bad is None else (bad, ValueError(
        "grouped_allreduce_ needs contiguous tensors without a lazy negation (it writes the results in place); "
        "call .contiguous() (or .resolve_neg()) first, or use grouped_allreduce"))  # (raised on every rank)
    inner = _grouped_submit(tensors, _op_or_refused(average, op), name, prescale_factor, postscale_factor,
                            process_set, refused)

    def into(results: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for t, result in zip(tensors, results, strict=True):
                if result.data_ptr() != t.data_ptr():
                    t.copy_(result.view(t.shape))
    return InPlaceHandle(inner, into, tensors)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: Any, pre: float, post: float, process_set: Any,
                *tensors: torch.Tensor) -> tuple:
        ctx.args = (op, pre, post, process_set)
        return tuple(synchronize(_grouped_submit(tensors, op, name, pre, post, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op, pre, post, ps = ctx.args
        reduced = _GroupedAllreduce.apply(None, op, pre, post, ps, *[g.contiguous() for g in grads])
        return (None,) * 5 + tuple(reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet | None = None) -> list[torch.Tensor]:
    """All-reduce a list of tensors together; differentiable. Returns a list."""
    rop = _op_or_refused(average, op)
    compression, refused = _compressor_or_refused(compression)
    tensors = list(tensors)
    if refused is not None or not all(isinstance(t, torch.Tensor) for t in tensors):  # raised on every rank
        return synchronize(_grouped_submit(tensors, refused or rop, name, prescale_factor, postscale_factor,
                                           process_set))
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(name, rop, prescale_factor, postscale_factor, process_set,
                                   *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs, strict=True)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet | None = None) -> list[torch.Tensor]:
    """In-place grouped all-reduce; returns the tensors."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))
