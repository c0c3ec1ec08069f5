"""Running agreed responses: tensor fusion and one collective per buffer.

[Note: fusion buffer] All-reduce responses of one cycle that share dtype, op and
scale factors are packed back to back into one persistent buffer (grown on
demand, never shrunk) up to the fusion threshold, reduced with one collective,
and unpacked::

    buffer: | grad_a | grad_b | grad_c | ...            (<= UNISON_FUSION_THRESHOLD)
             ^ MEMCPY_IN (prescale applied while copying)
             ALLREDUCE over the whole buffer (average/postscale on the owned segment)
             v MEMCPY_OUT into each tensor's result

Large tensors gain nothing from fusion (their transfer dwarfs one collective's
start-up) and would pay two extra copies, so a tensor of at least
``DIRECT_BYTES`` is reduced on its own, straight from its input into its result.
A joined rank contributes the op's identity to all-reduces it never submitted
(the other collectives fail while a rank is joined: controller [Note: join]).

[Note: grouped requests] ``grouped_allreduce`` submits its members as one request
under one name, with a layout (each member's dtype and shape) in its signature: one
negotiation, one response and one handle for the whole group, where a request per
member cost each of them a few microseconds of Python in every step (1000 small
tensors: a grouped call 7 ms, the same bytes as one array 1.6 ms). Ranks compare the
layouts, so a member that differs in shape or dtype is still named in the mismatch
error, on every rank. The executor runs a group as it would run its members alone in
one cycle: per dtype, in order of first appearance, members under ``DIRECT_BYTES``
(and the threshold) packed into fusion buffers of at most the threshold, the rest
reduced straight into their results. The packed members' results are consecutive
views of one pooled array, so an adapter can hand that array on whole (TensorFlow
adopts it as one tensor and splits it in the graph: ``tf_backend.host_ops``).

[Note: out= beyond the all-reduce] An all-gather, broadcast or reduce-scatter request may carry an
``out=`` array (the torch process group passes the output tensor's memory). The executor writes the
result there when ``out`` has exactly the result's shape and dtype (an all-gather's rows are known
only after the ranks exchange their counts) and, for a reduce-scatter, shares no memory with the
input; otherwise the result is a new array, as without ``out``, and the caller tells the two apart
by identity (``result is out``). A wrong ``out`` therefore never fails one rank alone: the
collective runs the same on every rank. Without it, a 64 MiB all-gather through the process group
wrote a fresh 128 MiB array (page faults on every page) and then copied it into the output tensor.

[Note: agreed bytes] ``agreed_bytes`` counts the bytes of executed responses from
values every rank knows alike (signatures, gathered row counts), never from what
only this rank received: the autotuner decides its sample boundaries from it, and
ranks that decided differently would enter different collectives. An alltoall
counts one row per call (how much each rank receives is known to it alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from unison.collectives import kernels
from unison.collectives.native import mpi_op, mpi_type
from unison.collectives.reduce import finalize, overlaps_partly, prescale, same_start
from unison.common.dtypes import dtype_from_code
from unison.common.engine.controller import Response
from unison.common.engine.errors import REFUSALS, JoinError
from unison.common.engine.requests import Kind, Signature, identity, identity_like, is_group
from unison.common.engine.timeline import Timeline, row
from unison.common.exceptions import MismatchError
from unison.common.ops import ReduceOp
from unison.common.pool import ResultPool

__all__ = ["Executor", "GroupResult", "landing"]

#: Tensors at least this large skip the fusion buffer (see [Note: fusion buffer]).
DIRECT_BYTES = 1 << 20
#: Response.invalid -> the exception raised on every rank ([Note: refusal kinds] in errors.py)
_ERRORS = {**REFUSALS, "join": JoinError}


class GroupResult(list):
    """A grouped all-reduce's results, one per member, and where packed members lie back to back:
    ``packed`` lists ``(member indices, flat array)``, each member's result a view of its flat
    array (see [Note: grouped requests])."""

    __slots__ = ("packed",)

    def __init__(self, items: list[Any]) -> None:
        super().__init__(items)
        self.packed: list[tuple[tuple[int, ...], np.ndarray]] = []


#: the most :class:`_NativeAllreduce` plans an executor keeps, and the most names it remembers
#: having run once (past either, that dict starts again empty)
_PLANS = 4096


class _NativeAllreduce:
    """A single all-reduce the kernels hand to ``MPI_Allreduce`` untouched, with that call's datatype
    and op looked up once: a name's later cycles skip the kernels' choice of algorithm (a lone small
    all-reduce spent about 10 us of Python there on this project's machine before it reached MPI).
    Made on a name's second run with one signature, after the kernels ran it (their topology is
    built collectively on first use), so a name used once costs no lookup; a name submitted with
    another signature runs in full, and gets its own plan on its second run."""

    __slots__ = ("sig", "direct", "executor", "comm", "count", "dtype", "shape", "mtype", "mop", "op", "finish",
                 "size", "pool", "mpi")

    def __init__(self, executor: Executor, sig: Signature, nbytes: int) -> None:
        self.sig, self.executor, self.comm, self.mpi = sig, executor, executor.comm, executor.mpi
        self.shape, self.dtype, self.op = sig.shape, dtype_from_code(sig.dtype), ReduceOp(sig.op)
        #: False: the kernels run it otherwise (an algorithm of ours, a wider sum): no plan
        self.direct = kernels.allreduce_is_native(self.comm, self.mpi, nbytes, self.dtype, self.op, 1.0,
                                                  sig.algorithm)
        self.count = math.prod(sig.shape)
        if self.direct:
            self.mtype, self.mop = mpi_type(self.mpi, self.dtype), mpi_op(self.mpi, self.dtype, self.op)
        self.finish = self.op is ReduceOp.AVERAGE or sig.postscale != 1.0
        self.size = executor.comm.Get_size()
        self.pool = executor.pool

    def run(self, src: np.ndarray) -> np.ndarray:
        out = self.pool.empty(self.shape, self.dtype)
        send = self.mpi.IN_PLACE if same_start(out, src) else [src, self.count, self.mtype]
        self.comm.Allreduce(send, [out, self.count, self.mtype], op=self.mop)
        if self.finish:
            finalize(out, self.op, self.size, self.sig.postscale)
        self.executor.agreed_bytes += out.nbytes
        return out


def landing(out: Any, shape: tuple[int, ...], dtype: np.dtype, avoid: np.ndarray | None = None) -> np.ndarray:
    """Where a result of ``shape`` and ``dtype`` goes ([Note: out= beyond the all-reduce]): ``out`` when it
    is a C-contiguous, writeable array of exactly that shape and dtype sharing no memory with ``avoid`` (the
    input), else a new array, so the caller tells the two apart by identity. (The sub-groups of the
    ``torch.distributed`` backend follow the same rule.)"""
    if (isinstance(out, np.ndarray) and out.shape == tuple(shape) and out.dtype == dtype
            and out.flags.c_contiguous and out.flags.writeable
            and (avoid is None or not np.may_share_memory(out, avoid))):
        return out
    return np.empty(shape, dtype=dtype)


class Executor:
    """Executes responses on one process set's communicator."""

    def __init__(self, comm: Any, mpi: Any, chunk_bytes: int, timeline: Timeline, set_id: int = 0,
                 job_ranks: list[int] | None = None) -> None:
        self.comm, self.mpi = comm, mpi
        self.chunk_bytes = chunk_bytes
        self.timeline = timeline
        #: the process set's id and its ranks in the job (None: the job's own): the timeline names
        #: rows by set and marks readiness by job rank, as errors do
        self.set_id, self.job_ranks = set_id, job_ranks
        self._buffer = np.empty(0, dtype=np.uint8)
        #: the fusion threshold of the cycle being run (set by :meth:`run`)
        self.threshold = 0
        #: bytes executed, counted alike on every rank (see [Note: agreed bytes])
        self.agreed_bytes = 0
        self.pool = ResultPool()
        #: name -> how its cached signature's single all-reduce runs (see :class:`_NativeAllreduce`)
        self._plans: dict[str, _NativeAllreduce] = {}
        #: name -> the signature it ran with once, without a plan yet
        self._once: dict[str, Signature] = {}
        #: Signature.kind -> the method that runs one such response
        self._runs: dict[int, Callable[[Response], Any]] = {
            Kind.ALLREDUCE: self._allreduce, Kind.ALLGATHER: self._allgather, Kind.BROADCAST: self._broadcast,
            Kind.REDUCESCATTER: self._reducescatter, Kind.ALLTOALL: self._alltoall, Kind.BARRIER: self._barrier}

    def _fusion_buffer(self, nbytes: int) -> np.ndarray:
        if self._buffer.size < nbytes:
            self._buffer = np.empty(nbytes, dtype=np.uint8)
        return self._buffer[:nbytes]

    def run(self, responses: list[Response], threshold: int) -> None:
        """Execute one cycle's responses in order, fusing compatible all-reduces."""
        self.threshold = threshold
        if len(responses) == 1 and responses[0].error is None:  # nothing to fuse it with
            resp = responses[0]
            self._mark_ready(resp)
            self._single(resp)
            return
        groups: dict[tuple, list[Response]] = {}
        order: list[Any] = []
        for resp in responses:
            if resp.error is not None:
                if resp.request is not None:
                    resp.request.handle.set_error(_ERRORS.get(resp.invalid, MismatchError)(resp.error))
                continue
            self._mark_ready(resp)
            sig = resp.sig
            if (sig.kind == Kind.ALLREDUCE and not is_group(sig) and threshold > 0  # (a group packs itself)
                    and self._nbytes(resp) < min(DIRECT_BYTES, threshold)
                    and sig.op != ReduceOp.ADASUM):  # Adasum's coefficients are per tensor: never fused
                key = (sig.dtype, sig.op, sig.prescale, sig.postscale, sig.algorithm)
                if key not in groups:
                    groups[key] = []
                    order.append(key)
                groups[key].append(resp)
            else:
                order.append(resp)
        for item in order:
            if isinstance(item, Response):
                self._single(item)
            else:
                self._fused(groups[item], threshold)

    @staticmethod
    def _nbytes(resp: Response) -> int:
        if resp.nbytes < 0:
            sig = resp.sig
            if is_group(sig):
                resp.nbytes = sum(math.prod(shape) * dtype_from_code(code).itemsize for code, shape in sig.layout)
            else:
                resp.nbytes = math.prod(sig.shape) * dtype_from_code(sig.dtype).itemsize
        return resp.nbytes

    @staticmethod
    def _batches(sizes: list[int], threshold: int) -> list[tuple[int, int]]:
        """``[start, end)`` runs of ``sizes`` of at most ``threshold`` bytes each (at least one item)."""
        out, start = [], 0
        while start < len(sizes):
            total, end = 0, start
            while end < len(sizes) and (end == start or total + sizes[end] <= threshold):
                total += sizes[end]
                end += 1
            out.append((start, end))
            start = end
        return out

    def _mark_ready(self, resp: Response) -> None:
        tl = self.timeline
        if not tl.active:
            return
        name, ranks = row(self.set_id, resp.name), self.job_ranks
        for r, t in sorted((resp.ready_times or {}).items(), key=lambda kv: kv[1]):
            tl.mark(name, f"rank {r if ranks is None else ranks[r]} ready", t)  # (job ranks: before 2026-12-07
        tl.end(name, "NEGOTIATE_" + Kind(resp.sig.kind).name)  # the set's, 'rank 1' for job rank 2)
        tl.begin(name, "QUEUE")

    @staticmethod
    def _input(resp: Response) -> np.ndarray:
        if resp.request is not None:
            return resp.request.array.reshape(-1)
        return identity_like(resp.sig).reshape(-1)

    @staticmethod
    def _kernel_prescale(sig: Signature) -> float:
        """The prescale factor the all-reduce kernels apply: none, because :meth:`_scaled` applied it
        (Adasum keeps its own; its identity, zeros, scales to zeros)."""
        return sig.prescale if ReduceOp(sig.op) is ReduceOp.ADASUM else 1.0

    @staticmethod
    def _scaled(src: np.ndarray, sig: Signature, joined: bool) -> np.ndarray:
        """``src`` times the prescale factor, in its dtype, as the kernels scale; an identity (the
        contribution of a rank that joined) is left as it is. [Note: a joined rank's identity is not
        scaled] Scaled in the kernel with the real inputs, the identity of Product became the factor
        and Min's and Max's flipped sign with a negative one (a joined rank turned Min's -4 into
        -inf). Every rank scales here and passes 1.0 to the kernel alike, so the kernels choose the
        same algorithm on every rank."""
        if joined or sig.prescale == 1.0 or ReduceOp(sig.op) is ReduceOp.ADASUM:
            return src
        out = np.empty_like(src)
        prescale(src, sig.prescale, out)
        return out

    def _phase(self, resps: list[Response], phase: str, begin: bool) -> None:
        if self.timeline.active:
            for resp in resps:
                (self.timeline.begin if begin else self.timeline.end)(row(self.set_id, resp.name), phase)
            if begin:
                self.timeline.flush()  # on disk before a collective that may hang

    def _fused(self, resps: list[Response], threshold: int) -> None:
        # split the group into buffers of at most `threshold` bytes
        sizes = [self._nbytes(resp) for resp in resps]
        for start, end in self._batches(sizes, threshold):
            batch = resps[start:end]
            if len(batch) == 1:
                self._single(batch[0])
            else:
                self._fused_batch(batch, sum(sizes[start:end]))

    def _packed(self, srcs: Sequence[np.ndarray], dtype: np.dtype, sig: Signature,
                timed: list[Response]) -> np.ndarray:
        """All-reduce the flat ``srcs`` of ``dtype`` through the fusion buffer; returns one new (pooled)
        array holding every result back to back. ``timed``: the responses whose timeline phases these are."""
        count = sum(src.size for src in srcs)
        buf = self._fusion_buffer(count * dtype.itemsize).view(dtype)
        self._phase(timed, "MEMCPY_IN_FUSION_BUFFER", True)
        np.concatenate(srcs, axis=None, out=buf[:count])  # axis=None: each source flattened
        self._phase(timed, "MEMCPY_IN_FUSION_BUFFER", False)
        self._phase(timed, "ALLREDUCE", True)
        kernels.allreduce(self.comm, self.mpi, buf, buf, ReduceOp(sig.op), self._kernel_prescale(sig),
                          sig.postscale, sig.algorithm, self.chunk_bytes)
        self._phase(timed, "ALLREDUCE", False)
        self._phase(timed, "MEMCPY_OUT_FUSION_BUFFER", True)
        # one copy out of the fusion buffer; each result is a view of it (or the caller's out=)
        results = self.pool.empty((count,), dtype)
        np.copyto(results, buf[:count])
        self._phase(timed, "MEMCPY_OUT_FUSION_BUFFER", False)
        return results

    def _fused_batch(self, batch: list[Response], total: int) -> None:
        sig = batch[0].sig
        self._phase(batch, "QUEUE", False)
        srcs = [self._input(resp) for resp in batch]
        scaled = [self._scaled(src, sig, resp.request is None) for resp, src in zip(batch, srcs, strict=True)]
        results = self._packed(scaled, dtype_from_code(sig.dtype), sig, batch)
        off = 0
        for resp, src in zip(batch, srcs, strict=True):
            req, n = resp.request, src.size
            if req is not None:
                if req.out is not None:
                    req.out.reshape(-1)[:] = results[off:off + n]
                    req.handle.set_result(req.out)
                else:
                    req.handle.set_result(results[off:off + n].reshape(req.array.shape))
            off += n
        self.agreed_bytes += total

    def _grouped(self, resp: Response) -> list[np.ndarray]:
        """A grouped request's results, one per member (see [Note: grouped requests])."""
        sig, req = resp.sig, resp.request
        layout = sig.layout
        if req is not None and req.members is not None:
            members: Sequence[np.ndarray] = [self._scaled(m, sig, False) for m in req.members]
        else:  # this rank joined: the op's identity for every member
            members = [identity(dtype_from_code(code), shape, sig.op) for code, shape in layout]
        limit = min(DIRECT_BYTES, self.threshold)  # (Adasum never comes as a group: frontend)
        results = GroupResult([None] * len(layout))
        by_dtype: dict[int, list[int]] = {}
        for i, (code, _) in enumerate(layout):
            by_dtype.setdefault(code, []).append(i)
        for code, idx in by_dtype.items():
            dtype = dtype_from_code(code)
            sizes = [math.prod(layout[i][1]) * dtype.itemsize for i in idx]
            self.agreed_bytes += sum(sizes)
            small, small_bytes = [], []
            for i, nbytes in zip(idx, sizes, strict=True):
                if nbytes < limit:
                    small.append(i)
                    small_bytes.append(nbytes)
                    continue
                out = self.pool.empty(layout[i][1], dtype)
                kernels.allreduce(self.comm, self.mpi, members[i].reshape(-1), out.reshape(-1), ReduceOp(sig.op),
                                  self._kernel_prescale(sig), sig.postscale, sig.algorithm, self.chunk_bytes)
                results[i] = out
            for start, end in self._batches(small_bytes, self.threshold):
                batch = small[start:end]
                flat = self._packed([members[i] for i in batch], dtype, sig, [])
                results.packed.append((tuple(batch), flat))
                off = 0
                for i in batch:
                    shape = layout[i][1]
                    n = members[i].size
                    view = flat[off:off + n]
                    results[i] = view if len(shape) == 1 else view.reshape(shape)
                    off += n
        return results

    def _single(self, resp: Response) -> None:
        run = self._runs[resp.sig.kind]
        if not self.timeline.active:
            result = run(resp)
        else:
            kind = Kind(resp.sig.kind).name
            self._phase([resp], "QUEUE", False)
            self._phase([resp], kind, True)
            try:
                result = run(resp)
            finally:
                self._phase([resp], kind, False)
        if resp.request is not None:
            resp.request.handle.set_result(result)

    def _allreduce(self, resp: Response) -> np.ndarray | list[np.ndarray]:
        if is_group(resp.sig):
            return self._grouped(resp)
        sig, req = resp.sig, resp.request
        if req is not None and req.out is None:
            plan = self._plans.get(resp.name)
            if plan is not None and plan.direct and (plan.sig is sig or plan.sig == sig):
                return plan.run(req.array)
        src = self._scaled(self._input(resp), sig, req is None)
        out = req.out if (req is not None and req.out is not None) else self.pool.empty(
            sig.shape, dtype_from_code(sig.dtype))
        if req is not None and req.out is not None and overlaps_partly(out, src):
            src = src.copy()  # (see overlaps_partly: the engine's out= got wrong sums before 2026-12-07)
        kernels.allreduce(self.comm, self.mpi, src, out.reshape(-1), ReduceOp(sig.op), self._kernel_prescale(sig),
                          sig.postscale, sig.algorithm, self.chunk_bytes)
        self.agreed_bytes += out.nbytes
        if req is not None and req.out is None and sig.prescale == 1.0:  # (asked after the kernel's first run)
            plan = self._plans.get(resp.name)
            if plan is None or plan.sig != sig:
                if self._once.pop(resp.name, None) == sig:  # its second run with this signature
                    if len(self._plans) >= _PLANS:
                        self._plans.clear()
                    self._plans[resp.name] = _NativeAllreduce(self, sig, out.nbytes)
                else:
                    if len(self._once) >= _PLANS:
                        self._once.clear()
                    self._once[resp.name] = sig
        return out

    def _allgather(self, resp: Response) -> np.ndarray:
        sig = resp.sig
        dtype = dtype_from_code(sig.dtype)
        inp, req = self._input(resp), resp.request
        row_elems = int(np.prod(sig.shape, dtype=np.int64))
        if row_elems:
            first = inp.size // row_elems
        else:  # rows of zero elements ((3, 0)): their count is in the shape only
            first = (req.array.shape[0] if req.array.ndim else 1) if req is not None else 0
        mine: np.ndarray = inp.reshape((first, *sig.shape))
        rows = np.empty(self.comm.Get_size(), dtype=np.int64)
        self.comm.Allgather(np.array([mine.shape[0]], dtype=np.int64), rows)
        row_bytes = int(np.prod(sig.shape, dtype=np.int64)) * dtype.itemsize
        out = landing(req.out if req is not None else None, (int(rows.sum()), *sig.shape), dtype)
        if np.may_share_memory(mine, out):  # (an input inside the caller's out=: MPI takes no overlap)
            mine = mine.copy()
        kernels.allgatherv(self.comm, self.mpi, mine, out, [int(r) * row_bytes for r in rows],
                           sig.algorithm, self.chunk_bytes)
        self.agreed_bytes += out.nbytes  # the gathered rows: the same on every rank
        return out

    def _broadcast(self, resp: Response) -> np.ndarray:
        sig, req = resp.sig, resp.request
        out = landing(req.out if req is not None else None, sig.shape, dtype_from_code(sig.dtype))
        src = self._input(resp)
        if self.comm.Get_rank() == sig.root and not same_start(out, src):  # (the others' out is overwritten)
            np.copyto(out.reshape(-1), src)
        kernels.broadcast(self.comm, self.mpi, out, sig.root, sig.algorithm, self.chunk_bytes)
        self.agreed_bytes += out.nbytes
        return out

    def _reducescatter(self, resp: Response) -> np.ndarray:
        sig = resp.sig
        shape = sig.shape
        n, r = self.comm.Get_size(), self.comm.Get_rank()
        base, extra = divmod(shape[0], n)
        rows = [base + (1 if i < extra else 0) for i in range(n)]
        row_elems = int(np.prod(shape[1:], dtype=np.int64))
        src = self._input(resp)
        req = resp.request
        out = landing(req.out if req is not None else None, (rows[r], *shape[1:]), dtype_from_code(sig.dtype), src)
        kernels.reducescatter(self.comm, self.mpi, src, out.reshape(-1),
                              [k * row_elems for k in rows], ReduceOp(sig.op), sig.prescale, sig.postscale,
                              sig.algorithm, self.chunk_bytes)
        self.agreed_bytes += self._nbytes(resp)  # the whole input: this rank's rows may differ
        return out

    def _alltoall(self, resp: Response) -> tuple[np.ndarray, np.ndarray]:
        sig, req = resp.sig, resp.request
        if req is None or req.splits is None:
            raise AssertionError(f"alltoall {resp.name!r} reached the executor without this rank's "
                                 "request (a joined rank is refused before: controller [Note: join])")
        dtype = dtype_from_code(sig.dtype)
        n = self.comm.Get_size()
        splits = np.asarray(req.splits, dtype=np.int64)
        every = np.empty((n, n), dtype=np.int64)  # every rank's splits: the algorithm's choice is agreed
        self.comm.Allgather(splits, every)
        recv = every[:, self.comm.Get_rank()].copy()
        row_bytes = int(np.prod(sig.shape, dtype=np.int64)) * dtype.itemsize
        out = np.empty((int(recv.sum()), *sig.shape), dtype=dtype)
        kernels.alltoallv(self.comm, self.mpi, self._input(resp), [int(v) * row_bytes for v in splits],
                          out, [int(v) * row_bytes for v in recv], sig.algorithm, self.chunk_bytes,
                          largest=kernels.alltoall_largest(every, row_bytes))
        self.agreed_bytes += row_bytes  # one row: the received volume differs per rank
        return out, recv

    def _barrier(self, resp: Response) -> Any:
        req = resp.request
        return req.action() if req is not None and req.action is not None else None
