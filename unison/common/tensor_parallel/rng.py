"""Random streams for tensor parallelism: one shared by the group, one per shard.

[Note: two random streams per rank] Dropout means different things on the two sides of a
tensor-parallel region. Outside it (after a row layer's all-reduce, on the residual stream)
every rank of the tensor group holds the *same* activation, and must drop the *same* elements,
or the replicas drift apart; inside it (a shard's attention heads, or, with sequence
parallelism, a shard's own positions) each rank holds a *different* piece, and the pieces must
get *different* masks, or the model sees one mask tiled ``tp`` times. So each rank keeps two
streams: the framework's default generator, seeded with the user's seed on every rank of the
group, and a "model-parallel" stream seeded with ``seed + MODEL_PARALLEL_SEED_OFFSET + shard``,
entered only inside a region (:meth:`RNGStatesTracker.fork`). Both depend only on the seed and
the shard index, so a run is reproducible, and a rank's draws do not depend on the group size
of any other rank. Megatron-LM does the same with CUDA generator states.

The tracker holds opaque states; a backend gives it three functions: make a state from a
seed, read the framework's current state, and install one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["MODEL_PARALLEL", "MODEL_PARALLEL_SEED_OFFSET", "RNGStatesTracker", "model_parallel_seed",
           "check_probability"]

#: The name of the per-shard stream.
MODEL_PARALLEL = "model-parallel"
#: Added to the user's seed for the per-shard stream, so it never equals the shared one.
MODEL_PARALLEL_SEED_OFFSET = 2718


def model_parallel_seed(seed: int, shard: int) -> int:
    """The seed of shard ``shard``'s own stream, derived from the shared ``seed``.

    Raises:
        ValueError: ``seed`` or ``shard`` is not a non-negative integer.
    """
    for what, value in (("seed", seed), ("shard", shard)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"model_parallel_seed: {what} must be a non-negative integer; received {value!r}")
    return seed + MODEL_PARALLEL_SEED_OFFSET + shard


def check_probability(what: str, p: float) -> float:
    """``p`` as a float in [0, 1), or a ValueError naming ``what``."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise ValueError(f"{what} must be a probability in [0, 1); received {p!r}")
    return float(p)


class RNGStatesTracker:
    """Named random states that :meth:`fork` swaps in and out of the framework's default generator.

    Args:
        new_state: seed -> a state of the framework's generator seeded with it.
        get_state: () -> the framework's current default state.
        set_state: state -> None, installs it as the framework's default state.
    """

    def __init__(self, new_state: Callable[[int], Any], get_state: Callable[[], Any],
                 set_state: Callable[[Any], None]) -> None:
        self._new_state, self._get, self._set = new_state, get_state, set_state
        self._states: dict[str, Any] = {}
        self._seeds: dict[str, int] = {}

    def reset(self) -> None:
        """Forget every state."""
        self._states.clear()
        self._seeds.clear()

    def add(self, name: str, seed: int) -> None:
        """Add a stream ``name`` seeded with ``seed``.

        Raises:
            ValueError: ``name`` exists already, or ``seed`` is used by another stream.
        """
        if name in self._states:
            raise ValueError(f"RNGStatesTracker: a stream named {name!r} exists already (seed "
                             f"{self._seeds[name]}); call reset() first to re-seed")
        for other, used in self._seeds.items():
            if used == seed:
                raise ValueError(f"RNGStatesTracker: seed {seed} is used by stream {other!r} already; streams "
                                 "with one seed would draw the same numbers")
        self._states[name] = self._new_state(seed)
        self._seeds[name] = seed

    def has(self, name: str = MODEL_PARALLEL) -> bool:
        """Whether a stream ``name`` exists."""
        return name in self._states

    def seeds(self) -> dict[str, int]:
        """name -> the seed each stream started from."""
        return dict(self._seeds)

    def get_states(self) -> dict[str, Any]:
        """name -> current state (for a checkpoint)."""
        return dict(self._states)

    def set_states(self, states: dict[str, Any]) -> None:
        """Replace the states (from :meth:`get_states`); the seeds of unknown names are unknown (-1)."""
        self._states = dict(states)
        self._seeds = {name: self._seeds.get(name, -1) for name in self._states}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream is untouched by it.

        Raises:
            ValueError: no stream ``name`` (seed it first).
        """
        if name not in self._states:
            raise ValueError(f"no random stream {name!r}: call model_parallel_manual_seed(seed, process_set) on "
                             "every rank of the tensor group before using dropout inside a tensor-parallel "
                             "region")
        saved = self._get()
        self._set(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self._get()
            self._set(saved)
