"""Which algorithm ``"auto"`` runs, by topology, message size and rank count.

Messages of at most 256 bytes travel inline in the agreement exchange (see
:mod:`unison.collectives.header`) before this is consulted. Above that:

* One host (the communicator's :class:`~.topology.Topology` has one host, or
  none is known): the table comes from ``benchmarks/collectives.py`` on a
  2-core shared-memory host at 2 and 4 ranks. Open MPI's own collectives win
  for medium messages, where a Python-driven algorithm pays a few microseconds
  per message, and our ring wins for large all-reduces and reduce-scatters,
  where it streams pieces through cache and writes each output segment once
  (1.2-1.5x ``MPI_Allreduce`` at 64-256 MiB).
* Several hosts: the table comes from runs on 2 test hosts x 2 ranks
  (``unison.run.testhosts``), with the links unshaped and limited to 1 and
  3 Gbit/s (docs/collectives.md, "Many hosts", has the numbers). The
  all-reduce depends on the link's speed, measured once per communicator
  (:func:`~.hierarchical.link_rate`): below :data:`SLOW_LINK_BYTES_PER_S`
  the link is the bottleneck and, between 2 hosts, Open MPI's own all-reduce
  (HAN: a pipeline of 64 KiB segments in C) ran within 1% of the link's
  floor, 4-8% ahead of ours, so MPI's call is used at every size there. From
  3 hosts on it is not: at 64 MiB on 1 Gbit/s links MPI's call took 1.8x
  (3 hosts x 2 ranks) and 2.0-3.1x (4 x 2) the time of our ring, whose
  cross-host traffic stays at the link's floor (942 ms at 3 hosts, 0.99-1.41 s
  in three runs at 4, within 4% of the model's prediction in two; 2026-12-06,
  ``benchmarks/hosts.py --hosts 3|4``). So above 2 hosts a slow link takes
  the ring from :data:`HIER_MIN_BYTES` on (host-ordered: each link carries one
  flow each way). Our hierarchical all-reduce was 11% faster than the ring at
  3 hosts but erratic at 4 (1289 and 3008 ms in two runs). On a faster link the cores are
  the bottleneck and ours was up to 2x faster from :data:`HIER_MIN_BYTES`
  on: the hierarchical all-reduce there (it sends each byte across the
  network once per host instead of once per rank), MPI's call below. The
  hierarchical all-gather and broadcast from :data:`HIER_SIMPLE_MIN_BYTES`;
  and for reduce-scatter the direct algorithm of :mod:`.ordered` (each
  segment's owner receives every rank's piece through ``MPI_Alltoallv``),
  which was fastest at 5 of 6 sizes on both links. A layout with unequal
  hosts makes the hierarchical algorithms fall back (see :mod:`.kernels`).
* ``UNISON_HIERARCHICAL_ALLREDUCE=1`` / ``UNISON_HIERARCHICAL_ALLGATHER=1``
  (``force``) pick the hierarchical algorithms at every size whenever the
  communicator spans hosts.

Every rank derives the same choice from the same inputs (the topology is built
collectively and identical everywhere), so no agreement is needed.

[Note: messages over 2 GiB] A count or displacement above 2**31 - 1 bytes fails in Open MPI
5.0's calls (``MPI_ERR_ARG``: its large-count entry points exist but refuse such values), and
MPI's all-gather, all-to-all and reduce-scatter and the hierarchical algorithms' steps within a
host pass byte displacements into the whole buffer. So from :data:`MAX_MPI_BYTES` on, whether
asked for by name or by ``auto``, those run our point-to-point algorithms instead (ring
all-reduce, all-gather and reduce-scatter, pairwise all-to-all), which send pieces of at most
the chunk size; broadcasts stay with MPI, in pieces (:func:`.native.broadcast`), and the
deterministic algorithm (:mod:`.ordered`) packs its pieces.
"""

from __future__ import annotations

from typing import Any

__all__ = ["choose_allreduce", "choose_simple", "MAX_MPI_BYTES", "RING_MIN_BYTES", "RS_RING_MIN_BYTES",
           "HIER_MIN_BYTES", "HIER_SIMPLE_MIN_BYTES", "SLOW_LINK_BYTES_PER_S"]

#: One host: all-reduce messages from this size up use the ring; smaller ones MPI's call.
RING_MIN_BYTES = 1 << 20
#: Reduce-scatter inputs from this size up use the ring.
RS_RING_MIN_BYTES = 4 << 20
#: Several hosts: all-reduce messages from this size up use the hierarchical algorithm.
HIER_MIN_BYTES = 256 << 10
#: Several hosts: all-gathers (total bytes) and broadcasts from this size up use the hierarchical
#: algorithms (smaller ones travel inline or through MPI's call).
HIER_SIMPLE_MIN_BYTES = 16 << 10
#: Several hosts: a measured host-to-host rate below this (bytes/s; 2 Gbit/s) makes ``auto`` use
#: MPI's all-reduce at every size. Measured: 1 and 3 Gbit/s links -> MPI's call 4-8% faster;
#: unshaped (0.4-1.3 GB/s, wherever the shared cores let the probe run) -> ours up to 2x. Set
#: low because the errors cost unequally: 8% on a link just below it, 2x on a fast one.
SLOW_LINK_BYTES_PER_S = 250e6
#: The largest count or displacement, in bytes, that one MPI call takes here ([Note: messages over 2 GiB]).
MAX_MPI_BYTES = 2**31 - 1
#: What a message over :data:`MAX_MPI_BYTES` runs instead of MPI's call or a hierarchical algorithm.
_POINT_TO_POINT = {"allreduce": "ring", "allgather": "ring", "reducescatter": "ring", "alltoall": "pairwise"}


def _multi_host(topo: Any) -> bool:
    return topo is not None and topo.spans_hosts


def choose_allreduce(requested: str, nbytes: int, size: int, topo: Any = None, force: bool = False) -> str:
    """Resolve ``requested`` ("auto", "ring", "rhd", "hierarchical", "mpi") for a message of ``nbytes``.

    Args:
        topo: the communicator's :class:`~.topology.Topology`, when known; across hosts its
            ``cross_rate`` (measured by the caller for messages from :data:`HIER_MIN_BYTES`)
            picks between MPI's call and the hierarchical algorithm.
        force: ``UNISON_HIERARCHICAL_ALLREDUCE``: hierarchical whenever ``topo`` spans hosts.
    """
    algo = _choose_allreduce(requested, nbytes, topo, force)
    if nbytes > MAX_MPI_BYTES and algo in ("mpi", "hierarchical"):
        return "ring"
    return algo


def _choose_allreduce(requested: str, nbytes: int, topo: Any, force: bool) -> str:
    if requested != "auto":
        return requested
    if _multi_host(topo):
        if force:
            return "hierarchical"
        rate = getattr(topo, "cross_rate", None)
        if nbytes < HIER_MIN_BYTES:
            return "mpi"
        if rate is None or rate >= SLOW_LINK_BYTES_PER_S:
            return "hierarchical"
        return "ring" if getattr(topo, "num_hosts", 2) > 2 else "mpi"
    return "ring" if nbytes >= RING_MIN_BYTES else "mpi"


def choose_simple(collective: str, requested: str, nbytes: int, size: int, topo: Any = None,
                  force: bool = False) -> str:
    """Resolve the algorithm of allgather, broadcast, reducescatter or alltoall.

    Our ring all-gather, binomial tree and pairwise all-to-all stay available by
    name; measured here, MPI's own calls were faster for them at every size on
    one host. Across hosts see the module docstring; ``"ordered"`` (the direct
    reduce-scatter) is chosen by ``auto`` only. ``force``
    (``UNISON_HIERARCHICAL_ALLGATHER``) picks the hierarchical all-gather and
    broadcast whenever ``topo`` spans hosts.
    """
    algo = _choose_simple(collective, requested, nbytes, topo, force)
    if nbytes > MAX_MPI_BYTES and collective in _POINT_TO_POINT and algo in ("mpi", "hierarchical"):
        return _POINT_TO_POINT[collective]
    return algo


def _choose_simple(collective: str, requested: str, nbytes: int, topo: Any, force: bool) -> str:
    if requested != "auto":
        return requested
    if _multi_host(topo):
        if collective in ("allgather", "broadcast"):
            return "hierarchical" if force or nbytes >= HIER_SIMPLE_MIN_BYTES else "mpi"
        if collective == "reducescatter":
            return "ordered"
    if collective == "reducescatter":
        return "ring" if nbytes >= RS_RING_MIN_BYTES else "mpi"
    return "mpi"
