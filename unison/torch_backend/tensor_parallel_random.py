"""The two random streams of tensor parallelism for PyTorch (see [Note: two random streams per rank]).

``model_parallel_manual_seed(seed, process_set)`` seeds torch's default CPU generator with
``seed`` (the same on every rank of the tensor group: dropout outside a region draws the same
mask everywhere) and the tracker's model-parallel stream with ``seed + 2718 + shard``;
``get_rng_tracker().fork()`` draws from the latter inside a region. The parallel blocks call it
themselves for attention dropout (and for hidden dropout under sequence parallelism).
"""

from __future__ import annotations

import torch

from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.tensor_parallel.groups import group_position
from unison.common.tensor_parallel.rng import MODEL_PARALLEL, RNGStatesTracker, model_parallel_seed

__all__ = ["get_rng_tracker", "model_parallel_manual_seed"]


def _new_state(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


_TRACKER = RNGStatesTracker(_new_state, torch.get_rng_state, torch.set_rng_state)


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker of named random states (``fork()`` enters the per-shard stream)."""
    return _TRACKER


def model_parallel_manual_seed(seed: int, process_set: ProcessSet = global_process_set) -> None:
    """Seed the shared stream with ``seed`` and this shard's stream from it; call on every rank of the group.

    Raises:
        ValueError: ``seed`` not a non-negative integer, or this rank not in ``process_set``.
    """
    _, shard = group_position(process_set, "model_parallel_manual_seed")
    mine = model_parallel_seed(seed, shard)
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL, mine)
