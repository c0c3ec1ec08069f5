"""A ``torch.distributed`` backend on Unison's engine: ``dist.init_process_group("unison")``.

    import torch.distributed as dist
    import unison.torch_backend            # registers the backend "unison"

    dist.init_process_group("unison")      # under unisonrun / mpirun: rank and size from MPI
    model = torch.nn.parallel.DistributedDataParallel(model)

Each collective of the group is submitted to Unison's engine (negotiation, fusion, our
all-reduce algorithms) and returns at once; its ``Work`` (and ``Work.get_future()``) completes
when the engine has finished it, so DDP's bucket reductions overlap the backward pass.

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

This module holds the group and its registration; the group's collective methods are in
process_group_collectives.py (the tensor-side helpers in process_group_ops.py), its ``Work`` objects in
process_group_work.py, and the store of an MPI launch ([Note: the store under MPI]) in
process_group_store.py.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from unison.common import runtime
from unison.common.engine import frontend
from unison.torch_backend import process_group_functional as functional
from unison.torch_backend.process_group_collectives import Collectives
from unison.torch_backend.process_group_store import wrap_env_handler
from unison.torch_backend.process_group_sub import CommOps, create_sub_communicator
from unison.torch_backend.process_group_work import OwnRefusals, P2PWork, host, irecv_bytes, isend_bytes, seconds

__all__ = ["UnisonProcessGroup", "BACKEND"]

logger = logging.getLogger(__name__)

BACKEND = "unison"


class UnisonProcessGroup(Collectives, dist.ProcessGroup):
    """A process group of ``init_process_group("unison")``: the default group (every rank: the engine) or,
    given ``ops``, a sub-group whose collectives run on its own communicator (process_group_sub.py). Its
    collective methods are :class:`Collectives`' (process_group_collectives.py)."""

    def __init__(self, rank: int, size: int, ops: Any = None, comm: Any = None,
                 timeout_s: float | None = None) -> None:
        _exclude_from_dynamo()
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._ops = OwnRefusals(_SetOps() if ops is None else ops)
        self._comm = comm  # a sub-group's communicator (None: the job's)
        self._seq = itertools.count()  # the calls made outside a future's callback (Collectives._work)
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

    # ----------------------------------------------------------- point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        (t,) = tensors
        self._check_rank(dst, "send", "dst")
        self._check_tag(tag)
        # as bytes: mpi4py takes no bfloat16 array (a BufferError where gloo sends it)
        data = _bytes(np.ascontiguousarray(host(_numpy_able(t), "send", any_dtype=True)))
        return P2PWork(isend_bytes(self._p2p_comm, data, dst, tag), data, timeout_s=self._timeout_s)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        self._check_rank(src, "recv", "src")  # (-1 is MPI's any source: a receive from anyone, reported as -1)
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        from mpi4py import MPI

        return self._recv(tensors, MPI.ANY_SOURCE, tag)

    def _recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        self._check_tag(tag)
        t = _numpy_able(tensors[0])  # (written through: a view of the same memory)
        # the tensor's own values first: a shorter message leaves the rest of it as it was (as gloo),
        # where an empty buffer copied uninitialised memory into it
        buf = np.array(host(t, "recv", any_dtype=True), copy=True, order="C")
        return P2PWork(irecv_bytes(self._p2p_comm, _bytes(buf), src, tag), buf, into=t,
                       timeout_s=self._timeout_s)

    @staticmethod
    def _check_tag(tag: Any) -> None:
        """A tag MPI takes as given: -1 is its any-tag (a receive of any message) and gloo refuses it too."""
        from mpi4py import MPI

        if not 0 <= int(tag) <= MPI.COMM_WORLD.Get_attr(MPI.TAG_UB):
            raise ValueError(f"Tag must be nonnegative and at most {MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)}; "
                             f"got tag={tag}")


#: the integer dtype of each element size, for the memory of a tensor whose dtype numpy has no type for
_SAME_SIZE_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _numpy_able(t: torch.Tensor) -> torch.Tensor:
    """``t``, or where numpy has no type for its dtype (float8 and the other 1-byte float formats), a view of
    its memory as integers of the same size: point to point moves bytes. (Before 2026-12-07 a float8 send or
    receive raised numpy's "Got unsupported ScalarType Float8_e4m3fn"; gloo sends them; found by an audit.)"""
    return t if _numpy_has(t.dtype) else t.view(_SAME_SIZE_INTEGER[t.element_size()])


@functools.cache
def _numpy_has(dtype: torch.dtype) -> bool:
    try:
        torch.empty(0, dtype=dtype).numpy()
    except TypeError:
        return False
    return True


def _out_of_dynamo(cls: type) -> None:
    """[Note: the group's methods are out of torch.compile's reach] A compiled ``DistributedDataParallel``
    (``torch.compile(ddp_model)``, any backend) runs DDP's forward under TorchDynamo, whose frame hook
    then sees the Python frames of the collectives DDP's C++ reducer calls on this group (its bucket
    broadcasts) and tries to trace them: "Attempted to access unregistered member on an OpaqueObject"
    raised on every rank (before 2026-12-06 evening; gloo's and NCCL's methods are C++, which Dynamo
    never sees). The group's public methods (and the older names PyTorch binds) are therefore excluded
    from Dynamo (``torch.compiler.disable``, which also covers what they call): a compiled model's
    collectives run as the eager ones do, about 1 us more per call. The functional collectives
    (process_group_functional.py) are dispatcher kernels and stay in compiled graphs.
    """
    import inspect

    names = {name for klass in cls.__mro__ if klass.__module__.startswith("unison.")
             for name, member in vars(klass).items()
             if inspect.isfunction(member) and (not name.startswith("_") or name in ("_allgather_base",
                                                                                      "_reduce_scatter_base"))}
    for name in sorted(names):
        setattr(cls, name, torch.compiler.disable(getattr(cls, name)))


_excluded = False


def _exclude_from_dynamo() -> None:
    """:func:`_out_of_dynamo` for the group class, once, when the first group is made: ``torch.compiler.disable``
    imports ``torch._dynamo`` (with inductor and sympy: 0.8 s of CPU, and it sets ``TORCHINDUCTOR_CACHE_DIR``),
    which every ``import unison.torch_backend`` paid before 2026-12-07 (an audit), ``torch.distributed`` user or
    not."""
    global _excluded
    if not _excluded:
        _excluded = True
        _out_of_dynamo(UnisonProcessGroup)


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
    """The engine's operations on one process set (None: the job's global set, the default group's): what a
    group of every rank runs its collectives through ([Note: groups of every rank]). ``name``: a call made
    inside a future's callback ([Note: collectives from future callbacks]), a reduce's too: ranks that name
    different roots raise ``MismatchError``, named or not (until 2026-12-06 a named reduce was an all-reduce
    named after its root, and such ranks stalled until the engine's stall check)."""

    def __init__(self, process_set: Any = None) -> None:
        self.process_set = process_set

    def allreduce_async(self, arr: Any, op: Any, out: Any = None, name: str | None = None) -> Any:
        return frontend.allreduce_async(arr, op, name=name, process_set=self.process_set, out=out)

    def coalesced_base(self, kind: str) -> str:
        """The name of a coalesced call's members (``<base>.<i>``), the same on every rank: the set's next
        unnamed name of ``kind``'s coalesced calls ([Note: coalesced calls do not block] in
        process_group_collectives.py)."""
        return frontend._auto_name(f"coalesced_{kind}", None, self.process_set)

    def count_agreement(self, base: str, count: int, kind: str, what: str) -> Any:
        """The agreement on a coalesced call's member count, asynchronous: a longer call's extra members meet
        refusals (frontend.group_size_agreement)."""
        return frontend.group_size_agreement(base, count, self.process_set, kind, what=what)

    def reducescatter_async(self, arr: Any, op: Any, name: str | None = None, out: Any = None) -> Any:
        return frontend.reducescatter_async(arr, op, name=name, process_set=self.process_set, out=out)

    def close(self) -> None:
        """Unregister the group's process set (every member destroys the group: [Note: a destroyed group frees
        its communicators]); nothing for the global set, or when Unison has already shut down."""
        if self.process_set is None:
            return
        eng = frontend.running_engine()
        if eng is None or not eng.alive() or self.process_set.process_set_id is None:
            return  # (Unison shut down, or its engine stopped: the set went with it)
        try:
            frontend.remove_process_set(self.process_set)
        except Exception as exc:  # noqa: BLE001 - a destroy must finish; the set is then left registered
            logger.warning("destroy_process_group: could not remove the group's process set (%s); a group of "
                           "every rank is destroyed on every rank, as it was made", exc)

    def broadcast_async(self, arr: Any, root: int, name: str | None = None, out: Any = None) -> Any:
        return frontend.broadcast_async(arr, root, name=name, process_set=self.process_set, out=out)

    def allgather_async(self, arr: Any, name: str | None = None, out: Any = None) -> Any:
        return frontend.allgather_async(arr, name=name, process_set=self.process_set, out=out)

    def alltoall_async(self, arr: Any, splits: Any, name: str | None = None) -> Any:
        return frontend.alltoall_async(arr, splits, name=name, process_set=self.process_set)

    def rooted_allreduce_async(self, arr: Any, op: Any, root: int, name: str | None = None) -> Any:
        # (set ranks are job ranks; the root is compared across ranks, named or not: a MismatchError)
        return frontend.rooted_allreduce_async(arr, op, root, self.process_set, name=name)


def register() -> None:
    """Register the backend ``"unison"`` with ``torch.distributed`` (once; importing
    ``unison.torch_backend`` does it)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    wrap_env_handler()
