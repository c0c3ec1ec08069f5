"""Where every rank of a communicator runs: hosts, local and cross communicators.

The hierarchical algorithms (:mod:`.hierarchical`) move data first among the
ranks of one host, over shared memory, and only then between hosts, over the
network; the flat ring (:mod:`.ring`) runs through the ranks host by host so
that it crosses each host boundary once. Both need, for the communicator they
run on (the world's or a process set's), the layout below::

    comm ranks    0  1  2  3        (--map-by node places them round-robin)
    host          A  B  A  B        hosts are numbered by their lowest rank
    local         {0,2}  {1,3}      Split_type(COMM_TYPE_SHARED): one per host
    local rank    0  0  1  1
    cross         {0,1}  {2,3}      ranks of equal local rank, one per host
    host order    0  2  1  3        the ring's order: host A's ranks, then host B's

The layout is *homogeneous* when every host runs the same number of ranks; the
hierarchical algorithms need that (local rank j of every host owns the same
piece of the buffer) and fall back to the host-ordered ring otherwise.

[Note: topology is collective] Building a :class:`Topology` calls
``Split_type``/``Split``/``allgather`` on the communicator, so every rank must
build it in the same call. :func:`of` builds it the first time a kernel needs
it -- kernels are entered by all ranks of a communicator in the same order, and
whether a kernel needs the topology depends only on values every rank shares
(the algorithm requested, the message size, the rank count) -- and caches it on
the communicator as an MPI attribute, so it is freed with the communicator.
There is no lock: a communicator is used by one thread at a time (the caller's
for the direct API, the engine's for its own), and a lock shared between
communicators could deadlock two ranks building two topologies in opposite
orders.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["Topology", "of", "build", "attach"]

logger = logging.getLogger(__name__)

#: mpi module -> the attribute key under which communicators keep their Topology
_KEYVALS: dict[int, int] = {}


class Topology:
    """The layout of one communicator's ranks over hosts (see the module docstring).

    Attributes:
        size, rank: the communicator's.
        hosts: host index of every rank (hosts numbered by their lowest rank).
        local_ranks: every rank's rank within its host.
        local_sizes: ranks on each host, by host index.
        local, cross: this rank's host communicator and cross-host communicator
            (the ranks with this rank's local rank, ordered by host).
        homogeneous: every host runs the same number of ranks.
        host_order: the ranks sorted by (host, local rank).
        ring: a communicator whose rank order is ``host_order`` (``comm`` itself
            when that is already its order).
    """

    def __init__(self, comm: Any, local: Any, cross: Any, hosts: list[int], local_ranks: list[int],
                 ring: Any) -> None:
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.local, self.cross, self.ring = local, cross, ring
        self.hosts = tuple(hosts)
        self.local_ranks = tuple(local_ranks)
        self.num_hosts = max(hosts) + 1
        self.local_sizes = tuple(hosts.count(h) for h in range(self.num_hosts))
        self.homogeneous = len(set(self.local_sizes)) == 1
        self.host_order = tuple(sorted(range(self.size), key=lambda r: (hosts[r], local_ranks[r])))
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        self.cross_rank, self.cross_size = cross.Get_rank(), cross.Get_size()
        #: communicators this object made and frees (not ``comm`` itself)
        self.owned = [c for c in (local, cross, ring) if c is not comm]
        #: the slowest host-to-host rate in bytes/s, once measured (see hierarchical.link_rate)
        self.cross_rate: float | None = None
        self._warned: set[str] = set()

    @property
    def spans_hosts(self) -> bool:
        """Whether the communicator's ranks run on more than one host."""
        return self.num_hosts > 1

    def members(self, local_rank: int) -> list[int]:
        """The ranks with ``local_rank``, in host order (a cross communicator's ranks)."""
        return [r for r in self.host_order if self.local_ranks[r] == local_rank]

    def on_host(self, host: int) -> list[int]:
        """The ranks of host ``host``, in local-rank order (a local communicator's ranks)."""
        return [r for r in self.host_order if self.hosts[r] == host]

    def warn_once(self, what: str, message: str, *args: Any) -> None:
        """Log ``message`` at INFO level the first time ``what`` happens on this communicator."""
        if what not in self._warned:
            self._warned.add(what)
            logger.info(message, *args)

    def free(self) -> None:
        """Free the communicators this topology made."""
        for c in self.owned:
            c.Free()
        self.owned = []

    def __repr__(self) -> str:
        return (f"Topology(size={self.size}, hosts={self.num_hosts}, local_sizes={self.local_sizes}, "
                f"homogeneous={self.homogeneous}, host_order={self.host_order})")


def build(comm: Any, mpi: Any, host_of: Callable[[int], int] | None = None) -> Topology:
    """Build the topology of ``comm`` (collective: every rank calls it).

    Args:
        comm: an intra-communicator.
        mpi: the ``mpi4py.MPI`` module.
        host_of: for tests, a function from a rank of ``comm`` to a host key,
            simulating hosts on one machine; by default ranks that share
            memory (``Split_type(COMM_TYPE_SHARED)``) are one host.
    """
    rank = comm.Get_rank()
    if host_of is None:
        local = comm.Split_type(mpi.COMM_TYPE_SHARED, key=rank)
    else:
        local = comm.Split(int(host_of(rank)), rank)
    leader = local.bcast(rank, root=0)  # the host's lowest rank: key=rank orders it first
    info = comm.allgather((leader, local.Get_rank()))
    leaders = sorted({lead for lead, _ in info})
    hosts = [leaders.index(lead) for lead, _ in info]
    local_ranks = [lr for _, lr in info]
    cross = comm.Split(local_ranks[rank], hosts[rank])
    order = sorted(range(len(info)), key=lambda r: (hosts[r], local_ranks[r]))
    ring = comm if order == list(range(len(info))) else comm.Split(0, order.index(rank))
    return Topology(comm, local, cross, hosts, local_ranks, ring)


def _keyval(mpi: Any) -> int:
    key = _KEYVALS.get(id(mpi))
    if key is None:
        def delete(comm: Any, keyval: int, topo: Any) -> None:
            if isinstance(topo, Topology):
                topo.free()

        key = _KEYVALS[id(mpi)] = mpi.Comm.Create_keyval(delete_fn=delete)
    return key


def attach(comm: Any, mpi: Any, topo: Topology) -> None:
    """Cache ``topo`` on ``comm`` (replacing any earlier one), to be freed with it."""
    key = _keyval(mpi)
    old = comm.Get_attr(key)
    if isinstance(old, Topology) and old is not topo:
        comm.Delete_attr(key)
    comm.Set_attr(key, topo)


def of(comm: Any, mpi: Any) -> Topology:
    """The cached topology of ``comm``, built on first use (see [Note: topology is collective])."""
    key = _keyval(mpi)
    topo = comm.Get_attr(key)
    if topo is None:
        topo = build(comm, mpi)
        comm.Set_attr(key, topo)
        logger.debug("topology of a %d-rank communicator: %r", topo.size, topo)
    return topo
