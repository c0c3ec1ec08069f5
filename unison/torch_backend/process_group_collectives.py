"""The collectives of the ``torch.distributed`` backend's group (process_group.py): the methods PyTorch calls.

Each method checks its tensors, submits one call per tensor to the group's operations (the engine's
``frontend``, a process set's, or a sub-group's ``CommOps``: the same ``*_async`` names) and returns a
``Work`` that writes the results into PyTorch's tensors (process_group_work.py). A check that refuses
this rank's tensors does not raise here: the call is submitted carrying the error
(``frontend.Refused``), so every rank of the call raises it from ``wait()`` and the ranks' next calls
still pair. The coalesced calls first agree on the number of tensors (:meth:`Collectives._agree_count`).

:class:`Collectives` is a mixin: :class:`~unison.torch_backend.process_group.UnisonProcessGroup` holds the
state it reads and adds the rest (names, point-to-point, shutdown).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from unison.common.engine import frontend
from unison.common.engine.handles import waiting_on
from unison.common.exceptions import MismatchError
from unison.common.ops import Max, Sum
from unison.torch_backend import process_group_callbacks as callbacks
from unison.torch_backend.process_group_ops import (
    check_op,
    into,
    is_view,
    pieces_of,
    premul,
    real_view,
    unison_op,
)
from unison.torch_backend.process_group_work import collective_work, copy_into, host, timed_out

__all__ = ["Collectives"]


class Collectives:
    """The collective methods of a ``torch.distributed`` group on Unison (see the module's docstring)."""

    #: set by the group: its rank and size, its operations and ``wait()``'s default timeout (None: none)
    _rank: int
    _size: int
    _ops: Any
    _timeout_s: float | None
    #: numbers the calls made outside a future's callback (see :meth:`_work`)
    _seq: Iterator[int]

    def _work(self, handles: Any, finish: Any) -> dist.Work:
        """The call's ``Work``, named for the collectives its future's callbacks issue: after its place in the
        callback that made it, else after the group's count of calls ([Note: collectives from future
        callbacks] in process_group_callbacks.py)."""
        run = callbacks.current()
        if run is not None:
            family = run.family_prefix()
        else:
            family = f"torch.{getattr(self, 'group_name', '')}.cb{next(self._seq)}"
        return collective_work(handles, finish, self._timeout_s, family)

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

    # ----------------------------------------------------------- reductions
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op, factor = unison_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        handles, copy = [], []
        for t in tensors:
            try:
                arr = host(t, "allreduce")
                check_op(arr.dtype, op, factor, "allreduce")
            except (TypeError, ValueError) as exc:  # (refused on this rank: every rank raises it)
                handles.append(self._ops.allreduce_async(frontend.Refused(exc), op))
                copy.append(False)
                continue
            inplace = factor is None and is_view(arr, t)
            # in place: the result lands in the tensor itself (DDP's buckets: no copy of 25 MB back)
            handles.append(self._ops.allreduce_async(arr, op, out=arr) if inplace
                           else self._ops.allreduce_async(premul(arr, factor), op))
            copy.append(not inplace)

        return self._work(handles, into(tensors, copy))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        self._agree_count("all_reduce_coalesced", len(tensors))
        return self.allreduce(tensors, opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any = None) -> dist.Work:
        op, factor = unison_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        handles, targets = [], []
        for out, pieces in zip(outputs, inputs, strict=True):
            target = out
            try:
                target = real_view(out, op, "reduce_scatter", written=True)
                reals = [real_view(p, op, "reduce_scatter") for p in pieces]
                self._check_pieces(reals, target, "reduce_scatter")
                stacked: Any = np.stack([host(p, "reduce_scatter") for p in reals])
                check_op(stacked.dtype, op, factor, "reduce_scatter")
                stacked = premul(stacked, factor)
            except (TypeError, ValueError) as exc:
                stacked = frontend.Refused(exc)
            targets.append(target)
            handles.append(self._ops.reducescatter_async(stacked, op))

        return self._work(handles, lambda results: (into(targets)(results), outputs)[1])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002 - PyTorch's
                              opts: Any = None) -> dist.Work:
        return self.reduce_scatter([output], [pieces_of(input, output, self._size)], opts)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        """``dist.reduce_scatter_tensor`` calls inside ``dist._coalescing_manager()``: one reduce-scatter per
        pair, after the ranks agreed on their number (as ``allreduce_coalesced``)."""
        pieces = self._paired_pieces("reduce_scatter_tensor_coalesced", outputs, inputs, split_outputs=False)
        return self.reduce_scatter(outputs, pieces, opts)

    # PyTorch's older names, which its C++ group still binds (with parameters named differently)
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    _reduce_scatter_base = reduce_scatter_single

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

        return self._work(handles, into(tensors, self._rank != root))

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

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # (as above)

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
        return self.allgather([pieces_of(output, input, self._size)], [input], opts)

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
        op, factor = unison_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        handles, targets = [], []
        for t in tensors:
            target = t
            try:
                target = real_view(t, op, "reduce", written=True)
                data: Any = host(target, "reduce")
                check_op(data.dtype, op, factor, "reduce")
                data = premul(data, factor)
            except (TypeError, ValueError) as exc:
                data = frontend.Refused(exc)
            targets.append(target)
            # the root is compared across ranks (ranks naming different ones kept or dropped the sum silently)
            handles.append(self._ops.rooted_allreduce_async(data, op, root))

        return self._work(handles, lambda results: (into(targets, self._rank == root)(results), tensors)[1])

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """Every rank's tensor to the root: an all-to-all in which only the root receives.

        Each rank sends its tensor as one row of ``numel`` elements, so a rank whose tensor holds another
        number of elements than the others' raises the engine's ``MismatchError`` on every rank (the rows'
        width is compared). Before 2026-12-06 the root alone could tell, and raised alone."""
        root = opts.rootRank if opts is not None else 0
        (t,) = inputs
        try:  # (-1 indexed the last rank: every rank sent there, silently; refused, it travels to the others)
            self._check_rank(root, "gather", "dst")
            data = host(t, "gather").reshape(1, -1)
            if self._rank == root:
                self._check_pieces(outputs[0], t, "gather")
        except (TypeError, ValueError) as exc:
            return self._work([self._ops.alltoall_async(frontend.Refused(exc), None)], lambda results: [])
        splits = np.zeros(self._size, np.int32)
        splits[root] = 1
        handle = self._ops.alltoall_async(data, splits)

        def finish(results: list[Any]) -> Any:
            if self._rank != root:
                return []
            for out, row in zip(outputs[0], np.asarray(results[0][0]), strict=True):
                copy_into(out, row, "gather")
            return outputs[0]  # (gloo's future value: the list of gathered tensors)

        return self._work([handle], finish)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts: Any = None) -> dist.Work:
        """The root's pieces, one to each rank: an all-to-all in which only the root sends.

        The root sends each piece as one row of ``numel`` elements and the others send no rows of their
        output's ``numel``, so an output of another size than the root's pieces raises the engine's
        ``MismatchError`` on every rank. Before 2026-12-06 that rank raised alone and the root returned."""
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
                data = np.stack([host(p, "scatter").reshape(-1) for p in inputs[0]])
            except (TypeError, ValueError) as exc:
                data = frontend.Refused(exc)
            splits[:] = 1
        else:
            data = np.zeros((0, out.numel()), dtype=mine.dtype)
        handle = self._ops.alltoall_async(data, splits)
        return self._work([handle], lambda results: (copy_into(out, results[0][0], "scatter"), outputs)[1])

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._work([self._ops.allreduce_async(np.zeros(1, np.int8), Sum)], lambda results: [])

    def _check_rank(self, rank: Any, what: str, arg: str) -> None:
        """A rank of this group (PyTorch checks them for other groups; the default one's reach us as given)."""
        if not isinstance(rank, (int, np.integer)) or not 0 <= int(rank) < self._size:
            raise ValueError(f"{what}: {arg}={rank} is not a rank of this group of {self._size} (0 .. "
                             f"{self._size - 1})")

    def _paired_pieces(self, what: str, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                       split_outputs: bool) -> list[list[torch.Tensor]]:
        """The coalesced one-tensor calls: once the ranks agreed on the count (and that each rank's lists pair:
        PyTorch's ``_coalescing_manager`` pairs them, a direct call might not), each whole tensor (the outputs of
        an all-gather, the inputs of a reduce-scatter) as one piece per rank shaped like its partner."""
        unpaired = (f"{what} takes one output tensor per input; got {len(outputs)} outputs and {len(inputs)} "
                    "inputs") if len(outputs) != len(inputs) else None
        self._agree_count(what, len(inputs), unpaired)
        wholes, likes = (outputs, inputs) if split_outputs else (inputs, outputs)
        return [pieces_of(w, like, self._size) for w, like in zip(wholes, likes, strict=True)]

    def _check_pieces(self, pieces: Sequence[torch.Tensor], like: torch.Tensor, what: str) -> None:
        if len(pieces) != self._size or any(p.shape != like.shape for p in pieces):
            raise ValueError(f"{what} needs {self._size} tensors (one per rank) shaped like {tuple(like.shape)}; "
                             f"got {[tuple(p.shape) for p in pieces]}")
        if any(p.dtype != like.dtype for p in pieces):  # (they were cast silently: 0.5 became 0; gloo refuses)
            raise TypeError(f"{what} needs tensors of one dtype, {like.dtype}; got "
                            f"{sorted({str(p.dtype) for p in pieces})}")

