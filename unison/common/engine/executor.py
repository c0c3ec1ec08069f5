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

[Note: agreed bytes] ``agreed_bytes`` counts the bytes of executed responses from
values every rank knows alike (signatures, gathered row counts), never from what
only this rank received: the autotuner decides its sample boundaries from it, and
ranks that decided differently would enter different collectives. An alltoall
counts one row per call (how much each rank receives is known to it alone).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from unison.collectives import kernels
from unison.common.dtypes import dtype_from_code
from unison.common.engine.controller import Response
from unison.common.engine.errors import JoinError
from unison.common.engine.requests import Kind, identity_like
from unison.common.engine.timeline import Timeline
from unison.common.exceptions import CollectiveError, InvalidArgumentError, MismatchError
from unison.common.ops import ReduceOp
from unison.common.pool import ResultPool

__all__ = ["Executor"]

#: Tensors at least this large skip the fusion buffer (see [Note: fusion buffer]).
DIRECT_BYTES = 1 << 20
#: Response.invalid -> the exception raised on every rank
_ERRORS = {"type": CollectiveError, "value": InvalidArgumentError, "join": JoinError}


class Executor:
    """Executes responses on one process set's communicator."""

    def __init__(self, comm: Any, mpi: Any, chunk_bytes: int, timeline: Timeline) -> None:
        self.comm, self.mpi = comm, mpi
        self.chunk_bytes = chunk_bytes
        self.timeline = timeline
        self._buffer = np.empty(0, dtype=np.uint8)
        #: bytes executed, counted alike on every rank (see [Note: agreed bytes])
        self.agreed_bytes = 0
        self.pool = ResultPool()

    def _fusion_buffer(self, nbytes: int) -> np.ndarray:
        if self._buffer.size < nbytes:
            self._buffer = np.empty(nbytes, dtype=np.uint8)
        return self._buffer[:nbytes]

    def run(self, responses: list[Response], threshold: int) -> None:
        """Execute one cycle's responses in order, fusing compatible all-reduces."""
        groups: dict[tuple, list[Response]] = {}
        order: list[Any] = []
        for resp in responses:
            if resp.error is not None:
                if resp.request is not None:
                    resp.request.handle.set_error(_ERRORS.get(resp.invalid, MismatchError)(resp.error))
                continue
            self._mark_ready(resp)
            sig = resp.sig
            nbytes = self._nbytes(resp)
            if (sig.kind == Kind.ALLREDUCE and threshold > 0 and nbytes < min(DIRECT_BYTES, threshold)
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
            resp.nbytes = math.prod(resp.sig.shape) * dtype_from_code(resp.sig.dtype).itemsize
        return resp.nbytes

    def _mark_ready(self, resp: Response) -> None:
        tl = self.timeline
        if not tl.active:
            return
        for r, t in sorted((resp.ready_times or {}).items(), key=lambda kv: kv[1]):
            tl.mark(resp.name, f"rank {r} ready", t)
        tl.end(resp.name, "NEGOTIATE_" + Kind(resp.sig.kind).name)
        tl.begin(resp.name, "QUEUE")

    @staticmethod
    def _input(resp: Response) -> np.ndarray:
        if resp.request is not None:
            return resp.request.array.reshape(-1)
        return identity_like(resp.sig).reshape(-1)

    def _phase(self, resps: list[Response], phase: str, begin: bool) -> None:
        if self.timeline.active:
            for resp in resps:
                (self.timeline.begin if begin else self.timeline.end)(resp.name, phase)

    def _fused(self, resps: list[Response], threshold: int) -> None:
        start = 0
        while start < len(resps):  # split the group into buffers of at most `threshold` bytes
            total, end = 0, start
            while end < len(resps) and (end == start or total + self._nbytes(resps[end]) <= threshold):
                total += self._nbytes(resps[end])
                end += 1
            batch = resps[start:end]
            if len(batch) == 1:
                self._single(batch[0])
            else:
                self._fused_batch(batch, total)
            start = end

    def _fused_batch(self, batch: list[Response], total: int) -> None:
        sig = batch[0].sig
        dtype = dtype_from_code(sig.dtype)
        buf = self._fusion_buffer(total).view(dtype)
        self._phase(batch, "QUEUE", False)
        self._phase(batch, "MEMCPY_IN_FUSION_BUFFER", True)
        srcs = [self._input(resp) for resp in batch]
        count = total // dtype.itemsize
        np.concatenate(srcs, out=buf[:count])
        self._phase(batch, "MEMCPY_IN_FUSION_BUFFER", False)
        self._phase(batch, "ALLREDUCE", True)
        kernels.allreduce(self.comm, self.mpi, buf, buf, ReduceOp(sig.op), sig.prescale, sig.postscale,
                          sig.algorithm, self.chunk_bytes)
        self._phase(batch, "ALLREDUCE", False)
        self._phase(batch, "MEMCPY_OUT_FUSION_BUFFER", True)
        # one copy out of the fusion buffer; each result is a view of it (or the caller's out=)
        results = self.pool.empty((count,), dtype)
        np.copyto(results, buf[:count])
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
        self._phase(batch, "MEMCPY_OUT_FUSION_BUFFER", False)
        self.agreed_bytes += total

    def _single(self, resp: Response) -> None:
        kind = Kind(resp.sig.kind)
        self._phase([resp], "QUEUE", False)
        self._phase([resp], kind.name, True)
        try:
            result = getattr(self, "_" + kind.name.lower())(resp)
        finally:
            self._phase([resp], kind.name, False)
        if resp.request is not None:
            resp.request.handle.set_result(result)

    def _allreduce(self, resp: Response) -> np.ndarray:
        sig, req = resp.sig, resp.request
        src = self._input(resp)
        out = req.out if (req is not None and req.out is not None) else self.pool.empty(
            sig.shape, dtype_from_code(sig.dtype))
        kernels.allreduce(self.comm, self.mpi, src, out.reshape(-1), ReduceOp(sig.op), sig.prescale,
                          sig.postscale, sig.algorithm, self.chunk_bytes)
        self.agreed_bytes += out.nbytes
        return out

    def _allgather(self, resp: Response) -> np.ndarray:
        sig = resp.sig
        dtype = dtype_from_code(sig.dtype)
        mine: np.ndarray = self._input(resp).reshape((-1, *sig.shape))
        rows = np.empty(self.comm.Get_size(), dtype=np.int64)
        self.comm.Allgather(np.array([mine.shape[0]], dtype=np.int64), rows)
        row_bytes = int(np.prod(sig.shape, dtype=np.int64)) * dtype.itemsize
        out = np.empty((int(rows.sum()), *sig.shape), dtype=dtype)
        kernels.allgatherv(self.comm, self.mpi, mine, out, [int(r) * row_bytes for r in rows],
                           sig.algorithm, self.chunk_bytes)
        self.agreed_bytes += out.nbytes  # the gathered rows: the same on every rank
        return out

    def _broadcast(self, resp: Response) -> np.ndarray:
        sig = resp.sig
        out = np.array(self._input(resp).reshape(sig.shape), order="C")
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
        out = np.empty((rows[r], *shape[1:]), dtype=dtype_from_code(sig.dtype))
        kernels.reducescatter(self.comm, self.mpi, self._input(resp), out.reshape(-1),
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
        recv = np.empty(n, dtype=np.int64)
        self.comm.Alltoall(splits, recv)
        row_bytes = int(np.prod(sig.shape, dtype=np.int64)) * dtype.itemsize
        out = np.empty((int(recv.sum()), *sig.shape), dtype=dtype)
        kernels.alltoallv(self.comm, self.mpi, self._input(resp), [int(v) * row_bytes for v in splits],
                          out, [int(v) * row_bytes for v in recv], sig.algorithm, self.chunk_bytes)
        self.agreed_bytes += row_bytes  # one row: the received volume differs per rank
        return out, recv

    def _barrier(self, resp: Response) -> Any:
        req = resp.request
        return req.action() if req is not None and req.action is not None else None
