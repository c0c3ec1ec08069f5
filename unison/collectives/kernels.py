"""Data movement once the ranks agree on a call: one function per collective.

Both front ends call these: the direct API (:mod:`unison.collectives.api`, after
its header exchange) and the engine (:mod:`unison.common.engine`, after its
negotiation, on its fused buffers too). Inputs are 1-D contiguous arrays;
nothing here checks agreement.

Two settings reach the kernels without passing through the callers: with
``UNISON_DETERMINISTIC`` float reductions take :mod:`.ordered` whatever the
algorithm, and ``UNISON_HIERARCHICAL_ALLREDUCE``/``_ALLGATHER`` make ``auto``
pick :mod:`.hierarchical` whenever the communicator spans hosts. Both are read
from the runtime's settings (equal on every rank, checked at ``init()``) unless
given as arguments. The communicator's :mod:`.topology` is built the first time
an algorithm needs it (see [Note: topology is collective]).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from unison.collectives import adasum, hierarchical, native, ordered, rhd, ring, topology, tree
from unison.collectives.p2p import exchange
from unison.collectives.reduce import accumulator, finalize, prescale, reducer
from unison.collectives.select import HIER_MIN_BYTES, choose_allreduce, choose_simple
from unison.common import runtime
from unison.common.dtypes import is_float
from unison.common.ops import ReduceOp

__all__ = ["allreduce", "allgatherv", "broadcast", "reducescatter", "alltoallv", "allreduce_is_native",
           "simple_is_native", "reducescatter_is_native"]

TAG_A2A = 41
#: Integer averages are summed in int64 (see [Note: integer average] in :mod:`.reduce`)
#: this many elements at a time, so the accumulator stays at most 32 MiB.
WIDE_PIECE_ELEMS = 4 << 20


def _elems(chunk_bytes: int, itemsize: int) -> int:
    return max(1, chunk_bytes // itemsize)


def _setting(value: bool | None, field: str) -> bool:
    """An explicit argument, else the runtime's setting ``field`` (False before ``init()``)."""
    if value is not None:
        return value
    return bool(getattr(runtime.state().config, field)) if runtime.is_initialized() else False


def _cross_piece_setting() -> int:
    """``UNISON_CROSS_PIECE_BYTES`` (0 before ``init()``: measured)."""
    return int(runtime.state().config.cross_piece_bytes) if runtime.is_initialized() else 0


def _topology(comm: Any, mpi: Any, requested: str) -> topology.Topology | None:
    """The communicator's topology when ``requested`` may need it (the same answer on every rank)."""
    if requested in ("mpi", "rhd", "pairwise"):
        return None
    return topology.of(comm, mpi)


def _hierarchical_ok(topo: topology.Topology, what: str) -> bool:
    """Whether the hierarchical algorithms can run on ``topo``; logs the fallback once."""
    if topo.homogeneous:
        return True
    topo.warn_once(what, "hierarchical %s needs the same number of ranks on every host; got %s ranks "
                   "per host, so the host-ordered %s runs instead", what, list(topo.local_sizes),
                   "tree" if what == "broadcast" else "ring")
    return False


def _by_ring_order(topo: topology.Topology, values: list[int]) -> list[int]:
    """``values`` (indexed by rank of the communicator) reindexed by rank of ``topo.ring``."""
    return [values[r] for r in topo.host_order]


def allreduce(comm: Any, mpi: Any, src: np.ndarray, out: np.ndarray, op: ReduceOp,
              prescale_factor: float, postscale_factor: float, algorithm: str,
              chunk_bytes: int, *, deterministic: bool | None = None,
              hierarchical_forced: bool | None = None) -> None:
    """``out = postscale * op(prescale * src over ranks)``; ``out`` may be ``src`` (in place).

    Args:
        deterministic: fold float data in rank order (:mod:`.ordered`); default
            ``UNISON_DETERMINISTIC``.
        hierarchical_forced: ``auto`` picks the hierarchical algorithm whenever
            ``comm`` spans hosts; default ``UNISON_HIERARCHICAL_ALLREDUCE``.
    """
    if op is ReduceOp.ADASUM:  # its own algorithm (vector halving, distance doubling); never fused
        adasum.allreduce(comm, mpi, src, out, prescale_factor, postscale_factor, chunk_bytes)
        return
    n = comm.Get_size()
    if n == 1 or out.size == 0:
        prescale(src, prescale_factor, out)
        finalize(out, op, 1, postscale_factor)
        return
    algo, topo = _allreduce_algorithm(comm, mpi, out.nbytes, out.dtype, algorithm, deterministic,
                                      hierarchical_forced)
    wide = accumulator(out.dtype, op)
    if wide is not None:
        _allreduce_widened(comm, mpi, src, out, wide, op, prescale_factor, postscale_factor, algo,
                           chunk_bytes, topo)
        return
    _allreduce_run(comm, mpi, src, out, op, prescale_factor, postscale_factor, algo,
                   _elems(chunk_bytes, out.itemsize), topo)


def _allreduce_algorithm(comm: Any, mpi: Any, nbytes: int, dtype: np.dtype, algorithm: str,
                         deterministic: bool | None, hierarchical_forced: bool | None,
                         ) -> tuple[str, topology.Topology | None]:
    """The algorithm :func:`allreduce` runs (``"ordered"`` for deterministic floats), and the topology."""
    if _setting(deterministic, "deterministic") and is_float(dtype):
        return "ordered", None
    topo = _topology(comm, mpi, algorithm)
    force = _setting(hierarchical_forced, "hierarchical_allreduce")
    if algorithm == "auto" and not force and topo is not None and topo.spans_hosts \
            and nbytes >= HIER_MIN_BYTES:
        hierarchical.link_rate(topo, mpi)  # the choice depends on it (collective on first use)
    algo = choose_allreduce(algorithm, nbytes, comm.Get_size(), topo, force)
    if algo == "hierarchical" and not _hierarchical_ok(topo, "allreduce"):  # type: ignore[arg-type]
        algo = "ring"
    return algo, topo


def allreduce_is_native(comm: Any, mpi: Any, nbytes: int, dtype: np.dtype, op: ReduceOp,
                        prescale_factor: float, algorithm: str) -> bool:
    """Whether :func:`allreduce` would hand this call to ``MPI_Allreduce`` untouched.

    A cached plan (:mod:`.plans`) then makes that call itself. Ask only after
    :func:`allreduce` has run once with the same arguments: the topology it
    may need is then built (see [Note: topology is collective]).
    """
    if op is ReduceOp.ADASUM or prescale_factor != 1.0 or accumulator(dtype, op) is not None \
            or comm.Get_size() == 1 or nbytes == 0:
        return False
    return _allreduce_algorithm(comm, mpi, nbytes, dtype, algorithm, None, None)[0] == "mpi"


def simple_is_native(comm: Any, mpi: Any, collective: str, nbytes: int, algorithm: str) -> bool:
    """Whether :func:`allgatherv`, :func:`broadcast` or :func:`alltoallv` would call MPI's own
    collective for a call of ``nbytes`` (all-gather: the gathered total); see :func:`allreduce_is_native`.
    """
    n = comm.Get_size()
    if n == 1 or nbytes == 0:
        return False
    topo = None if collective == "alltoall" else _topology(comm, mpi, algorithm)
    force = collective != "alltoall" and _setting(None, "hierarchical_allgather")
    return choose_simple(collective, algorithm, nbytes, n, topo, force) == "mpi"


def reducescatter_is_native(comm: Any, mpi: Any, nbytes: int, dtype: np.dtype, op: ReduceOp,
                            prescale_factor: float, algorithm: str) -> bool:
    """Whether :func:`reducescatter` would call ``MPI_Reduce_scatter`` untouched; see
    :func:`allreduce_is_native`."""
    if prescale_factor != 1.0 or accumulator(dtype, op) is not None or comm.Get_size() == 1 \
            or (_setting(None, "deterministic") and is_float(dtype)):
        return False
    topo = _topology(comm, mpi, algorithm)
    return choose_simple("reducescatter", algorithm, nbytes, comm.Get_size(), topo) == "mpi"


def _allreduce_run(comm: Any, mpi: Any, src: np.ndarray, out: np.ndarray, op: ReduceOp,
                   prescale_factor: float, postscale_factor: float, algo: str, chunk: int,
                   topo: topology.Topology | None) -> None:
    """Run the resolved algorithm ``algo``."""
    n = comm.Get_size()

    def finish(seg: np.ndarray) -> None:
        finalize(seg, op, n, postscale_factor)

    ufunc = reducer(out.dtype, op)
    if algo == "rhd":
        prescale(src, prescale_factor, out)
        rhd.allreduce(comm, mpi, out, ufunc, chunk, finish)
        return
    if prescale_factor != 1.0:
        scaled = np.empty_like(src)
        prescale(src, prescale_factor, scaled)
        src = scaled
    if algo == "ordered":
        ordered.allreduce(comm, mpi, src, out, ufunc, chunk, finish)
    elif algo == "hierarchical" and topo is not None:
        hierarchical.allreduce(topo, mpi, src, out, ufunc, chunk, finish, _cross_piece_setting())
    elif algo == "ring":  # (without a topology: MPI's call asked for by name, over 2 GiB; see select)
        if topo is not None and topo.spans_hosts:  # pieces sized to the slowest link (see hierarchical)
            chunk = min(chunk, max(1, hierarchical.cross_piece_bytes(topo, mpi, _cross_piece_setting())
                                   // out.itemsize))
        ring.allreduce(comm if topo is None else topo.ring, mpi, src, out, ufunc, chunk, finish)
    else:
        native.allreduce(comm, mpi, src, out, op)
        finish(out)


def _allreduce_widened(comm: Any, mpi: Any, src: np.ndarray, out: np.ndarray, wide: np.dtype,
                       op: ReduceOp, prescale_factor: float, postscale_factor: float, algo: str,
                       chunk_bytes: int, topo: topology.Topology | None) -> None:
    """An integer average summed in ``wide``, piece by piece (every rank cuts the same pieces)."""
    acc = np.empty(min(out.size, WIDE_PIECE_ELEMS), dtype=wide)
    for lo in range(0, out.size, acc.size):
        hi = min(lo + acc.size, out.size)
        piece = acc[:hi - lo]
        prescale(src[lo:hi], prescale_factor, piece)  # scaled in the input's dtype, then widened
        _allreduce_run(comm, mpi, piece, piece, op, 1.0, postscale_factor, algo,
                       _elems(chunk_bytes, wide.itemsize), topo)
        np.copyto(out[lo:hi], piece, casting="unsafe")


def allgatherv(comm: Any, mpi: Any, mine: np.ndarray, out: np.ndarray, byte_counts: list[int],
               algorithm: str, chunk_bytes: int, *, hierarchical_forced: bool | None = None) -> None:
    """Gather every rank's bytes (``byte_counts[r]`` each) into ``out`` in rank order.

    Args:
        hierarchical_forced: ``auto`` picks the hierarchical all-gather whenever
            ``comm`` spans hosts; default ``UNISON_HIERARCHICAL_ALLGATHER``.
    """
    n, r = comm.Get_size(), comm.Get_rank()
    offsets = [0] * n
    for i in range(1, n):
        offsets[i] = offsets[i - 1] + byte_counts[i - 1]
    ob = out.reshape(-1).view(np.uint8)
    topo = _topology(comm, mpi, algorithm) if n > 1 else None
    algo = choose_simple("allgather", algorithm, sum(byte_counts), n, topo,
                         _setting(hierarchical_forced, "hierarchical_allgather"))
    if algo == "mpi" or n == 1:
        native.allgatherv(comm, mine, out, byte_counts, offsets, mpi)
        return
    ob[offsets[r]:offsets[r] + byte_counts[r]] = mine.reshape(-1).view(np.uint8)
    if topo is None:  # MPI's call asked for by name, over 2 GiB ([Note: messages over 2 GiB] in select)
        ring.allgatherv(comm, mpi, ob, byte_counts, offsets, chunk_bytes)
    elif algo == "hierarchical" and _hierarchical_ok(topo, "allgather"):
        hierarchical.allgatherv(topo, mpi, ob, byte_counts, offsets, _cross_piece_setting())
    else:
        ring.allgatherv(topo.ring, mpi, ob, _by_ring_order(topo, byte_counts),
                        _by_ring_order(topo, offsets), chunk_bytes)


def broadcast(comm: Any, mpi: Any, buf: np.ndarray, root: int, algorithm: str,
              chunk_bytes: int, *, hierarchical_forced: bool | None = None,
              source: np.ndarray | None = None) -> None:
    """Broadcast ``buf`` (contiguous) from ``root`` in place.

    Args:
        hierarchical_forced: as for :func:`allgatherv` (``UNISON_HIERARCHICAL_ALLGATHER``).
        source: on the root only, the data to broadcast (contiguous, ``buf``'s size), which also
            lands in ``buf``; MPI's call then sends it while the root copies it (see
            :func:`.native.broadcast`). Without it the root's ``buf`` holds the data.
    """
    ob = buf.reshape(-1).view(np.uint8)
    src = None if source is None else source.reshape(-1).view(np.uint8)
    n = comm.Get_size()
    if ob.size == 0 or n == 1:
        if src is not None:
            native.copy_exact(ob, src)
        return
    topo = _topology(comm, mpi, algorithm)
    algo = choose_simple("broadcast", algorithm, ob.size, n, topo,
                         _setting(hierarchical_forced, "hierarchical_allgather"))
    if algo == "mpi" or topo is None:
        native.broadcast(comm, ob, root, mpi, src)
        return
    if src is not None:
        native.copy_exact(ob, src)
    if algo == "hierarchical" and _hierarchical_ok(topo, "broadcast"):
        hierarchical.broadcast(topo, mpi, ob, root, _cross_piece_setting())
    else:  # the tree (hierarchical falls back to it too), over the host-ordered communicator
        tree.broadcast(topo.ring, ob, topo.host_order.index(root), chunk_bytes)


def reducescatter(comm: Any, mpi: Any, src: np.ndarray, out: np.ndarray, counts: list[int],
                  op: ReduceOp, prescale_factor: float, postscale_factor: float, algorithm: str,
                  chunk_bytes: int, *, deterministic: bool | None = None) -> None:
    """Reduce ``src`` over ranks; write this rank's ``counts[rank]`` elements to ``out``.

    Args:
        deterministic: fold float data in rank order (:mod:`.ordered`); default
            ``UNISON_DETERMINISTIC``.
    """
    n, r = comm.Get_size(), comm.Get_rank()
    if n == 1:
        prescale(src, prescale_factor, out)
        finalize(out, op, 1, postscale_factor)
        return
    if _setting(deterministic, "deterministic") and is_float(src.dtype):
        algo, topo = "ordered", None
    else:
        topo = _topology(comm, mpi, algorithm)
        algo = choose_simple("reducescatter", algorithm, src.nbytes, n, topo)
    wide = accumulator(src.dtype, op)
    if wide is not None:  # see [Note: integer average] in .reduce
        acc, acc_out = np.empty(src.size, dtype=wide), np.empty(out.size, dtype=wide)
        prescale(src, prescale_factor, acc)
        reducescatter(comm, mpi, acc, acc_out, counts, op, 1.0, postscale_factor, algo, chunk_bytes,
                      deterministic=False)
        np.copyto(out, acc_out, casting="unsafe")
        return
    if prescale_factor != 1.0:
        scaled = np.empty_like(src)
        prescale(src, prescale_factor, scaled)
        src = scaled
    offsets = [sum(counts[:i]) for i in range(n)]
    chunk = _elems(chunk_bytes, src.itemsize)
    if algo == "ordered":
        ordered.reduce_scatter(comm, mpi, src, out, counts, offsets, reducer(src.dtype, op), chunk)
    elif algo == "mpi":
        native.reduce_scatter(comm, mpi, src, out, counts, op)
    else:  # ring, over the host-ordered communicator (or comm: see select's 2 GiB Note): rank i owns its segment
        work = np.empty_like(src)
        if topo is not None:
            comm, counts_r, offsets_r = topo.ring, _by_ring_order(topo, counts), _by_ring_order(topo, offsets)
        else:
            counts_r, offsets_r = counts, offsets
        ring.reduce_scatter(comm, mpi, src, work, counts_r, offsets_r, reducer(src.dtype, op), chunk, shift=0)
        out[:] = work[offsets[r]:offsets[r] + counts[r]]
    finalize(out, op, n, postscale_factor)


def alltoall_largest(all_splits: np.ndarray, row_bytes: int) -> int:
    """The most bytes any rank sends or receives in an all-to-all of ``all_splits`` (rows, sender by
    receiver): what :func:`alltoallv`'s ``largest`` is, the same on every rank."""
    return int(max(all_splits.sum(axis=1).max(), all_splits.sum(axis=0).max())) * row_bytes


def alltoallv(comm: Any, mpi: Any, send: np.ndarray, send_counts: list[int], out: np.ndarray,
              recv_counts: list[int], algorithm: str, chunk_bytes: int, *, uniform: bool = False,
              largest: int | None = None) -> None:
    """Send ``send_counts[i]`` bytes to rank i, receive ``recv_counts[i]`` from it, in rank order.

    Args:
        largest: the largest total any rank sends or receives, in bytes (the same on every
            rank: from every rank's counts); it decides, alike everywhere, whether MPI's call
            can take the call ([Note: messages over 2 GiB] in :mod:`.select`). None: this
            rank's own totals, for callers whose ranks all stay below 2 GiB.
        uniform: every rank sends every rank the same number of bytes (true of all
            ranks' counts, so every rank passes the same value); MPI's algorithm is
            then ``MPI_Alltoall``, several times faster than ``MPI_Alltoallv`` at
            256 KiB here.
    """
    n, r = comm.Get_size(), comm.Get_rank()
    xb, ob = send.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8)
    soffs = [sum(send_counts[:i]) for i in range(n)]
    roffs = [sum(recv_counts[:i]) for i in range(n)]
    agreed = max(xb.size, ob.size) if largest is None else largest
    if choose_simple("alltoall", algorithm, agreed, n) == "mpi":
        if uniform:
            comm.Alltoall([xb, send_counts[0], mpi.BYTE], [ob, recv_counts[0], mpi.BYTE])
        else:
            native.alltoallv(comm, mpi, xb, send_counts, soffs, ob, recv_counts, roffs)
        return
    ob[roffs[r]:roffs[r] + recv_counts[r]] = xb[soffs[r]:soffs[r] + send_counts[r]]
    for k in range(1, n):
        d, s = (r + k) % n, (r - k) % n
        exchange(comm, mpi, xb[soffs[d]:soffs[d] + send_counts[d]], d,
                 ob[roffs[s]:roffs[s] + recv_counts[s]], s, TAG_A2A, chunk_bytes)
