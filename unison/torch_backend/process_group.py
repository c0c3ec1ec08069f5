"""A ``torch.distributed`` backend on Unison's engine: ``dist.init_process_group("unison")``.

    import torch.distributed as dist
    import unison.torch_backend            # registers the backend "unison"

    dist.init_process_group("unison")      # under unisonrun / mpirun: rank and size from MPI
    model = torch.nn.parallel.DistributedDataParallel(model)

Each collective of the group is submitted to Unison's engine (negotiation, fusion, our
all-reduce algorithms) and returns at once; its ``Work`` (and ``Work.get_future()``) completes
when the engine has finished it, so DDP's bucket reductions overlap the backward pass.

[Note: the store under MPI] ``init_process_group`` without ``init_method`` uses ``env://``,
which needs ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``. Under an MPI launch that
set none of them, Unison's wrapper of the ``env://`` handler makes the store itself: rank 0
opens a ``TCPStore`` on a free port and MPI broadcasts its address, so PyTorch code that uses
the store (barriers, ``new_group`` bookkeeping) has a real one. Everything else is left to
PyTorch's own handler.

The group runs, on CPU tensors: all-reduce (SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM; BAND, BOR, BXOR
on integers and bools), reduce, broadcast, all-gather (lists and into one tensor), reduce-scatter
(lists and from one tensor), their coalesced forms (``all_reduce_coalesced``, ``all_gather_coalesced``,
and ``_coalescing_manager``'s all-gathers and reduce-scatters into one tensor), all-to-all (lists and
with split sizes), gather, scatter, barrier and point-to-point sends and receives. What it does not
support raises ``UnsupportedError`` (a ``NotImplementedError``) on every rank
(process_group_work.py, [Note: what the backend does not support]); docs/torch_distributed.md has
the table. ``dist.new_group`` and ``DeviceMesh`` sub-groups run on the members' own MPI communicator
(process_group_sub.py, [Note: sub-groups on MPI communicators]); PyTorch's functional collectives
(DTensor) reach these methods through process_group_functional.py.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import importlib
import logging
import os
import socket
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from unison.common import runtime
from unison.common.dtypes import dtype_name, is_bool, is_float
from unison.common.engine import frontend
from unison.common.engine.handles import waiting_on
from unison.common.exceptions import MismatchError
from unison.common.ops import BITWISE, Average, Band, Bor, Bxor, Max, Min, Product, Sum
from unison.torch_backend import process_group_functional as functional
from unison.torch_backend.process_group_sub import CommOps, create_sub_communicator
from unison.torch_backend.process_group_work import (
    P2PWork,
    TranslatingOps,
    collective_work,
    copy_into,
    host,
    irecv_bytes,
    isend_bytes,
    seconds,
    timed_out,
    unsupported,
)

__all__ = ["UnisonProcessGroup", "BACKEND"]

logger = logging.getLogger(__name__)

BACKEND = "unison"

_OPS = {dist.ReduceOp.SUM: Sum, dist.ReduceOp.AVG: Average, dist.ReduceOp.PRODUCT: Product,
        dist.ReduceOp.MIN: Min, dist.ReduceOp.MAX: Max, dist.ReduceOp.BAND: Band, dist.ReduceOp.BOR: Bor,
        dist.ReduceOp.BXOR: Bxor}


def _op(reduce_op: Any) -> tuple[Any, float | None]:
    """(Unison's op, the PREMUL_SUM factor or None) of PyTorch's ``reduce_op``."""
    if reduce_op == dist.ReduceOp.PREMUL_SUM:  # dist._make_nccl_premul_sum(factor): sum of factor * x
        factor = reduce_op.__getstate__()[1]
        return Sum, float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    for theirs, ours in _OPS.items():
        if reduce_op == theirs:
            return ours, None
    raise unsupported(f"reduce op {reduce_op}; it supports SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM (floating "
                      "point) and BAND, BOR, BXOR (integers and bools)")


def _check_op(dtype: np.dtype, op: Any, factor: float | None, what: str) -> None:
    """Refuse an op with no meaning for ``dtype`` ([Note: what the backend does not support]); the caller
    submits the error, so every rank raises it. Before 2026-12-06 PREMUL_SUM of integers raised ValueError
    on its own rank only, and bitwise ops of floats the engine's CollectiveError."""
    if factor is None and op is not Average and op not in BITWISE:  # (the common case: nothing to refuse)
        return
    name = dtype_name(dtype)
    if op in BITWISE and (is_float(dtype) or np.dtype(dtype).kind == "c"):
        raise unsupported(f"{what} with ReduceOp.{op.name} of {name} tensors: BAND, BOR and BXOR are a bitwise "
                          "operation on integers or bools. Cast the tensor to an integer dtype, or use another op")
    if factor is not None and not is_float(dtype):
        raise unsupported(f"{what} with PREMUL_SUM of {name} tensors: PREMUL_SUM scales floating-point "
                          "tensors. Use SUM, or cast the tensor to a floating-point dtype")
    if op is Average and is_bool(dtype):
        raise unsupported(f"{what} with AVG of bool tensors, which has no meaning: use SUM or MAX (logical or), "
                          "MIN or PRODUCT (logical and)")


def _premul(arr: np.ndarray, factor: float | None) -> np.ndarray:
    """``arr`` times a PREMUL_SUM factor (a new array, same dtype; floating point: see ``_check_op``), or
    ``arr`` itself."""
    if factor is None:
        return arr
    return (arr.astype(np.float64) * factor).astype(arr.dtype)


def _real(t: torch.Tensor, op: Any, what: str, written: bool = False) -> torch.Tensor:
    """A complex tensor as its real view (sums and averages add the parts alike; ``allreduce`` gets them so
    from PyTorch itself), any other as it is. ``written``: results land in it, so a lazily conjugated one
    is refused (by ``view_as_real``) rather than resolved into a copy. Before 2026-12-05 a complex
    ``reduce_scatter`` or ``reduce`` raised (in a sub-group, a bare ``KeyError``)."""
    if not t.is_complex():
        return t
    if op is not Sum and op is not Average:
        raise unsupported(f"{what} of complex tensors takes SUM, AVG or PREMUL_SUM (as gloo); got {op}. Reduce "
                          "the real and imaginary parts (torch.view_as_real) yourself for another op")
    if written and t.is_conj():  # (view_as_real's own RuntimeError was raised on this rank alone: a review)
        raise ValueError(f"{what} cannot write into a lazily conjugated complex tensor (a .conj() view); "
                         "pass t.resolve_conj(), or a tensor of its own")
    return torch.view_as_real(t if written else t.resolve_conj())


def _pieces_of(whole: torch.Tensor, like: torch.Tensor, size: int) -> list[torch.Tensor]:
    """``whole`` as one piece per rank shaped like ``like``: PyTorch's concatenation (``size`` times the
    rows) or its stack (a new first axis of ``size``), which raised before 2026-12-05."""
    if whole.dim() == like.dim() + 1 and whole.shape[0] == size and whole.shape[1:] == like.shape:
        return list(whole.unbind(0))
    return list(torch.chunk(whole, size))


def _is_view(arr: np.ndarray, tensor: torch.Tensor) -> bool:
    """Whether ``arr`` is ``tensor``'s own memory (a contiguous CPU tensor's view), not a copy."""
    return bool(arr.size) and arr.__array_interface__["data"][0] == tensor.data_ptr()


def _into(targets: list[torch.Tensor],
          keep: bool | Sequence[bool] = True) -> Callable[[list[Any]], list[torch.Tensor]]:
    """A ``finish`` that copies each result into its target tensor (when ``keep``, or its entry of ``keep``)."""
    keeps = [keep] * len(targets) if isinstance(keep, bool) else list(keep)

    def finish(results: list[Any]) -> list[torch.Tensor]:
        for target, result, needed in zip(targets, results, keeps, strict=True):
            if needed:
                copy_into(target, result)
        return targets

    return finish


class UnisonProcessGroup(dist.ProcessGroup):
    """A process group of ``init_process_group("unison")``: the default group (every rank: the engine) or,
    given ``ops``, a sub-group whose collectives run on its own communicator (process_group_sub.py)."""

    def __init__(self, rank: int, size: int, ops: Any = None, comm: Any = None,
                 timeout_s: float | None = None) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._ops = TranslatingOps(frontend if ops is None else ops)
        self._comm = comm  # a sub-group's communicator (None: the job's)
        # point-to-point messages go on a communicator of the group's own (never the engine's). It is
        # made here, while every member is creating the group: made at the first send or receive
        # instead (a collective), it waited for ranks that were not sending, e.g. in a barrier
        base = comm if comm is not None else runtime.state("torch.distributed").comm
        self._p2p_comm: Any = base.Dup()
        #: init_process_group/new_group(timeout=...): how long wait() waits before DistBackendError
        self._timeout_s = timeout_s

    def shutdown(self) -> None:
        """Free what the group holds; ``torch.distributed.destroy_process_group`` calls it on every member.

        [Note: a destroyed group frees its communicators] Before 2026-12-06 nothing was freed (found by a
        leak audit): each ``new_group``/``destroy_process_group`` of a sub-group kept its communicators (about
        four, 35 KB) until Open MPI ran out of them after about 16,000 groups (``MPI_ERR_INTERN``), and each
        group of every rank kept an engine process set, which every later cycle negotiates (the default
        group's all-reduce went from 330 us to 6.9 ms after 1,000 such groups). Now the point-to-point
        communicator is freed, a sub-group's own communicator and thread with it, and a group of every rank
        other than the default one removes its process set (collective, as the destroy is). The default
        group's collectives are the engine's, which lives on until ``unison.shutdown()``.
        """
        if self.__dict__.get("_shut"):
            return
        self._shut = True
        try:
            close = getattr(self._ops, "close", None)
            if close is not None:
                close()
        finally:  # (a failed removal must not keep the communicator, nor stop a whole-world destroy half way)
            comm, self._p2p_comm = self._p2p_comm, None
            if comm is not None:
                try:
                    comm.Free()
                except Exception:  # noqa: BLE001 - MPI already finalized (a destroy at interpreter exit)
                    logger.debug("the group's point-to-point communicator was already freed", exc_info=True)

    def _work(self, handles: Any, finish: Any) -> dist.Work:
        return collective_work(handles, finish, self._timeout_s)

    def _agree_count(self, what: str, count: int, refused: str | None = None) -> None:
        """Every rank passed ``count`` tensors to a coalesced call (one request per tensor follows), or every
        rank raises. Before 2026-12-05 lists of different lengths paired a longer list's extra tensor with
        the other ranks' next collective: wrong values there, then a hang. ``refused``: this rank's own
        objection to its arguments, raised on every rank (raised before the agreement, it left the others
        waiting in it: a review, 2026-12-06)."""
        handle = self._ops.allreduce_async(np.array([count, -count, refused is not None], np.int64), Max)
        try:  # (blocking, so an async coalesced call waits here for the others: at most the group's timeout)
            with waiting_on((handle,)):  # (its timeout is an error's deadline: engine [Note: a deadlock is ...])
                got = np.asarray(handle.wait(self._timeout_s))
        except (TimeoutError, concurrent.futures.TimeoutError):
            raise timed_out(f"{what}'s agreement on the tensor count", self._timeout_s or 0.0) from None
        most, least = int(got[0]), -int(got[1])
        if got[2]:
            raise ValueError(refused or f"{what}: another rank's arguments were refused (it raises why)")
        if most != least:
            raise MismatchError(f"{what}: the ranks passed {least} to {most} tensors (this rank {count}); every "
                                "rank must pass the same number")

    def getBackendName(self) -> str:  # noqa: N802 - PyTorch's name
        return BACKEND

    # PyTorch names a group through its C++ backend, which a Python group has none of; DeviceMesh
    # reads ``group_name`` (from Python) to find its dimensions' groups, so keep the name here.
    def _set_group_name(self, name: str) -> None:
        self._unison_group_name = name
        try:
            super()._set_group_name(name)
        except RuntimeError:  # no C++ backend to hold it
            pass

    @property
    def group_name(self) -> str:
        return getattr(self, "_unison_group_name", "")

    @property
    def group_desc(self) -> str:
        return getattr(self, "_unison_group_desc", "")

    def _set_group_desc(self, desc: str) -> None:
        self._unison_group_desc = desc
        try:
            super()._set_group_desc(desc)
        except RuntimeError:
            pass

    def __repr__(self) -> str:
        return f"UnisonProcessGroup(rank={self._rank}, size={self._size})"

    # ----------------------------------------------------------- reductions
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op, factor = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        handles, copy = [], []
        for t in tensors:
            try:
                arr = host(t, "allreduce")
                _check_op(arr.dtype, op, factor, "allreduce")
            except (TypeError, ValueError) as exc:  # (refused on this rank: every rank raises it)
                handles.append(self._ops.allreduce_async(frontend.Refused(exc), op))
                copy.append(False)
                continue
            inplace = factor is None and _is_view(arr, t)
            # in place: the result lands in the tensor itself (DDP's buckets: no copy of 25 MB back)
            handles.append(self._ops.allreduce_async(arr, op, out=arr) if inplace
                           else self._ops.allreduce_async(_premul(arr, factor), op))
            copy.append(not inplace)

        return self._work(handles, _into(tensors, copy))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        self._agree_count("all_reduce_coalesced", len(tensors))
        return self.allreduce(tensors, opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any = None) -> dist.Work:
        op, factor = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        handles, targets = [], []
        for out, pieces in zip(outputs, inputs, strict=True):
            target = out
            try:
                target = _real(out, op, "reduce_scatter", written=True)
                reals = [_real(p, op, "reduce_scatter") for p in pieces]
                self._check_pieces(reals, target, "reduce_scatter")
                stacked: Any = np.stack([host(p, "reduce_scatter") for p in reals])
                _check_op(stacked.dtype, op, factor, "reduce_scatter")
                stacked = _premul(stacked, factor)
            except (TypeError, ValueError) as exc:
                stacked = frontend.Refused(exc)
            targets.append(target)
            handles.append(self._ops.reducescatter_async(stacked, op))

        return self._work(handles, lambda results: (_into(targets)(results), outputs)[1])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002 - PyTorch's
                              opts: Any = None) -> dist.Work:
        return self.reduce_scatter([output], [_pieces_of(input, output, self._size)], opts)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        """``dist.reduce_scatter_tensor`` calls inside ``dist._coalescing_manager()``: one reduce-scatter per
        pair, after the ranks agreed on their number (as ``allreduce_coalesced``)."""
        pieces = self._paired_pieces("reduce_scatter_tensor_coalesced", outputs, inputs, split_outputs=False)
        return self.reduce_scatter(outputs, pieces, opts)

    # PyTorch's older names, which its C++ group still binds (with parameters named differently)
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]
    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    # ----------------------------------------------------------- movement
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        root = opts.rootRank if opts is not None else 0
        handles = []
        for t in tensors:
            try:
                data: Any = host(t, "broadcast")
            except (TypeError, ValueError) as exc:  # (refused on this rank: every rank raises it)
                data = frontend.Refused(exc)
            handles.append(self._ops.broadcast_async(data, root))

        return self._work(handles, _into(tensors, self._rank != root))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        """``outputs[i][k]`` receives rank k's ``inputs[i]``; the future holds them as one flat list (as gloo)."""
        return self._allgather(outputs, inputs, lambda: [t for outs in outputs for t in outs])

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> dist.Work:
        """``dist.all_gather_coalesced``: ``output_lists[k][i]`` receives rank k's ``inputs[i]`` (gloo's layout,
        and the future's value), one all-gather per input after the ranks agreed on their number."""
        self._agree_count("all_gather_coalesced", len(inputs))
        if len(output_lists) != self._size or any(len(outs) != len(inputs) for outs in output_lists):
            error = ValueError(f"all_gather_coalesced needs one output list per rank ({self._size}), each of one "
                               f"tensor per input ({len(inputs)}); got lists of {[len(o) for o in output_lists]}")
            return self._work([self._ops.allgather_async(frontend.Refused(error)) for _ in inputs],
                              lambda results: output_lists)
        per_input = [[outs[i] for outs in output_lists] for i in range(len(inputs))]
        return self._allgather(per_input, inputs, lambda: output_lists)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> dist.Work:
        """``dist.all_gather_into_tensor`` calls inside ``dist._coalescing_manager()``: one all-gather per
        pair, after the ranks agreed on their number (as ``allreduce_coalesced``)."""
        pieces = self._paired_pieces("all_gather_into_tensor_coalesced", outputs, inputs, split_outputs=True)
        return self._allgather(pieces, inputs, lambda: outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]  # (as above)

    def _allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                   value: Callable[[], Any]) -> dist.Work:
        """One all-gather per input into its list of per-rank outputs; ``value()`` completes the future."""
        handles = []
        for outs, t in zip(outputs, inputs, strict=True):
            try:
                self._check_pieces(outs, t, "allgather")
                row: Any = host(t, "allgather").reshape(1, -1)
            except (TypeError, ValueError) as exc:
                row = frontend.Refused(exc)
            handles.append(self._ops.allgather_async(row))

        def finish(results: list[Any]) -> list[torch.Tensor]:
            for outs, r in zip(outputs, results, strict=True):
                for out, row in zip(outs, np.asarray(r), strict=True):
                    copy_into(out, row)
            return value()

        return self._work(handles, finish)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002 - PyTorch's
                          opts: Any = None) -> dist.Work:
        return self.allgather([_pieces_of(output, input, self._size)], [input], opts)

    _allgather_base = all_gather_single  # (PyTorch's older name, as above)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        flat: Any
        splits: Any = None
        try:
            if len(inputs) != self._size or len(outputs) != self._size:
                raise ValueError(f"alltoall takes one input and one output tensor per rank ({self._size}); got "
                                 f"{len(inputs)} inputs and {len(outputs)} outputs")
            flat = np.concatenate([host(t, "alltoall").reshape(-1) for t in inputs])
            splits = np.array([t.numel() for t in inputs], dtype=np.int32)
        except (TypeError, ValueError) as exc:
            flat = frontend.Refused(exc)
        handle = self._ops.alltoall_async(flat, splits)

        def finish(results: list[Any]) -> list[torch.Tensor]:
            received, counts = np.asarray(results[0][0]), np.asarray(results[0][1])
            sizes = [out.numel() for out in outputs]
            if counts.tolist() != sizes:
                raise ValueError(f"alltoall: this rank's output tensors hold {sizes} elements but the ranks sent "
                                 f"{counts.tolist()}; size output k for what rank k sends")
            offset = 0
            for out in outputs:
                copy_into(out, received[offset:offset + out.numel()], "alltoall")
                offset += out.numel()
            return outputs

        return self._work([handle], finish)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002 - PyTorch's
                          output_split_sizes: list[int] | None, input_split_sizes: list[int] | None,
                          opts: Any = None) -> dist.Work:
        rows = input.shape[0] if input.dim() else 1
        splits = list(input_split_sizes) if input_split_sizes else [rows // self._size] * self._size
        data: Any
        try:  # (a refusal travels, as the others')
            host(output, "all_to_all_single")
            data = host(input, "all_to_all_single")
            if sum(splits) != rows:
                raise ValueError(f"all_to_all_single: input_split_sizes {splits} do not add up to the input's "
                                 f"{rows} rows")
        except (TypeError, ValueError) as exc:
            data = frontend.Refused(exc)
        handle = self._ops.alltoall_async(data, np.asarray(splits, dtype=np.int32))

        def finish(results: list[Any]) -> list[torch.Tensor]:
            got = [int(c) for c in np.asarray(results[0][1])]
            if output_split_sizes and list(output_split_sizes) != got:
                raise ValueError(f"all_to_all_single: output_split_sizes {list(output_split_sizes)} on this rank, "
                                 f"but the ranks sent {got} rows")
            copy_into(output, results[0][0], "all_to_all_single")
            return [output]

        return self._work([handle], finish)

    # ----------------------------------------------------------- rooted
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """An all-reduce whose result only the root keeps (the engine fuses and pipelines it)."""
        root = opts.rootRank if opts is not None else 0
        op, factor = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        handles, targets = [], []
        for t in tensors:
            target = t
            try:
                target = _real(t, op, "reduce", written=True)
                data: Any = host(target, "reduce")
                _check_op(data.dtype, op, factor, "reduce")
                data = _premul(data, factor)
            except (TypeError, ValueError) as exc:
                data = frontend.Refused(exc)
            targets.append(target)
            # the root is compared across ranks (ranks naming different ones kept or dropped the sum silently)
            handles.append(self._ops.rooted_allreduce_async(data, op, root))

        return self._work(handles, lambda results: (_into(targets, self._rank == root)(results), tensors)[1])

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """Every rank's tensor to the root: an all-to-all in which only the root receives."""
        root = opts.rootRank if opts is not None else 0
        (t,) = inputs
        try:  # (-1 indexed the last rank: every rank sent there, silently; refused, it travels to the others)
            self._check_rank(root, "gather", "dst")
            data = host(t, "gather").reshape(-1)
        except (TypeError, ValueError) as exc:
            return self._work([self._ops.alltoall_async(frontend.Refused(exc), None)], lambda results: [])
        splits = np.zeros(self._size, np.int32)
        splits[root] = data.size
        handle = self._ops.alltoall_async(data, splits)

        def finish(results: list[Any]) -> Any:
            if self._rank == root:
                self._check_pieces(outputs[0], t, "gather")
                received, counts = np.asarray(results[0][0]), np.asarray(results[0][1])
                bad = {k: int(c) for k, c in enumerate(counts) if c != data.size}
                if bad:  # the root is the only rank that can tell: the others sent and are done
                    raise ValueError(f"gather: the root's tensors hold {data.size} elements, but rank(s) "
                                     f"{sorted(bad)} sent {sorted(set(bad.values()))}: every rank must pass a "
                                     "tensor of the root's size")
                for k, out in enumerate(outputs[0]):
                    copy_into(out, received[k * data.size:(k + 1) * data.size], "gather")
                return outputs[0]  # (gloo's future value: the list of gathered tensors)
            return []

        return self._work([handle], finish)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts: Any = None) -> dist.Work:
        """The root's pieces, one to each rank: an all-to-all in which only the root sends."""
        root = opts.rootRank if opts is not None else 0
        (out,) = outputs
        try:
            self._check_rank(root, "scatter", "src")
            mine = host(out, "scatter")
        except (TypeError, ValueError) as exc:  # (travels to the others, as gather's)
            return self._work([self._ops.alltoall_async(frontend.Refused(exc), None)], lambda results: [])
        splits = np.zeros(self._size, np.int32)
        data: Any
        if self._rank == root:
            try:
                self._check_pieces(inputs[0], out, "scatter")
                data = np.concatenate([host(p, "scatter").reshape(-1) for p in inputs[0]])
            except (TypeError, ValueError) as exc:
                data = frontend.Refused(exc)
            splits[:] = out.numel()
        else:
            data = np.zeros(0, dtype=mine.dtype)
        handle = self._ops.alltoall_async(data, splits)
        return self._work([handle], lambda results: (copy_into(out, results[0][0], "scatter"), outputs)[1])

    # ----------------------------------------------------------- point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        (t,) = tensors
        self._check_rank(dst, "send", "dst")
        self._check_tag(tag)
        # as bytes: mpi4py takes no bfloat16 array (a BufferError where gloo sends it)
        data = _bytes(np.ascontiguousarray(host(t, "send")))
        return P2PWork(isend_bytes(self._p2p_comm, data, dst, tag), data, timeout_s=self._timeout_s)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        self._check_rank(src, "recv", "src")  # (-1 is MPI's any source: a receive from anyone, reported as -1)
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        from mpi4py import MPI

        return self._recv(tensors, MPI.ANY_SOURCE, tag)

    def _recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        self._check_tag(tag)
        (t,) = tensors
        # the tensor's own values first: a shorter message leaves the rest of it as it was (as gloo),
        # where an empty buffer copied uninitialised memory into it
        buf = np.array(host(t, "recv"), copy=True, order="C")
        return P2PWork(irecv_bytes(self._p2p_comm, _bytes(buf), src, tag), buf, into=t,
                       timeout_s=self._timeout_s)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._work([self._ops.allreduce_async(np.zeros(1, np.int8), Sum)], lambda results: [])

    def _check_rank(self, rank: Any, what: str, arg: str) -> None:
        """A rank of this group (PyTorch checks them for other groups; the default one's reach us as given)."""
        if not isinstance(rank, (int, np.integer)) or not 0 <= int(rank) < self._size:
            raise ValueError(f"{what}: {arg}={rank} is not a rank of this group of {self._size} (0 .. "
                             f"{self._size - 1})")

    @staticmethod
    def _check_tag(tag: Any) -> None:
        """A tag MPI takes as given: -1 is its any-tag (a receive of any message) and gloo refuses it too."""
        from mpi4py import MPI

        if not 0 <= int(tag) <= MPI.COMM_WORLD.Get_attr(MPI.TAG_UB):
            raise ValueError(f"Tag must be nonnegative and at most {MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)}; "
                             f"got tag={tag}")

    def _paired_pieces(self, what: str, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                       split_outputs: bool) -> list[list[torch.Tensor]]:
        """The coalesced one-tensor calls: once the ranks agreed on the count (and that each rank's lists pair:
        PyTorch's ``_coalescing_manager`` pairs them, a direct call might not), each whole tensor (the outputs of
        an all-gather, the inputs of a reduce-scatter) as one piece per rank shaped like its partner."""
        unpaired = (f"{what} takes one output tensor per input; got {len(outputs)} outputs and {len(inputs)} "
                    "inputs") if len(outputs) != len(inputs) else None
        self._agree_count(what, len(inputs), unpaired)
        wholes, likes = (outputs, inputs) if split_outputs else (inputs, outputs)
        return [_pieces_of(w, like, self._size) for w, like in zip(wholes, likes, strict=True)]

    def _check_pieces(self, pieces: Sequence[torch.Tensor], like: torch.Tensor, what: str) -> None:
        if len(pieces) != self._size or any(p.shape != like.shape for p in pieces):
            raise ValueError(f"{what} needs {self._size} tensors (one per rank) shaped like {tuple(like.shape)}; "
                             f"got {[tuple(p.shape) for p in pieces]}")
        if any(p.dtype != like.dtype for p in pieces):  # (they were cast silently: 0.5 became 0; gloo refuses)
            raise TypeError(f"{what} needs tensors of one dtype, {like.dtype}; got "
                            f"{sorted({str(p.dtype) for p in pieces})}")


def _bytes(arr: np.ndarray) -> np.ndarray:
    """A contiguous array's memory as bytes (a view: what MPI moves for any dtype, bfloat16 included)."""
    return arr.reshape(-1).view(np.uint8)


def _create(opts: Any, backend_options: Any = None) -> UnisonProcessGroup:
    """PyTorch's creator hook (extended API): the default group, after checking PyTorch's rank and size
    against MPI's, or a sub-group on the members' own communicator (see process_group_sub.py)."""
    from unison.torch_backend import basics

    functional.install()  # DTensor & co. call the dispatcher's collectives (see process_group_functional.py)
    rank, world_size = opts.group_rank, opts.group_size
    members = list(opts.global_ranks_in_group)
    timeout = seconds(getattr(opts, "timeout", None))
    if not runtime.is_initialized():
        basics.init()
    mine, total = runtime.rank(), runtime.size()
    if members and members != list(range(total)):
        if members[rank] != mine:
            raise ValueError(f"torch.distributed made this process rank {rank} of a group of ranks {members}, but "
                             f"MPI says it is rank {mine}")
        comm = create_sub_communicator(runtime.state("dist.new_group").comm, members)
        return UnisonProcessGroup(rank, world_size, CommOps(comm, str(opts.group_id)), comm, timeout)
    if world_size != total:
        raise ValueError(f"init_process_group('unison') got world_size={world_size} but MPI runs {total} ranks: "
                         "drop rank=/world_size= (they come from MPI) or make them match")
    if rank != mine:
        raise ValueError(f"init_process_group('unison') got rank={rank} but MPI says this process is rank "
                         f"{mine}: drop rank=/world_size= (they come from MPI) or make them match")
    if dist.is_initialized():  # another group of every rank (new_group(), a mesh dimension over the world)
        # [Note: groups of every rank] each gets an engine process set of its own (a communicator and
        # a negotiation of its own): on the engine's global set, two such groups drew their names
        # from one counter, so calls of one group met the other's and summed its data
        return UnisonProcessGroup(rank, world_size, _SetOps(frontend.add_process_set(list(range(total)))),
                                  timeout_s=timeout)
    return UnisonProcessGroup(rank, world_size, timeout_s=timeout)


class _SetOps:
    """The engine's operations on one process set: what a group of every rank other than the default
    one runs its collectives through ([Note: groups of every rank])."""

    def __init__(self, process_set: Any) -> None:
        self.process_set = process_set

    def allreduce_async(self, arr: Any, op: Any, out: Any = None) -> Any:
        return frontend.allreduce_async(arr, op, process_set=self.process_set, out=out)

    def reducescatter_async(self, arr: Any, op: Any) -> Any:
        return frontend.reducescatter_async(arr, op, process_set=self.process_set)

    def close(self) -> None:
        """Unregister the group's process set (every member destroys the group: [Note: a destroyed group frees
        its communicators]); nothing when Unison has already shut down."""
        eng = frontend.running_engine()
        if eng is None or not eng.alive() or self.process_set.process_set_id is None:
            return  # (Unison shut down, or its engine stopped: the set went with it)
        try:
            frontend.remove_process_set(self.process_set)
        except Exception as exc:  # noqa: BLE001 - a destroy must finish; the set is then left registered
            logger.warning("destroy_process_group: could not remove the group's process set (%s); a group of "
                           "every rank is destroyed on every rank, as it was made", exc)

    def broadcast_async(self, arr: Any, root: int) -> Any:
        return frontend.broadcast_async(arr, root, process_set=self.process_set)

    def allgather_async(self, arr: Any) -> Any:
        return frontend.allgather_async(arr, process_set=self.process_set)

    def alltoall_async(self, arr: Any, splits: Any) -> Any:
        return frontend.alltoall_async(arr, splits, process_set=self.process_set)

    def rooted_allreduce_async(self, arr: Any, op: Any, root: int) -> Any:
        return frontend.rooted_allreduce_async(arr, op, root, self.process_set)  # (set ranks are job ranks)


def _mpi_launch() -> tuple[int, int] | None:
    """(rank, size) of an MPI launch that set no torch rendezvous variables; else None."""
    if any(os.environ.get(v) for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")):
        return None
    if not (os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMIX_RANK")):
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def _mpi_store(rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """A TCPStore hosted by rank 0 on a free port; MPI tells the others where (see the Note)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    hosts = comm.allgather(socket.gethostname())
    address = "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(hosts[0])
    store = (dist.TCPStore(address, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
             if rank == 0 else None)
    port = comm.bcast(store.port if store is not None else None, root=0)
    if store is None:
        store = dist.TCPStore(address, port, size, is_master=False, timeout=timeout)
    return store


def _check_url(url: str, rank: int, size: int) -> None:
    """Refuse a ``rank=`` or ``world_size=`` (which PyTorch puts in the URL's query) that differs from MPI's.

    The MPI launch's rendezvous hands PyTorch MPI's rank and size, so before 2026-12-05 such values were
    dropped silently (``rank=5, world_size=7`` at 2 ranks ran as ranks 0 and 1 of 2: code sharding its data
    by its own ``rank`` then disagreed with ``dist``), and the backend's own check compared MPI with itself.
    """
    query = urllib.parse.parse_qs(urllib.parse.urlparse(url).query)
    for key, mpi_value in (("rank", rank), ("world_size", size)):
        given = query.get(key)
        if given and given[0].lstrip("-").isdigit() and int(given[0]) not in (-1, mpi_value):
            raise ValueError(f"init_process_group('unison') got {key}={int(given[0])} but MPI says this "
                             f"process's {key} is {mpi_value}: drop rank=/world_size= (they come from MPI) or "
                             "make them match")


def _wrap_env_handler() -> None:
    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module, not its function
    original = rdzv._rendezvous_handlers.get("env")
    if original is None or getattr(original, "_unison", False):
        return

    def handler(url: str, timeout: datetime.timedelta = dist.default_pg_timeout, **kwargs: Any) -> Any:
        launch = _mpi_launch()
        if launch is None:
            yield from original(url, timeout=timeout, **kwargs)
            return
        rank, size = launch
        _check_url(url, rank, size)
        yield _mpi_store(rank, size, timeout), rank, size
        raise RuntimeError("the MPI launch's store cannot rendezvous again")

    handler._unison = True  # type: ignore[attr-defined]
    rdzv._rendezvous_handlers["env"] = handler


def register() -> None:
    """Register the backend ``"unison"`` with ``torch.distributed`` (once; importing
    ``unison.torch_backend`` does it)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    _wrap_env_handler()
