"""The engine's user API on numpy arrays: ``*_async`` submissions, ``poll``, ``synchronize``.

Every function builds a named :class:`Request` and hands it to the engine. A
rank whose arguments are invalid still submits the name, carrying the error, so
that every rank raises it instead of the others waiting. Unnamed calls get
``<op>.noname.<n>`` names from per-op counters, identical on every rank as long as
ranks make the same calls in the same order.

A job of size 1 (no mpirun) computes immediately and returns a finished handle.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from unison.collectives import adasum
from unison.collectives import api as direct
from unison.collectives.reduce import check_op
from unison.collectives.validate import as_array, check_root, check_splits
from unison.common import runtime
from unison.common.compression import Compression, Compressor
from unison.common.dtypes import dtype_code
from unison.common.engine.engine import Engine, caller_waits
from unison.common.engine.errors import refusal_kind
from unison.common.engine.handles import Handle, wait_all
from unison.common.engine.process_sets import ProcessSet, global_process_set, not_registered
from unison.common.engine.requests import AUTO_NAME_MARK, AUTO_NAME_SLOTS, Kind, Request
from unison.common.engine.timeline import Timeline
from unison.common.exceptions import MismatchError
from unison.common.ops import Average, ReduceOp, parse_op

__all__ = [
    "allreduce_async", "allgather_async", "broadcast_async", "alltoall_async", "reducescatter_async",
    "grouped_allreduce_async", "grouped_allreduce", "allreduce", "allgather", "broadcast", "alltoall",
    "reducescatter", "barrier", "join", "poll", "synchronize", "engine", "add_process_set",
    "remove_process_set", "start_timeline", "stop_timeline",
]

_counters: collections.Counter[str] = collections.Counter()
logger = logging.getLogger(__name__)
#: dtypes whose every op is valid (bool refuses Average, so it takes the checked path)
# ops the fast path may submit unchecked (Adasum and the bitwise ops have rules: checks() below)
_FAST_OPS = frozenset({ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT})
#: the supported dtypes but bool, which the fast path below takes; bfloat16 too, by name (see dtypes.py)
_FAST_DTYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int8, np.int16, np.int32,
                                               np.int64, np.uint8, np.uint16))


def engine(what: str = "this call") -> Engine | None:
    """The running engine, started on first use; None in a job of size 1."""
    st = runtime.state(what)
    eng = st.cache.get("engine")
    if eng is None and st.size > 1:
        from mpi4py import MPI

        eng = st.cache["engine"] = Engine(st.comm.Dup(), MPI, st.config, st.rank)
    return eng


def running_engine() -> Engine | None:
    """The engine if this process started one (never starts it)."""
    if not runtime.is_initialized():
        return None
    return runtime.state().cache.get("engine")


def _stop_engine(st: runtime.State) -> None:
    eng = st.cache.pop("engine", None)
    if eng is not None:
        eng.stop()
    local = st.cache.pop("local_timeline", None)
    if local is not None:
        local.stop()


def _start_engine(st: runtime.State, process_sets: list[Any]) -> None:
    reset_auto_names()  # a new world names its unnamed calls from 0 (ranks reach init() with any counts)
    if engine("unison.init()") is None and st.config.timeline:  # (collective: it duplicates the communicator)
        _local_timeline(st).start(st.config.timeline)
    for ps in process_sets:
        add_process_set(ps)


def _local_timeline(st: runtime.State) -> Timeline:
    """The timeline of a job of size 1, which runs no engine.

    [Note: a timeline at size 1] Its collectives are local copies made on the caller's thread; each
    is one slice named after its kind (``ALLREDUCE``...) in its name's row. Without it the file was
    never written (Horovod writes one at size 1 too).
    """
    tl = st.cache.get("local_timeline")
    if tl is None:
        tl = st.cache["local_timeline"] = Timeline()
    return tl


def _local(kind: str, name: str, run: Callable[[], Any], post: Callable[[Any], Any] | None = None) -> Handle:
    """A collective of a job of size 1: ``run()`` now, as one slice of the timeline when one records."""
    tl = runtime.state().cache.get("local_timeline")
    if tl is None or not tl.active:
        return _done(run(), post)
    tl.begin(name, kind)
    tl.flush()  # as the engine does before each collective ([Note: a timeline survives the job])
    try:
        return _done(run(), post)
    finally:
        tl.end(name, kind)


def _close_timelines(st: runtime.State, reason: str) -> None:
    """Before the job is aborted: close the trace ([Note: a timeline survives the job] in .timeline)."""
    for tl in (getattr(st.cache.get("engine"), "timeline", None), st.cache.get("local_timeline")):
        if tl is not None:
            tl.abandon(reason)


runtime.add_shutdown_hook(_stop_engine)
runtime.add_init_hook(_start_engine)
runtime.add_abort_hook(_close_timelines)


def _auto_name(kind: str, name: str | None, process_set: ProcessSet | None = None) -> str:
    """``name``, or the next ``<kind>.noname.<n>``: one counter per kind and process set.

    [Note: a counter per process set] A rank makes the unnamed calls of the sets it belongs
    to only, so a counter shared by all sets would leave a rank that sat out another set's
    calls behind its peers, and their next common call would carry different names (a hang,
    seen with tensor-parallel groups). Calls on a set other than the global one are named
    ``<kind>.set<id>.noname.<n>``.

    [Note: unnamed calls reuse names] The engine's negotiation caches names: a name it has
    seen costs one bit in one reduction, a new one a round of all-gathering names and
    signatures. A counter that grows forever made every unnamed call a new name (measured:
    a lone unnamed 4 KiB all-reduce 1.7-2.6x the named one). So the n-th unnamed call gets
    slot ``n % AUTO_NAME_SLOTS``: the same on every rank, since ranks make the same calls in
    the same order, and cached from the second round on. Should an unnamed call's slot
    still be in flight on this rank (``AUTO_NAME_SLOTS`` unnamed calls of one op outstanding),
    the engine holds the new call and queues it when the old one completes, where a
    user's duplicate name raises; completions happen at the same cycle on every rank, so
    every rank runs the two calls in the same order.
    """
    if name is not None:
        return str(name)
    sid = getattr(process_set, "process_set_id", None)
    if process_set is None or process_set is global_process_set:
        counters, key = _counters, kind
    elif sid is None:  # removed or never added: refused before it takes a name (before 2026-12-07 it took the
        # global set's next one, and the ranks that made the refused call paired their next unnamed global
        # calls with the other ranks' previous ones: each other's data, then a stall; found by an audit)
        raise not_registered(process_set)
    else:
        counters, key = _set_counters(process_set, sid), f"{kind}.set{sid}"
    me = threading.current_thread()
    with _auto_lock:  # (two threads read-then-bumped one count: both calls took one name)
        n = counters[key]
        counters[key] = n + 1
        last = _auto_callers.get(key)
        _auto_callers[key] = me
    if last is not None and last is not me and key not in _auto_warned and _both_python(last, me) \
            and last.is_alive():
        _warn_threads(key, last, me)
    return f"{key}{AUTO_NAME_MARK}{n % AUTO_NAME_SLOTS}"


_auto_lock = threading.Lock()
#: the thread that made each counter's last unnamed call, and the counters already warned about
_auto_callers: dict[str, threading.Thread] = {}
_auto_warned: set[str] = set()


def _both_python(a: threading.Thread, b: threading.Thread) -> bool:
    """Whether both threads were started by Python's ``threading``: a framework's own threads (TensorFlow's
    inter-op pool running a ``numpy_function``, JAX's callback threads) appear as dummy threads, and the
    framework keeps their callbacks in program order (the Keras ops' unnamed calls: found by a review)."""
    dummy = threading._DummyThread  # noqa: SLF001 - how threading marks threads it did not start
    return not isinstance(a, dummy) and not isinstance(b, dummy)


def _warn_threads(key: str, last: threading.Thread, me: threading.Thread) -> None:
    """[Note: unnamed calls from several threads] Unnamed calls are paired across ranks by their order, and two
    threads of one process interleave their calls differently on each rank: a loader thread's unnamed
    all-reduce of a metric was summed with another rank's main-thread all-reduce of a gradient of the same
    shape, silently (found by an audit, 2026-12-06: 16 of 300 results wrong; Horovod pairs them the same way).
    Which thread a rank's call came from is not known to the others, so it cannot be told apart; a warning
    once per kind of call, while both threads live, says what to do."""
    _auto_warned.add(key)
    logger.warning("[unison rank %d] unnamed %r calls come from two live threads (%r and %r): unnamed calls "
                   "are paired across ranks by their order, which differs between ranks when threads interleave, "
                   "so one thread's tensor can be reduced with another's without an error. Give the calls of "
                   "every thread but one a name (name=...)", runtime.rank() if runtime.is_initialized() else -1,
                   key, last.name, me.name)


def _set_counters(process_set: ProcessSet, sid: int) -> collections.Counter[str]:
    """The unnamed-call counters of ``process_set`` under its current id: kept on the set object
    and started afresh whenever the set is registered under a new id (ids are reused after a
    removal or a new ``init()``; a count left from an earlier set of that id would differ
    between ranks that did and did not belong to it)."""
    key = (sid, _generation[0])
    held = getattr(process_set, "_unison_auto_names", None)
    if held is None or held[0] != key:
        held = (key, collections.Counter())
        process_set._unison_auto_names = held  # type: ignore[attr-defined]
    return held[1]


#: bumped by :func:`reset_auto_names`: every set's counters start again at their next call
_generation = [0]


def reset_auto_names() -> None:
    """Start the ``<op>.noname.<n>`` counters again, the global set's and every process set's (after an
    elastic reset, so that ranks that had reached different counts before a failure name their next
    calls alike; a set's counters kept counting before 2026-12-05, since recovery registers the same
    set objects under the same ids)."""
    _counters.clear()
    _auto_callers.clear()
    _generation[0] += 1


def _check_local(process_set: ProcessSet | None) -> None:
    """In a size-1 job: only registered sets (which all hold rank 0) are usable."""
    if process_set is not None and process_set.process_set_id is None:
        raise not_registered(process_set)


def _set_id(eng: Engine, process_set: ProcessSet | None) -> tuple[int, int]:
    """(process set id, its size) — raising now if the set is unusable on this rank."""
    if process_set is None or process_set.process_set_id == 0 and process_set.ranks is None:
        return 0, runtime.size()
    st = eng.process_set(process_set)
    return st.ps.process_set_id or 0, st.comm.Get_size()


def _done(value: Any, post: Callable[[Any], Any] | None = None) -> Handle:
    h = Handle("local", post)
    h.set_result(value)
    return h


def _submit(eng: Engine, kind: Kind, name: str, tensor: Any, sid: int,
            checks: Callable[[np.ndarray], dict | None], post: Callable[[Any], Any] | None = None,
            **fields: Any) -> Handle:
    """Build the request; an argument error is carried in it (its kind, ":" and its message: [Note: refusal
    kinds] in errors.py).

    ``checks(array)`` raises for invalid arguments and may return extra request fields.
    """
    error, arr = "", np.empty(0, dtype=np.float32)
    try:
        arr = as_array(tensor)
        if not arr.flags.c_contiguous:  # (np.ascontiguousarray would also turn 0-d into 1-d)
            arr = np.ascontiguousarray(arr)
        fields.update(checks(arr) or {})
    except (TypeError, ValueError) as exc:
        error = f"{refusal_kind(exc)}:{exc}"
    req = Request(name=name, kind=kind, array=arr, handle=Handle(name, post), process_set=sid,
                  error=error, **fields)
    return eng.submit(req)


class Refused:
    """An input an adapter's own check refused on this rank, submitted anyway in its place: converting it
    raises ``error``, which the request carries, so every rank of the collective raises it (naming this
    rank) and the ranks' next calls pair as before. Raised at once on this rank alone, it left the others'
    call unpaired, and their next collective paired with it: stale data here, a hang there."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise self.error


def _array_or_error(tensor: Any, eng: Engine | None) -> tuple[np.ndarray, Exception | None]:
    """``np.asarray(tensor)``, and no error; with an engine, an input numpy cannot convert (a ragged list)
    gives an empty array and the error, for the request's ``checks`` to raise, so that it travels in the
    request and every rank raises (raised here at once, it left the other ranks waiting for ever)."""
    try:
        return np.asarray(tensor), None
    except (TypeError, ValueError) as exc:
        if eng is None:
            raise
        return np.empty(0, np.float32), exc


def _op(op: Any) -> ReduceOp:
    try:
        return parse_op(op)
    except ValueError:
        return ReduceOp.SUM  # reported through the checks below


def allreduce_async(tensor: Any, op: Any = Average, name: str | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet | None = None,
                    compression: type[Compressor] = Compression.none,
                    out: np.ndarray | None = None, algorithm: str | None = None) -> Handle:
    """Submit an all-reduce of ``tensor`` (see :func:`unison.allreduce`); returns a handle.

    ``algorithm`` None is the job's ``UNISON_ALLREDUCE_ALGORITHM`` (``auto`` unless set).

    ``synchronize(handle)`` returns the reduced array (``out`` when given). The
    engine reads ``tensor`` later, in its thread: do not modify it until then.
    """
    st = runtime._state
    if (st is not None and type(tensor) is np.ndarray and type(op) is ReduceOp and out is None
            and process_set is None and compression is Compression.none and algorithm is None
            and prescale_factor == 1.0 and postscale_factor == 1.0 and tensor.flags.c_contiguous
            and (tensor.dtype in _FAST_DTYPES or tensor.dtype.name == "bfloat16")
            and op in _FAST_OPS):  # the common case, kept cheap
        eng = st.cache.get("engine")
        if eng is not None:
            name = _auto_name("allreduce", None) if name is None else str(name)  # global set here
            return eng.submit(Request(name, Kind.ALLREDUCE, tensor, Handle(name), op=int(op)))
    eng = engine("unison.allreduce_async()")
    name = _auto_name("allreduce", name, process_set)
    array, unusable = _array_or_error(tensor, eng)
    compressed, ctx = compression.compress(array)
    post: Callable[[Any], Any] | None = None
    wire_out = out  # with compression the wire array has another dtype: out= gets the decompressed result
    if compression is not Compression.none:
        wire_out = None

        def post(result: Any) -> Any:
            value = compression.decompress(result, ctx)
            if out is None:
                return value
            np.copyto(out, np.asarray(value).reshape(out.shape), casting="unsafe")
            return out
    if eng is None:
        _check_local(process_set)
        if out is not None and wire_out is None:
            direct._check_out(out, array)
        return _local("ALLREDUCE", name, lambda: direct.allreduce(compressed, op, name, prescale_factor,
                                                                  postscale_factor, out=wire_out), post)
    rop = _op(op)
    sid, set_size = _set_id(eng, process_set)
    if rop is ReduceOp.ADASUM:  # Horovod's rules, raised on every rank alike (NotImplementedError)
        if sid != 0:
            raise NotImplementedError("Adasum does not support non-global process sets yet (as in Horovod)")
        adasum.check_size(set_size)

    def checks(arr: np.ndarray) -> None:
        if unusable is not None:
            raise unusable
        parse_op(op)
        check_op(arr.dtype, rop, float(prescale_factor), float(postscale_factor))
        if algorithm is not None:
            direct.validate_algorithm("allreduce_algorithm", algorithm)
        if out is not None:  # against the caller's array (with compression, not the wire's)
            direct._check_out(out, array)

    usable_out = isinstance(wire_out, np.ndarray) and wire_out.flags.c_contiguous and wire_out.flags.writeable
    return _submit(eng, Kind.ALLREDUCE, name, compressed, sid, checks, post, op=int(rop),
                   prescale=float(prescale_factor), postscale=float(postscale_factor),
                   out=wire_out if usable_out else None, algorithm="" if algorithm is None else str(algorithm))


def count_mismatch(what: str, least: int, most: int, count: int) -> str:
    """The error of a call ``what`` whose ranks passed ``least`` to ``most`` tensors (this rank ``count``)."""
    return (f"{what}: the ranks passed {least} to {most} tensors (this rank {count}); every rank must pass the "
            "same number")


def group_size_agreement(base: str, count: int, process_set: ProcessSet | None = None,
                         members: str = "allgather", what: str | None = None) -> Handle:
    """Submit the agreement on a group's member count that a grouped op of one request per member
    needs (``grouped_allgather``, ``grouped_reducescatter``, an Adasum ``grouped_allreduce``:
    ``members`` names the kind); its ``wait`` raises :class:`MismatchError` on every rank when ranks
    passed groups of different lengths.

    ``what``: the call its mismatch error names (default: the grouped collective ``base``).

    Wait on it before the members. [Note: a longer group's extra members] When the counts differ,
    a rank with fewer members submits, as soon as the agreement completes (on the thread that
    completes it, waited on or not), a refusal (:class:`Refused`) under the name of each member
    it lacks, ``<base>.<i>`` up to the largest count: a longer group's extra members pair with
    those and fail, so nothing is left pending (and the agreement's ``wait`` raises only once this
    rank's refusals are done, so the names are free for a retry at once). Left pending (before
    2026-12-05), such a member met the same name's next use: a rank waited on it for ever, or,
    with unnamed calls (whose names come back every ``AUTO_NAME_SLOTS`` calls), a later group's
    member was paired with this one's stale data, a silent wrong result.
    """
    if members not in ("allgather", "reducescatter", "allreduce"):
        raise ValueError(f"members={members!r}: a grouped op of one request per member is an 'allgather', "
                         "a 'reducescatter' or an 'allreduce'")
    handle = allreduce_async(np.array([count, -count], np.int64), ReduceOp.MAX, f"{base}.count",
                             process_set=process_set)
    post = handle._post

    def counts(result: Any) -> tuple[int, int]:
        result = result if post is None else post(result)
        return int(result[0]), -int(result[1])

    def message(most: int, least: int) -> str:
        if what is not None:
            return count_mismatch(what, least, most, count)
        return (f"grouped collective {base!r}: the ranks passed groups of {least} to {most} tensors (this "
                f"rank {count}); every rank must pass the same number")

    fillers: list[Handle] = []  # this rank's refusals of the members it lacks

    def check(result: Any) -> int:
        most, least = counts(result)
        if most != least:
            for filler in fillers:  # done before the error is raised, so the names are free again for a retry
                try:
                    filler.wait()
                except Exception:  # noqa: BLE001, S110 - a refusal fails, as it should
                    pass
            raise MismatchError(message(most, least))
        return count

    def settle(done: Handle) -> None:  # (runs before any waiter sees the agreement done)
        if done._error is not None:  # (the job failed or stopped: the members fail with it)
            return
        most, least = counts(done._result)
        for i in range(count, most):
            refused = Refused(MismatchError(message(most, least)))
            if members == "reducescatter":
                fillers.append(reducescatter_async(refused, Average, f"{base}.{i}", process_set=process_set))
            elif members == "allreduce":
                fillers.append(allreduce_async(refused, Average, f"{base}.{i}", process_set=process_set))
            else:
                fillers.append(allgather_async(refused, f"{base}.{i}", process_set))

    handle._post = check
    handle.add_done_callback(settle)
    return handle


def allgather_async(tensor: Any, name: str | None = None, process_set: ProcessSet | None = None,
                    out: np.ndarray | None = None) -> Handle:
    """Submit an all-gather along the first dimension (which may differ per rank).

    ``out``: where the result may land: the result is ``out`` itself when ``out`` is a C-contiguous,
    writeable array of exactly the gathered shape and dtype, else a new array (compare with ``is``;
    [Note: out= beyond the all-reduce] in executor.py).
    """
    eng = engine("unison.allgather_async()")
    name = _auto_name("allgather", name, process_set)
    arr, unusable = _array_or_error(tensor, eng)
    arr = arr.reshape(1) if arr.ndim == 0 else arr
    if eng is None:
        _check_local(process_set)
        return _local("ALLGATHER", name, lambda: direct.allgather(arr, name))
    sid, _ = _set_id(eng, process_set)

    def checks(a: np.ndarray) -> None:
        if unusable is not None:
            raise unusable

    return _submit(eng, Kind.ALLGATHER, name, arr, sid, checks, out=out)


def rooted_allreduce_async(tensor: Any, op: Any, root_rank: int, process_set: ProcessSet | None = None,
                           name: str | None = None) -> Handle:
    """An all-reduce whose result only ``root_rank`` keeps (``torch.distributed.reduce``); unnamed unless
    ``name`` is given (a torch collective issued from a future's callback is named).

    The root travels in the request's signature, as a broadcast's does, so ranks that name
    different roots raise :class:`MismatchError` on every rank instead of each keeping or
    dropping the sum as it thinks (not exported: Horovod has no reduce).
    """
    eng = engine("reduce")
    name = _auto_name("allreduce", name, process_set)
    if eng is None:
        return allreduce_async(tensor, op, name=name, process_set=process_set)
    arr, unusable = _array_or_error(tensor, eng)
    rop = _op(op)
    sid, size = _set_id(eng, process_set)
    root = int(root_rank) if isinstance(root_rank, (int, np.integer)) else -1

    def checks(a: np.ndarray) -> None:
        if unusable is not None:
            raise unusable
        parse_op(op)
        check_op(a.dtype, rop, 1.0, 1.0)
        check_root(root_rank, size, "this job" if sid == 0 else f"process set {sid}")

    return _submit(eng, Kind.ALLREDUCE, name, arr, sid, checks, op=int(rop), root=root)


def broadcast_async(tensor: Any, root_rank: int = 0, name: str | None = None,
                    process_set: ProcessSet | None = None, out: np.ndarray | None = None) -> Handle:
    """Submit a broadcast from ``root_rank`` (a rank of ``process_set``).

    ``out``: where the result may land, as for :func:`allgather_async` (``out=tensor`` broadcasts in
    place).
    """
    eng = engine("unison.broadcast_async()")
    name = _auto_name("broadcast", name, process_set)
    if eng is None:
        _check_local(process_set)
        return _local("BROADCAST", name, lambda: direct.broadcast(tensor, root_rank, name))
    sid, size = _set_id(eng, process_set)
    root = int(root_rank) if isinstance(root_rank, (int, np.integer)) else -1
    within = "this job" if sid == 0 else f"process set {sid} (roots are ranks within the set)"
    return _submit(eng, Kind.BROADCAST, name, tensor, sid, lambda a: check_root(root_rank, size, within),
                   root=root, out=out)


def alltoall_async(tensor: Any, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet | None = None) -> Handle:
    """Submit an all-to-all; the result is ``(received, received_splits)``."""
    eng = engine("unison.alltoall_async()")
    name = _auto_name("alltoall", name, process_set)
    if eng is None:
        _check_local(process_set)
        return _local("ALLTOALL", name, lambda: direct.alltoall(tensor, splits, name))
    sid, size = _set_id(eng, process_set)

    def checks(arr: np.ndarray) -> dict:
        if arr.ndim == 0:
            raise ValueError("alltoall needs an array with at least one dimension; got a 0-d array")
        return {"splits": tuple(check_splits(splits, arr.shape[0], size))}

    return _submit(eng, Kind.ALLTOALL, name, tensor, sid, checks)


def reducescatter_async(tensor: Any, op: Any = Average, name: str | None = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: ProcessSet | None = None, out: np.ndarray | None = None) -> Handle:
    """Submit a reduce-scatter; the result is this rank's rows of the reduction.

    ``out``: where the result may land, as for :func:`allgather_async` (not when it overlaps the input).
    """
    eng = engine("unison.reducescatter_async()")
    name = _auto_name("reducescatter", name, process_set)
    if eng is None:
        _check_local(process_set)
        return _local("REDUCESCATTER", name, lambda: direct.reducescatter(tensor, op, name, prescale_factor,
                                                                          postscale_factor))
    rop = _op(op)
    sid, _ = _set_id(eng, process_set)

    def checks(arr: np.ndarray) -> None:
        parse_op(op)
        check_op(arr.dtype, rop, float(prescale_factor), float(postscale_factor), "reducescatter")
        if arr.ndim == 0:
            raise ValueError("reducescatter needs an array with at least one dimension to split; "
                             "got a 0-d array. Reshape it to (1,) or use allreduce")

    return _submit(eng, Kind.REDUCESCATTER, name, tensor, sid, checks, op=int(rop),
                   prescale=float(prescale_factor), postscale=float(postscale_factor), out=out)


class _GroupHandle(Handle):
    """Completes when every member does; its result is the list of results (after the first ``first``:
    a count agreement's)."""

    __slots__ = ("members", "first")

    def __init__(self, name: str, members: list[Handle], first: int = 0) -> None:
        super().__init__(name)
        self.members, self.first = members, first

    def done(self) -> bool:
        return all(h.done() for h in self.members)

    def set_result(self, value: Any) -> None:
        raise TypeError("a group handle completes through its members")

    def wait(self, timeout: float | None = None) -> Any:
        return wait_all(self.members, timeout)[self.first:]  # [Note: a group waits for all its members]


def grouped_allreduce_async(tensors: Sequence[Any], op: Any = Average, name: str | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet | None = None,
                            compression: type[Compressor] = Compression.none) -> Handle:
    """Submit all-reduces of several tensors at once, as one request (one negotiation, fused).

    ``synchronize(handle)`` returns the list of results, in order. The members travel as
    one engine request named ``name`` (executor [Note: grouped requests]); a member that
    differs across ranks is reported as ``<name>.<i>``. Adasum (its coefficients are per
    tensor) and a job of size 1 take one request per member, named ``<name>.<i>``.
    """
    base = _auto_name("grouped_allreduce", name, process_set)
    eng = engine("unison.grouped_allreduce_async()")
    rop = _op(op)
    if eng is None or rop is ReduceOp.ADASUM:
        # one request per member: with an engine, a count agreement first (groups of different lengths
        # left the longer one's extra members waiting for ever, before 2026-12-05)
        count = [] if eng is None else [group_size_agreement(base, len(tensors), process_set, "allreduce")]
        handles = [allreduce_async(t, op, f"{base}.{i}", prescale_factor, postscale_factor, process_set,
                                   compression) for i, t in enumerate(tensors)]
        return _GroupHandle(base, count + handles, len(count))
    # (an empty group is submitted too: it pairs with the other ranks' call, a mismatch when theirs is not
    # empty; returned at once on this rank alone, it left their call unpaired, a hang, before 2026-12-05)
    sid, _ = _set_id(eng, process_set)
    members: list[np.ndarray] = []
    layout: list[tuple[int, tuple[int, ...]]] = []
    contexts: list[Any] = []
    codes: dict[np.dtype, int] = {}  # each dtype checked once: a group may hold a thousand tensors
    plain = compression is Compression.none
    try:
        parse_op(op)
        error = ""
    except ValueError as exc:  # the op's error names no member, as a single call's does not
        error = f"V:{exc}"
    if not error:
        try:
            for t in tensors:
                if plain:
                    arr, ctx = (t if type(t) is np.ndarray else np.asarray(t)), None
                else:
                    arr, ctx = compression.compress(np.asarray(t))
                    arr = np.asarray(arr)
                code = codes.get(arr.dtype)
                if code is None:
                    as_array(arr)
                    check_op(arr.dtype, rop, float(prescale_factor), float(postscale_factor))
                    code = codes[arr.dtype] = dtype_code(arr.dtype)
                if not arr.flags.c_contiguous:
                    arr = np.ascontiguousarray(arr)
                members.append(arr)
                layout.append((code, arr.shape))
                contexts.append(ctx)
        except (TypeError, ValueError) as exc:
            error = f"{refusal_kind(exc)}:tensor '{base}.{len(members)}': {exc}"
    post = None
    if compression is not Compression.none:
        def post(results: list[np.ndarray]) -> list[np.ndarray]:
            return [compression.decompress(r, c) for r, c in zip(results, contexts, strict=True)]
    req = Request(name=base, kind=Kind.ALLREDUCE, array=_NO_ARRAY, handle=Handle(base, post), op=int(rop),
                  prescale=float(prescale_factor), postscale=float(postscale_factor), process_set=sid,
                  error=error, members=None if error else tuple(members), layout=() if error else tuple(layout))
    return eng.submit(req)


#: ``Request.array`` of a grouped request (its arrays are its ``members``)
_NO_ARRAY = np.empty(0, dtype=np.uint8)


def poll(handle: Handle) -> bool:
    """Whether ``handle``'s collective has finished (successfully or not)."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle``; return its result or raise its error."""
    return handle.wait()


# --------------------------------------------------------------- blocking forms

def _now(submit: Callable[..., Handle], *args: Any) -> Any:
    """``submit(*args)`` and wait for it: the engine thread is left asleep, since this thread
    runs the cycle itself (engine [Note: a waiter runs the cycle])."""
    with caller_waits():
        handle = submit(*args)
    return handle.wait()


def allreduce(tensor: Any, op: Any = Average, name: str | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet | None = None,
              compression: type[Compressor] = Compression.none, out: np.ndarray | None = None,
              algorithm: str | None = None) -> np.ndarray:
    """Reduce ``tensor`` over all ranks (of ``process_set``); see docs/engine.md."""
    return _now(allreduce_async, tensor, op, name, prescale_factor, postscale_factor, process_set,
                compression, out, algorithm)


def grouped_allreduce(tensors: Sequence[Any], op: Any = Average, name: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet | None = None,
                      compression: type[Compressor] = Compression.none) -> list[np.ndarray]:
    return _now(grouped_allreduce_async, tensors, op, name, prescale_factor, postscale_factor, process_set,
                compression)


def allgather(tensor: Any, name: str | None = None, process_set: ProcessSet | None = None) -> np.ndarray:
    return _now(allgather_async, tensor, name, process_set)


def broadcast(tensor: Any, root_rank: int = 0, name: str | None = None,
              process_set: ProcessSet | None = None) -> np.ndarray:
    return _now(broadcast_async, tensor, root_rank, name, process_set)


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet | None = None) -> tuple[np.ndarray, np.ndarray]:
    return _now(alltoall_async, tensor, splits, name, process_set)


def reducescatter(tensor: Any, op: Any = Average, name: str | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, process_set: ProcessSet | None = None) -> np.ndarray:
    return _now(reducescatter_async, tensor, op, name, prescale_factor, postscale_factor, process_set)


def barrier(process_set: ProcessSet | None = None) -> None:
    """Wait until every rank (of ``process_set``) reaches the barrier."""
    eng = engine("unison.barrier()")
    if eng is None:
        return
    sid, _ = _set_id(eng, process_set)
    name = _auto_name("barrier", None, process_set)
    _now(_submit, eng, Kind.BARRIER, name, np.empty(0, np.uint8), sid, lambda a: None)


def enter(name: str, flagged: bool = False) -> bool:
    """Whether any rank raised ``flagged``: one all-reduce of the job named ``name``, which every rank must call.

    [Note: entered through the engine] Work that talks over MPI's own calls (a sharded save's agreements, a
    pipeline step's messages) is invisible to the engine: a rank that skipped it left the others blocked in
    MPI for ever. Entering it first through this named engine collective makes the skip a deadlock the
    engine sees (engine.md, "Deadlocks"): every rank raises a ``StallError`` naming ``name``. The flag
    carries a pre-flight problem for free.
    """
    return bool(allreduce(np.array([flagged], dtype=np.int32), op=ReduceOp.MAX, name=name)[0])


def join() -> int:
    """Take part in the other ranks' allreduces with identity values until all ranks join.

    Call it when this rank has run out of data; the other ranks' allreduces and
    barriers keep completing (this rank contributes zeros to sums). Returns the last
    rank to join.

    A joined rank has no data for broadcast, allgather, alltoall or reducescatter,
    and cannot take part in ``add_process_set`` / ``remove_process_set``: while some
    rank is joined these raise :class:`~unison.common.engine.errors.JoinError` on the
    ranks that called them. This ``join()`` still returns normally, as Horovod's does,
    and logs a warning naming each refused collective and the ranks that submitted it.

    Raises:
        ShutdownError: the engine stopped (some rank shut down) before every rank joined.
    """
    eng = engine("unison.join()")
    if eng is None:
        return 0
    last = eng.join().wait()
    _agree_auto_names(eng)
    return last


def _agree_auto_names(eng: Engine) -> None:
    """After a join, every rank takes the highest count of each unnamed-call counter.

    [Note: unnamed calls after a join] A joined rank makes no calls while the others run
    their extra batches, so its ``<op>.noname.<n>`` counters fall behind theirs, and after the
    join the same call carried a different name on each rank: the ranks paired the wrong
    calls (one rank's loss averaged with another's accuracy), then hung (found by an audit,
    2026-12-05; Horovod's per-process handle counter drifts the same way). The ranks that
    never joined made every call, so the highest count is the one all ranks had reached with
    the same data. Two all-gathers under fixed names, once per ``join()``; each rank takes the
    counters of the sets it belongs to.
    """
    mine: dict[str, dict[str, int]] = {"": dict(_counters)}
    sets = {str(ps.process_set_id): ps for ps in eng.registered_sets() if ps.process_set_id}
    for sid, ps in sets.items():
        mine[sid] = dict(_set_counters(ps, int(sid)))
    data = np.frombuffer(json.dumps(mine).encode(), np.uint8)
    sizes = allgather(np.array([data.size], np.int64), "unison.join.auto_names.sizes")
    rows = allgather(data, "unison.join.auto_names")
    start = 0
    for size in np.asarray(sizes).tolist():
        theirs = json.loads(np.asarray(rows)[start:start + size].tobytes())
        start += size
        for sid, counts in theirs.items():
            if sid and sid not in sets:
                continue  # a set this rank is not in
            held = _counters if not sid else _set_counters(sets[sid], int(sid))
            for key, n in counts.items():
                held[key] = max(held[key], n)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set; call it on every rank, in the same order.

    Raises:
        JoinError: some rank has called ``join()`` (raised on every other rank; the
            set is not registered anywhere).
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    eng = engine("unison.add_process_set()")
    if eng is None:
        ps.process_set_id = ps.process_set_id if ps.process_set_id is not None else 0
        return ps
    return eng.add_process_set(ps)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set and free its communicator; call it on every rank, in the same order.

    Every rank frees the set at the same point (a negotiated request of the global
    set, as for :func:`add_process_set`); afterwards ``process_set.process_set_id`` is
    None and using the set raises ``ValueError`` (it can be added again).

    Returns:
        True when removed; False for the global set or a set that is not registered
        (as Horovod's ``remove_process_set``).

    Raises:
        JoinError: some rank has called ``join()`` (the set stays registered everywhere).
    """
    sid = process_set.process_set_id
    if sid is None or sid == 0 or process_set.ranks is None:
        return False
    eng = engine("unison.remove_process_set()")
    if eng is None:
        process_set.process_set_id = None
        return True
    return eng.remove_process_set(process_set)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording a Chrome-trace timeline to ``file_path`` (written by rank 0). Collective: call
    it on every rank; each raises when rank 0 cannot start it.

    Horovod's signature; ``mark_cycles`` is accepted, engine cycles are not marked.
    """
    eng = engine("unison.start_timeline()")
    if eng is not None:
        # rank 0 opens the file; every rank learns whether it could (it raised there alone before 2026-12-05)
        problem = None
        try:
            eng.start_timeline(file_path)
        except Exception as exc:  # noqa: BLE001 - any failure (a bad path's TypeError too) reaches every rank
            problem = f"rank 0 could not start the timeline at {file_path!r} ({type(exc).__name__}: {exc})"
        told = np.asarray(allgather(np.frombuffer((problem or "").encode(), dtype=np.uint8),
                                    name="unison.start_timeline.agree"))
        if told.size:  # (only rank 0 has something to say)
            raise OSError(told.tobytes().decode(errors="replace"))
    else:  # a job of size 1 ([Note: a timeline at size 1])
        _local_timeline(runtime.state()).start(file_path)


def stop_timeline() -> None:
    """Stop recording and close the timeline file."""
    eng = engine("unison.stop_timeline()")
    if eng is not None:
        eng.stop_timeline()
    else:
        _local_timeline(runtime.state()).stop()
