"""Where each row of a sharded table lives.

[Note: storage order]
Rows are kept in *storage order*: key ``k`` is stored at index ``p(k)`` and shard ``s`` of ``n``
holds the contiguous block ``[s*N//n, (s+1)*N//n)`` of storage indices (the same split rule as the
data-parallel batch plan). ``"row"`` sharding is ``p(k) = k``: contiguous key ranges per shard.
``"hash"`` sharding is the affine bijection ``p(k) = (a*k + b) mod N`` with ``a`` near ``N/phi`` and
coprime to ``N``: consecutive keys land about 0.618 N apart, so the hot low keys of a Zipf
distribution spread evenly over the shards, and every shard still holds exactly its block's
share. ``p`` depends on ``N`` only, never on the number of shards, so a checkpoint written in
storage order loads on any number of ranks (block ranges of the same array).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Sharding", "block_bounds"]

KINDS = ("row", "hash")
_PHI = (math.sqrt(5.0) - 1.0) / 2.0


def block_bounds(num_rows: int, shards: int) -> np.ndarray:
    """``shards + 1`` increasing storage indices: shard s holds ``[b[s], b[s+1])``."""
    return np.array([s * num_rows // shards for s in range(shards + 1)], np.int64)


def _multiplier(num_rows: int) -> int:
    """An odd-ish integer near ``N * 0.618`` that is coprime to ``N`` (1 for tiny tables)."""
    if num_rows <= 2:
        return 1
    a = max(1, int(num_rows * _PHI))
    while math.gcd(a, num_rows) != 1:
        a += 1
    return a


@dataclass(frozen=True)
class Sharding:
    """The map key -> (shard, local row) of a table of ``num_rows`` rows over ``shards`` shards."""

    kind: str
    num_rows: int
    shards: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"sharding={self.kind!r} is not one of {list(KINDS)}: 'row' keeps contiguous key "
                "ranges per shard, 'hash' spreads neighbouring keys over the shards"
            )
        if self.kind == "hash" and self.num_rows >= 1 << 32:
            raise ValueError(
                f"sharding='hash' supports tables of fewer than 2**32 rows; num_rows={self.num_rows}. "
                "Use sharding='row' for larger tables"
            )

    # computed once: every table operation maps its keys through them
    @functools.cached_property
    def multiplier(self) -> int:
        return _multiplier(self.num_rows) if self.kind == "hash" else 1

    @property
    def offset(self) -> int:
        return self.num_rows // 3 if self.kind == "hash" else 0

    @functools.cached_property
    def _inverse(self) -> int:
        return pow(self.multiplier, -1, self.num_rows) if self.num_rows > 1 else 0

    @functools.cached_property
    def _bounds(self) -> np.ndarray:
        return block_bounds(self.num_rows, self.shards)

    def bounds(self) -> np.ndarray:
        return self._bounds

    def block(self, shard: int) -> tuple[int, int]:
        """Storage indices ``[lo, hi)`` that ``shard`` holds."""
        b = self.bounds()
        return int(b[shard]), int(b[shard + 1])

    def storage(self, keys: np.ndarray) -> np.ndarray:
        """Storage index of each (in-range, int64) key."""
        if self.kind == "row":
            return keys.astype(np.int64, copy=False)
        k = keys.astype(np.uint64)
        return ((k * np.uint64(self.multiplier) + np.uint64(self.offset)) % np.uint64(self.num_rows)).astype(
            np.int64
        )

    def keys_of(self, storage: np.ndarray) -> np.ndarray:
        """The keys stored at ``storage`` indices (the inverse of :meth:`storage`)."""
        if self.kind == "row":
            return storage.astype(np.int64, copy=False)
        p = (storage.astype(np.int64) - self.offset) % self.num_rows
        return ((p.astype(np.uint64) * np.uint64(self._inverse)) % np.uint64(self.num_rows)).astype(np.int64)

    def owners(self, storage: np.ndarray) -> np.ndarray:
        """The shard holding each storage index."""
        return np.searchsorted(self.bounds(), storage, side="right") - 1
