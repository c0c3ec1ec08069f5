"""What the Keras tensor-parallel rank suites share: float64 comparisons, shards and seeded arrays."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from unison.common.tensor_parallel import shard_range


def close(actual: Any, expected: Any) -> None:
    """Equal to 1e-10 (float64 throughout the suites)."""
    np.testing.assert_allclose(np.asarray(tf.convert_to_tensor(actual)), np.asarray(expected), rtol=1e-10,
                               atol=1e-11)


def piece(t: Any, ps: Any, axis: int = -1) -> np.ndarray:
    """This rank's equal piece of ``t`` along ``axis``."""
    t = np.asarray(tf.convert_to_tensor(t))
    start, stop = shard_range(t.shape[axis], ps.size(), ps.rank())
    return np.take(t, range(start, stop), axis=axis)


def seeded(seed: int, *shape: int) -> np.ndarray:
    """A standard normal array from ``seed``, the same on every rank."""
    return np.random.default_rng(seed).standard_normal(shape)
