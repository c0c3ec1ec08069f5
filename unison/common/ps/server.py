"""The server side of SSP/ASP tables: a thread per server rank answering the workers' requests.

[Note: table messages]
Requests travel on the table's request communicator, replies on its reply communicator (both
``Dup``s of the table's, so they never match other traffic). A request is one byte buffer: an
int64 header ``[op, request id, value, n]`` then ``n`` int64 storage indices, then for a push
``n`` gradient rows. ``PULL``'s value is the slowest clock the reply must wait for (SSP); the
reply, tagged with the request id, is an int64 (the slowest clock when served) then the rows.
``CLOCK``'s value is the worker's new clock; ``FIN`` says the worker sends nothing more. A
worker's messages to one server arrive in the order sent (MPI's non-overtaking rule: same
source, communicator and tag), so a clock message is applied after that worker's pushes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from unison.common.engine.errors import process_failure
from unison.common.ps.optimizers import rows_of
from unison.common.ps.shard import Shard

__all__ = ["Server", "PULL", "PUSH", "CLOCK", "FIN", "MARK", "DONE", "ACK_TAG", "ACK_LEN", "HEADER", "pack",
           "NO_WAIT", "BARRIER_MARK", "SAVE_MARK", "LOAD_MARK", "MARK_NAMES", "mismatch_code", "mismatch_of",
           "INPUT_ERROR_TAG", "APPLY_ERROR_TAG", "apply_failure", "post"]

logger = logging.getLogger(__name__)

PULL, PUSH, CLOCK, FIN, MARK = 1, 2, 3, 4, 5
ACK_TAG = 32001  # replies to MARK (request ids stay below 30001)
#: what a worker's MARK marks (its request field): the operations whose marks must meet
BARRIER_MARK, SAVE_MARK, LOAD_MARK = 1, 2, 3
MARK_NAMES = {BARRIER_MARK: "barrier()", SAVE_MARK: "save()", LOAD_MARK: "load()"}
#: a MARK's acknowledgement: [the mark, the clock every worker has after it (or -1 - a closed worker's index),
#: 0 or the encoded pair of operations that met at it (:func:`mismatch_code`), the bad-input errors the workers
#: had posted by their marks, all together (a MARK carries its worker's count as its one storage word: table
#: [Note: errors without collectives]), the apply() failures this server had posted by then (each to every
#: worker: the pushes before the marks are all applied, or dropped, when it answers)]
ACK_LEN = 5
#: tags on the table's error communicator: a worker's bad input (raised on that worker too), a shard's apply()
#: failure posted by its server thread (raised on no rank until the message arrives)
INPUT_ERROR_TAG, APPLY_ERROR_TAG = 1, 2


def apply_failure(table: str, exc: BaseException, source: int | None = None) -> str:
    """What a shard whose optimizer's ``apply()`` raised ``exc`` (on a push of rank ``source``, when one worker's)
    reports, after ``"rank r: "``; the update it was applying is dropped ([Note: a failed apply()] in table.py)."""
    push = "" if source is None else f" on a push of rank {source}"
    return (f"table {table!r}: the optimizer's apply() failed on this rank's shard{push} ({type(exc).__name__}: "
            f"{exc}); that update of the shard's rows was dropped and the table goes on (fix the gradients or the "
            "optimizer)")


def post(err: Any, mpi: Any, message: str, ranks: list[int], tag: int) -> list[tuple[Any, np.ndarray]]:
    """Send ``message`` to each of ``ranks`` on the table's error communicator; the sends (request, buffer)."""
    data = np.frombuffer(message.encode("utf-8"), np.uint8).copy()
    return [(err.Isend([data, mpi.BYTE], r, tag), data) for r in ranks]


def mismatch_code(kinds: np.ndarray) -> int:
    """0 when every worker marked the same operation, else ``1 + (w * 4 + kinds[w]) * 4 + kinds[0]`` for the
    first worker index ``w`` whose operation differs from worker 0's (see :func:`mismatch_of`)."""
    other = np.flatnonzero(kinds != kinds[0])
    if other.size == 0:
        return 0
    w = int(other[0])
    return 1 + (w * 4 + int(kinds[w])) * 4 + int(kinds[0])


def mismatch_of(code: int) -> tuple[int, int, int]:
    """(worker 0's operation, the worker index w, w's operation) of a nonzero :func:`mismatch_code`."""
    code -= 1
    return code % 4, code // 16, (code // 4) % 4
DONE = 1 << 62  # the clock of a worker that has closed the table: nobody waits for it
HEADER = 4  # int64 words
NO_WAIT = -(1 << 62)


def pack(op: int, request: int, value: int, storage: np.ndarray, grads: np.ndarray | None = None) -> np.ndarray:
    """One request buffer (uint8)."""
    head = np.array([op, request, value, len(storage)], np.int64)
    parts = [head.view(np.uint8), np.ascontiguousarray(storage, np.int64).view(np.uint8)]
    if grads is not None:
        parts.append(np.ascontiguousarray(grads).reshape(-1).view(np.uint8))
    return np.concatenate(parts)


class Server:
    """Serve one shard to the workers over ``req``/``rep`` until every remote worker has sent FIN."""

    def __init__(
        self, shard: Shard, req: Any, rep: Any, mpi: Any, worker_of: dict[int, int], remote_workers: int,
        err: Any = None, name: str = "",
    ) -> None:
        self.shard, self.req, self.rep, self.mpi = shard, req, rep, mpi
        self.err, self.name = err, name  # the table's error communicator and name ([Note: a failed apply()])
        self.worker_of = worker_of  # table rank -> worker index
        self.remaining = remote_workers
        self.deferred: list[tuple[int, int, int, np.ndarray]] = []  # (source, request, need, storage)
        self.sends: list[tuple[Any, np.ndarray]] = []
        self.error: BaseException | None = None
        #: apply() failures posted to every worker, and their sends (completed by the table's close, after the
        #: workers received them: a message to this rank's own worker may wait for its receive)
        self.failures = 0
        self.error_sends: list[tuple[Any, np.ndarray]] = []
        self.stop = threading.Event()
        self.requests = 0
        self.marks = np.zeros(len(set(worker_of.values())), np.int64)  # the last save mark of each worker
        self.kinds = np.zeros_like(self.marks)  # what each worker's last mark marks (BARRIER_MARK, ...)
        self.pending_mark = 0  # a barrier some workers are waiting in (its mark), or 0
        self.failed = np.zeros_like(self.marks)  # the last mark each worker was told it cannot complete
        self.posted = np.zeros_like(self.marks)  # the errors each worker had posted by its last mark
        #: a dedicated server's part of the workers' save() or load() (SAVE_MARK or LOAD_MARK), called on the
        #: serving thread once every worker's mark is in and acknowledged; True stops serve() there (the table's
        #: [Note: a dedicated server checkpoints with its workers])
        self.on_checkpoint: Callable[[int], bool] | None = None
        self.paused = False
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="unison-ps-server", daemon=True)
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def _run(self) -> None:
        try:
            self.serve()
        except BaseException as exc:  # surfaced to the worker thread on its next call
            self.error = exc
            if self.stop.is_set() or process_failure(exc, self.mpi) is not None:  # (a lost table: failure.py)
                logger.debug("the sharded-table server thread ended on a rank's failure", exc_info=True)
            else:
                logger.exception("the sharded-table server thread failed")

    def serve(self) -> None:
        status = self.mpi.Status()
        idle = 0.0
        self.paused = False
        while self.remaining > 0 and not self.stop.is_set() and not self.paused:
            if self.req.Iprobe(self.mpi.ANY_SOURCE, self.mpi.ANY_TAG, status):
                idle = 0.0
                count = status.Get_count(self.mpi.BYTE)
                buf = np.empty(count, np.uint8)
                self.req.Recv([buf, self.mpi.BYTE], status.Get_source(), status.Get_tag())
                self._handle(status.Get_source(), buf)
                continue
            if self.deferred:  # the local worker advances its clock without a message: look again
                self._answer_ready()
            if self.pending_mark:  # (the local worker closes without a message too)
                self._fail_barrier_if_closed()
            self._reap()
            time.sleep(idle)
            idle = min(1e-3, idle * 2 + 2e-5)
        if self.paused:  # (serve() goes on from here when called again)
            return
        # pulls still deferred (a worker stopped waiting for them when a peer's error reached it: table
        # [Note: errors without collectives]) are answered once the local worker, closing, is done too
        while self.deferred and not self.stop.is_set():
            self._answer_ready()
            self._reap()
            time.sleep(1e-3)
        self._reap(wait=True)

    def _handle(self, source: int, buf: np.ndarray) -> None:
        self.requests += 1
        op, request, value, n = (int(x) for x in buf[: HEADER * 8].view(np.int64))
        storage = buf[HEADER * 8 : (HEADER + n) * 8].view(np.int64)
        if op == PULL:
            self.deferred.append((source, request, value, storage))
            self._answer_ready()
        elif op == PUSH:
            grads = buf[(HEADER + n) * 8 :].view(self.shard.dtype).reshape(n, self.shard.dim)
            try:
                self.shard.apply(storage, grads)
            except Exception as exc:  # noqa: BLE001 - a user's optimizer may raise anything: every worker raises it
                self._post_failure(source, exc)
        elif op == CLOCK:
            self.shard.advance(self.worker_of[source], value)
            self._answer_ready()
        elif op == FIN:
            self.remaining -= 1
            self.shard.advance(self.worker_of[source], DONE)
            self._answer_ready()
            self._fail_barrier_if_closed()
        elif op == MARK:  # a barrier: acknowledge to every worker once all have marked (their pushes are in)
            self.marks[self.worker_of[source]] = value
            self.kinds[self.worker_of[source]] = request
            self.posted[self.worker_of[source]] = int(storage[0]) if n else 0
            self.shard.park(self.worker_of[source])  # (table [Note: clocks meet at a barrier])
            if int(self.marks.min()) >= value:
                self.pending_mark = 0
                # the mark, the clock every worker has now, and whether they all marked the same operation
                code = mismatch_code(self.kinds)
                ack = np.array([value, self.shard.meet(), code, self.posted.sum(), self.failures], np.int64)
                for rank in self.worker_of:
                    self.sends.append((self.rep.Isend([ack, self.mpi.INT64_T], rank, ACK_TAG), ack))
                if self.on_checkpoint is not None and not code and request in (SAVE_MARK, LOAD_MARK):
                    self._reap(wait=True)
                    self.paused = self.on_checkpoint(request)
            else:
                self.pending_mark = value
                self._fail_barrier_if_closed()
            self._answer_ready()  # a pull deferred for the parked worker's clock goes now
        else:
            raise RuntimeError(f"sharded table: unknown request op {op} from rank {source}")

    def _post_failure(self, source: int, exc: Exception) -> None:
        """The optimizer's apply() raised on a push of ``source``: drop that update, tell every worker (this
        rank's own too) on the error communicator, and serve on ([Note: a failed apply()] in table.py; before
        2026-12-07 this thread died and every worker's next barrier waited for ever)."""
        if self.err is None:  # (a table always gives one; a bare Server as before)
            raise exc
        message = f"rank {self.req.Get_rank()}: {apply_failure(self.name, exc, source)}"
        logger.warning("%s", message, exc_info=exc)
        self.failures += 1  # (read by this thread's acknowledgements, and by the worker's close after join())
        self.error_sends += post(self.err, self.mpi, message, list(self.worker_of), APPLY_ERROR_TAG)

    def _fail_barrier_if_closed(self) -> None:
        """A worker closed the table while others wait in a barrier it will never join: answer those with
        ``[mark, -1 - the closed worker's index]`` (they raise; before 2026-12-06 they waited for ever)."""
        if not self.pending_mark:
            return
        with self.shard.cond:
            closed = np.flatnonzero(self.shard.clocks >= DONE)
        absent = [int(w) for w in closed if self.marks[w] < self.pending_mark]  # (not one that raised and closed)
        if not absent:
            return
        ack = np.array([self.pending_mark, -1 - absent[0], 0, 0, 0], np.int64)
        for rank, w in self.worker_of.items():
            if self.marks[w] == self.pending_mark and self.failed[w] < self.pending_mark:
                self.failed[w] = self.pending_mark  # answered once
                self.sends.append((self.rep.Isend([ack, self.mpi.INT64_T], rank, ACK_TAG), ack))
                # out of the barrier it raised in, the worker holds the others back again: left parked, it was
                # skipped by every hold-back, and the workers that went on ran as under ASP (an audit, 2026-12-06)
                self.shard.unpark(w)
        self.pending_mark = 0  # (a worker that marks later sets it again, and is answered then)

    def _answer_ready(self) -> None:
        keep = []
        with self.shard.cond:
            slowest = self.shard.slowest()
            everyone_parked = bool(self.shard.parked.all())  # (Shard.ready, computed once for every request)
            for source, request, need, storage in self.deferred:
                if slowest < need and not everyone_parked:
                    keep.append((source, request, need, storage))
                    continue
                rows = rows_of(self.shard.weights, storage - self.shard.lo)
                reply = np.concatenate(
                    [np.array([slowest], np.int64).view(np.uint8), rows.reshape(-1).view(np.uint8)]
                )
                self.sends.append((self.rep.Isend([reply, self.mpi.BYTE], source, request), reply))
        self.deferred = keep

    def _reap(self, wait: bool = False) -> None:
        if not self.sends:
            return
        if wait:
            self.mpi.Request.Waitall([r for r, _ in self.sends])
            self.sends = []
            return
        self.sends = [(r, b) for r, b in self.sends if not r.Test()]
