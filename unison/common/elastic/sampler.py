"""Which samples each rank reads in an epoch, resumable after the world changes.

[Note: elastic sampling]
An epoch's samples not yet processed are shuffled (seed + epoch) and dealt round-robin::

    remaining = sorted(all indices - processed)        (processed: at the last commit)
    order     = remaining permuted by numpy's default_rng(seed + epoch)   (if shuffle)
    padded    = order + order[:pad]                    (pad: to a multiple of the ranks)
    rank r    = padded[r::ranks]                       (its batch b: positions b*bs..(b+1)*bs)

Every rank knows ``padded``, so ``record_batch(b, bs)`` records batch ``b`` of *every* rank,
not only its own: the committed ``processed`` set is the whole job's, identical on every
rank, and stays right when a rank dies after the commit (its samples are neither lost nor
read again). After a reset the same formula, with the new number of ranks and the
committed set, deals out exactly the samples left: none twice, none skipped (padding
aside, as in any distributed sampler).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["SamplerCore"]


class SamplerCore:
    """The framework-neutral state of an elastic sampler over ``num_samples`` samples."""

    def __init__(self, num_samples: int, shuffle: bool = True, seed: int = 0) -> None:
        if num_samples < 0:
            raise ValueError(f"an elastic sampler needs a dataset length >= 0; got {num_samples}")
        self.num_samples_total = int(num_samples)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.rank, self.num_replicas = 0, 1
        self._padded: list[int] = []
        self.indices: list[int] = []

    def reset(self, rank: int, num_replicas: int) -> None:
        """Deal the epoch's remaining samples over ``num_replicas`` ranks (see the module note)."""
        self.rank, self.num_replicas = rank, num_replicas
        remaining = np.array(sorted(set(range(self.num_samples_total)) - self.processed_indices), dtype=np.int64)
        if self.shuffle:
            rng = np.random.default_rng((self.seed + self.epoch) % (1 << 64))  # (a negative seed too)
            remaining = remaining[rng.permutation(remaining.size)]
        order = remaining.tolist()
        per_rank = math.ceil(len(order) / num_replicas) if order else 0
        pad = per_rank * num_replicas - len(order)
        self._padded = order + (order * (pad // max(len(order), 1) + 1))[:pad]
        self.indices = self._padded[rank::num_replicas]

    def __len__(self) -> int:
        return len(self.indices)

    def batch_indices(self, batch_idx: int, batch_size: int, rank: int | None = None) -> list[int]:
        """The samples of batch ``batch_idx`` of ``rank`` (this rank by default)."""
        mine = self._padded[(self.rank if rank is None else rank)::self.num_replicas]
        return mine[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch ``batch_idx`` of every rank processed (commit afterwards to keep it)."""
        for r in range(self.num_replicas):
            self.processed_indices.update(self.batch_indices(batch_idx, batch_size, r))

    def record_indices(self, indices: Any) -> None:
        """Mark ``indices`` processed (only this rank's knowledge; prefer :meth:`record_batch`)."""
        self.processed_indices.update(int(i) for i in indices)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed yet, a new shuffle."""
        self.epoch = int(epoch)
        self.processed_indices = set()
        self.reset(self.rank, self.num_replicas)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state: dict[str, Any], rank: int, num_replicas: int) -> None:
        self.epoch = int(state["epoch"])
        self.processed_indices = {int(i) for i in state["processed_indices"]}
        self.reset(rank, num_replicas)
