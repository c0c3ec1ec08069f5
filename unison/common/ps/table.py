"""A sharded key-value table with push/pull: every rank a worker, every (or a chosen) rank a server.

See [Note: storage order] (sharding.py), [Note: consistency models] (consistency.py),
[Note: a BSP round] (exchange.py), [Note: table messages] (server.py) and docs/embeddings.md.
"""

from __future__ import annotations

import concurrent.futures
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from unison.common import runtime
from unison.common.agreement import raise_together
from unison.common.engine.controller import wait as wait_request
from unison.common.exceptions import UnisonError, UnisonInternalError
from unison.common.ps import exchange as ex
from unison.common.ps import failure, membership
from unison.common.ps import server as sv
from unison.common.ps.consistency import Consistency, consistency_from_name
from unison.common.ps.optimizers import SGD, Optimizer, rows_of
from unison.common.ps.shard import Shard
from unison.common.ps.sharding import Sharding

__all__ = ["ShardedTable", "TableError", "TableLostError", "Handle", "get_table", "tables", "open_tables"]

logger = logging.getLogger(__name__)

_registry: dict[str, ShardedTable] = {}
_registry_lock = threading.Lock()


class TableError(UnisonError, ValueError):
    """Bad input to a sharded table, or ranks that disagree about it; raised on every rank that takes part."""


class TableLostError(UnisonInternalError, TableError):
    """A rank of the table failed: the table is lost ([Note: a table that loses a rank] in failure.py).

    A ``HorovodInternalError``, so the elastic ``run`` wrapper rolls back and resets; also a
    :class:`TableError`. Raised by every operation of the lost table until Unison is rebuilt on the
    survivors; a plain :class:`TableError` after that (the table belongs to the old world).
    """


def get_table(name: str) -> ShardedTable:
    """The open table called ``name`` on this process."""
    with _registry_lock:
        if name not in _registry:
            raise TableError(
                f"no sharded table named {name!r} exists on this rank (open tables: "
                f"{sorted(_registry)}); create it with ShardedTable(..., name={name!r}) on every rank"
            )
        return _registry[name]


def tables() -> list[str]:
    with _registry_lock:
        return sorted(_registry)


def open_tables() -> list[ShardedTable]:
    """This rank's open tables, in the order they were created."""
    with _registry_lock:
        return [t for t in _registry.values() if not t.closed]


def _close_at_shutdown(state: Any) -> None:
    """``unison.shutdown()`` (and so the interpreter's exit) closes every table this rank still has
    open as a worker, in the order they were created (the same on every rank); an elastic reset's
    rebuild does not (the tables keep their own communicators, as before).

    Under SSP/ASP a worker may finish its loop steps ahead of the others and exit; its server thread
    (a daemon) then died with it, and a slower worker's pull of rows that lived there waited for ever
    (before 2026-12-05). Closing sends this worker's FIN and keeps its server answering until every
    worker has closed. Under BSP every operation pairs across the ranks, and a rank that made one
    more (rank 0 alone printing the table with ``to_numpy()``) waited for ever in it once the others
    had exited (before 2026-12-05): their closing operation now meets it, and it raises the table's
    "different operations" error instead. The BSP tables close at once, each on a thread of its own
    (each table has its own communicator): closed one after another, the closing ranks waited in the
    first table's close for the rank whose extra operation was on a later table, which waited in that
    operation for them (until 2026-12-05)."""
    with _registry_lock:
        open_tables = [t for t in _registry.values() if not t.closed and t.is_worker]
    together = [t for t in open_tables if t.consistency.collective]
    threads = [threading.Thread(target=_close_logged, args=(t,), name=f"unison-ps-close-{t.name}", daemon=True)
               for t in together[1:]]
    for thread in threads:
        thread.start()
    for table in together[:1] + [t for t in open_tables if not t.consistency.collective]:
        _close_logged(table)
    for thread in threads:
        thread.join()


def _close_logged(table: ShardedTable) -> None:
    logger.info("table %r: closing it at shutdown (call close() on every rank to choose when)", table.name)
    try:
        table.close()
    except Exception:  # noqa: BLE001 - the other tables, and the rest of the shutdown, still run
        logger.exception("table %r: closing it at shutdown failed", table.name)


runtime.add_exit_hook(_close_at_shutdown)


class Handle:
    """An asynchronous table operation: :meth:`wait` returns its result (rows for a pull) or raises."""

    def __init__(self, future: concurrent.futures.Future[Any], table: ShardedTable) -> None:
        self._future = future
        self._table = table

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Any:
        try:
            return self._future.result(timeout)
        except concurrent.futures.CancelledError:
            if self._table._lost is None:
                raise
            raise failure.lost_error(self._table) from None  # queued behind the operation that lost the table


def _sum_by(inverse: np.ndarray, rows: np.ndarray, groups: int) -> np.ndarray:
    """``out[j] = sum of rows[i] with inverse[i] == j``: a sort and ``reduceat`` (``np.add.at`` is ~10x slower)."""
    if len(rows) == groups:  # no duplicates: a permutation
        out = np.empty_like(rows)
        out[inverse] = rows
        return out
    order = np.argsort(inverse, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(inverse[order]) != 0])
    return np.add.reduceat(rows_of(rows, order), starts, axis=0)


class _HeldInterrupt:
    """On the main thread, hold a SIGINT that arrives inside the block and deliver it on exit;
    a second one is delivered at once ([Note: inline operations]). Elsewhere, or when SIGINT's
    handler is not a Python callable (ignored, default, or set outside Python), it does nothing."""

    def __enter__(self) -> _HeldInterrupt:
        self.previous: Any = None
        self.held: tuple[int, Any] | None = None
        if threading.current_thread() is threading.main_thread():
            handler = signal.getsignal(signal.SIGINT)
            if callable(handler):
                self.previous = handler
                signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum: int, frame: Any) -> None:
        if self.held is not None:  # the second: now
            signal.signal(signal.SIGINT, self.previous)
            self.previous(signum, frame)
            return
        self.held = (signum, frame)
        logger.warning("Ctrl-C: the sharded table finishes its operation first (press again to interrupt it)")

    def __exit__(self, *exc: Any) -> None:
        if self.previous is None or signal.getsignal(signal.SIGINT) != self._hold:
            return
        signal.signal(signal.SIGINT, self.previous)
        if self.held is not None:
            self.previous(*self.held)


def _resolve_comm(comm: Any, process_set: Any, name: str | None = None) -> tuple[Any, Any]:
    """(communicator or None for one process, mpi module or None)."""
    if comm is not None:
        from mpi4py import MPI  # a communicator was given: mpi4py is there

        return comm, MPI
    st = runtime.state("ShardedTable()")
    if st.comm is None:
        return None, None
    given = None if process_set is None else getattr(process_set, "ranks", None)
    if given is not None and st.rank not in given:
        raise TableError(f"rank {st.rank} is not in {process_set!r}: create the table only on its ranks")
    # every rank that takes part names the same ranks, before any collective ([Note: agreeing on a table's ranks])
    membership.agree_members(st.comm, st.mpi, st.rank, membership.describe(given, st.size), TableError, name)
    if given is None or sorted(given) == list(range(st.size)):  # (a set of every rank: the job's communicator)
        return st.comm, st.mpi
    return st.comm.Create_group(st.comm.Get_group().Incl(sorted(given))), st.mpi


def _default_name(comm: Any, mpi: Any) -> str:
    """``table<k>`` for the k-th unnamed table over all ranks, ``table<k>@<ranks>`` over a subset.

    Counted per group of ranks (world ranks of ``comm``), so every member of a table's group
    gives it the same name: one counter for all tables let a table on a process set advance it
    on its members only, and the next world table got different names on different ranks.
    """
    if comm is None:
        members: tuple[int, ...] = (0,)
        everyone = True
    else:
        world = mpi.COMM_WORLD
        members = tuple(mpi.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                                  world.Get_group()))
        everyone = len(members) == world.Get_size()
    k = ShardedTable._counts[members] = ShardedTable._counts.get(members, 0) + 1
    return f"table{k}" if everyone else f"table{k}@{list(members)}"


class ShardedTable:
    """A ``num_rows x dim`` table spread over the ranks, read with :meth:`pull` and trained with :meth:`push`.

    Collective to create (every rank of the communicator, the same arguments; checked). Each
    server rank holds the storage block ``[s*N//n, (s+1)*N//n)`` of ``n`` servers, with the
    optimizer's per-row state; each worker pulls the rows its batch needs and pushes their
    gradients, which the owning server applies (see the module's notes for the consistency
    models).

    Args:
        num_rows, dim: the table's shape.
        dtype: the rows' numpy dtype (float32 or float64).
        sharding: ``"hash"`` (default: neighbouring keys on different shards) or ``"row"``.
        optimizer: :class:`SGD`, :class:`Adagrad` or :class:`Adam` (default ``SGD(lr=0.01)``).
        consistency: ``BSP()`` (default), ``SSP(s)`` or ``ASP()`` (or their names).
        name: the table's name (default ``"table<k>"``); unique per process.
        initializer: ``"uniform"`` (default), ``"normal"``, ``"zeros"`` or ``keys -> rows``.
        seed: the initial rows' random seed; the table is the same on any number of ranks.
        servers: ranks (of the communicator) that hold the shards and do not train (PS style);
            they call :meth:`serve`. Default: every rank is a server and a worker.
        average: scale pushes by ``1/workers`` (default True: the data-parallel average).
        comm, process_set: the ranks of the table (default: every rank of ``unison.init``).
        refuse: a problem an adapter found with its own arguments on this rank (a layer's dtype): raised
            on every rank, as a :class:`TableError`, with the table's own first check, so that a rank
            refusing alone does not leave the others waiting in the creation (they did before 2026-12-05).
    """

    #: default names already given, per group of world ranks (see :func:`_default_name`)
    _counts: dict[tuple[int, ...], int] = {}

    def __init__(
        self,
        num_rows: int,
        dim: int,
        dtype: Any = "float32",
        sharding: str = "hash",
        optimizer: Optimizer | None = None,
        consistency: Consistency | str = "bsp",
        name: str | None = None,
        initializer: Any = "uniform",
        seed: int = 0,
        servers: Sequence[int] | None = None,
        average: bool = True,
        comm: Any = None,
        process_set: Any = None,
        refuse: str | None = None,
    ) -> None:
        base, self.mpi = _resolve_comm(comm, process_set, name)
        #: why the table was lost (a rank of it failed: [Note: a table that loses a rank]), else None
        self._lost: str | None = None
        self._lost_generation = -1
        self.size = 1 if base is None else base.Get_size()
        self.rank = 0 if base is None else base.Get_rank()
        self.name = name if name is not None else _default_name(base, self.mpi)
        problem = refuse
        try:
            self._check_args(num_rows, dim, dtype, optimizer, servers)
            self.consistency = consistency_from_name(consistency)
            with _registry_lock:
                if self.name in _registry:
                    raise ValueError(f"a sharded table named {self.name!r} is already open on this rank; close it "
                                     "or pick another name")
                _registry[self.name] = self  # reserved; released below if the creation fails
        except (TypeError, ValueError) as exc:
            problem = problem or str(exc)
        try:
            raise_together(base, problem, TableError)
            self.num_rows, self.dim, self.dtype = int(num_rows), int(dim), np.dtype(dtype)
            self.optimizer = optimizer if optimizer is not None else SGD()
            self._build(base, sharding, initializer, seed, servers, average)
        except BaseException:
            with _registry_lock:
                if _registry.get(self.name) is self:
                    del _registry[self.name]
            raise

    def _build(self, base: Any, sharding: str, initializer: Any, seed: int, servers: Sequence[int] | None,
               average: bool) -> None:
        self.servers = list(range(self.size)) if servers is None else sorted(int(r) for r in servers)
        self.workers = [r for r in range(self.size) if servers is None or r not in self.servers]
        self.is_server, self.is_worker = self.rank in self.servers, self.rank in self.workers
        # what can fail on one rank only (a bad sharding name there, an initializer a shard's keys make
        # raise) fails on every rank, before the next collective, instead of leaving the others in it
        problem: str | None = None
        cause: Exception | None = None
        try:
            self.sharding = Sharding(sharding, self.num_rows, len(self.servers))
        except (TypeError, ValueError) as exc:
            problem, cause = str(exc), exc
        raise_together(base, problem, TableError, cause)
        self._agree(base, initializer, seed, average)
        self.shard: Shard | None = None
        try:
            if self.is_server:
                self.shard = Shard(
                    self.sharding,
                    self.servers.index(self.rank),
                    self.dim,
                    self.dtype,
                    self.optimizer,
                    initializer,
                    seed,
                    len(self.workers),
                    1.0 / len(self.workers) if average else 1.0,
                )
        except Exception as exc:  # noqa: BLE001 - a user's initializer may raise anything: every rank raises it
            problem, cause = f"{type(exc).__name__}: {exc}", exc
        raise_together(base, problem, TableError, cause)
        self.comm = None if base is None else base.Dup()
        self._rep = None if base is None or self.consistency.collective else base.Dup()
        # SSP/ASP: bad input on one worker reaches the others on a communicator of its own
        # ([Note: errors without collectives])
        self._err = None if self._rep is None else base.Dup()
        self._err_sends: list[tuple[Any, Any]] = []
        self._err_count = np.zeros((2, self.size), np.int64)  # error messages sent to / received from each rank
        self._peer_errors: list[tuple[str, int]] = []  # (message, its tag: sv.INPUT_ERROR_TAG or APPLY_ERROR_TAG)
        self._posted = 0  # bad-input errors this worker posted (each to every other worker)
        self._clock = 0
        #: the slowest worker's clock as some shard last reported it (a lower bound: clocks only grow)
        self._slowest_seen = 0
        self._request = 0
        self._sends: list[tuple[Any, np.ndarray]] = []
        #: replies of pulls a peer's error cut short: (request, buffer, server, tag), received when they come
        self._orphans: list[tuple[Any, np.ndarray, int, int]] = []
        self._stats = {
            "pulls": 0,
            "pushes": 0,
            "keys": 0,
            "rows_pulled": 0,
            "remote_rows_pulled": 0,
            "remote_rows_pushed": 0,
            "bytes_sent": 0,
            "bytes_received": 0,
            "max_staleness": 0,
            "wait_seconds": 0.0,
        }
        self._server: sv.Server | None = None
        #: the server thread's error judged a rank's failure or not (once: see _check_server)
        self._server_verdict: tuple[Any] | None = None
        if self.comm is not None and not self.consistency.collective and self.shard is not None:
            remote = len(self.workers) - (1 if self.is_worker else 0)
            self._server = sv.Server(
                self.shard,
                self.comm,
                self._rep,
                self.mpi,  # type: ignore[arg-type]
                {w: i for i, w in enumerate(self.workers)},
                remote,
                self._err,
                self.name,
            )
            if self.is_worker:
                self._server.start()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"unison-ps-{self.name}")
        self._op_lock = threading.Lock()  # held by the one operation running ([Note: inline operations])
        self._queued = 0  # operations submitted to the executor and not finished
        self._queued_lock = threading.Lock()
        self.closed = False
        #: BSP: the workers that closed the table in a round where others asked for another operation
        #: ([Note: a close that meets another operation]); then no round is run again
        self._closed_by: list[int] = []

    # ------------------------------------------------------------------ checks

    def _check_args(self, num_rows: Any, dim: Any, dtype: Any, optimizer: Any, servers: Any) -> None:
        for label, value in (("num_rows", num_rows), ("dim", dim)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"ShardedTable({label}={value!r}): must be a positive int")
        if np.dtype(dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"ShardedTable(dtype={dtype!r}): rows must be float32 or float64")
        if optimizer is not None and (not isinstance(optimizer, Optimizer)
                                      or type(optimizer).apply is Optimizer.apply):
            # (the base class's apply() raised a bare NotImplementedError at every push, and killed
            # the server thread of an SSP table; refused here, on every rank, before 2026-12-05 not)
            raise TypeError(f"ShardedTable(optimizer={optimizer!r}): give unison.ps.SGD, Adagrad or Adam "
                            "(or a subclass of unison.ps.Optimizer that defines apply())")
        if servers is not None:
            bad = [r for r in servers if not 0 <= int(r) < self.size]
            if bad or not servers or len(set(servers)) != len(list(servers)) or len(set(servers)) == self.size:
                raise ValueError(
                    f"ShardedTable(servers={list(servers)!r}): give distinct ranks in [0, {self.size}) "
                    "and leave at least one worker rank"
                )

    def _agree(self, base: Any, initializer: Any, seed: int, average: bool) -> None:
        """Every rank must define the same table: compare the definitions, raise the difference on every rank."""
        mine = {
            "name": self.name,
            "num_rows": self.num_rows,
            "dim": self.dim,
            "dtype": str(self.dtype),
            "sharding": self.sharding.kind,
            "optimizer": self.optimizer.config(),
            "consistency": repr(self.consistency),
            "servers": self.servers,
            "seed": seed,
            "average": average,
            "initializer": "callable" if callable(initializer) else initializer,
        }
        if base is None:
            return
        every = base.allgather(mine)
        diffs = [
            f"{key}: rank 0 has {every[0][key]!r}, rank {r} has {d[key]!r}"
            for r, d in enumerate(every)
            for key in mine
            if d[key] != every[0][key]
        ]
        if diffs:
            raise TableError(
                f"sharded table {self.name!r} is defined differently across ranks ({'; '.join(diffs[:4])}); "
                "create it with the same arguments on every rank"
            )

    def _check_open(self, what: str) -> None:
        if self._lost is not None:
            raise failure.lost_error(self)
        if self.closed:
            raise TableError(f"table {self.name!r} is closed; {what} needs an open table")
        self._check_server()

    def _keys(self, keys: Any, what: str) -> np.ndarray:
        arr = np.asarray(keys)
        if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
            raise TypeError(
                f"{self.name}.{what}: keys must be integers; got dtype {arr.dtype}. Cast them with "
                ".astype('int64')"
            )
        if arr.size and arr.dtype.kind == "u" and int(arr.max()) >= self.num_rows:  # before a cast could wrap it
            raise ValueError(f"{self.name}.{what}: key {int(arr.max())} is out of range [0, {self.num_rows}); "
                             f"the table has num_rows={self.num_rows}")
        arr = arr.astype(np.int64, copy=False)
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.num_rows:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"{self.name}.{what}: key {bad} is out of range [0, {self.num_rows}); the table "
                    f"has num_rows={self.num_rows}"
                )
        return arr

    def _grads(self, grads: Any, keys: np.ndarray, what: str) -> np.ndarray:
        if grads is None:  # (what torch gives an unused tensor: BSP read past an empty buffer, SSP/ASP dropped the
            # update and still counted the clock, before 2026-12-07; found by an audit)
            raise ValueError(f"{self.name}.{what}: gradients are None (a tensor no loss reached has no gradient); "
                             f"pass an array of shape {keys.shape + (self.dim,)} (zeros to push nothing), "
                             "or call pull")
        g = np.asarray(grads)
        if g.dtype.kind != "f":
            raise TypeError(f"{self.name}.{what}: gradients must be floating point; got dtype {g.dtype}")
        if g.shape != keys.shape + (self.dim,):
            raise ValueError(
                f"{self.name}.{what}: gradients of shape {g.shape} do not match keys of shape "
                f"{keys.shape}: expected {keys.shape + (self.dim,)}"
            )
        return g.reshape(-1, self.dim).astype(self.dtype, copy=False)

    # ------------------------------------------------------------------ public API

    def pull(self, keys: Any) -> np.ndarray:
        """The rows of ``keys`` (any shape of ints): an array ``keys.shape + (dim,)``."""
        return self._call("pull", self._pull, keys)

    def push(self, keys: Any, grads: Any, clock: bool = True) -> None:
        """Apply the gradient rows ``grads`` (``keys.shape + (dim,)``) through the server-side optimizer.

        Duplicate keys are summed first. ``clock`` ends this worker's step (SSP/ASP).
        """
        self._call("push", self._push, keys, grads, clock)

    def push_pull(self, keys: Any, grads: Any) -> np.ndarray:
        """Push ``grads`` of ``keys``, then return the updated rows of the same keys (one key exchange)."""
        return self._call("push_pull", self._push_pull, keys, grads)

    def pull_async(self, keys: Any) -> Handle:
        return self._submit("pull", self._pull, keys)

    def push_async(self, keys: Any, grads: Any, clock: bool = True) -> Handle:
        return self._submit("push", self._push, keys, grads, clock)

    def push_pull_async(self, keys: Any, grads: Any) -> Handle:
        return self._submit("push_pull", self._push_pull, keys, grads)

    def clock(self) -> None:
        """End this worker's step by hand (after pushes given ``clock=False``)."""
        self._call("clock", self._clock_by_hand)

    def wait(self) -> None:
        """Wait for every operation submitted so far."""
        self._submit("wait", lambda: None).wait()

    def stats(self) -> dict[str, Any]:
        """Counters of this rank: operations, rows, bytes to/from other ranks, largest staleness, and ``clock``
        (the steps this worker finished, or the clock every worker met at in its last barrier, if larger)."""
        out = dict(self._stats)
        out["clock"] = self._clock
        out["requests_served"] = self._server.requests if self._server is not None else 0
        return out

    def reset_stats(self) -> None:
        for key in self._stats:
            self._stats[key] = 0.0 if key == "wait_seconds" else 0

    # [Note: inline operations]
    # Operations run one at a time, in the order issued: the *_async calls queue them on the
    # table's executor thread. A blocking call (pull, push, barrier, ...) made while nothing is
    # queued runs on the caller's thread instead: handing it to the executor and waking the caller
    # afterwards cost two thread switches per call, which with more ranks than cores (each switch
    # waiting for a time slice) was ~3 ms of a 72 ms step at 4 ranks on 2 cores and 1.6 ms of 53 at
    # 2 (benchmarks/embeddings.py, 1% touched). _op_lock is held by whichever operation runs, so
    # an inline one and a queued one never overlap; a blocking call made while operations are
    # queued goes through the queue behind them.
    # On the main thread, where Python raises KeyboardInterrupt, an inline operation holds a
    # Ctrl-C until it has finished (_HeldInterrupt), as it would have finished on the executor:
    # cut off mid-round, this rank would leave its peers inside the round's collectives, and a
    # `except KeyboardInterrupt: table.save(...)` would meet them there. A second Ctrl-C is
    # raised at once (a round whose peers are gone never finishes).

    def _check_worker(self, what: str) -> None:
        self._check_open(what)
        if not self.is_worker:
            raise TableError(
                f"rank {self.rank} is a dedicated server of table {self.name!r} (servers={self.servers}): "
                f"it cannot {what}; call table.serve() there instead"
            )

    def _locked(self, fn: Any, *args: Any) -> Any:
        with self._op_lock:
            return self._guarded(fn, *args)

    def _inline(self, fn: Any, *args: Any) -> Any:
        with self._op_lock, _HeldInterrupt():
            return self._guarded(fn, *args)

    def _guarded(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``; a rank's failure met there loses the table ([Note: a table that loses a rank])."""
        try:
            return fn(*args)
        except Exception as exc:
            lost = failure.failure_of(self, exc)
            if lost is None:
                raise
            raise failure.lose(self, lost) from exc

    def _forget(self) -> None:
        """Closed without freeing anything (a lost table: its communicators are revoked, not freed)."""
        self.closed = True
        with _registry_lock:
            if _registry.get(self.name) is self:
                del _registry[self.name]
        self._executor.shutdown(wait=False, cancel_futures=True)  # (their handles raise the loss: Handle.wait)

    def _queued_op(self, fn: Any, *args: Any) -> Any:
        try:
            return self._locked(fn, *args)
        finally:
            with self._queued_lock:
                self._queued -= 1

    def _submit(self, what: str, fn: Any, *args: Any) -> Handle:
        self._check_worker(what)
        with self._queued_lock:
            self._queued += 1
        try:
            return Handle(self._executor.submit(self._queued_op, fn, *args), self)
        except Exception as exc:  # not queued (a KeyboardInterrupt may come after it was: leave the count)
            with self._queued_lock:
                self._queued -= 1
            if self._lost is not None:  # lost on the executor thread since the check above: no new work there
                raise failure.lost_error(self) from exc
            raise

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        """A blocking operation: inline when nothing is queued, else behind the queued ones (see the Note)."""
        self._check_worker(what)
        if self._queued:
            return self._submit(what, fn, *args).wait()
        return self._inline(fn, *args)

    # ------------------------------------------------------------------ the operations

    def _route(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Keys -> (their unique storage indices, sorted: grouped by server; rows per server; each key's place).

        Storage order is a bijection of the keys, so the unique storage indices are the unique
        keys, already in the order the servers hold them (one sort for both). Keys that are
        already unique and sorted under row sharding (``ShardedEmbedding`` pushes and pulls
        ``np.unique``'s output) are their own storage order: the place is None (the identity), which
        spares a sort, gathering the pulled rows into place and permuting the pushed ones.
        """
        flat = self.sharding.storage(keys.reshape(-1))
        inverse: np.ndarray | None = None
        if self.sharding.kind == "row" and bool(np.all(flat[1:] > flat[:-1])):
            storage = flat
        else:
            storage, inverse = np.unique(flat, return_inverse=True)
            inverse = inverse.reshape(-1)
        counts = np.diff(np.searchsorted(storage, self.sharding.bounds()))
        full = np.zeros(self.size, np.int64)
        full[self.servers] = counts
        return storage, full, inverse

    def _pull(self, keys: Any) -> np.ndarray:
        arr, _, problem = self._validate(keys, None, "pull")
        rows = self._operate(ex.PULL, arr, None, problem)
        self._stats["pulls"] += 1
        return rows

    def _push(self, keys: Any, grads: Any, clock: bool) -> None:
        arr, flat, problem = self._validate(keys, grads, "push")
        self._operate(ex.PUSH, arr, flat, problem)
        self._stats["pushes"] += 1
        if clock:
            self._advance()

    def _push_pull(self, keys: Any, grads: Any) -> np.ndarray:
        arr, flat, problem = self._validate(keys, grads, "push_pull")
        rows = self._operate(ex.PUSH_PULL, arr, flat, problem)
        self._stats["pushes"] += 1
        self._stats["pulls"] += 1
        self._advance()
        return rows

    def _validate(self, keys: Any, grads: Any, what: str) -> tuple[np.ndarray, np.ndarray | None, str | None]:
        """(int64 keys, gradient rows flattened to (keys, dim) or None, None); under BSP bad input
        gives (no keys, None, the problem), which the round then raises on every rank; under
        SSP/ASP it is raised here and sent to the other workers ([Note: errors without collectives])."""
        try:
            arr = self._keys(keys, what)
            return arr, None if what == "pull" else self._grads(grads, arr, what), None
        except (TypeError, ValueError) as exc:
            if not self.consistency.collective:
                message = f"rank {self.rank}: {exc}"
                self._post_error(message)
                raise TableError(message) from exc
            return np.zeros(0, np.int64), None, str(exc)

    # [Note: errors without collectives]
    # Under SSP/ASP a worker's operation involves no other worker at the same moment, so bad input
    # cannot be agreed on as BSP's rounds do. The worker that meets it raises at once and sends the
    # message to every other worker on the table's error communicator; each of them raises the
    # same text (naming that rank) at its next pull or push on the table, once the message arrived
    # (each probes for one first, on the thread that runs the operation, before any side effect), or at its
    # next barrier(), save() or load(), once that has completed on every rank (so no rank skips one the others
    # are in): each worker's barrier mark carries the number of errors it has posted, the acknowledgements the
    # sum, and a worker receives every error posted before the barrier before it returns (before 2026-12-06 a
    # worker whose last operation before a barrier or close was a peer's bad push never heard of it: an audit).
    # Each worker raises each peer's error once; one that closes before raising it logs it. The
    # table stays usable on every rank afterwards, as under BSP. A worker already waiting in a pull when
    # the message arrives raises it there (it probes while it waits: the pull may wait on the very worker
    # that failed, whose clock no longer moves); its push of that call (push_pull) was sent already, and
    # the replies it no longer waits for are received when they come, at the latest when the table
    # closes. Before 2026-12-05 it went on waiting, and a failing worker that caught its error and then
    # called barrier() or save() waited for it in turn: a hang.

    # [Note: a failed apply()]
    # The optimizer's apply() runs on the shard's rank and may raise: a user's Optimizer subclass refusing a
    # non-finite gradient, a MemoryError. That update is dropped (the shard's rows keep what apply() left:
    # nothing, for one that checks before it writes), the rows of the same push on other shards are applied,
    # and a TableError naming the rank, the table and the error is raised on every worker; the table goes on.
    # Under BSP the apply follows the round's last exchange of a push, so the round agrees on it with one
    # 8-byte allreduce (raise_together; a few microseconds beside the round's milliseconds, where a flag
    # carried in a push_pull's rows would copy every row twice) and every rank raises in that push or
    # push_pull; a dedicated server logs it and serves on. Under SSP/ASP a push to this worker's own shard is
    # applied on its thread, raised there and posted as bad input is; a push to another rank's shard is applied
    # by that rank's server thread, which catches the error, drops that update and posts the message on the
    # error communicator to every worker (its own rank's too), with a tag of its own (APPLY_ERROR_TAG): each
    # raises it at its next operation once it arrived, or once its next barrier(), save() or load() has
    # completed, as bad input (each acknowledgement carries its server's count). The server thread keeps its
    # own count and sends (read by close() after the thread has ended): the worker's bookkeeping is the
    # worker's. Before 2026-12-07 the server thread died (every worker then waited in its next barrier for
    # ever, its own included), and under BSP the shard's rank raised alone: after a push the others went on
    # (the update silently lost), in a push_pull they waited for ever in the rows' exchange (an audit).

    def _post_error(self, message: str) -> None:
        if self._err is None:
            return
        self._posted += 1
        others = [r for r in self.workers if r != self.rank]
        self._err_sends += sv.post(self._err, self.mpi, message, others, sv.INPUT_ERROR_TAG)
        self._err_count[0][others] += 1

    def _check_peers(self) -> None:
        """Raise a bad-input error another worker posted (see the Note)."""
        if self._err is None:
            return
        status = self.mpi.Status()
        while self._err.Iprobe(self.mpi.ANY_SOURCE, self.mpi.ANY_TAG, status):
            self._receive_error(status)
        if self._peer_errors:
            message, tag = self._peer_errors.pop(0)
            how = "raised on that rank" if tag == sv.INPUT_ERROR_TAG else "its server thread serves on"
            raise TableError(f"{message} ({how}; table {self.name!r} under "
                             f"{self.consistency!r} raises it on every worker at its next operation, or once "
                             "its next barrier(), save() or load() has completed)")

    def _receive_error(self, status: Any) -> None:
        buf = np.empty(status.Get_count(self.mpi.BYTE), np.uint8)
        self._err.Recv([buf, self.mpi.BYTE], status.Get_source(), status.Get_tag())  # type: ignore[union-attr]
        self._err_count[1][status.Get_source()] += 1
        self._peer_errors.append((buf.tobytes().decode("utf-8", "replace"), status.Get_tag()))

    def _receive_posted(self, total: int) -> None:
        """After a barrier: receive every error the others had posted by their marks (``total``, all workers'
        together and the servers' apply() failures, carried by the acknowledgements), so that the barrier's
        caller raises them (see the Note)."""
        status = self.mpi.Status()
        while int(self._err_count[1].sum()) < total - self._posted:  # (each was sent before its poster's mark)
            self._err.Probe(self.mpi.ANY_SOURCE, self.mpi.ANY_TAG, status)  # type: ignore[union-attr]
            self._receive_error(status)

    def _check_not_closed_by_peers(self) -> None:
        if self._closed_by:
            raise TableError(f"table {self.name!r}: rank(s) {self._closed_by} closed it while this rank asked for "
                             "another operation; it is closed on every rank (close() frees it)")

    def _operate(self, op: int, keys: np.ndarray, flat: np.ndarray | None, problem: str | None) -> Any:
        self._check_not_closed_by_peers()
        self._check_peers()
        storage, counts, inverse = self._route(keys)
        g = flat if flat is None or inverse is None else _sum_by(inverse, flat, len(storage))
        self._stats["keys"] += int(keys.size)
        if self.consistency.collective:
            rows = self._bsp(op, storage, counts, g, problem)
        else:
            rows = self._async(op, storage, counts, g)
        if rows is None:
            return None
        if op != ex.PUSH:
            self._stats["rows_pulled"] += len(storage)
        return (rows if inverse is None else rows_of(rows, inverse)).reshape(keys.shape + (self.dim,))

    def _advance(self) -> None:
        self._clock += 1
        if self.consistency.collective:
            return
        if self.shard is not None:
            self.shard.advance(self.workers.index(self.rank), self._clock)
        for r in self.servers:
            if r != self.rank:
                self._send(r, sv.pack(sv.CLOCK, 0, self._clock, np.zeros(0, np.int64)))

    def _clock_by_hand(self) -> None:
        """``clock()``: held back first, as any operation of a step ([Note: SSP holds back every operation])."""
        bound = self.consistency.bound()
        if self.comm is not None and not self.consistency.collective and bound is not None:
            self._hold_back(self._clock - bound)
        self._advance()

    def _hold_back(self, need: int) -> None:
        """SSP: return once every worker's clock is at least ``need``.

        [Note: SSP holds back every operation]
        SSP(s) lets no worker run more than ``s`` steps ahead of the slowest. Its pulls always
        waited (the shard that answers defers them until the clocks it has received reach ``c - s``,
        so the bound holds per row), but a worker that only pushed, or whose pulls touched no rows,
        never waited: at 2 ranks under SSP(1) a push-only rank finished 10 steps while its peer had
        done one (an audit, 2026-12-06). So every operation of a worker at clock ``c`` (a push, a
        push-pull, ``clock()``) first waits for the slowest worker to reach ``c - s``, as a pull
        does; a pull of rows waits in its own requests. The wait comes before the operation does
        anything, so a peer's error raised there leaves this worker's push unapplied (raised after
        it, a retry would apply it twice), and ``barrier()``, ``save()``, ``load()`` and ``close()``
        never wait: workers that end with different numbers of steps still meet there (a first
        version waited at the end of each step, and such workers waited for ever: a review), and
        a worker in a barrier holds nobody back ([Note: clocks meet at a barrier]). A
        worker holding a shard reads the clocks its own server has received; a worker without one
        (dedicated servers) asks a server with a pull of no rows (the servers in turn), which that
        server defers like any pull. Every pull reply reports the slowest clock its shard has seen,
        a lower bound of the true one, so a worker that pulls at the start of each step never needs
        that extra request.
        """
        if need <= self._slowest_seen:
            return
        t0 = time.perf_counter()
        if self.shard is not None:
            self._slowest_seen = self.shard.wait_ready(need, self._check_waiting)
        else:
            server = self.servers[need % len(self.servers)]
            self._next_request(server)
            reply = np.empty(8, np.uint8)
            wait = self._rep.Irecv([reply, self.mpi.BYTE], server, self._request)  # type: ignore[union-attr]
            self._send(server, sv.pack(sv.PULL, self._request, need, np.zeros(0, np.int64)))
            try:
                wait_request(wait, self._check_waiting)
            except BaseException:  # (as in _async_pull: the reply still comes, received later)
                self._orphans.append((wait, reply, server, self._request))
                raise
            self._slowest_seen = max(self._slowest_seen, int(reply.view(np.int64)[0]))
        self._stats["wait_seconds"] += time.perf_counter() - t0

    # BSP ----------------------------------------------------------------

    def _bsp(
        self,
        op: int,
        storage: np.ndarray,
        counts: np.ndarray,
        grads: np.ndarray | None,
        problem: str | None,
    ) -> np.ndarray | None:
        if self.comm is None:
            if problem is not None:
                raise TableError(problem)
            return self._serve_local(op, storage, grads)
        rnd = ex.Round(self.comm, self.mpi, self.rank)
        head = rnd.header(ex.ERROR if problem is not None else op, counts)
        self._settle(head, problem, op)
        rows = self._bsp_body(rnd, op, storage, counts, grads, head[:, 1])
        self._stats["bytes_sent"] += rnd.sent
        self._stats["bytes_received"] += rnd.received
        remote = int(counts.sum() - counts[self.rank])
        if op != ex.PUSH:
            self._stats["remote_rows_pulled"] += remote
        if op != ex.PULL:
            self._stats["remote_rows_pushed"] += remote
        return rows

    def _settle(self, head: np.ndarray, problem: str | None, op: int) -> None:
        """Raise on every rank when a rank reported bad input or the workers asked for different operations."""
        ops = head[:, 0]
        if (ops == ex.ERROR).any():
            problems = self.comm.allgather(problem)  # type: ignore[union-attr]
            bad = [r for r, p in enumerate(problems) if p is not None]
            raise TableError(f"rank {bad[0]}: {problems[bad[0]]}" + (f" (ranks {bad[1:]} too)" if bad[1:] else ""))
        asked = {int(ops[r]) for r in self.workers}
        if len(asked) > 1:
            names = {r: ex.OP_NAMES[int(ops[r])] for r in self.workers}
            # [Note: a close that meets another operation] A worker closing (it is done, or exiting: the
            # shutdown closes its tables) while another asks for one more operation (rank 0 alone printing
            # the table) leaves no round that could pair again: the closer goes on to exit. Every rank then
            # takes the table as closed: the closer finishes its close, the others' later operations raise at
            # once, and their close() only frees it (before 2026-12-05 the extra operation, or a later
            # close, waited for ever).
            self._closed_by = [r for r in self.workers if int(ops[r]) == ex.CLOSE]
            closed = (f"; rank(s) {self._closed_by} closed it, so it is closed on every rank now (close() frees "
                      "it)") if self._closed_by else ""
            raise TableError(
                f"table {self.name!r}: the workers called different operations at the same step "
                f"({names}); under BSP every worker must pull, push, save and close in the same order{closed}"
            )

    def _bsp_body(
        self,
        rnd: ex.Round,
        op: int,
        storage: np.ndarray,
        counts: np.ndarray,
        grads: np.ndarray | None,
        incoming: np.ndarray,
    ) -> np.ndarray | None:
        got = rnd.alltoallv(storage, counts, incoming, (), np.dtype(np.int64))
        if op in (ex.PUSH, ex.PUSH_PULL):
            g = grads if grads is not None else np.zeros((0, self.dim), self.dtype)
            got_grads = rnd.alltoallv(g, counts, incoming, (self.dim,), self.dtype)
            problem: str | None = None
            cause: Exception | None = None
            if self.shard is not None:
                try:
                    self.shard.apply(got, got_grads, incoming)
                except Exception as exc:  # noqa: BLE001 - a user's optimizer may raise anything: every rank raises it
                    problem, cause = sv.apply_failure(self.name, exc), exc
            raise_together(self.comm, problem, TableError, cause)  # [Note: a failed apply()]
        if op == ex.PUSH:
            return None
        out = self.shard.read(got) if self.shard is not None else np.zeros((0, self.dim), self.dtype)
        return rnd.alltoallv(out, incoming, counts, (self.dim,), self.dtype)

    def _serve_local(self, op: int, storage: np.ndarray, grads: np.ndarray | None) -> np.ndarray | None:
        if self.shard is None:  # one process holds the only shard
            raise TableError(f"table {self.name!r}: no shard on this rank")
        if op in (ex.PUSH, ex.PUSH_PULL) and grads is not None:
            self._apply_here(storage, grads)
        return None if op == ex.PUSH else self.shard.read(storage)

    def _apply_here(self, storage: np.ndarray, grads: np.ndarray) -> None:
        """Apply this worker's push to its own shard, on its own thread; an apply() that raises is this rank's
        error, raised here and posted to the other workers as bad input is ([Note: a failed apply()])."""
        try:
            self.shard.apply(storage, grads)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - a user's optimizer may raise anything
            message = f"rank {self.rank}: {sv.apply_failure(self.name, exc)}"
            self._post_error(message)
            raise TableError(message) from exc

    # SSP / ASP ----------------------------------------------------------

    def _send(self, dest: int, buf: np.ndarray) -> None:
        self._sends.append((self.comm.Isend([buf, self.mpi.BYTE], dest, 0), buf))  # type: ignore[union-attr]
        self._stats["bytes_sent"] += buf.nbytes
        if len(self._sends) > 64:
            self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def _async(
        self, op: int, storage: np.ndarray, counts: np.ndarray, grads: np.ndarray | None
    ) -> np.ndarray | None:
        if self.comm is None:
            return self._serve_local(op, storage, grads)
        bound = self.consistency.bound()
        need = sv.NO_WAIT if bound is None else self._clock - bound
        if bound is not None and not (op == ex.PULL and len(storage)):  # (a pull of rows waits in its requests)
            self._hold_back(need)  # [Note: SSP holds back every operation]
        starts = np.concatenate([[0], np.cumsum(counts)])
        if op in (ex.PUSH, ex.PUSH_PULL) and grads is not None:
            for r in self.servers:
                if starts[r] == starts[r + 1] or r == self.rank:
                    continue
                part = slice(starts[r], starts[r + 1])
                self._send(r, sv.pack(sv.PUSH, 0, 0, storage[part], grads[part]))
                self._stats["remote_rows_pushed"] += int(counts[r])
            # this worker's own shard last: an apply() failing there leaves the other shards' parts sent, as a
            # failure on another rank's shard does ([Note: a failed apply()])
            if self.shard is not None and counts[self.rank]:
                part = slice(starts[self.rank], starts[self.rank + 1])
                self._apply_here(storage[part], grads[part])
        if op == ex.PUSH:
            return None
        return self._async_pull(storage, counts, starts, need)

    def _async_pull(self, storage: np.ndarray, counts: np.ndarray, starts: np.ndarray, need: int) -> np.ndarray:
        rows = np.empty((len(storage), self.dim), self.dtype)
        waits, replies = [], []
        t0 = time.perf_counter()
        if self._orphans:
            self._orphans = [o for o in self._orphans if not o[0].Test()]
        for r in self.servers:
            if r == self.rank or counts[r] == 0:
                continue
            self._next_request(r)
            reply = np.empty(8 + int(counts[r]) * self.dim * self.dtype.itemsize, np.uint8)
            waits.append(self._rep.Irecv([reply, self.mpi.BYTE], r, self._request))  # type: ignore[union-attr]
            replies.append((r, reply, self._request))
            self._send(r, sv.pack(sv.PULL, self._request, need, storage[starts[r] : starts[r + 1]]))
            self._stats["remote_rows_pulled"] += int(counts[r])
        slowest = []
        try:
            if self.shard is not None and counts[self.rank]:
                part = slice(starts[self.rank], starts[self.rank + 1])
                slowest.append(
                    self.shard.wait_ready(need, self._check_waiting)
                    if need != sv.NO_WAIT
                    else int(self.shard.clocks.min())
                )
                rows[part] = self.shard.read(storage[part])
            # brief spin, then sleeps (MPI's Waitall would spin, sched_yield, beside the model), checking for a
            # peer's error: a reply that waits on a worker that met bad input never comes while that worker,
            # having caught it, waits in a barrier for this one (before 2026-12-05 a hang)
            for w in waits:
                wait_request(w, self._check_waiting)
        except BaseException:
            # a peer's error (or this rank's server's) cut the wait short: the replies still come (every
            # server answers its deferred pulls by the time every worker closes); receive them then
            self._orphans += [(w, reply, r, tag) for w, (r, reply, tag) in zip(waits, replies, strict=True)]
            raise
        for r, reply, _ in replies:
            slowest.append(int(reply[:8].view(np.int64)[0]))
            rows[starts[r] : starts[r + 1]] = reply[8:].view(self.dtype).reshape(-1, self.dim)
            self._stats["bytes_received"] += reply.nbytes
        self._stats["wait_seconds"] += time.perf_counter() - t0
        if slowest and need != sv.NO_WAIT:
            self._stats["max_staleness"] = max(self._stats["max_staleness"], self._clock - min(slowest))
            self._slowest_seen = max(self._slowest_seen, max(slowest))  # (each shard's view is a lower bound)
        return rows

    def _next_request(self, server: int) -> None:
        """Take the next request id (a reply's tag) for ``server``, skipping those whose reply is still posted."""
        self._request = self._request % 30000 + 1
        while any(o[2] == server and o[3] == self._request for o in self._orphans):
            self._request = self._request % 30000 + 1

    def _check_waiting(self) -> None:
        """While an SSP/ASP pull waits: raise this rank's server thread's failure or a peer's error."""
        self._check_server()
        self._check_peers()

    def _check_server(self) -> None:
        if self._server is not None and self._server.error is not None:
            if self._server_verdict is None:  # judged once (it may wait for news of a failure)
                self._server_verdict = (failure.failure_of(self, self._server.error),)
            lost = self._server_verdict[0]
            if lost is not None:
                raise failure.lose(self, lost)
            raise TableError(f"table {self.name!r}: the server thread failed: {self._server.error!r}")

    # ------------------------------------------------------------------ checkpoints

    def save(self, path: Any, metadata: dict[str, Any] | None = None) -> Any:
        """Save every shard and the optimizer state to the folder ``path`` with a manifest. Collective.

        Every push issued before the call (on any worker) is in the checkpoint. The folder loads
        on any number of ranks (:meth:`load`). Returns the committed manifest.
        """
        return self._call("save", self._checkpoint, ex.SAVE, path, metadata)

    def load(self, path: Any) -> dict[str, Any]:
        """Replace the rows and optimizer state with the checkpoint at ``path`` (any rank count). Collective.

        Returns the metadata given to :meth:`save`. On a dedicated server rank it answers the workers'
        ``load()`` (of the path their first worker gives) and returns, so that every rank of the table can
        call it in the same place, an elastic reset callback's for one ([Note: dedicated servers in elastic
        mode]).
        """
        if not self.is_worker:
            self._check_open("load")
            return self._guarded(self._serve, None, True)
        return self._call("load", self._checkpoint, ex.LOAD, path, None)

    def _checkpoint(self, op: int, path: Any, metadata: dict[str, Any] | None) -> Any:
        from unison.common.ps import checkpoint

        dedicated = len(self.workers) < self.size
        if self.comm is not None and self.consistency.collective:
            self._check_not_closed_by_peers()
            # the header round first, as every BSP operation does: a worker that pulls or pushes while
            # another saves is told so on every rank instead of meeting the checkpoint's collectives
            rnd = ex.Round(self.comm, self.mpi, self.rank)
            self._settle(rnd.header(op, np.zeros(self.size, np.int64)), None, op)
            if dedicated:  # the servers learn the path and the metadata (the manifest takes rank 0's)
                path, metadata = self.comm.bcast((str(path), metadata) if self.rank == self.workers[0] else None,
                                                 root=self.workers[0])
        elif self.comm is not None and not self.consistency.collective:
            self._quiesce(sv.SAVE_MARK if op == ex.SAVE else sv.LOAD_MARK)
            # a dedicated server joins here ([Note: a dedicated server checkpoints with its workers])
            self.comm.Barrier()
            if dedicated:
                path, metadata = self.comm.bcast((str(path), metadata) if self.rank == self.workers[0] else None,
                                                 root=self.workers[0])
        if op == ex.SAVE:
            saved = checkpoint.save(self, path, metadata)
            self._check_peers()  # once the save has completed on every rank ([Note: errors without collectives])
            return saved
        loaded = checkpoint.load(self, path)
        if self.comm is not None and not self.consistency.collective:
            # every shard holds the loaded rows before any worker goes on: a worker that returned first
            # could pull a peer's old rows, or push into a shard the load then overwrote (before 2026-12-05)
            self.comm.Barrier()
            self._check_peers()
        return loaded

    def barrier(self) -> None:
        """Collective over the workers: returns once every push any worker issued before it is applied.

        Under BSP every operation is already applied when it returns; under SSP/ASP each worker
        marks every server, and a server acknowledges once all workers' marks (which follow
        their pushes) have arrived.
        """
        self._call("barrier", self._barrier)

    def _barrier(self) -> None:
        self._quiesce()
        self._check_peers()  # once it has completed on every worker ([Note: errors without collectives])

    def _quiesce(self, kind: int = sv.BARRIER_MARK) -> None:
        """Under SSP/ASP: wait until every worker's pushes issued before it are applied; the clocks then meet.

        [Note: clocks meet at a barrier]
        A worker in ``barrier()`` (or ``save()``/``load()``, which start with one) makes no step until
        every worker has joined it, so while it waits it holds nobody back: each server *parks* it
        when its mark arrives, and defers pulls and hold-backs only for the workers not parked. Once
        every mark is in, each server sets every worker's clock to the largest of them (the same on
        every server: a worker's clock messages reach each server before its mark) and sends it with
        the acknowledgement; the worker takes it as its own clock. So the ranks that meet in a barrier
        leave it at one clock, as if the slower ones had made empty steps, and SSP's bound holds again
        from there: every push made before the barrier is applied, and every later one carries a later
        clock. Before 2026-12-06 a worker with more steps left than another's ``s`` (an uneven last
        epoch) waited for ever in a push or pull for a worker already in the barrier, and a worker that
        left a barrier more than ``s`` steps ahead waited in its next operation for workers that had none
        left to make (``test_ssp_workers_with_uneven_steps_meet_in_a_barrier``). A worker that closes the
        table instead never marks: each server answers the waiting workers that it closed, and they
        raise (:meth:`_wait_acks`; they too waited for ever before). Each mark says which operation
        made it, and workers whose marks met in different operations (one in ``barrier()``, another in
        ``save()``) raise on every worker: the one saving would wait in the checkpoint's collectives for
        a peer that had gone on training (before 2026-12-06 both hung).
        """
        if self.comm is None or self.consistency.collective:
            return
        self._mark = getattr(self, "_mark", 0) + 1
        # a lone worker's pushes to its own shard are applied inline, and its server thread serves no one
        # (it ended at once): it is not marked (before 2026-12-05 the mark waited for ever for its ACK)
        servers = [r for r in self.servers if not (r == self.rank and len(self.workers) == 1)]
        acks = [np.zeros(sv.ACK_LEN, np.int64) for _ in servers]  # see sv.ACK_LEN
        waits = [
            self._rep.Irecv([a, self.mpi.INT64_T], r, sv.ACK_TAG)  # type: ignore[union-attr]
            for a, r in zip(acks, servers, strict=True)
        ]
        for r in servers:
            self._send(r, sv.pack(sv.MARK, kind, self._mark, np.array([self._posted], np.int64)))
        self._wait_acks(waits, acks)
        self.mpi.Request.Waitall([r for r, _ in self._sends])
        self._sends = []
        if acks:  # [Note: clocks meet at a barrier]
            # ([Note: errors without collectives]; each server's apply() failures: [Note: a failed apply()])
            self._receive_posted(int(acks[0][3]) + sum(int(a[4]) for a in acks))
            met = max(int(a[1]) for a in acks)
            self._clock = max(self._clock, met)
            self._slowest_seen = max(self._slowest_seen, met)
            code = int(acks[0][2])
            if code:  # (every server saw the same marks: one answer is enough, and every worker has it)
                first, w, other = sv.mismatch_of(code)
                raise TableError(
                    f"table {self.name!r}: workers called different operations at the same point: rank "
                    f"{self.workers[0]} {sv.MARK_NAMES[first]}, rank {self.workers[w]} {sv.MARK_NAMES[other]}; "
                    "every worker must make the same barriers, saves and loads, in the same order"
                )

    def _wait_acks(self, waits: list[Any], acks: list[np.ndarray]) -> None:
        """Wait for every server's acknowledgement of a barrier; raise if one says a worker closed the table
        instead of joining it (a server whose thread ended with it never answers: that wait is cancelled)."""
        done = [False] * len(waits)

        def check_closed() -> None:
            # this rank's server thread ended (a rank's failure loses the table): it will never answer
            # (before 2026-12-07 this barrier waited for ever; [Note: a failed apply()])
            self._check_server()
            for i, w in enumerate(waits):
                done[i] = done[i] or w.Test()
            failed = [a for a, d in zip(acks, done, strict=True) if d and a[1] < 0]
            if failed:
                for w, d in zip(waits, done, strict=True):
                    if not d:
                        w.Cancel()
                        w.Wait()
                closed = self.workers[-1 - int(failed[0][1])]
                raise TableError(f"table {self.name!r}: rank {closed} closed the table while this rank waited "
                                 "for it in barrier(), save() or load(); every worker must make the same "
                                 "barriers, saves and loads before close()")

        for w in waits:
            wait_request(w, check_closed)
        check_closed()  # (the last acknowledgement to come may be the one that says so)

    def to_numpy(self) -> np.ndarray:
        """The whole table in key order (a pull of every key: for small tables and tests)."""
        return self.pull(np.arange(self.num_rows, dtype=np.int64))

    # ------------------------------------------------------------------ dedicated servers, closing

    def serve(self, on_save: Callable[[dict[str, Any]], Any] | None = None) -> None:
        """On a dedicated server rank: answer the workers until they close the table (then it is closed here
        too; serving a closed table returns at once, as ``with table: table.serve()`` does on exit).

        Args:
            on_save: called on this rank after each ``save()`` of the workers, with the metadata they gave it
                (``{}`` for none), before the next operation is answered: what a server must do at the same
                point as the workers after a save, such as an elastic state's ``commit()`` ([Note: dedicated
                servers in elastic mode]). What it raises ends ``serve()`` (the table stays open).

        [Note: dedicated servers in elastic mode]
        Under the elastic ``run`` wrapper every rank commits the same commits (a commit is collective)
        and runs the same reset callbacks, but a dedicated server spends the training in ``serve()``.
        So the workers commit right after a ``save()`` (``table.save(path, {"step": state.step})``,
        then ``state.commit()``), and the server commits in ``on_save``, where it also takes the
        step from the metadata (``state.step = meta["step"]``): its state then equals the workers'
        at every commit, which matters when a server is rank 0, whose state every rank takes at a
        reset's sync. In the reset callback every rank creates the table again and calls
        ``load()``: on the server it answers the workers' load and returns. A load in the training
        function instead would deadlock: the server would be in the reset's sync, an all-ranks
        broadcast, while the workers waited in their load for it. Under SSP and ASP the server joins
        the checkpoints from inside its serving loop ([Note: a dedicated server checkpoints with its
        workers]; before 2026-12-06 only BSP tables with dedicated servers saved and loaded). Tested:
        ``test_a_table_survives_a_rank_killed[bsp-dedicated]`` and ``[ssp-dedicated]``.
        """
        if not self.is_server or self.is_worker:
            raise TableError(
                f"table {self.name!r}: serve() is for dedicated server ranks (servers={self.servers}); "
                f"rank {self.rank} is a worker"
            )
        if self.comm is None or self.closed:  # (before 2026-12-06 a second serve() failed in MPI: freed comm)
            return
        self._guarded(self._serve, on_save)

    def _serve(self, on_save: Callable[[dict[str, Any]], Any] | None = None, until_load: bool = False) -> Any:
        """Answer the workers until they close the table; with ``until_load``, until they load a checkpoint
        (return its metadata; a checkpoint that fails to load raises here as on the workers)."""
        if self.comm is None:
            return None
        if self._server is not None:
            # [Note: a dedicated server checkpoints with its workers]
            # Under SSP/ASP a dedicated server answers the workers on this thread, in Server.serve(); the
            # checkpoint's collectives need it too. A worker's save() or load() starts with a barrier mark (which
            # follows its pushes), then meets the others in the table communicator's barrier, the path's
            # broadcast and the checkpoint itself. So once every worker's mark is in and acknowledged (the same
            # operation on every worker: Server.on_checkpoint), the server takes the same steps from inside its
            # loop, with every push before the marks applied and no worker sending anything until the checkpoint
            # is done, then serves on (a load() called on it returns instead). Before 2026-12-06 such tables
            # refused save() and load().
            loaded: list[Any] = []

            def on_checkpoint(kind: int) -> bool:
                self.comm.Barrier()  # type: ignore[union-attr]
                op = ex.SAVE if kind == sv.SAVE_MARK else ex.LOAD
                stop, got = self._serve_checkpoint(op, on_save, until_load)
                loaded.append(got)
                return stop

            self._server.on_checkpoint = on_checkpoint
            try:
                self._server.serve()
            finally:
                self._server.on_checkpoint = None
            if self._server.paused:
                return loaded[-1]
        else:
            while True:
                rnd = ex.Round(self.comm, self.mpi, self.rank)
                head = rnd.header(ex.SERVE, np.zeros(self.size, np.int64))
                ops = {int(head[w, 0]) for w in self.workers}
                op = int(head[self.workers[0], 0])
                if ex.ERROR in ops:
                    self.comm.allgather(None)
                    continue
                if len(ops) > 1 and ex.CLOSE not in ops:  # the workers raise the mismatch; nothing else is
                    continue  # exchanged this round
                if ex.CLOSE in ops:  # (a close met another operation: closed on every rank, see the Note)
                    break
                if op == ex.SAVE or op == ex.LOAD:
                    stop, got = self._serve_checkpoint(op, on_save, until_load)
                    if stop:
                        return got
                    continue
                try:
                    self._bsp_body(
                        rnd,
                        op,
                        np.zeros(0, np.int64),
                        np.zeros(self.size, np.int64),
                        np.zeros((0, self.dim), self.dtype),
                        head[:, 1],
                    )
                except TableError as exc:  # a shard's apply() failed: the workers raise it, the server serves on
                    logger.info("table %r: %s", self.name, exc)
        self._finish()
        if until_load:
            raise TableError(f"table {self.name!r}: the workers closed the table while dedicated server rank "
                             f"{self.rank} waited in load() for them to load it")
        return None

    def _serve_checkpoint(self, op: int, on_save: Callable[[dict[str, Any]], Any] | None,
                          until_load: bool) -> tuple[bool, Any]:
        """A dedicated server's part of the workers' save or load: (whether ``_serve`` returns now, the loaded
        metadata). A checkpoint that fails raises on every rank: the workers report it and the server serves on
        (it stopped, and the workers' next operation waited for it for ever), unless it waits in load()."""
        from unison.common.ps import checkpoint

        path, metadata = self.comm.bcast(None, root=self.workers[0])  # type: ignore[union-attr]
        try:
            if op == ex.SAVE:
                checkpoint.save(self, path, metadata)
            else:
                loaded = checkpoint.load(self, path)
                if not self.consistency.collective:
                    self.comm.Barrier()  # type: ignore[union-attr]  # (as on the workers: see _checkpoint)
        except checkpoint.ck.CheckpointError as exc:
            if until_load and op == ex.LOAD:
                raise  # (as on the workers)
            logger.info("table %r: %s failed on every rank: %s", self.name, ex.OP_NAMES[op], exc)
            return False, None
        if op == ex.SAVE and on_save is not None:
            on_save(dict(metadata or {}))
        return (True, loaded) if op == ex.LOAD and until_load else (False, None)

    def close(self) -> None:
        """Collective: finish every operation, stop the server thread, free the communicators."""
        if self.closed:
            return
        if not self.is_worker:
            raise TableError(f"table {self.name!r}: rank {self.rank} is a dedicated server; serve() closes it")
        try:
            if self._queued:  # behind the queued operations
                self._executor.submit(self._locked, self._close_worker).result()
            else:  # on this thread (at the interpreter's exit the executors take no more work)
                self._inline(self._close_worker)
        except TableError:
            if self._closed_by:  # [Note: a close that meets another operation]: this rank closes all the same
                self._guarded(self._finish)
            raise
        self._guarded(self._finish)  # (a rank that dies meanwhile fails its barrier: the table is lost)

    def _close_worker(self) -> None:
        if self.comm is None:
            return
        if self.consistency.collective:
            if self._closed_by:  # [Note: a close that meets another operation]: no round pairs with one now
                return
            rnd = ex.Round(self.comm, self.mpi, self.rank)
            self._settle(rnd.header(ex.CLOSE, np.zeros(self.size, np.int64)), None, ex.CLOSE)
            return
        if self.shard is not None:
            self.shard.advance(self.workers.index(self.rank), sv.DONE)
        for r in self.servers:
            if r != self.rank:
                self._send(r, sv.pack(sv.FIN, 0, 0, np.zeros(0, np.int64)))
        self.mpi.Request.Waitall([r for r, _ in self._sends])
        self._sends = []

    def _finish(self) -> None:
        if self._server is not None:
            self._server.join()
        if self.comm is not None:
            self.comm.Barrier()
            if self._err is not None:  # errors no operation raised any more: receive each one sent here, then free
                sent = self._err_count[0].copy()
                server_sends = [] if self._server is None else self._server.error_sends  # (its thread has ended)
                if self._server is not None:
                    sent[self.workers] += self._server.failures  # (each to every worker)
                sent_here = np.empty(self.size, np.int64)
                self.comm.Alltoall([sent, self.mpi.INT64_T], [sent_here, self.mpi.INT64_T])
                status = self.mpi.Status()
                for _ in range(int((sent_here - self._err_count[1]).sum())):
                    self._err.Probe(self.mpi.ANY_SOURCE, self.mpi.ANY_TAG, status)
                    self._receive_error(status)
                for message, _ in self._peer_errors:  # (posted after this worker's last barrier, before its close)
                    logger.warning("table %r: closed before an operation raised a peer's error here: %s",
                                   self.name, message)
                self._peer_errors = []
                self.mpi.Request.Waitall([r for r, _ in self._err_sends + server_sends])
                self._err.Free()
            if self._orphans:  # every server answered its deferred pulls before the barrier (see the Note)
                self.mpi.Request.Waitall([o[0] for o in self._orphans])
                self._orphans = []
            self.comm.Free()
            if self._rep is not None:
                self._rep.Free()
        self._executor.shutdown(wait=True)
        self.closed = True
        with _registry_lock:
            _registry.pop(self.name, None)

    def __enter__(self) -> ShardedTable:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.is_worker:
            self.close()
        else:
            self.serve()

    def __repr__(self) -> str:
        return (
            f"ShardedTable({self.name!r}, {self.num_rows} x {self.dim} {self.dtype}, {self.sharding.kind}, "
            f"{self.consistency!r}, {len(self.servers)} servers, {len(self.workers)} workers)"
        )
