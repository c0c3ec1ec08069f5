"""The collectives of the ``torch.distributed`` backend's group (process_group.py): the methods PyTorch calls.

Each method checks its tensors, submits one call per tensor to the group's operations (the engine's
``frontend``, a process set's, or a sub-group's ``CommOps``: the same ``*_async`` names) and returns a
``Work`` that writes the results into PyTorch's tensors (process_group_work.py). A check that refuses
this rank's tensors does not raise here: the call is submitted carrying the error
(``frontend.Refused``), so every rank of the call raises it from ``wait()`` and the ranks' next calls
still pair. The coalesced calls agree on the number of tensors beside their members ([Note: coalesced calls
do not block]).

[Note: coalesced calls do not block]
A coalesced call (``all_reduce_coalesced``, ``all_gather_coalesced``, the all-gathers and reduce-scatters
of a ``_coalescing_manager``, the functional ``*_coalesced``) is one collective per tensor, and ranks that
pass lists of different lengths must not let the longer list's extra tensor pair with the others' next
call (wrong values there, then a hang: before 2026-12-05). Until 2026-12-06 (evening) the call first
agreed on the count and waited for it, so ``async_op=True`` blocked until every rank had made the call.
Now the agreement is submitted with the members and the call returns at once: the members are named
``<base>.<i>`` after one name the ranks share (the group's next coalesced call, or its place in a future's
callback), so they pair by name, not by order. When the counts differ, the engine's agreement makes the
shorter ranks submit refusals under the missing members' names (``frontend.group_size_agreement``), and a
sub-group's, run in order on its thread before the members, makes every member raise without
communicating. ``wait()`` raises the agreement's ``MismatchError`` (a ``Work`` raises its first handle's
error) on every rank, and the next call pairs.

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
from unison.common.ops import Sum
from unison.torch_backend import process_group_callbacks as callbacks
from unison.torch_backend.process_group_ops import (
    check_op,
    into,
    is_view,
    pieces_of,
    premul,
    real_view,
    unison_op,
    whole_view,
)
from unison.torch_backend.process_group_work import collective_work, copy_into, host

__all__ = ["Collectives"]

#: runs the done callbacks of coalesced calls' count agreements (see :class:`_OffEngine`)
_SETTLE = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="unison-pg-settle")


class _OffEngine:
    """A count agreement's handle whose done callbacks run on :data:`_SETTLE`, not on the thread that completed
    it: reading its result waits for the refusals that the engine's agreement submits for a longer list's
    extra members (``frontend.group_size_agreement``), and read on the engine thread (a ``Work``'s callback
    reads each handle's result when it completes) that wait blocked the very thread that had to run them (a
    hang, found by the test of counts that differ, 2026-12-06)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def __getattr__(self, name: str) -> Any:
        if name == "_handle":  # (before __init__: a copy)
            raise AttributeError(name)
        return getattr(self._handle, name)

    def wait(self, timeout: float | None = None) -> Any:
        return self._handle.wait(timeout)

    def add_done_callback(self, fn: Callable[[Any], Any]) -> None:
        self._handle.add_done_callback(lambda _done: _SETTLE.submit(fn, self))


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

    def _coalesced(self, kind: str, what: str, count: int) -> tuple[Any, Callable[[int], dict[str, str]]]:
        """A coalesced call's count agreement (submitted, not waited for) and its members' names, as keyword
        arguments ([Note: coalesced calls do not block]). ``kind``: the members' collective."""
        run = callbacks.current()
        base = run.call_name() if run is not None else self._ops.coalesced_base(kind)
        return self._ops.count_agreement(base, count, kind, what), lambda i: {"name": f"{base}.{i}"}

    def _done(self, agreement: Any, handles: list[Any], finish: Callable[[list[Any]], Any]) -> dist.Work:
        """The ``Work`` of ``handles``, after a coalesced call's ``agreement`` when there is one (its error
        first; its result left out of ``finish``'s)."""
        if agreement is None:
            return self._work(handles, finish)
        return self._work([_OffEngine(agreement), *handles], lambda results: finish(results[1:]))

    # ----------------------------------------------------------- reductions
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._allreduce(tensors, opts)

    def _allreduce(self, tensors: list[torch.Tensor], opts: Any, agreement: Any = None,
                   named: Callable[[int], dict[str, str]] = lambda i: {}) -> dist.Work:
        op, factor = unison_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        handles, copy = [], []
        for i, t in enumerate(tensors):
            try:
                arr = host(t, "allreduce")
                check_op(arr.dtype, op, factor, "allreduce")
            except (TypeError, ValueError) as exc:  # (refused on this rank: every rank raises it)
                handles.append(self._ops.allreduce_async(frontend.Refused(exc), op, **named(i)))
                copy.append(False)
                continue
            inplace = factor is None and is_view(arr, t)
            # in place: the result lands in the tensor itself (DDP's buckets: no copy of 25 MB back)
            handles.append(self._ops.allreduce_async(arr, op, out=arr, **named(i)) if inplace
                           else self._ops.allreduce_async(premul(arr, factor), op, **named(i)))
            copy.append(not inplace)

        return self._done(agreement, handles, into(tensors, copy))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        agreement, named = self._coalesced("allreduce", "all_reduce_coalesced", len(tensors))
        return self._allreduce(tensors, opts, agreement, named)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any = None) -> dist.Work:
        return self._reduce_scatter(outputs, inputs, opts)

    def _reduce_scatter(self, outputs: Sequence[Any], inputs: Sequence[Any], opts: Any, agreement: Any = None,
                        named: Callable[[int], dict[str, str]] = lambda i: {}) -> dist.Work:
        """``inputs[i]``: the pieces of output i, or the exception that refused them on this rank."""
        op, factor = unison_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        handles, targets, landed = [], [], []
        for i, (out, pieces) in enumerate(zip(outputs, inputs, strict=True)):
            target, lands = out, None
            try:
                if isinstance(pieces, Exception):
                    raise pieces
                target = real_view(out, op, "reduce_scatter", written=True)
                reals = [real_view(p, op, "reduce_scatter") for p in pieces]
                self._check_pieces(reals, target, "reduce_scatter")
                whole = whole_view(pieces, target, self._size)
                if whole is not None:  # one contiguous input (reduce_scatter_tensor): read where it lies
                    view = host(target, "reduce_scatter")  # (its dtype is the input's: checked as carried)
                    stacked: Any = whole.reshape(self._size, *view.shape)
                    lands = view.reshape(1, *view.shape) if is_view(view, target) else None  # (its shape there)
                else:
                    stacked = np.stack([host(p, "reduce_scatter") for p in reals])
                check_op(stacked.dtype, op, factor, "reduce_scatter")
                stacked = premul(stacked, factor)
            except (TypeError, ValueError) as exc:
                stacked, lands = frontend.Refused(exc), None
            targets.append(target)
            landed.append(lands)
            handles.append(self._ops.reducescatter_async(stacked, op, out=lands, **named(i)))

        return self._done(agreement, handles,
                          lambda results: (into(targets, landed=landed)(results), outputs)[1])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002 - PyTorch's
                              opts: Any = None) -> dist.Work:
        return self.reduce_scatter([output], [pieces_of(input, output, self._size)], opts)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        """``dist.reduce_scatter_tensor`` calls inside ``dist._coalescing_manager()``: one reduce-scatter per
        pair, beside the ranks' agreement on their number ([Note: coalesced calls do not block])."""
        what = "reduce_scatter_tensor_coalesced"
        agreement, named = self._coalesced("reducescatter", what, len(inputs))
        pieces = self._paired_pieces(what, outputs, inputs, split_outputs=False)
        return self._reduce_scatter(outputs if len(outputs) == len(inputs) else [None] * len(inputs), pieces,
                                    opts, agreement, named)

    # PyTorch's older names, which its C++ group still binds (with parameters named differently)
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    _reduce_scatter_base = reduce_scatter_single

    # ----------------------------------------------------------- movement
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        root = opts.rootRank if opts is not None else 0
        handles, landed = [], []
        for t in tensors:
            try:
                data: Any = host(t, "broadcast")
            except (TypeError, ValueError) as exc:  # (refused on this rank: every rank raises it)
                data = frontend.Refused(exc)
            lands = data if isinstance(data, np.ndarray) and is_view(data, t) else None  # in place: no copies
            landed.append(lands)
            handles.append(self._ops.broadcast_async(data, root, out=lands))

        return self._work(handles, into(tensors, self._rank != root, landed))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        """``outputs[i][k]`` receives rank k's ``inputs[i]``; the future holds them as one flat list (as gloo)."""
        return self._allgather(outputs, inputs, lambda: [t for outs in outputs for t in outs])

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> dist.Work:
        """``dist.all_gather_coalesced``: ``output_lists[k][i]`` receives rank k's ``inputs[i]`` (gloo's layout,
        and the future's value), one all-gather per input beside the ranks' agreement on their number."""
        agreement, named = self._coalesced("allgather", "all_gather_coalesced", len(inputs))
        if len(output_lists) != self._size or any(len(outs) != len(inputs) for outs in output_lists):
            error = ValueError(f"all_gather_coalesced needs one output list per rank ({self._size}), each of one "
                               f"tensor per input ({len(inputs)}); got lists of {[len(o) for o in output_lists]}")
            return self._done(agreement, [self._ops.allgather_async(frontend.Refused(error), **named(i))
                                          for i in range(len(inputs))], lambda results: output_lists)
        per_input = [[outs[i] for outs in output_lists] for i in range(len(inputs))]
        return self._allgather(per_input, inputs, lambda: output_lists, agreement, named)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> dist.Work:
        """``dist.all_gather_into_tensor`` calls inside ``dist._coalescing_manager()``: one all-gather per
        pair, beside the ranks' agreement on their number ([Note: coalesced calls do not block])."""
        what = "all_gather_into_tensor_coalesced"
        agreement, named = self._coalesced("allgather", what, len(inputs))
        pieces = self._paired_pieces(what, outputs, inputs, split_outputs=True)
        return self._allgather(pieces, inputs, lambda: outputs, agreement, named)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # (as above)

    def _allgather(self, outputs: Sequence[Any], inputs: list[torch.Tensor], value: Callable[[], Any],
                   agreement: Any = None, named: Callable[[int], dict[str, str]] = lambda i: {}) -> dist.Work:
        """One all-gather per input into its list of per-rank outputs (or the exception that refused them on
        this rank); ``value()`` completes the future."""
        handles, landed = [], []
        for i, (outs, t) in enumerate(zip(outputs, inputs, strict=True)):
            lands = None
            try:
                if isinstance(outs, Exception):
                    raise outs
                self._check_pieces(outs, t, "allgather")
                row: Any = host(t, "allgather").reshape(1, -1)
                lands = whole_view(outs, t, self._size)  # all_gather_into_tensor: gathered where it goes
            except (TypeError, ValueError) as exc:
                row, lands = frontend.Refused(exc), None
            landed.append(lands)
            handles.append(self._ops.allgather_async(row, out=lands, **named(i)))

        def finish(results: list[Any]) -> list[torch.Tensor]:
            for outs, r, lands in zip(outputs, results, landed, strict=True):
                if lands is not None and r is lands:
                    continue
                for out, row in zip(outs, np.asarray(r), strict=True):
                    copy_into(out, row)
            return value()

        return self._done(agreement, handles, finish)

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
                       split_outputs: bool) -> list[Any]:
        """The coalesced one-tensor calls: for each input, its whole tensor (the outputs of an all-gather, the
        inputs of a reduce-scatter) as one piece per rank shaped like its partner, or, when this rank's lists do
        not pair (PyTorch's ``_coalescing_manager`` pairs them, a direct call might not), the error each of
        its members then carries to every rank."""
        if len(outputs) != len(inputs):
            return [ValueError(f"{what} takes one output tensor per input; got {len(outputs)} outputs and "
                               f"{len(inputs)} inputs")] * len(inputs)
        wholes, likes = (outputs, inputs) if split_outputs else (inputs, outputs)
        return [pieces_of(w, like, self._size) for w, like in zip(wholes, likes, strict=True)]

    def _check_pieces(self, pieces: Sequence[torch.Tensor], like: torch.Tensor, what: str) -> None:
        if len(pieces) != self._size or any(p.shape != like.shape for p in pieces):
            raise ValueError(f"{what} needs {self._size} tensors (one per rank) shaped like {tuple(like.shape)}; "
                             f"got {[tuple(p.shape) for p in pieces]}")
        if any(p.dtype != like.dtype for p in pieces):  # (they were cast silently: 0.5 became 0; gloo refuses)
            raise TypeError(f"{what} needs tensors of one dtype, {like.dtype}; got "
                            f"{sorted({str(p.dtype) for p in pieces})}")

