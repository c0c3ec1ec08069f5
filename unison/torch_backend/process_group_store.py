"""The store of ``init_process_group("unison")`` under an MPI launch: PyTorch's ``env://`` without its variables.

[Note: the store under MPI] ``init_process_group`` without ``init_method`` uses ``env://``,
which needs ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``. Under an MPI launch that
did not set both ``RANK`` and ``WORLD_SIZE``, rank and size come from MPI, and Unison's wrapper of the
``env://`` handler makes the store: at ``MASTER_ADDR:MASTER_PORT`` when both are set (PyTorch's
handler, handed MPI's rank and size), else itself: rank 0 opens a ``TCPStore`` on a free port and
MPI broadcasts its address, so PyTorch code that uses the store (barriers, ``new_group``
bookkeeping) has a real one. Before 2026-12-06 any one of the four variables handed everything to
PyTorch's handler, so a ``MASTER_ADDR`` alone (a cluster profile's, which unisonrun forwards to
every rank) failed with "environment variable RANK expected". ``RANK`` and ``WORLD_SIZE`` both set
leave everything to PyTorch's own handler.
"""

from __future__ import annotations

import datetime
import importlib
import os
import socket
import urllib.parse
from typing import Any

import torch.distributed as dist

__all__ = ["wrap_env_handler"]


def _mpi_launch() -> tuple[int, int] | None:
    """(rank, size) of an MPI launch that did not set both ``RANK`` and ``WORLD_SIZE``; else None."""
    if os.environ.get("RANK") and os.environ.get("WORLD_SIZE"):
        return None
    if not (os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMIX_RANK")):
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def _with_rank(url: str, rank: int, size: int) -> str:
    """``url`` with MPI's rank and size in its query (PyTorch's handler reads them there before the
    environment)."""
    parts = urllib.parse.urlparse(url)
    query = {k: v[0] for k, v in urllib.parse.parse_qs(parts.query).items()}
    query.update(rank=str(rank), world_size=str(size))
    return urllib.parse.urlunparse(parts._replace(query=urllib.parse.urlencode(query)))


def _mpi_store(rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """A TCPStore hosted by rank 0 on a free port; MPI tells the others where (see the Note)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    hosts = comm.allgather(socket.gethostname())
    address = "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(hosts[0])
    store = (dist.TCPStore(address, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
             if rank == 0 else None)
    port = comm.bcast(store.port if store is not None else None, root=0)
    if store is None:
        store = dist.TCPStore(address, port, size, is_master=False, timeout=timeout)
    return store


def _check_url(url: str, rank: int, size: int) -> None:
    """Refuse a ``rank=`` or ``world_size=`` (which PyTorch puts in the URL's query) that differs from MPI's.

    The MPI launch's rendezvous hands PyTorch MPI's rank and size, so before 2026-12-05 such values were
    dropped silently (``rank=5, world_size=7`` at 2 ranks ran as ranks 0 and 1 of 2: code sharding its data
    by its own ``rank`` then disagreed with ``dist``), and the backend's own check compared MPI with itself.
    """
    query = urllib.parse.parse_qs(urllib.parse.urlparse(url).query)
    for key, mpi_value in (("rank", rank), ("world_size", size)):
        given = query.get(key)
        if given and given[0].lstrip("-").isdigit() and int(given[0]) not in (-1, mpi_value):
            raise ValueError(f"init_process_group('unison') got {key}={int(given[0])} but MPI says this "
                             f"process's {key} is {mpi_value}: drop rank=/world_size= (they come from MPI) or "
                             "make them match")


def wrap_env_handler() -> None:
    """Wrap PyTorch's ``env://`` handler so that an MPI launch without ``RANK``/``WORLD_SIZE`` gets MPI's rank
    and size, and a store made through MPI unless ``MASTER_ADDR`` and ``MASTER_PORT`` name one (see the Note);
    once, however often called."""
    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module, not its function
    original = rdzv._rendezvous_handlers.get("env")
    if original is None or getattr(original, "_unison", False):
        return

    def handler(url: str, timeout: datetime.timedelta = dist.default_pg_timeout, **kwargs: Any) -> Any:
        launch = _mpi_launch()
        if launch is None:
            yield from original(url, timeout=timeout, **kwargs)
            return
        rank, size = launch
        _check_url(url, rank, size)
        if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            yield from original(_with_rank(url, rank, size), timeout=timeout, **kwargs)
            return
        yield _mpi_store(rank, size, timeout), rank, size
        raise RuntimeError("the MPI launch's store cannot rendezvous again")

    handler._unison = True  # type: ignore[attr-defined]
    rdzv._rendezvous_handlers["env"] = handler

