"""Each rank's rows of every global batch, for the inputs ``model.fit`` takes on each backend.

The user passes the *global* data (the same on every rank) and the *global* batch size;
every rank trains on its rows of each global batch (the split of
:class:`unison.common.data_parallel.BatchPlan`), so N ranks see exactly the batches one
process would, and all run the same number of steps.

* numpy arrays (and dicts / lists / tuples of them): :class:`ShardedArrays`, a
  ``keras.utils.PyDataset`` that also shuffles (the same permutation on every rank,
  from a seed rank 0 draws, a new one each pass over the rows) and turns ``class_weight`` into
  sample weights.
* a ``keras.utils.PyDataset`` whose items are global batches: :class:`ShardedPyDataset`.
* a torch ``DataLoader`` (torch backend): :class:`ShardedLoader`, reading the loader's
  global batches in order (a shuffling loader's sampler seeded alike on every rank).
* a ``tf.data.Dataset`` of global batches (TensorFlow backend): each element is cut to
  this rank's rows (``unison.tf_backend.split_global_batch``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np

from unison.common.data_parallel import BatchPlan

__all__ = ["ShardedArrays", "ShardedLoader", "ShardedPyDataset", "shard_input"]


def _rows(structure: Any) -> int:
    leaves = [a for a in keras.tree.flatten(structure) if a is not None]
    if not leaves:
        raise ValueError("the input has no arrays")
    counts = {int(np.shape(a)[0]) for a in leaves}
    if len(counts) != 1:
        raise ValueError(f"all input arrays must have the same number of rows; got {sorted(counts)}")
    return counts.pop()


def _class_weights(y: Any, class_weight: dict[int, float]) -> np.ndarray:
    """Each row's weight, as Keras derives it: the class is the argmax of one-hot targets, else
    the target rounded (a smoothed 0.9 is class 1); a class the dict lacks weighs 1.0.

    Raises:
        ValueError: ``y`` holds several outputs (Keras's own refusal; a bare ``TypeError`` before).
    """
    if isinstance(y, (dict, list, tuple)):
        raise ValueError("class_weight is only supported for Models with a single output (as in Keras); "
                         "pass sample_weight per output instead")
    labels = np.asarray(y)
    if labels.ndim > 1 and labels.shape[-1] > 1:
        labels = labels.argmax(axis=-1)
    labels = np.round(labels.reshape(len(labels))).astype(np.int64)
    weights = {int(k): float(w) for k, w in class_weight.items()}
    return np.array([weights.get(int(c), 1.0) for c in labels], np.float32)


class _PassOrder:
    """The order of ``n`` items in the pass being read, the same on every rank (None: no shuffling).

    [Note: one permutation per pass] Keras keeps its iterator across epochs when fit is given a
    steps_per_epoch below the batches of a pass, and starts a new one (reading batch 0 first)
    only when a pass is used up; one process permutes its data once per such iterator. So a
    permutation (from the seed and the number of passes begun) is drawn when batch 0 is read, not
    at each Keras epoch: a new one per epoch (before 2026-12-05) repeated some rows and skipped
    others within a pass.
    """

    def __init__(self, n: int, shuffle: bool, seed: int) -> None:
        self.n, self.shuffle, self.seed = n, shuffle, int(seed)
        self.passes = 0  # passes begun
        self.order: np.ndarray | None = None

    def at(self, step: int) -> np.ndarray | None:
        """The order for reading ``step`` (a new pass begins at step 0)."""
        if self.shuffle and (step == 0 or self.order is None):
            self.order = np.random.default_rng([self.seed, self.passes]).permutation(self.n)
            self.passes += 1
        return self.order


class ShardedArrays(keras.utils.PyDataset):
    """This rank's rows of each global batch of in-memory arrays.

    Args:
        x, y, sample_weight: the global data (``y`` and ``sample_weight`` may be None).
        batch_size: the global batch.
        rank, size: this rank and the number of ranks.
        shuffle: a new permutation of the rows for each pass over them (each epoch, unless
            ``fit``'s ``steps_per_epoch`` cuts passes into several epochs), the same on every rank.
        seed: the permutation's seed (the same on every rank).
        class_weight: ``{class: weight}``, folded into the sample weights.
        shadows: a last global batch of fewer rows than ranks goes whole to every rank, the ranks but
            0 as its shadows ([Note: shadow shares] in ``unison.common.data_parallel``; only with
            targets, whose batches can carry sample weights); else it is dropped.
    """

    def __init__(self, x: Any, y: Any = None, sample_weight: Any = None, *, batch_size: int, rank: int,
                 size: int, shuffle: bool = False, seed: int = 0,
                 class_weight: dict[int, float] | None = None, shadows: bool = False) -> None:
        super().__init__()
        if class_weight is not None:
            if y is None:
                raise ValueError("class_weight needs targets y")
            if sample_weight is not None:  # as Keras refuses them together
                raise ValueError("class_weight and sample_weight cannot both be given; fold the class weights "
                                 "into sample_weight")
            sample_weight = _class_weights(y, class_weight)
        samples = _rows(x)
        self.plan = BatchPlan(samples, int(batch_size), size, shadows=shadows and y is not None)
        if self.plan.has_shadows:  # every batch carries sample weights, a shadow's all -0.0
            sample_weight = (np.ones(samples, np.float32) if sample_weight is None else
                             keras.tree.map_structure(_signable, sample_weight))
        parts = tuple(p for p in (x, y, sample_weight) if p is not None) if y is not None else (x,)
        # tf.data (TensorFlow's input, from this PyDataset or from arrays_dataset) reads a Python list as one
        # tensor to stack: lists of inputs or targets become tuples, as Keras's own array adapter makes them
        # (before 2026-12-05 fit([a, b], ...) and y=[y1, y2] failed on TensorFlow)
        self.parts = keras.tree.lists_to_tuples(parts)
        self.samples = _rows(self.parts)
        self.rank, self.shuffle = rank, shuffle
        self._pass = _PassOrder(self.samples, shuffle, seed)

    @property
    def order(self) -> np.ndarray | None:
        """The permutation of the rows in the pass being read (None without shuffling)."""
        return self._pass.order

    def __len__(self) -> int:
        return self.plan.steps

    def __getitem__(self, step: int) -> Any:
        order = self._pass.at(step)  # [Note: one permutation per pass]
        lo, hi = self.plan.rank_rows(step, self.rank)
        take: Any = slice(lo, hi) if order is None else order[lo:hi]
        batch = keras.tree.map_structure(lambda a: np.asarray(a)[take], self.parts)
        if self.plan.has_shadows and self.plan.shadow(step, self.rank):  # [Note: shadow shares]
            batch = batch[:2] + (keras.tree.map_structure(shadow_weights, batch[2]),)
        return one_batch(batch)


def shadow_weights(weights: Any) -> Any:
    """A shadow share's sample weights: -0.0 in ``weights``' shape and dtype ([Note: shadow shares])."""
    return np.full(np.shape(weights), -0.0, np.asarray(weights).dtype)


def _signable(weights: Any) -> np.ndarray:
    """A user's sample weights where a shadow's can be told from them: floating point (integers as float32;
    float64 kept), and every -0.0 made 0.0 (``+ 0.0``), so no share of the user's reads as a shadow."""
    a = np.asarray(weights)
    return (a if np.issubdtype(a.dtype, np.floating) else a.astype(np.float32)) + 0.0


def one_batch(parts: tuple[Any, ...]) -> Any:
    """A batch as Keras reads it from ``(x,)`` or ``(x, y[, sample_weight])``: x alone unless it is a list or
    tuple (several inputs), which Keras would read as ``(x, y)``: then a 1-tuple (before 2026-12-05
    ``predict`` of a model with several inputs fed the second input as targets and failed)."""
    if len(parts) > 1:
        return parts
    return parts if isinstance(parts[0], (list, tuple)) else parts[0]


class ShardedPyDataset(keras.utils.PyDataset):
    """This rank's rows of each global batch of a ``keras.utils.PyDataset``.

    With ``shuffle`` (``fit``'s default, as in Keras, which reads a finite PyDataset's batches
    in a new order each pass) the order of the batches is a permutation drawn from ``seed``
    (rank 0's) and the number of passes begun, the same on every rank, so each global batch is
    still split, not mixed with another. A pass begins when batch 0 is read ([Note: one
    permutation per pass]); its first global batch is compared over the ranks ([Note: the same
    first global batch on every rank]).
    """

    def __init__(self, dataset: keras.utils.PyDataset, rank: int, size: int, shuffle: bool = False,
                 seed: int = 0) -> None:
        super().__init__()
        self.dataset, self.rank, self.size = dataset, rank, size
        self.shuffle = shuffle and dataset.num_batches is not None
        self._pass = _PassOrder(len(dataset) if self.shuffle else 0, self.shuffle, seed)
        self.passes = 0  # passes begun

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def num_batches(self) -> int | None:
        return self.dataset.num_batches

    def __getitem__(self, step: int) -> Any:
        order = self._pass.at(step)  # [Note: one permutation per pass]
        index = step if order is None else int(order[step])
        batch = self.dataset[index]
        if step == 0:
            self.passes += 1
            if self.size > 1:  # [Note: the same first global batch on every rank]
                _agree_on_first_batch(batch, self.passes, "PyDataset", ordered=True)
        return cut(batch, self.rank, self.size, f"batch {index} of the PyDataset")

    def on_epoch_begin(self) -> None:
        self.dataset.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.dataset.on_epoch_end()


class ShardedLoader(keras.utils.PyDataset):
    """This rank's rows of each global batch of an iterable with a length (a torch ``DataLoader``).

    Keras reads a ``PyDataset`` in order, from one thread (``workers=1``); each epoch
    reads the loader once from the start.

    [Note: one loader order on every rank] Each rank reads its own copy of the loader, so a
    shuffling loader (``shuffle=True``: a ``RandomSampler`` drawing from torch's global random
    state, which differs between ranks) gave each rank another permutation, and rank r cut its
    rows from another global batch than rank r+1: some rows trained twice per pass, others never,
    silently (before 2026-12-05). For each pass a sampler without a generator of its own gets one
    seeded from ``seed`` (rank 0's) and the number of passes begun, so every rank draws the same
    permutation, a new one each pass; once the sampler has taken it (at the pass's first index)
    the loader has no generator again. A generator the user gave is left alone (their seed, their
    order), and like a sampler Unison cannot seed (a custom sampler or batch sampler, an
    ``IterableDataset``) has the first global batch of each pass compared whole over the ranks
    ([Note: the same first global batch on every rank], inputs included): a difference raises on
    every rank.
    """

    def __init__(self, loader: Any, rank: int, size: int, seed: int = 0) -> None:
        super().__init__()
        self.loader, self.rank, self.size, self.seed = loader, rank, size, int(seed)
        self._it: Iterator[Any] | None = None
        self._next = 0
        self.passes = 0  # passes begun
        self.known, self.sampler = _order_of(loader)

    def __len__(self) -> int:
        return len(self.loader)

    def __getitem__(self, step: int) -> Any:
        return cut(self.global_batch(step), self.rank, self.size, f"batch {step} of the loader")

    def global_batch(self, step: int) -> Any:
        """The loader's global batch ``step`` as numpy (read in order; a pass begins at step 0)."""
        first = step == 0 or self._it is None
        ours = first and self.sampler is not None and self.sampler.generator is None
        if first:
            if ours:  # [Note: one loader order on every rank]
                import torch

                key = int(np.random.SeedSequence([self.seed, self.passes]).generate_state(1, np.uint64)[0] >> 1)
                self.sampler.generator = torch.Generator().manual_seed(key)
            self.passes += 1
            self._it, self._next = iter(self.loader), 0
        if step != self._next:
            raise RuntimeError(f"ShardedLoader is read in order; asked for batch {step} after {self._next - 1}")
        self._next += 1
        try:
            batch = next(self._it)
        finally:
            if ours:  # the pass's sampler drew its generator (at its first index): the loader is the user's again
                self.sampler.generator = None
        batch = tuple(batch) if isinstance(batch, list) else batch
        batch = keras.tree.map_structure(_numpy, batch)
        if first and self.size > 1:  # [Note: the same first global batch on every rank]
            # (an order Unison cannot seed, or a generator of the user's own: is it seeded alike?)
            _agree_on_first_batch(batch, self.passes, "DataLoader",
                                  ordered=self.known and (ours or self.sampler is None))
        return batch


def _order_of(loader: Any) -> tuple[bool, Any]:
    """(whether Unison knows ``loader``'s order, the sampler whose ``generator`` to seed or None).

    Known: a sequential sampler (nothing to seed) or one drawing from its ``generator`` (``RandomSampler``,
    ``SubsetRandomSampler``, ``WeightedRandomSampler``) under torch's own ``BatchSampler``. Unknown: a
    custom sampler or batch sampler, an ``IterableDataset`` (its order is its own)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is not None and type(batch_sampler).__name__ != "BatchSampler":
        return False, None
    sampler = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else getattr(loader, "sampler",
                                                                                                None)
    if type(sampler).__name__ == "SequentialSampler":
        return True, None
    if sampler is not None and hasattr(sampler, "generator"):
        return True, sampler
    return False, None


def _fingerprint(batch: Any, ordered: bool) -> str:
    """A global batch's shapes and a digest of its targets and sample weights (of its inputs too where it has
    no targets, or where ``ordered`` is False); see [Note: the same first global batch on every rank]."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
    digested = (y, sample_weight) if ordered and y is not None else (x, y, sample_weight)
    digest = hashlib.blake2b(digest_size=8)
    for a in keras.tree.flatten(digested):
        if a is not None:
            a = np.asarray(a)  # (an object array's bytes are pointers, another on each rank: its text instead)
            digest.update(repr(a.tolist()).encode() if a.dtype.hasobject else np.ascontiguousarray(a).data)
    shapes = [tuple(np.shape(a)) for a in keras.tree.flatten(batch) if a is not None]
    return f"{shapes}:{digest.hexdigest()}"


def _agree_on_first_batch(batch: Any, passes: int, source: str, ordered: bool) -> None:
    """Raise on every rank when the ranks' ``source`` began pass ``passes`` with different global batches.

    [Note: the same first global batch on every rank] Every rank must read the same global batches (each
    cuts its own rows from them). A DataLoader or PyDataset of each rank's own shard (Horovod's habit,
    ``DataLoader(Subset(ds, range(rank, n, size)))``) was accepted, as its length and type agree, and the
    ranks together trained on 1/N of the rows, silently (found by an audit, before 2026-12-07: 12 rows at
    2 ranks trained 6 a pass). So the first global batch of every pass is compared over the ranks (one
    small all-gather a pass). Where every rank reads the loader in one order (``ordered``: a sequential
    sampler, one Unison seeds, a PyDataset) only a difference of data can show, and random augmentation
    of the inputs, which draws apart on each rank (each rank's own torch stream: [Note: each rank's own
    random stream]) and does no harm, must not raise: so the targets and sample weights are compared
    (the inputs too where a batch has no targets). Where the order is unknown the inputs are compared too.
    """
    from unison.common.engine.objects import allgather_object

    everyone = allgather_object(_fingerprint(batch, ordered),
                                name=f"unison.keras.Sharded{source}.first_batch.{passes}")
    if any(other != everyone[0] for other in everyone):
        differ = [r for r, f in enumerate(everyone) if f != everyone[0]]
        order = "" if ordered else (
            "; and read it in the same order on every rank: give the loader a sampler Unison can seed "
            "(shuffle=True, a RandomSampler or SubsetRandomSampler), or seed your sampler alike on every rank "
            "(e.g. from DataParallel(seed=...).seed() and the epoch); random augmentation in the loader must "
            "draw alike on every rank too (keras.utils.set_random_seed)")
        raise ValueError(f"the ranks' {source}s gave different first global batches in pass {passes} (ranks "
                         f"{differ} differ from rank 0), so each rank would cut its rows from other data and "
                         "the ranks together would train on part of it. Pass the whole dataset, the same on "
                         "every rank: Unison splits each global batch over the ranks itself (not each rank's "
                         "own shard: a DataLoader(Subset(ds, range(rank, n, size))) or a PyDataset of the "
                         f"rank's own files){order}")


def _numpy(value: Any) -> Any:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)


def cut(batch: Any, rank: int, size: int, what: str) -> Any:
    """This rank's rows ``[rank*m//size, (rank+1)*m//size)`` of every array of a global batch of m rows."""
    m = _rows(batch)
    if m < size:
        raise ValueError(f"{what} has {m} row(s) for {size} ranks, so some rank would get none; make every "
                         f"global batch at least {size} rows (drop or pad the last one)")
    lo, hi = rank * m // size, (rank + 1) * m // size
    return keras.tree.map_structure(lambda a: None if a is None else a[lo:hi], batch)


def shard_input(x: Any, y: Any, sample_weight: Any, *, batch_size: int | None, rank: int, size: int,
                shuffle: bool, seed: int, class_weight: dict[int, float] | None, what: str,
                shadows: bool = True) -> Any:
    """``x`` (with ``y``, ``sample_weight``) as an input of this rank's rows (fit, evaluate, predict);
    ``shadows``: a small last batch of arrays may go to shadows ([Note: shadow shares]), else it is dropped.

    Raises:
        ValueError: a dataset, PyDataset or loader given with ``y`` or ``sample_weight``
            (their batches carry them), or an input type Unison cannot split.
    """
    if _is_arrays(x):
        plan_batch = 32 if batch_size is None else batch_size
        training = what != "model.predict"  # predict keeps a too-small last batch (see DataParallel)
        data = ShardedArrays(x, y, sample_weight, batch_size=plan_batch, rank=rank, size=size,
                             shuffle=shuffle, seed=seed, class_weight=class_weight, shadows=training and shadows)
        if training:
            if data.plan.steps == 0:
                raise ValueError(f"{what}: {data.samples} row(s) for {size} ranks, so some rank would get none; "
                                 f"give it at least {size} rows, or run it in one process")
            data.plan.warn_if_dropping(rank, what)
            if keras.backend.backend() == "tensorflow":  # gathered in tf.data: no Python call per step
                from unison.keras._tf_data import arrays_dataset

                return arrays_dataset(data.parts, data.plan, rank, shuffle, seed)
        return data
    if y is not None or sample_weight is not None:
        raise ValueError(f"{what}: y and sample_weight go with numpy arrays; a {type(x).__name__} yields them "
                         "in its batches")
    if isinstance(x, keras.utils.PyDataset):
        return ShardedPyDataset(x, rank, size, shuffle, seed)
    if _is_tf_dataset(x):
        from unison.tf_backend.strategy import split_global_batch

        return split_global_batch(x, rank, size, refuse_small=True)  # (an empty share trained NaN into BatchNorm)
    if is_loader(x):
        return ShardedLoader(x, rank, size, seed)
    raise ValueError(f"{what}: unison.keras.DataParallel splits numpy arrays, keras.utils.PyDataset, "
                     f"tf.data.Dataset (TensorFlow backend) and torch DataLoader (of global batches); "
                     f"got {type(x).__name__}")


def is_loader(x: Any) -> bool:
    """Whether ``x`` is read as a torch ``DataLoader`` (an iterable with a length and a ``dataset``)."""
    return hasattr(x, "__iter__") and hasattr(x, "__len__") and hasattr(x, "dataset")


def first_inputs(x: Any) -> Any:
    """The model inputs of the first global batch of ``x`` (arrays, a PyDataset, a torch DataLoader over a
    map-style dataset, a tf.data dataset), to build an unbuilt model on; None for another input, an empty
    one or a stream read once (an ``IterableDataset``'s loader: reading ahead would lose its first batch)."""
    if _is_arrays(x):
        return x
    batch = None
    if isinstance(x, keras.utils.PyDataset) and (x.num_batches or 0) > 0:
        batch = x[0]
    elif (is_loader(x) and hasattr(x.dataset, "__getitem__")) or _is_tf_dataset(x):
        batch = next(iter(x), None)  # (a fresh iterator: what training reads later starts again)
    if batch is None:
        return None
    batch = keras.tree.map_structure(_numpy, tuple(batch) if isinstance(batch, list) else batch)
    inputs, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
    return inputs


def _is_arrays(x: Any) -> bool:
    leaves = keras.tree.flatten(x) if isinstance(x, (dict, list, tuple)) else [x]
    return bool(leaves) and all(isinstance(a, np.ndarray) or (hasattr(a, "__array__") and hasattr(a, "shape")
                                                             and not hasattr(a, "element_spec"))
                                for a in leaves)


def _is_tf_dataset(x: Any) -> bool:
    return type(x).__module__.startswith("tensorflow") and hasattr(x, "element_spec")


def split_validation(arrays: Sequence[Any], fraction: float) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Keras's ``validation_split``: the last ``fraction`` of the rows (before shuffling) for validation."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"validation_split={fraction} must be between 0 and 1")
    n = _rows([a for a in arrays if a is not None])
    cut_at = int(n * (1.0 - fraction))
    if cut_at in (0, n):
        raise ValueError(f"validation_split={fraction} of {n} rows leaves an empty training or validation set")

    def part(a: Any, lo: int, hi: int) -> Any:
        return None if a is None else keras.tree.map_structure(lambda v: v[lo:hi], a)

    return tuple(part(a, 0, cut_at) for a in arrays), tuple(part(a, cut_at, n) for a in arrays)
