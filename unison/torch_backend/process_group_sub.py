"""Sub-groups of the ``torch.distributed`` backend: ``dist.new_group(ranks)`` and ``DeviceMesh`` dimensions.

[Note: sub-groups on MPI communicators]
PyTorch builds a sub-group's backend only on the group's members (the others get
``NON_GROUP_MEMBER``), while Unison's engine process sets are registered by every rank. So a
sub-group does not go through the engine: its members make an MPI communicator of their own with
``MPI_Comm_create_group`` (collective over the members only; PyTorch hands the backend the
group's global ranks), and each collective runs on it, on one thread per group, in the order
submitted (every member submits the same sequence, as PyTorch requires), through the same kernels
as the engine's (:mod:`unison.collectives.kernels`): the job's algorithm settings and chunk size
apply, ``auto`` picks MPI's call or our algorithms by size, and messages over 2 GiB, which MPI's
calls refuse here (``MPI_ERR_ARG``: before 2026-12-05 a sub-group's broadcast of a 2 GiB tensor
failed so), take pieces or our point-to-point algorithms ([Note: messages over 2 GiB] in
:mod:`unison.collectives.select`).
Before each call the members all-gather a 16-byte signature (operation, dtype, shape, root), so
tensors that differ across ranks raise the same error on every member instead of hanging or
truncating. The ``Work`` objects are the engine's (``collective_work``): ``wait()`` and
``get_future()`` complete when the call has. The methods mirror the engine's ``*_async``
functions, so the group class is the default group's with these operations swapped in.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from unison.collectives import kernels
from unison.collectives.reduce import check_op, same_start
from unison.common import runtime
from unison.common.engine.errors import refusal_class, refusal_kind
from unison.common.engine.executor import landing
from unison.common.engine.frontend import count_mismatch
from unison.common.exceptions import MismatchError
from unison.common.ops import ReduceOp, Sum

__all__ = ["CommOps", "create_sub_communicator"]

_CREATE_TAG = 7311  # MPI_Comm_create_group's tag for torch sub-groups


def create_sub_communicator(world: Any, global_ranks: Sequence[int]) -> Any:
    """The members' own communicator, ranks in ``global_ranks`` order (collective over the members only)."""
    group = world.Get_group().Incl(list(global_ranks))
    try:
        return world.Create_group(group, _CREATE_TAG)
    finally:
        group.Free()


class _Pending:
    """The engine ``Handle``'s interface (``wait``, ``add_done_callback``) over a future."""

    def __init__(self, future: concurrent.futures.Future[Any]) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> Any:
        return self._future.result(timeout)

    def add_done_callback(self, fn: Callable[[Any], Any]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))


def _array_or_error(tensor: Any) -> tuple[np.ndarray, Exception | None]:
    """``np.asarray(tensor)`` and no error, or an empty array and the error converting it raised (a local
    check the process group refused: see :meth:`CommOps._agree`)."""
    try:
        return np.asarray(tensor), None
    except (TypeError, ValueError) as exc:
        return np.empty(0, np.float32), exc


def _name(op: Any) -> str:
    return op.name.capitalize() if isinstance(op, ReduceOp) else str(op)


def _wide(arr: np.ndarray) -> np.ndarray:
    """float16/bfloat16 reduce as float32 (summed wide, rounded once); the kernels widen an integer
    average themselves (core [Note: integer average])."""
    if arr.dtype.itemsize == 2 and arr.dtype.kind in "fV":
        return arr.astype(np.float32)
    return np.ascontiguousarray(arr)


def _setting(field: str, default: Any) -> Any:
    """The job's setting ``field`` (the engine's, so a sub-group runs as the world group does)."""
    return getattr(runtime.state().config, field) if runtime.is_initialized() else default


class CommOps:
    """``allreduce_async``, ``broadcast_async``, ``allgather_async``, ``reducescatter_async`` and
    ``alltoall_async`` of one sub-group, run as MPI calls on its communicator (see the Note)."""

    def __init__(self, comm: Any, name: str) -> None:
        from mpi4py import MPI

        self.comm, self.mpi = comm, MPI
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"unison-pg-{name}")
        self._coalesced = itertools.count()
        self._failed: dict[str, str] = {}  # coalesced calls whose counts differed: their members' error

    def coalesced_base(self, kind: str) -> str:
        """The name of a coalesced call's members (``<base>.<i>``): the group's next number of such calls."""
        return f"coalesced_{kind}.{next(self._coalesced)}"

    def count_agreement(self, base: str, count: int, kind: str, what: str) -> _Pending:
        """The agreement on a coalesced call's member count, run in order before its members: when the counts
        differ, every member's call raises without communicating (the longer list's extra members would pair
        with the others' next calls; [Note: coalesced calls do not block] in process_group_collectives.py)."""
        return self._submit(self._count, base, count, what)

    def _count(self, base: str, count: int, what: str) -> int:
        every = np.empty(self.size, np.int64)
        self.comm.Allgather(np.array([count], np.int64), every)
        most, least = int(every.max()), int(every.min())
        if most != least:
            self._failed[base] = count_mismatch(what, least, most, count)
            raise MismatchError(self._failed[base])
        return count

    def _refuse_failed(self, name: str | None) -> None:
        """Raise a member of a coalesced call whose counts differed, before it communicates."""
        if name and self._failed:
            message = self._failed.get(name.rpartition(".")[0])
            if message is not None:
                raise MismatchError(message)

    @staticmethod
    def _chunk() -> int:
        return int(_setting("chunk_bytes", 1 << 20))

    def _submit(self, fn: Callable[..., Any], *args: Any) -> _Pending:
        return _Pending(self._thread.submit(fn, *args))

    def _agree(self, what: str, arr: np.ndarray, shape: Sequence[int], extra: int = 0,
               error: Exception | None = None, name: str | None = None) -> None:
        """Every member's call compared (a 16-byte digest each); raises on every member when they differ or a
        member's own checks refused its arguments (``error``: it takes part in this exchange instead of raising
        alone, which left the others' call unpaired and the next one paired with the wrong call). ``name``: a
        call made in a future's callback, compared too, so calls that meet out of order raise
        ([Note: collectives from future callbacks])."""
        key = (f"refused|{error}" if error is not None
               else f"{what}|{arr.dtype.str}|{tuple(shape)}|{extra}|{name or ''}").encode()
        mine = np.frombuffer(hashlib.blake2b(key, digest_size=16).digest(), np.int64).copy()
        every = np.empty((self.size, 2), np.int64)
        self.comm.Allgather(mine, every)
        if error is None and (every == mine).all():
            return
        rooted = what == "broadcast" or what.startswith("reduce/")
        call = f"{what}(dtype={arr.dtype}, shape={tuple(arr.shape)}" + (f", root={extra}" if rooted else "") + \
            (f", name={name!r})" if name else ")")
        # a refusal's kind as the engine's ("T", "U" or "V": [Note: refusal kinds] in common/engine/errors.py).
        # By its class name before 2026-12-06, so a TypeError's subclass (UnsupportedError) arrived as a
        # ValueError; then an UnsupportedError went as "T", recognised by its message's words (till later that day)
        kind = "" if error is None else refusal_kind(error)
        calls = self.comm.allgather((kind, str(error)) if error is not None else ("", call))
        refused = [(r, kind, text) for r, (kind, text) in enumerate(calls) if kind]
        if refused:
            cls = refusal_class(kind for _, kind, _ in refused)
            raise cls(f"a torch.distributed sub-group collective was refused on {len(refused)} of {self.size} "
                      "member(s): " + "; ".join(f"rank {r}: {text}" for r, _, text in refused))
        listing = "; ".join(f"rank {r}: {text}" for r, (_, text) in enumerate(calls))
        raise MismatchError(f"the members of this torch.distributed sub-group called different collectives "
                            f"at the same step ({listing}); every member must pass tensors of the same "
                            "dtype and shape" + (" and the same root" if rooted else ""))

    def allreduce_async(self, tensor: Any, op: Any = Sum, out: np.ndarray | None = None,
                        name: str | None = None) -> _Pending:
        return self._submit(self._allreduce, *_array_or_error(tensor), op, out, -1, name)

    def rooted_allreduce_async(self, tensor: Any, op: Any, root_rank: int, name: str | None = None) -> _Pending:
        """An all-reduce whose result only ``root_rank`` keeps, the root compared like a broadcast's."""
        return self._submit(self._allreduce, *_array_or_error(tensor), op, None, root_rank, name)

    def _allreduce(self, arr: np.ndarray, error: Exception | None, op: Any, into: np.ndarray | None = None,
                   root: int = -1, name: str | None = None) -> np.ndarray:
        what = f"allreduce/{_name(op)}" if root < 0 else f"reduce/{_name(op)}"
        self._refuse_failed(name)
        self._agree(what, arr, arr.shape, root, error, name)
        check_op(arr.dtype, op, 1.0, 1.0)  # after the agreement: every member raises alike
        send = _wide(arr)
        out = np.empty_like(send)
        kernels.allreduce(self.comm, self.mpi, send.reshape(-1), out.reshape(-1), op, 1.0, 1.0,
                          _setting("allreduce_algorithm", "auto"), self._chunk())
        if into is not None:
            np.copyto(into, out, casting="unsafe")
            return into
        return out.astype(arr.dtype, copy=False)

    def broadcast_async(self, tensor: Any, root_rank: int = 0, name: str | None = None,
                        out: np.ndarray | None = None) -> _Pending:
        """``out``: where the result may land, as the engine's (frontend.broadcast_async)."""
        return self._submit(self._broadcast, *_array_or_error(tensor), root_rank, name, out)

    def _broadcast(self, arr: np.ndarray, error: Exception | None, root: int, name: str | None,
                   out: np.ndarray | None = None) -> np.ndarray:
        self._agree("broadcast", arr, arr.shape, root, error, name)
        buf = landing(out, arr.shape, arr.dtype)
        source = np.ascontiguousarray(arr) if self.rank == root and not same_start(buf, arr) else None
        kernels.broadcast(self.comm, self.mpi, buf, root, _setting("broadcast_algorithm", "auto"), self._chunk(),
                          source=source)
        return buf

    def allgather_async(self, tensor: Any, name: str | None = None, out: np.ndarray | None = None) -> _Pending:
        """``out``: where the result may land, as the engine's (frontend.allgather_async)."""
        return self._submit(self._allgather, *_array_or_error(tensor), name, out)

    def _allgather(self, arr: np.ndarray, error: Exception | None, name: str | None,
                   into: np.ndarray | None = None) -> np.ndarray:
        self._refuse_failed(name)
        self._agree("allgather", arr, arr.shape, error=error, name=name)
        send = np.ascontiguousarray(arr)
        out = landing(into, (self.size * send.shape[0],) + send.shape[1:], send.dtype)
        if np.may_share_memory(send, out):  # (an input inside out=: MPI takes no overlap)
            send = send.copy()
        kernels.allgatherv(self.comm, self.mpi, send, out, [send.nbytes] * self.size,
                           _setting("allgather_algorithm", "auto"), self._chunk())
        return out

    def reducescatter_async(self, tensor: Any, op: Any = Sum, name: str | None = None,
                            out: np.ndarray | None = None) -> _Pending:
        """``out``: where the result may land, as the engine's (frontend.reducescatter_async)."""
        return self._submit(self._reducescatter, *_array_or_error(tensor), op, name, out)

    def _reducescatter(self, stacked: np.ndarray, error: Exception | None, op: Any,
                       name: str | None = None, into: np.ndarray | None = None) -> np.ndarray:
        """``stacked``: one piece per member along axis 0; returns this member's reduced piece, with a first
        axis of 1 (the engine's shape)."""
        self._refuse_failed(name)
        self._agree(f"reducescatter/{_name(op)}", stacked, stacked.shape, error=error, name=name)
        check_op(stacked.dtype, op, 1.0, 1.0)
        send = _wide(stacked)
        out = landing(into, (1, *send.shape[1:]), send.dtype, avoid=send)
        kernels.reducescatter(self.comm, self.mpi, send.reshape(-1), out.reshape(-1), [out.size] * self.size,
                              op, 1.0, 1.0, _setting("reducescatter_algorithm", "auto"), self._chunk())
        return out.astype(stacked.dtype, copy=False)

    def alltoall_async(self, tensor: Any, splits: Any = None, name: str | None = None) -> _Pending:
        return self._submit(self._alltoall, *_array_or_error(tensor), splits, name)

    def _alltoall(self, arr: np.ndarray, error: Exception | None, splits: Any,
                  name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``splits[r]`` (of axis 0) to member r; returns (rows received, by source; rows per source)."""
        self._agree("alltoall", arr, arr.shape[1:], error=error, name=name)
        rows = arr.shape[0] if arr.ndim else 1
        send_rows = (np.full(self.size, rows // self.size, np.int64) if splits is None
                     else np.asarray(splits, np.int64))
        row_bytes = int(np.prod(arr.shape[1:], dtype=np.int64)) * arr.dtype.itemsize
        every = np.empty((self.size, self.size), np.int64)  # rows, sender by receiver: the same everywhere
        self.comm.Allgather(send_rows, every)
        recv_rows = every[:, self.rank].copy()
        out = np.empty((int(recv_rows.sum()),) + arr.shape[1:], arr.dtype)
        kernels.alltoallv(self.comm, self.mpi, np.ascontiguousarray(arr), [int(v) * row_bytes for v in send_rows],
                          out, [int(v) * row_bytes for v in recv_rows], _setting("alltoall_algorithm", "auto"),
                          self._chunk(), largest=kernels.alltoall_largest(every, row_bytes))
        return out, recv_rows

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.comm.Free()
