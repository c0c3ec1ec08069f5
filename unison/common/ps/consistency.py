"""Consistency models of a sharded table: what a pull may miss of other workers' pushes.

[Note: consistency models]
Every worker has a *clock*: the number of steps it has finished (a push ends a step unless it
is given ``clock=False``; :meth:`ShardedTable.clock` ends one by hand).

* ``BSP()`` (bulk synchronous): push and pull are collective over the table's ranks; a push is
  summed over the workers and applied once, and a pull returns rows with every push issued
  before it applied. Training equals dense data-parallel training with the same optimizer.
* ``SSP(s)`` (stale synchronous, Ho et al. 2013): a worker with clock ``c`` may pull only once
  every worker has clock ``>= c - s``; the pull then sees every push of every worker's steps
  ``< c - s`` (and maybe later ones). The shard that answers checks this itself, against the
  clocks it has received (each worker's clock message travels after its pushes, on the same
  ordered channel), so the bound holds per row, not only per worker. ``SSP(0)`` waits for
  everyone every step, but pushes are still applied one worker at a time.
* ``ASP()`` (asynchronous): no waiting; a pull sees whatever has arrived.

Under SSP and ASP each worker's push is applied on arrival, scaled by ``1/workers`` when the
table averages (the default), as its own optimizer step. For SGD a step of every worker then moves
the rows as far as a BSP step would. Adagrad and Adam are not linear in the gradient: Adagrad adds
each worker's squared (scaled) gradient to a row's sum, and Adam ignores the scale and counts a
step per push, so the same gradient from N workers moves a row about N times as far as under BSP
(measured: Adam 2x at 2 workers, 3x at 3; Adagrad 1.7x and 2.3x). Lower their learning rate, or
use BSP where one update per step is wanted. (Before 2026-12-05 this said every optimizer moved as
under BSP.)

SSP bounds both how far a worker runs ahead and what a pull may miss: every operation of a
worker at clock ``c`` (a push, a pull, ``clock()``) waits until every worker has clock ``>= c - s``
(so a worker that only pushes, or whose pulls touch no rows, is held back too: before 2026-12-06 it
was not), and the shard that answers a pull defers it until the clocks it has received reach
``c - s`` (table [Note: SSP holds back every operation]). ``barrier()``, ``save()``, ``load()`` and
``close()`` do not wait; a worker in a barrier holds nobody back, and the workers leave it at one
clock, the largest (table [Note: clocks meet at a barrier]).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BSP", "SSP", "ASP", "Consistency", "consistency_from_name"]


@dataclass(frozen=True)
class Consistency:
    @property
    def collective(self) -> bool:
        return False

    def bound(self) -> int | None:
        """The most clocks a worker may run ahead of the slowest (None: no bound)."""
        return None


@dataclass(frozen=True)
class BSP(Consistency):
    """Bulk synchronous: every push applied before the next pull (collective push and pull)."""

    @property
    def collective(self) -> bool:
        return True

    def bound(self) -> int | None:
        return 0


@dataclass(frozen=True)
class SSP(Consistency):
    """Stale synchronous with staleness ``s``: a worker's operations wait until every worker is at most ``s``
    clocks behind it, and its pulls see every push at least ``s`` clocks old (see the module's Note)."""

    staleness: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(
                f"SSP(staleness={self.staleness!r}): the staleness bound must be an int >= 0 "
                "(0 waits for every worker each step; 2-4 is usual)"
            )

    def bound(self) -> int | None:
        return self.staleness


@dataclass(frozen=True)
class ASP(Consistency):
    """Asynchronous: pulls never wait; no bound on staleness."""


def consistency_from_name(spec: Consistency | str) -> Consistency:
    """``BSP()``, ``SSP(2)``, ``ASP()`` or their names ``"bsp"``, ``"ssp"`` (s=2), ``"asp"``."""
    if isinstance(spec, Consistency):
        return spec
    named = {"bsp": BSP(), "ssp": SSP(), "asp": ASP()}
    if isinstance(spec, str) and spec.lower() in named:
        return named[spec.lower()]
    raise ValueError(f"consistency={spec!r} is not BSP(), SSP(s), ASP() or one of {list(named)}")
