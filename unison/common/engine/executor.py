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
A joined rank contributes the op's identity for names it never submitted.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from unison.collectives import kernels
from unison.common.dtypes import dtype_from_code
from unison.common.engine.controller import Response
from unison.common.engine.requests import Kind, identity_like
from unison.common.engine.timeline import Timeline
from unison.common.exceptions import CollectiveError, InvalidArgumentError, MismatchError
from unison.common.ops import ReduceOp
from unison.common.pool import ResultPool

__all__ = ["Executor"]

#: Tensors at least this large skip the fusion buffer (see [Note: fusion buffer]).
DIRECT_BYTES = 1 << 20


class Executor:
    """Executes responses on one process set's communicator."""

    def __init__(self, comm: Any, mpi: Any, chunk_bytes: int, timeline: Timeline) -> None:
        self.comm, self.mpi = comm, mpi
        self.chunk_bytes = chunk_bytes
        self.timeline = timeline
        self._buffer = np.empty(0, dtype=np.uint8)
        self.bytes_done = 0
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
                    cls = {"type": CollectiveError, "value": InvalidArgumentError}.get(resp.invalid,
                                                                                        MismatchError)
                    resp.request.handle.set_error(cls(resp.error))
                continue
            self._mark_ready(resp)
            kind = resp.sig[0]
            nbytes = self._nbytes(resp)
            if kind == Kind.ALLREDUCE and threshold > 0 and nbytes < min(DIRECT_BYTES, threshold):
                key = (resp.sig[1], resp.sig[3], resp.sig[5], resp.sig[6], resp.sig[8])
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
            resp.nbytes = math.prod(resp.sig[2]) * dtype_from_code(resp.sig[1]).itemsize
        return resp.nbytes

    def _mark_ready(self, resp: Response) -> None:
        tl = self.timeline
        if not tl.active:
            return
        for r, t in sorted((resp.ready_times or {}).items(), key=lambda kv: kv[1]):
            tl.mark(resp.name, f"rank {r} ready", t)
        tl.end(resp.name, "NEGOTIATE_" + Kind(resp.sig[0]).name)
        tl.begin(resp.name, "QUEUE")

    def _input(self, resp: Response, dim0: int = 0) -> np.ndarray:
        if resp.request is not None:
            return resp.request.array.reshape(-1)
        return identity_like(resp.sig, dim0).reshape(-1)

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
        _, dtc, _, op, _, pre, post, _, algorithm = batch[0].sig
        dtype = dtype_from_code(dtc)
        buf = self._fusion_buffer(total).view(dtype)
        self._phase(batch, "QUEUE", False)
        self._phase(batch, "MEMCPY_IN_FUSION_BUFFER", True)
        srcs = [self._input(resp) for resp in batch]
        count = total // dtype.itemsize
        np.concatenate(srcs, out=buf[:count])
        self._phase(batch, "MEMCPY_IN_FUSION_BUFFER", False)
        self._phase(batch, "ALLREDUCE", True)
        kernels.allreduce(self.comm, self.mpi, buf, buf, ReduceOp(op), pre, post, algorithm,
                          self.chunk_bytes)
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
        self.bytes_done += total

    def _single(self, resp: Response) -> None:
        kind = Kind(resp.sig[0])
        self._phase([resp], "QUEUE", False)
        self._phase([resp], kind.name, True)
        try:
            result = getattr(self, "_" + kind.name.lower())(resp)
        finally:
            self._phase([resp], kind.name, False)
        if resp.request is not None:
            resp.request.handle.set_result(result)

    def _allreduce(self, resp: Response) -> np.ndarray:
        _, dtc, shape, op, _, pre, post, _, algorithm = resp.sig
        req = resp.request
        src = self._input(resp)
        out = req.out if (req is not None and req.out is not None) else self.pool.empty(shape,
                                                                                         dtype_from_code(dtc))
        kernels.allreduce(self.comm, self.mpi, src, out.reshape(-1), ReduceOp(op), pre, post, algorithm,
                          self.chunk_bytes)
        self.bytes_done += out.nbytes
        return out

    def _allgather(self, resp: Response) -> np.ndarray:
        _, dtc, trailing, *_ = resp.sig
        dtype = dtype_from_code(dtc)
        mine: np.ndarray = self._input(resp).reshape((-1, *trailing))
        rows = np.empty(self.comm.Get_size(), dtype=np.int64)
        self.comm.Allgather(np.array([mine.shape[0]], dtype=np.int64), rows)
        row_bytes = int(np.prod(trailing, dtype=np.int64)) * dtype.itemsize
        out = np.empty((int(rows.sum()),) + tuple(trailing), dtype=dtype)
        kernels.allgatherv(self.comm, self.mpi, mine, out, [int(r) * row_bytes for r in rows],
                           resp.sig[8], self.chunk_bytes)
        self.bytes_done += out.nbytes
        return out

    def _broadcast(self, resp: Response) -> np.ndarray:
        _, dtc, shape, _, root, *_, algorithm = resp.sig
        out = np.array(self._input(resp).reshape(shape), order="C")
        kernels.broadcast(self.comm, self.mpi, out, root, algorithm, self.chunk_bytes)
        self.bytes_done += out.nbytes
        return out

    def _reducescatter(self, resp: Response) -> np.ndarray:
        _, dtc, shape, op, _, pre, post, _, algorithm = resp.sig
        n, r = self.comm.Get_size(), self.comm.Get_rank()
        base, extra = divmod(shape[0], n)
        rows = [base + (1 if i < extra else 0) for i in range(n)]
        row_elems = int(np.prod(shape[1:], dtype=np.int64))
        out = np.empty((rows[r],) + tuple(shape[1:]), dtype=dtype_from_code(dtc))
        kernels.reducescatter(self.comm, self.mpi, self._input(resp), out.reshape(-1),
                              [k * row_elems for k in rows], ReduceOp(op), pre, post, algorithm,
                              self.chunk_bytes)
        self.bytes_done += out.nbytes * n
        return out

    def _alltoall(self, resp: Response) -> tuple[np.ndarray, np.ndarray]:
        _, dtc, trailing, *_ = resp.sig
        dtype = dtype_from_code(dtc)
        n = self.comm.Get_size()
        req = resp.request
        splits = np.asarray(req.splits if req is not None else [0] * n, dtype=np.int64)
        recv = np.empty(n, dtype=np.int64)
        self.comm.Alltoall(splits, recv)
        row_bytes = int(np.prod(trailing, dtype=np.int64)) * dtype.itemsize
        out = np.empty((int(recv.sum()),) + tuple(trailing), dtype=dtype)
        kernels.alltoallv(self.comm, self.mpi, self._input(resp), [int(v) * row_bytes for v in splits],
                          out, [int(v) * row_bytes for v in recv], resp.sig[8], self.chunk_bytes)
        self.bytes_done += out.nbytes
        return out, recv

    def _barrier(self, resp: Response) -> Any:
        req = resp.request
        return req.action() if req is not None and req.action is not None else None

