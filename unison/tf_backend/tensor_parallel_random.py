"""The two random streams of tensor parallelism for Keras 3 (see [Note: two random streams per rank]).

Keras draws dropout masks from ``keras.random.SeedGenerator`` objects, one per layer, not from a
global generator, so there is nothing to fork: a parallel layer with dropout makes two
generators when it is built, a *shared* one seeded with the layer's seed (the same on every rank
of the tensor group: the same mask on replicated activations) and the shard's *own* one seeded
with ``seed + 2718 + shard`` (different pieces, different masks). The layer's seed is its
``seed=`` argument, or else the next one of a sequence that :func:`model_parallel_manual_seed`
starts (the k-th parallel layer with dropout built after the call gets ``seed + k * 7919``): the
ranks of a group build the same layers in the same order, so they agree.
"""

from __future__ import annotations

from typing import Any

import keras

from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.tensor_parallel.groups import agree_on_seed, group_position
from unison.common.tensor_parallel.rng import model_parallel_seed

__all__ = ["model_parallel_manual_seed", "dropout_generators"]

LAYER_SEED_STRIDE = 7919
_SEQUENCE: dict[str, int | None] = {"seed": None, "count": 0}


def model_parallel_manual_seed(seed: int, process_set: ProcessSet = global_process_set) -> None:
    """Seed Keras (``keras.utils.set_random_seed``) and the layer seeds that follow; every rank of the group.

    Collective over the group: the ranks agree on ``seed`` (one 16-byte all-gather). Before 2026-12-05 a
    seed that differed between them (``seed + rank``, a common habit) was taken, and the copies that dropout
    must leave identical on every rank of the group drifted apart, with no error.

    Raises:
        ValueError: ``seed`` not a non-negative integer, or this rank not in ``process_set``.
        MismatchError: the ranks of the group passed different seeds (on every rank of it).
    """
    _, shard = group_position(process_set, "model_parallel_manual_seed")
    model_parallel_seed(seed, shard)  # checks the seed
    agree_on_seed("model_parallel_manual_seed", process_set, seed)
    keras.utils.set_random_seed(seed)
    _SEQUENCE.update(seed=seed, count=0)


def dropout_generators(owner: str, seed: int | None, process_set: ProcessSet) -> tuple[Any, Any]:
    """``(shared, own)`` seed generators of a parallel layer with dropout.

    Raises:
        ValueError: no ``seed`` and no :func:`model_parallel_manual_seed` before.
    """
    _, shard = group_position(process_set, owner)
    if seed is None:
        base = _SEQUENCE["seed"]
        if base is None:
            raise ValueError(f"{owner}: dropout needs a seed the ranks of the tensor group agree on: pass "
                             "seed= (the same on every rank) or call model_parallel_manual_seed(seed, "
                             "process_set) before building the layers")
        _SEQUENCE["count"] = int(_SEQUENCE["count"] or 0) + 1
        seed = base + LAYER_SEED_STRIDE * _SEQUENCE["count"]
        # the layer's arguments were compared with seed=None on every rank; the seed the sequence gives is its
        # count of layers with dropout built since the seeding, which drifts when one rank built another
        # (before 2026-12-05 the ranks then drew different masks on replicated activations, silently)
        agree_on_seed(f"{owner} (its dropout seed from model_parallel_manual_seed's sequence)", process_set, seed)
    own = model_parallel_seed(seed, shard)
    return keras.random.SeedGenerator(seed), keras.random.SeedGenerator(own)
