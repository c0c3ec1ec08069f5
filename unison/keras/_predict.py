"""``predict`` of global batches (a ``keras.utils.PyDataset``, a ``tf.data.Dataset``, a torch ``DataLoader``).

Arrays are split by a :class:`~unison.common.data_parallel.BatchPlan`, which knows every batch's rows
beforehand. A dataset's batches are only known as they are read, so :class:`PredictBatches` reads the
global batches once, in order, gives Keras this rank's rows of each and records each global batch's
rows; :func:`gather_batches` then puts every rank's outputs back in the data's order::

    global batch i (m rows)   rank 0: rows [0, m//N)   rank 1: [m//N, 2m//N) ...  -> outputs of batch i
    a batch of m < N rows     every rank predicts all m; rank 0's outputs count

Before 2026-12-06 ``predict`` refused everything but numpy arrays (found by an audit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np

from unison.common.engine import frontend
from unison.keras import data

__all__: list[str] = []


class PredictBatches(keras.utils.PyDataset):
    """This rank's rows of each global batch ``read(i)`` gives (read in order, from batch 0), recording
    each global batch's rows in :attr:`global_rows`. A batch with fewer rows than ranks is given whole."""

    def __init__(self, read: Callable[[int], Any], length: int, rank: int, size: int) -> None:
        super().__init__()
        self.read, self.length, self.rank, self.size = read, length, rank, size
        self.global_rows: list[int] = []

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, step: int) -> Any:
        if step == 0:
            self.global_rows = []
        if step != len(self.global_rows):
            raise RuntimeError(f"PredictBatches is read in order; asked for batch {step} after "
                               f"{len(self.global_rows) - 1}")
        batch = self.read(step)
        batch = keras.tree.map_structure(data._numpy, tuple(batch) if isinstance(batch, list) else batch)
        m = data._rows(batch)
        self.global_rows.append(m)
        return batch if m < self.size else data.cut(batch, self.rank, self.size, f"batch {step}")


def predict_batches(x: Any, rank: int, size: int, steps: int | None, seed: int) -> PredictBatches:
    """``x`` (a PyDataset, a tf.data dataset or a torch DataLoader of global batches) for ``predict``;
    ``steps``: only the first that many batches (Keras's ``predict(steps=...)``).

    Raises:
        ValueError: ``x`` is none of those, or its length is unknown and ``steps`` is not given.
    """
    length: int | None
    read: Callable[[int], Any]
    if isinstance(x, keras.utils.PyDataset):
        length, read = x.num_batches, x.__getitem__
    elif data._is_tf_dataset(x):
        count = int(x.cardinality())
        length = count if count >= 0 else None
        read = _in_order(lambda: iter(x.as_numpy_iterator()))
    elif data.is_loader(x):
        loader = data.ShardedLoader(x, rank, size, seed)  # (its order seeded alike on every rank)
        length, read = len(x), loader.global_batch
    else:
        raise ValueError(f"model.predict: unison.keras.DataParallel splits numpy arrays, keras.utils.PyDataset, "
                         f"tf.data.Dataset and torch DataLoader (of global batches); got {type(x).__name__}")
    if steps is not None:
        length = steps if length is None else min(length, steps)
    if length is None:
        raise ValueError(f"model.predict: a {type(x).__name__} of unknown or infinite length; pass steps=..., "
                         "or give a tf.data dataset its length (dataset.apply(tf.data.experimental."
                         "assert_cardinality(n)))")
    return PredictBatches(read, length, rank, size)


def _in_order(start: Callable[[], Iterator[Any]]) -> Callable[[int], Any]:
    """``read(i)`` over an iterator read once in order (a new one at batch 0)."""
    state: dict[str, Iterator[Any]] = {}

    def read(step: int) -> Any:
        if step == 0 or "it" not in state:
            state["it"] = start()
        return next(state["it"])

    return read


def rows_of_rank(m: int, rank: int, size: int) -> int:
    """The rows rank ``rank`` predicts of a global batch of ``m`` rows (all of them when ``m < size``)."""
    return m if m < size else (rank + 1) * m // size - rank * m // size


def gather_batches(local: np.ndarray, global_rows: list[int], rank: int, size: int) -> np.ndarray:
    """Every rank's outputs (``local``: this rank's, for its rows of each batch in turn) in the data's order.

    Raises:
        ValueError: ``local`` does not have the rows this rank was given.
    """
    counts = [[rows_of_rank(m, r, size) for m in global_rows] for r in range(size)]
    if local.shape[0] != sum(counts[rank]):
        raise ValueError(f"predict: this rank (rank {rank}) has {local.shape[0]} rows of output but was given "
                         f"{sum(counts[rank])} rows of {len(global_rows)} global batches")
    everyone = np.asarray(frontend.allgather(np.ascontiguousarray(local)))
    cursor = np.cumsum([0] + [sum(c) for c in counts[:-1]])  # where each rank's rows start in `everyone`
    pieces: list[np.ndarray] = []
    for i, m in enumerate(global_rows):
        for r in range(size):
            if m >= size or r == 0:  # (a batch smaller than the ranks: rank 0's copy)
                pieces.append(everyone[cursor[r]:cursor[r] + counts[r][i]])
            cursor[r] += counts[r][i]
    return np.concatenate(pieces) if pieces else everyone[:0]
