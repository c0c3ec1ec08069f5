"""TensorFlow backend: in-memory arrays as a ``tf.data`` pipeline of this rank's rows.

The numpy path (:class:`unison.keras.data.ShardedArrays`, a ``PyDataset``) reaches a
TensorFlow step through ``tf.data.Dataset.from_generator``, a Python call per batch:
measured here 93 ms per step of the benchmark CNN against 65 ms for Keras's own array
input. This pipeline gathers each step's rows inside ``tf.data`` instead, by the same
split (:class:`~unison.common.data_parallel.BatchPlan`). Shuffling draws each epoch's
permutation with a stateless shuffle keyed by ``(seed, epoch)``, so every rank has the
same one whatever its TensorFlow global seed; the shuffled dataset runs one epoch after
another without end, and ``fit`` is given ``steps_per_epoch`` (Keras then keeps one
iterator across epochs). Where the caller gives its own ``steps_per_epoch``, the dataset
is one pass of known length instead, permuted by the number of passes begun before
(:meth:`TFArrays.one_pass_each`), so Keras's own rule applies: an epoch ends early where
a pass runs out, and the next one starts a new pass, as it does for arrays without Unison.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from unison.common.data_parallel import BatchPlan
from unison.keras.data import one_batch

__all__: list[str] = []


@dataclass
class TFArrays:
    """A rank's input as a ``tf.data.Dataset``; ``endless`` datasets need ``steps_per_epoch=plan.steps``."""

    dataset: tf.data.Dataset
    plan: BatchPlan
    endless: bool
    _passes: Callable[[], tf.data.Dataset] | None = None

    def one_pass_each(self) -> tf.data.Dataset:
        """The shuffled rows as a dataset of one pass (``plan.steps`` batches, a known cardinality) whose
        every iterator starts the next pass, permuted as the endless dataset permutes that pass.

        [Note: a caller's steps_per_epoch over shuffled arrays] Keras, given arrays and a
        ``steps_per_epoch`` that does not divide the batches of a pass, ends an epoch early where the
        pass runs out and starts a new (reshuffled) pass with the next epoch: 46 rows in batches of
        12, ``steps_per_epoch=3``, 3 epochs are 3 + 1 + 3 steps. The endless dataset ran 3 steps every
        epoch (9) until 2026-12-07. Keras ends that epoch by the dataset's cardinality, and starts a
        pass by making a new iterator; the pass number is counted where each iterator begins (one
        Python call per pass), and every rank makes its iterators at the same points of ``fit``.
        """
        if self._passes is None:
            return self.dataset
        return self._passes()


def arrays_dataset(parts: tuple[Any, ...], plan: BatchPlan, rank: int, shuffle: bool, seed: int) -> TFArrays:
    """This rank's rows of each global batch of ``parts`` (x, y, sample weights), gathered in ``tf.data``."""
    data = keras.tree.map_structure(tf.convert_to_tensor, parts)  # (lists made tuples: see ShardedArrays)
    kept, batch, size = plan.samples - plan.dropped, plan.batch, plan.size

    def mine(ids: tf.Tensor) -> Any:
        m = tf.shape(ids, out_type=tf.int64)[0]
        if not plan.has_shadows:
            rows = ids[(rank * m) // size:((rank + 1) * m) // size]
            return one_batch(keras.tree.map_structure(lambda t: tf.gather(t, rows), data))
        # a batch of fewer rows than ranks goes whole to every rank, the ranks but 0 its shadows
        # ([Note: shadow shares] in unison.common.data_parallel; ShardedArrays made sure of sample weights)
        small = m < size
        zero = tf.constant(0, tf.int64)
        rows = ids[tf.where(small, zero, (rank * m) // size):tf.where(small, m, ((rank + 1) * m) // size)]
        batch = keras.tree.map_structure(lambda t: tf.gather(t, rows), data)
        if rank:
            shadow = keras.tree.map_structure(lambda w: tf.where(small, -tf.zeros_like(w), w), batch[2])
            batch = batch[:2] + (shadow,)
        return one_batch(batch)

    def rows(ids: tf.data.Dataset) -> tf.data.Dataset:
        return ids.map(mine, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).prefetch(tf.data.AUTOTUNE)

    if not shuffle:
        return TFArrays(rows(tf.data.Dataset.range(kept).batch(batch)), plan, endless=False)

    def epoch(e: tf.Tensor) -> tf.data.Dataset:
        key = tf.stack([tf.constant(seed, tf.int64), e])
        order = tf.random.experimental.stateless_shuffle(tf.range(plan.samples, dtype=tf.int64), seed=key)
        return tf.data.Dataset.from_tensor_slices(order[:kept]).batch(batch)

    def passes() -> tf.data.Dataset:  # [Note: a caller's steps_per_epoch over shuffled arrays]
        begun = itertools.count()
        number = tf.data.Dataset.from_generator(lambda: iter((next(begun),)),
                                                output_signature=tf.TensorSpec((), tf.int64))
        one = number.flat_map(epoch).apply(tf.data.experimental.assert_cardinality(plan.steps))
        return rows(one)

    return TFArrays(rows(tf.data.Dataset.range(2**62).flat_map(epoch)), plan, endless=True, _passes=passes)
