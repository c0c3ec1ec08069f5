"""``DataParallel``: Keras 3 ``model.fit`` across ranks on the TensorFlow, JAX and torch backends.

A model compiled inside ``DataParallel().scope()`` is adapted on this instance only
(other models are left alone):

* its optimizer becomes a :func:`~unison.keras.DistributedOptimizer`, and its
  ``train_step`` tells the optimizer this rank's batch rows, so each update uses the
  gradient of the mean loss over the global batch (exact also for a ragged last batch);
* ``fit`` / ``evaluate`` / ``predict`` take the *global* data and the *global*
  ``batch_size`` and give each rank its rows of every global batch
  (:mod:`unison.keras.data`); rank 0's weights and optimizer variables are broadcast
  when every ``fit`` starts, rank 0's weights at every ``evaluate`` / ``predict`` ([Note: rank 0's
  weights at every evaluate and predict]); ``predict`` returns the global predictions on every rank
  (of arrays, or of a dataset's global batches: ``_predict.py``); all three are collective ([Note:
  evaluate and predict are collective]);
* loss and metrics are global: ``get_metrics_result`` sums each metric's state over the
  ranks before computing the result (Keras's metrics keep additive state: totals and
  counts), so every rank reports what one process would on the same global batches;
* non-trainable float variables (``BatchNormalization``'s moving statistics, computed
  from each rank's rows) are averaged over the ranks at the end of each epoch, so the
  ranks end every epoch with identical weights;
* only rank 0 shows the progress bar; ``save`` / ``save_weights`` (and so Keras's
  ``ModelCheckpoint``) write from rank 0 only, atomically and durably; under ``fit`` Keras's
  ``ModelCheckpoint`` shares a failed write with every rank, and ``CSVLogger`` and ``TensorBoard``
  run on rank 0 alone ([Note: rank-0-only files under fit] in ``_rank0.py``).

Compiling: JAX keeps ``jax.jit``: Keras's own train step runs as two jitted programs with
the gradients' exchange on the host between them ([Note: the JAX step in two programs] in
``_jax_step.py``), a model class with its own ``train_step`` as one program with the
exchange as an ordered ``io_callback`` inside it; TensorFlow and torch run with
``jit_compile=False`` (XLA cannot call the host).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import inspect
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np

from unison.common import runtime
from unison.common.data_parallel import BatchPlan, broadcast_arrays, gather_rows, sum_states
from unison.common.engine import frontend
from unison.common.engine.errors import ShutdownError, StallError
from unison.common.files import atomic_keras_save
from unison.common.ops import Max
from unison.keras import _host, _rank0, data
from unison.keras.optimizer import DistributedOptimizer, batch_rows

__all__ = ["DataParallel"]

_ACTIVE: contextvars.ContextVar[DataParallel | None] = contextvars.ContextVar("unison_keras_dp", default=None)
_INSTALLED = False
_models = itertools.count()
_FIT = inspect.signature(keras.Model.fit)
_EVALUATE = inspect.signature(keras.Model.evaluate)
_PREDICT = inspect.signature(keras.Model.predict)
#: fit's arguments the ranks must agree on beside the data (one rank's other epochs or steps hung the job)
_FIT_SETTINGS = ("epochs", "initial_epoch", "steps_per_epoch", "validation_steps", "validation_batch_size",
                 "validation_freq")


class DataParallel:
    """Data parallelism for Keras 3 on any backend: build and compile inside :meth:`scope`, then fit.

    Args:
        global_metrics: report loss and metrics over the global batch (sum each metric's
            state over the ranks). False: each rank reports its own rows' values.
        average_non_trainable: average non-trainable float variables over the ranks at
            the end of each epoch.
        seed: the shuffling seed (None: rank 0 draws one; every rank uses rank 0's).
        overlap_gradients: on the torch backend, start each gradient's exchange as soon as
            backward produces it (else all at once in the optimizer, as on the other backends).

    Example::

        dp = unison.keras.DataParallel()
        with dp.scope():
            model = make_model()
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
            model.fit(x, y, batch_size=64 * unison.keras.size(), epochs=5)
    """

    def __init__(self, global_metrics: bool = True, average_non_trainable: bool = True,
                 seed: int | None = None, overlap_gradients: bool = True) -> None:
        for name, value in (("global_metrics", global_metrics), ("average_non_trainable", average_non_trainable),
                            ("overlap_gradients", overlap_gradients)):
            if not isinstance(value, bool):
                raise TypeError(f"DataParallel({name}={value!r}): pass True or False")
        if _host.backend() not in ("tensorflow", "jax", "torch"):
            raise NotImplementedError(f"unison.keras.DataParallel runs on the tensorflow, jax and torch backends; "
                                      f"KERAS_BACKEND is {_host.backend()!r}")
        runtime.init()
        self.global_metrics = global_metrics
        self.average_non_trainable = average_non_trainable
        self.overlap_gradients = overlap_gradients
        self._seed = seed
        self._fits = 0  # fit calls: each shuffles in a new order, as plain Keras does
        #: the seed the latest ``fit`` shuffled with (from :meth:`seed`, the number of fit calls and
        #: ``initial_epoch``: each call, and a resumed run, draws new orders), to reproduce its batches
        self.last_fit_seed: int | None = None

    @property
    def rank(self) -> int:
        return runtime.rank()

    @property
    def size(self) -> int:
        return runtime.size()

    @contextlib.contextmanager
    def scope(self) -> Iterator[DataParallel]:
        """Models compiled inside the block train data-parallel (fit may be called inside or after it)."""
        _install()
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def seed(self) -> int:
        """The shuffling seed, rank 0's (one broadcast, on every rank, the first time): ``seed=`` if given,
        else the one ``keras.utils.set_random_seed`` set (so a seeded script shuffles alike in every run,
        as plain Keras does; before 2026-12-04 it drew fresh entropy), else fresh entropy."""
        if self._seed is None:
            chosen = _keras_global_seed()
            if chosen is None:
                chosen = np.random.SeedSequence().entropy
            mine = np.array([int(chosen) % (2**31)], np.int64)
            self._seed = int(broadcast_arrays([mine])[0][0])
        return self._seed

    # ----------------------------------------------------------------- compile

    def compile_args(self, model: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``compile``'s arguments for a data-parallel ``model``: a distributed optimizer, host-callable steps."""
        kwargs = dict(kwargs)
        if _host.backend() != "jax":
            if kwargs.get("jit_compile") is True:
                raise ValueError(f"DataParallel on the {_host.backend()} backend: jit_compile=True cannot "
                                 "call the host for the gradient exchange; leave jit_compile unset (or False)")
            kwargs["jit_compile"] = False
        if self.size > 1:  # (one process's gradient is its own)
            _refuse_per_rank_reductions(kwargs.get("loss"))
            if self.global_metrics:
                _refuse_whole_batch_metrics(model, kwargs.get("metrics"), kwargs.get("weighted_metrics"))
        optimizer = keras.optimizers.get(kwargs.get("optimizer", "rmsprop"))
        if not getattr(optimizer, "_unison_distributed", False):
            # in place: model.optimizer is the object passed, so the user's handle on it (learning_rate,
            # iterations) is the model's (a copy before 2026-12-05: assigning its learning rate did nothing)
            optimizer = DistributedOptimizer(optimizer, _in_place=True)
        kwargs["optimizer"] = optimizer
        return kwargs

    def adapt(self, model: Any) -> None:
        """Give ``model`` (just compiled) its data-parallel methods, on this instance only."""
        _set(model, "_unison_dp", self)
        overlap = None
        if _host.backend() == "torch" and self.overlap_gradients:
            from unison.keras._torch_overlap import Overlap

            # compiled again: keep the hooks already on the parameters (new ones would send twice)
            overlap = getattr(model, "_unison_overlap", None)
            overlap = overlap or Overlap(model, f"unison.keras.{next(_models)}.grad")
        _set(model, "_unison_overlap", overlap)
        _set_steps(model)
        if self.global_metrics:
            _set(model, "get_metrics_result", _global_metrics_result(model))
        elif "get_metrics_result" in model.__dict__:
            object.__delattr__(model, "get_metrics_result")
        for name, make in (("fit", _fit), ("evaluate", _evaluate), ("predict", _predict)):
            _set(model, name, make(self, model, getattr(type(model), name).__get__(model)))
        for name in ("save", "save_weights"):
            _set(model, name, _rank0_save(getattr(type(model), name).__get__(model)))
        for name in ("train_on_batch", "test_on_batch", "predict_on_batch"):
            _set(model, name, _not_distributed(name))
        _set(model, "compute_loss", _unmasked_loss(type(model).compute_loss.__get__(model)))
        if _host.backend() == "jax":
            original = type(model).make_train_function.__get__(model)
            _set(model, "make_train_function", _jax_train_function(model, original))
            original = type(model).make_test_function.__get__(model)
            _set(model, "make_test_function", _jax_test_function(model, original))
        model.train_function = model.test_function = model.predict_function = None

    # --------------------------------------------------------------- helpers

    def shard(self, x: Any, y: Any, sample_weight: Any, batch_size: Any, shuffle: bool, class_weight: Any,
              what: str, settings: str = "", call: int = 0, shadows: bool = True) -> Any:
        """This rank's input; ``settings`` (the call's other arguments, as text) and the data are compared over
        the ranks first. ``call`` keys the shuffling: a new order for each ``fit`` call. ``shadows``: a small
        last batch of arrays may go to shadows (:func:`_shadows_allowed`)."""
        if _already_sharded(x):
            return x
        if self.size > 1:
            _agree_on_inputs(what, x, y, sample_weight, batch_size, settings)
        seed = int(np.random.SeedSequence([self.seed(), call]).generate_state(1)[0]) if shuffle else 0
        if what == "model.fit":
            self.last_fit_seed = seed
        return data.shard_input(x, y, sample_weight, batch_size=batch_size, rank=self.rank, size=self.size,
                                shuffle=shuffle, seed=seed, class_weight=class_weight, what=what, shadows=shadows)

    def broadcast_state(self, model: Any, optimizer: bool = True) -> None:
        """Rank 0's model (and, with ``optimizer``, optimizer) variables, on every rank; each rank keeps its
        own random state (seed generators), so Dropout draws other masks on each rank's rows."""
        variables = without_seed_states(model, list(model.variables))
        if optimizer and getattr(model, "optimizer", None) is not None and model.optimizer.built:
            variables += list(model.optimizer.variables)
        _assign(variables, broadcast_arrays([_host.to_numpy(v) for v in variables],
                                            what="the model's and optimizer's variables (rank 0's to every rank)"))
        if self.size > 1:
            _agree_on_function(model)

    def average_state(self, model: Any) -> None:
        """Average the non-trainable float variables over the ranks (summed in float64: equal
        values, such as frozen weights, come back bit for bit)."""
        variables = [v for v in model.non_trainable_variables if np.dtype(v.dtype).kind == "f"]
        values = [_host.to_numpy(v) for v in variables]
        summed = sum_states([v.astype(np.float64) for v in values])
        _assign(variables, [(s / self.size).astype(v.dtype) for s, v in zip(summed, values, strict=True)])


def _refuse_per_rank_reductions(loss: Any) -> None:
    """Refuse a loss object whose reduction is not a mean over the batch's rows.

    DataParallel weighs each rank's gradient by its rows (the split of a global batch), which is one
    process's gradient for a loss that averages over the batch (Keras's default,
    ``"sum_over_batch_size"``). ``"sum"`` gave 1/N of one process's gradient and loss, and
    ``"mean_with_sample_weight"`` divides by each rank's own sum of sample weights: both trained
    silently wrong before 2026-12-05 (weights 0.04-0.2 off one process's after three epochs).
    ``UnisonStrategy`` refuses the second too. Every rank compiles the same loss, so every rank raises.
    """
    items = keras.tree.flatten(loss) if loss is not None else []
    ignoring = [item for item in items if isinstance(item, keras.losses.SparseCategoricalCrossentropy)
                and item.get_config().get("ignore_class") is not None]
    if ignoring and len(items) > 1:
        name = getattr(ignoring[0], "name", ignoring[0])
        raise ValueError(f"DataParallel: the loss {name!r} ignores a class, in a model with {len(items)} losses: "
                         "DataParallel weighs each rank by the targets such a loss counts, which it cannot do for "
                         "one loss among several. Compile one loss, or drop ignore_class and weigh the padding "
                         "out with sample weights")
    _refuse_whole_batch("loss", items, "axis=None: Keras's default for Dice and Tversky",
                        "pass axis over each row's own values (e.g. keras.losses.Dice(axis=(1, 2, 3)) for "
                        "images), a loss per row that Keras then averages")
    for item in items:
        reduction = getattr(item, "reduction", None)
        if isinstance(item, keras.losses.Loss) and reduction in ("sum", "mean_with_sample_weight"):
            raise ValueError(f"DataParallel: the loss {getattr(item, 'name', item)!r} uses "
                             f"reduction={reduction!r}; DataParallel averages each rank's gradient by its rows, "
                             "which is one process's gradient only for a loss that averages over the batch. Use "
                             "the default reduction 'sum_over_batch_size' (with sample weights scaled to average "
                             "1 where 'mean_with_sample_weight' was meant)")


def _whole_batch(item: Any, outputs: tuple[int, bool] | None = None) -> bool:
    """Whether a loss or metric is one statistic of the whole batch, not a mean of per-row values
    ([Note: statistics of the whole batch]): Dice and Tversky over the batch axis (``axis=None``, their
    default), a correlation metric along it. ``outputs``: the model's output rank (batch axis included) and
    whether an output has one unit, where known: a correlation along the last axis of a one-unit output is
    along the batch (Keras squeezes the unit away for targets of one value per row; with a unit in the targets
    too, it is a correlation of one value, never meaningful)."""
    if isinstance(item, str) or callable(item) and not isinstance(item, (keras.losses.Loss, keras.metrics.Metric)):
        name = item.lower() if isinstance(item, str) else item
        return name in ("dice", "tversky", keras.losses.dice, keras.losses.tversky)  # (axis=None)
    if getattr(item, "fn", None) in (keras.losses.dice, keras.losses.tversky):  # Dice, Tversky, their wrappers
        return _over_batch(getattr(item, "_fn_kwargs", {}).get("axis"), outputs, last_is_batch=False)
    if isinstance(item, (keras.metrics.PearsonCorrelation, keras.metrics.ConcordanceCorrelation)):
        return _over_batch(item.get_config().get("axis", -1), outputs, last_is_batch=True)
    return False


def _over_batch(axis: Any, outputs: tuple[int, bool] | None, last_is_batch: bool) -> bool:
    if axis is None:
        return True
    rank, one_unit = outputs if outputs is not None else (None, False)
    axes = [int(a) for a in (axis if isinstance(axis, (list, tuple)) else (axis,))]
    if rank is not None:
        axes = [a + rank if a < 0 else a for a in axes]
    return 0 in axes or (last_is_batch and one_unit and rank is not None and rank - 1 in axes)


def _output_shapes(model: Any) -> tuple[int, bool] | None:
    """``model``'s highest output rank and whether an output has one unit (see :func:`_whole_batch`), or None
    where its outputs are not known yet (a model built at its first call)."""
    try:
        shapes = [tuple(o.shape) for o in keras.tree.flatten(model.outputs)]
    except (AttributeError, ValueError, TypeError):
        return None
    if not shapes:
        return None
    return max(len(s) for s in shapes), any(len(s) == 1 or s[-1] == 1 for s in shapes)


def _refuse_whole_batch_metrics(model: Any, *metrics: Any) -> None:
    """[Note: statistics of the whole batch] A loss or metric computed as one statistic of the batch (Dice over
    every element, a correlation down the batch axis) is not a mean of per-row values: each rank's value of its
    share, combined, is not one process's value of the global batch (an audit on 2026-12-07: Dice trained
    0.035 off one process's weights at np 2, a Pearson correlation along axis 0 read -0.101 for -0.113). Such
    losses and, with global metrics, such metrics are refused at ``compile`` on every rank, naming the fix."""
    _refuse_whole_batch("metric", keras.tree.flatten([m for m in metrics if m is not None]),
                        "along the batch axis", "compute it along each row's values (an output of several "
                        "units, axis=-1), or pass DataParallel(global_metrics=False) to log each rank's own "
                        "value", _output_shapes(model))


def _refuse_whole_batch(what: str, items: list[Any], why: str, fix: str,
                        outputs: tuple[int, bool] | None = None) -> None:
    for item in items:
        if _whole_batch(item, outputs):
            name = getattr(item, "name", getattr(item, "__name__", item))
            raise ValueError(f"DataParallel: the {what} {name!r} is one statistic of the whole batch ({why}), "
                             f"which no combination of the ranks' shares gives; {fix}")


#: how :func:`_describe_input` shows a ``shuffle`` without a seed in a tf.data chain
_UNSEEDED = "one shuffled without a seed"


def _describe_input(x: Any, y: Any, sample_weight: Any, batch_size: Any) -> str:
    """What a rank passed, as far as the ranks must agree on it (rows, shapes, dtypes, batch, and a digest
    of each array: :func:`_rows_digest`)."""
    if data._is_arrays(x):
        leaves = [a for part in (x, y, sample_weight) if part is not None
                  for a in (keras.tree.flatten(part) if isinstance(part, (dict, list, tuple)) else [part])]
        shapes = ", ".join(f"{tuple(np.shape(a))} {np.asarray(a[:0]).dtype.name} {_rows_digest(a)}"
                           for a in leaves)
        return f"arrays {shapes}, batch_size={batch_size}"
    if data._is_tf_dataset(x):
        # (len() raises for an infinite dataset or one tf.data cannot count, a filtered one: such input
        # raised TypeError on every rank before 2026-12-05, where plain Keras takes it)
        from unison.tf_backend.strategy import data_sources, shuffle_seeds

        count = int(x.cardinality())
        length = {-1: "infinitely many", -2: "an unknown number of"}.get(count, str(count))
        seeds = shuffle_seeds(x)
        shuffled = f", shuffled with seeds {seeds}" if seeds else ""
        if (0, 0) in seeds:
            shuffled += ", " + _UNSEEDED
        # (each rank's own shard() or in-memory part: the specs agree, and it trained on 1/N of the data)
        sources = data_sources(x, _rows_digest)
        return (f"{type(x).__name__} of {length} batches, elements {x.element_spec}{shuffled}"
                + (f", from {', '.join(sources)}" if sources else ""))
    length = len(x) if hasattr(x, "__len__") else None
    return f"{type(x).__name__} of {length} batches" if length is not None else type(x).__name__


#: numpy arrays up to this size are digested whole; larger ones by :data:`_SAMPLED_ROWS` rows spread evenly
_WHOLE_BYTES = 64 << 20
_SAMPLED_ROWS = 64


def _rows_digest(a: Any) -> str:
    """A digest of ``a``'s bytes: equal data gives equal digests on any rank (where a sum might round otherwise).

    A numpy array of numbers up to 64 MiB is digested whole (about 1 ms per MiB), anything else by 64 rows
    spread evenly, the first and last among them. Before 2026-12-05 three rows (the first, middle and last)
    were: data that differed across ranks in other rows trained silently on different rows."""
    n = int(np.shape(a)[0]) if np.ndim(a) else 0
    digest = hashlib.blake2b(digest_size=6)
    if type(a) is np.ndarray and not a.dtype.hasobject and a.nbytes <= _WHOLE_BYTES:  # (shape, dtype: compared
        digest.update(np.ascontiguousarray(a).data)  # beside the digest)
        return digest.hexdigest()
    for i in sorted({int(i) for i in np.linspace(0, n - 1, min(n, _SAMPLED_ROWS))} if n else ()):
        row = np.asarray(a[i:i + 1])  # (a slice: rows of a DataFrame too)
        # an object array's bytes are pointers, another on each rank: its values' text instead (strings)
        digest.update(repr(row.tolist()).encode() if row.dtype.hasobject else np.ascontiguousarray(row).tobytes())
    return digest.hexdigest()


#: rows of the probe :func:`_agree_on_function` runs, and its tolerance (hosts of other CPUs round apart)
_PROBE_ROWS, _PROBE_RTOL, _PROBE_ATOL = 2, 1e-4, 1e-5


def _probe_inputs(model: Any) -> Any:
    """Inputs for ``model`` drawn from one seed (the same on every rank), or None where they cannot be made:
    no known input shapes (a subclassed model), a non-numeric input, or a stateful layer (the call would
    move its state)."""
    if any(getattr(layer, "stateful", False) for layer in model._flatten_layers()):
        return None
    try:
        inputs = list(model.inputs)
    except (AttributeError, ValueError):
        return None
    rng = np.random.default_rng(20261205)
    made = []
    for spec in inputs:
        shape = (_PROBE_ROWS, *[d if d is not None else 3 for d in tuple(spec.shape)[1:]])
        dtype = np.dtype(keras.backend.standardize_dtype(spec.dtype))
        if dtype.kind == "f":
            made.append(rng.standard_normal(shape).astype(dtype))
        elif dtype.kind in "iu":
            made.append(rng.integers(0, 2, size=shape).astype(dtype))  # (valid ids for any embedding of 2+ rows)
        elif dtype.kind == "b":
            made.append(rng.integers(0, 2, size=shape).astype(bool))
        else:
            return None
    return made[0] if len(made) == 1 else made


def _largest_gap(first: list[np.ndarray] | None, theirs: list[np.ndarray] | None) -> float:
    """0 when two probes' outputs agree (to the probe's tolerance, or neither rank could run it); else the
    largest difference between them (inf where their structures differ)."""
    if first is None and theirs is None:
        return 0.0
    if first is None or theirs is None or len(first) != len(theirs):
        return float("inf")
    gaps = []
    for a, b in zip(first, theirs, strict=True):
        if a.shape != b.shape:
            return float("inf")
        if not np.allclose(a, b, rtol=_PROBE_RTOL, atol=_PROBE_ATOL, equal_nan=True):
            gaps.append(float(np.nanmax(np.abs(a - b))))
    return max(gaps, default=0.0)


def _agree_on_function(model: Any) -> None:
    """Raise ``ValueError`` on every rank unless every rank's model, holding rank 0's weights, gives the same
    outputs on the same probe inputs (two rows from one seed, inference mode; to 1e-4, as other hosts' CPUs
    may round apart).

    [Note: one function on every rank] Rank 0's weights are broadcast, so weights and their shapes agree;
    what the weights do is each rank's own code. A model built with another activation, another layer
    option, or another layer without weights on one rank trained each rank's rows through another function,
    and the averaged gradients belonged to no model, with no error (before 2026-12-05). One forward pass of
    two rows and one small all-gather, at each fit's start and the first evaluate or predict; models whose
    inputs cannot be drawn (no known shapes, strings) or with a stateful layer are not probed.
    """
    from unison.common.engine.objects import allgather_object

    probe = _probe_inputs(model)
    outputs = None
    if probe is not None:
        try:
            got = model(probe, training=False)
            outputs = [np.asarray(_host.to_numpy(o), np.float64) for o in keras.tree.flatten(got)]
        except Exception:  # noqa: BLE001 - a model that cannot run the probe is not compared (every rank alike,
            outputs = None  # or its outputs differ: None against arrays below)
    everyone = allgather_object(outputs, name="unison.keras.DataParallel.function")
    bad = [f"rank {r} (largest difference {gap:.3g})" for r, theirs in enumerate(everyone[1:], start=1)
           if (gap := _largest_gap(everyone[0], theirs)) > 0]
    if bad:
        raise ValueError(
            f"DataParallel: the ranks' models compute different functions: holding rank 0's weights, they give "
            f"other outputs than rank 0's on the same two inputs on {', '.join(bad)}. Build the same model on "
            "every rank (the same layers, activations and options); rank 0's weights are broadcast, its code is "
            "not")


def _agree_on_inputs(what: str, x: Any, y: Any, sample_weight: Any, batch_size: Any, settings: str = "") -> None:
    """Every rank must pass the same global data and settings: the ranks compare what they passed (one
    small allgather per call) and raise on every rank if it differs. Different rows or batch sizes hung
    the job (each rank waited in a step the others never took) or returned predictions of some rows
    only; each rank's own shard of the same shape (Horovod's habit) trained on a part of each rank's
    rows, silently; ``validation_data`` on some ranks only hung, and ``shuffle`` on some only split
    different permutations (before 2026-12-05)."""
    from unison.common.engine.objects import allgather_object

    mine = _describe_input(x, y, sample_weight, batch_size) + (f"; {settings}" if settings else "")
    everyone = allgather_object(mine, name=f"unison.keras.DataParallel.{what}.inputs")
    if len(everyone) > 1 and any(_UNSEEDED in d for d in everyone):
        # [Note: an unseeded tf.data shuffle] each rank shuffles its own way, and its share of a global
        # batch comes from another order than its peers': some rows trained twice a pass, others never,
        # silently (an audit measured 50 distinct rows of 64 in one pass at 2 ranks, before 2026-12-06).
        # UnisonStrategy refused it already; the chain of inputs tells (seed 0, 0: no seed at all)
        raise ValueError(f"{what}: the tf.data dataset is shuffled without a seed, so each rank shuffles its own "
                         "way and the ranks' shares of a global batch come from different rows (some trained "
                         "twice, others never). Pass dataset.shuffle(buffer, seed=...) the same seed on every "
                         "rank, or keras.utils.set_random_seed(...) before building the dataset")
    if any(other != everyone[0] for other in everyone):
        shown = "; ".join(f"rank {r}: {d}" for r, d in enumerate(everyone))
        raise ValueError(f"{what}: the ranks passed different inputs or settings ({shown}). DataParallel "
                         "splits the global data itself: pass the same x, y, sample_weight, batch_size and other "
                         "arguments on every rank (the whole data, not each rank's own part)")


def without_seed_states(model: Any, variables: list[Any]) -> list[Any]:
    """``variables`` less the states of the seed generators of ``model``'s layers (Dropout's,
    GaussianNoise's): random state stays each rank's own (on JAX it is uint32, which the
    collectives do not carry)."""
    seeds = {id(state) for state in _seed_states(model)}
    return [v for v in variables if id(v) not in seeds]


def _seed_states(model: Any) -> list[Any]:
    """The state variables of the seed generators of ``model``'s layers, each once."""
    layers = model._flatten_layers(include_self=True) if hasattr(model, "_flatten_layers") else []
    states = {id(gen.state): gen.state for layer in layers for gen in getattr(layer, "_seed_generators", [])
              if getattr(gen, "state", None) is not None}
    return list(states.values())


def own_seed_streams(model: Any, rank: int) -> None:
    """Move every seed generator of ``model``'s layers on rank ``rank`` (not 0) to a stream of its own.

    [Note: each rank's own random stream]
    The seed generators' states are left out of the broadcast (:func:`without_seed_states`), but a
    seeded script (``keras.utils.set_random_seed(42)`` on every rank, as the shuffling's seed asks)
    starts every rank's generators in the same state: row i of every rank's share drew the same
    Dropout mask at every step, where one process draws independent masks over the global batch
    (found by an audit on 2026-12-07: identical masks on both ranks at every step, JAX and torch).
    At every ``fit`` start each rank but 0 mixes its rank into the seed half of each state (the other
    half counts the draws), so the streams differ, and a seeded script still draws the same masks in
    every run. Rank 0's stream is untouched: a job of one rank draws what one process draws. On the
    torch backend an unseeded layer (``Dropout(0.5)``) draws from torch's global generator, not from its
    state, so that generator is moved the same way (a rank's own ``torch.rand`` calls then differ from
    rank 0's too, as they would had each rank been seeded by its rank).
    """
    if rank == 0:
        return
    def mix(seed: int, bits: int) -> int:
        return (seed * 1_000_003 + 0x9E3779B1 * rank) % (1 << bits)

    if keras.backend.backend() == "torch":
        import torch

        torch.manual_seed(mix(torch.initial_seed(), 63))
    for state in _seed_states(model):
        value = np.asarray(keras.ops.convert_to_numpy(state))
        mixed = value.astype(np.int64)
        # (below 2**31, so every backend's seed dtype holds it: uint32 on JAX, int64 on TensorFlow, int32 on torch)
        mixed[0] = mix(int(mixed[0]), 31)
        state.assign(mixed.astype(value.dtype))


def _set(model: Any, name: str, value: Any) -> None:
    object.__setattr__(model, name, value)


def _set_steps(model: Any) -> None:
    """``model``'s data-parallel ``train_step`` and ``test_step``: new function objects on every call (jax.jit
    keeps its traces by the function: [Note: compiled steps per shadow setting])."""
    # the class's methods, not this instance's (already wrapped when the model is compiled again)
    _set(model, "train_step", _rows_step(model, type(model).train_step.__get__(model),
                                         getattr(model, "_unison_overlap", None)))
    _set(model, "test_step", _counted_test_step(model, type(model).test_step.__get__(model)))


def _assign(variables: list[Any], values: list[np.ndarray]) -> None:
    for var, value in zip(variables, values, strict=True):
        var.assign(value)


def _already_sharded(x: Any) -> bool:
    return isinstance(x, (data.ShardedArrays, data.ShardedPyDataset, data.ShardedLoader))


def _install() -> None:
    """Wrap ``keras.Model.compile`` once: under an active scope it makes the model data-parallel."""
    global _INSTALLED
    if _INSTALLED:
        return
    # Keras's Trainer, where compile is defined: Keras compiles a loaded model only when its class's
    # compile is Trainer.compile, so the wrapper replaces it there (not on keras.Model)
    from keras.src.trainers.trainer import Trainer

    original = Trainer.compile

    def compile(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A001 - Keras's name
        # a model adapted before stays data-parallel when compiled again outside the scope (fine-tuning with
        # a new optimizer): plain compile left it Unison's fit, each rank on its own rows, and a new optimizer
        # that exchanged nothing, so the ranks trained apart with global-looking metrics (before 2026-12-05)
        dp = _ACTIVE.get() or self.__dict__.get("_unison_dp")
        if dp is None:
            return original(self, *args, **kwargs)
        bound = inspect.signature(original).bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        extra = arguments.pop("kwargs", {})
        result = original(self, **dp.compile_args(self, {**arguments, **extra}))
        dp.adapt(self)
        return result

    compile.__doc__ = original.__doc__
    Trainer.compile = compile
    _INSTALLED = True


def _rows_step(model: Any, step: Callable[..., Any], overlap: Any = None) -> Callable[..., Any]:
    """``train_step`` telling the optimizer this rank's rows (the last argument is the batch on every backend).

    With ``overlap`` (torch), gradients stream out during backward (see :mod:`unison.keras._torch_overlap`).
    """

    def train_step(*args: Any) -> Any:
        shadow = shadow_share(model, args[-1])
        tracked = tracker_weight(model, args[-1], shadow)  # (once: the rows' weight and the loss tracker's)
        rows = batch_rows_of(args[-1]) if tracked is None else tracked
        if overlap is not None and rows is not None and not isinstance(rows, int):
            rows = int(rows)  # (torch: the streamed exchange settles its weighting when it starts)
        with batch_rows(rows), loss_weighted_by(model, tracked):
            settings = getattr(model.optimizer, "_unison_settings", None)
            if overlap is None or settings is None:
                return shadow_step(model, shadow, step, args)
            return overlap.step(rows, settings, lambda: shadow_step(model, shadow, step, args))

    return train_step


def _counted_test_step(model: Any, step: Callable[..., Any]) -> Callable[..., Any]:
    """``test_step`` whose loss tracker weighs by the targets the loss counts ([Note: targets a loss does not
    count]; the last argument is the batch on every backend)."""

    def test_step(*args: Any) -> Any:
        shadow = shadow_share(model, args[-1])
        with loss_weighted_by(model, tracker_weight(model, args[-1], shadow)):
            return shadow_step(model, shadow, step, args)

    return test_step


def _ignored_class(model: Any) -> Any:
    """The class ``model``'s loss leaves out of its mean (a ``SparseCategoricalCrossentropy`` with
    ``ignore_class``, Keras's default reduction), or None."""
    loss = _only(getattr(model, "loss", None))
    if not isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
        return None
    config = loss.get_config()
    return config.get("ignore_class") if config.get("reduction") == "sum_over_batch_size" else None


def counted_targets(model: Any, data: Any) -> Any:
    """How many of this rank's targets ``model``'s loss counts, where its mean divides by that count (an
    ``ignore_class``): an int or a scalar tensor; None for any other loss.

    [Note: targets a loss does not count] DataParallel weighs each rank's gradient by its share of the
    global batch, which is one process's gradient when the loss is a mean over the batch's rows. A
    ``SparseCategoricalCrossentropy(ignore_class=...)`` (padding in a sequence model) averages over the
    targets it does not ignore, whose count differs between the ranks' shares: weighted by rows, the
    weights were 0.12 off one process's after one step at 2 ranks (found on 2026-12-06). Such a loss weighs
    each rank by its counted targets instead, its gradients and its reported loss alike.
    """
    ignored = _ignored_class(model)
    if ignored is None:
        return None
    _, y, _ = keras.utils.unpack_x_y_sample_weight(data)
    y = _only(y)
    if y is None or isinstance(y, (list, tuple, dict)):
        return None
    return keras.ops.sum(keras.ops.cast(keras.ops.not_equal(y, ignored), "int32"))


def _only(value: Any) -> Any:
    """The one item of a one-element list, tuple or dict (``compile(loss=[...])`` on a one-output model), else
    ``value``: wrapped so, an ignore_class loss was weighed by rows again (found by a review, 2026-12-06)."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return value[0]
    if isinstance(value, dict) and len(value) == 1:
        return next(iter(value.values()))
    return value


def batch_weight_of(model: Any, data: Any, shadow: Any = None) -> Any:
    """This rank's weight among the ranks in a step: its counted targets (:func:`counted_targets`) for a
    loss that averages over those, else its rows (:func:`batch_rows_of`); 0 for a shadow share (``shadow``,
    else :func:`shadow_share`)."""
    weight = tracker_weight(model, data, shadow)
    return batch_rows_of(data) if weight is None else weight


def tracker_weight(model: Any, data: Any, shadow: Any = None) -> Any:
    """The weight of this rank's loss in the step (the loss tracker's, and the gradients' among the ranks)
    where it is not the batch's rows: the targets an ``ignore_class`` loss counts (:func:`counted_targets`),
    0 for a shadow share (``shadow``, else :func:`shadow_share` of ``data``); None otherwise (the rows, as
    Keras weighs)."""
    counted = counted_targets(model, data)
    if shadow is None:
        shadow = shadow_share(model, data)
    if shadow is False:
        return counted
    weight = batch_rows_of(data) if counted is None else counted
    if shadow is True:
        return 0
    return keras.ops.where(shadow, keras.ops.zeros_like(weight), weight)  # (a compiled step: a tensor)


def shadow_share(model: Any, data: Any) -> Any:
    """Whether a step's batch is a shadow share ([Note: shadow shares] in ``unison.common.data_parallel``):
    sample weights that are all -0.0, in a fit or evaluate whose data has a shadow batch (the user's weights
    of -0.0 were made 0.0 there). False otherwise; a bool, or a scalar boolean tensor in a compiled step
    (where the values are not known yet)."""
    if not getattr(model, "_unison_shadows", False):
        return False
    _, _, weights = keras.utils.unpack_x_y_sample_weight(data)
    leaves = [w for w in keras.tree.flatten(weights) if w is not None] if weights is not None else []
    if not leaves or "float" not in str(keras.backend.standardize_dtype(leaves[0].dtype)):
        return False
    w = leaves[0]
    flag = keras.ops.all(keras.ops.logical_and(keras.ops.equal(w, 0), keras.ops.signbit(w)))
    return flag if _host.traced([w]) else bool(keras.ops.convert_to_numpy(flag))


@contextlib.contextmanager
def loss_weighted_by(model: Any, counted: Any) -> Iterator[None]:
    """Within the block, Keras's loss tracker weighs the step's loss by ``counted`` (:func:`counted_targets`)
    instead of its rows (see [Note: targets a loss does not count]); nothing when it is None."""
    tracker = getattr(model, "_loss_tracker", None)
    if counted is None or tracker is None:
        yield
        return
    original = tracker.update_state

    def update_state(values: Any, sample_weight: Any = None) -> Any:
        return original(values, sample_weight=counted)

    with _instead(tracker, "update_state", update_state):
        yield


@contextlib.contextmanager
def _instead(obj: Any, name: str, method: Callable[..., Any]) -> Iterator[None]:
    """Within the block ``obj.name`` is ``method``; after it, what it was (an instance attribute of Keras's own
    put back, else the class's method again)."""
    own = obj.__dict__.get(name)
    setattr(obj, name, method)
    try:
        yield
    finally:
        if own is None:
            delattr(obj, name)
        else:
            setattr(obj, name, own)


def shadow_step(model: Any, shadow: Any, step: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``step(*args)`` (a train or test step), after which a shadow share's metrics' states are as before it;
    ``shadow`` is :func:`shadow_share`'s answer (False: the step alone).

    [Note: a shadow's metrics] A shadow share's sample weights of -0.0 weigh its loss and Keras's
    ``weighted_metrics`` by zero, but neither the metrics given to ``compile(metrics=...)`` nor the
    per-output losses Keras tracks are weighted by sample weights, so they counted the shadow's rows
    (found by its tests, 2026-12-07: a mean absolute error's count 17 on a shadow with 16 rows of its
    own; a two-output model's per-output losses off one process's). So every metric state is kept
    from before the step and put back, through ``where`` in a compiled step:

    * inside Keras's own ``compute_metrics``, after its update and before its result is read (the
      update under :func:`local_metrics`, then one global result, as Keras's makes: the same
      collectives on every rank), so the step's logs are one process's too;
    * else (a ``compute_metrics`` of the user's, or a step of the user's that does not call it) after
      the step, on the variables where they hold state (TensorFlow, torch), in the returned state's
      last part where the step is a function of its state (JAX: the metrics' variables come last in
      the train step's and the test step's); that step's logs then count the shadow's rows (Keras
      takes each epoch's and ``evaluate``'s logs from the states afterwards,
      ``_get_metrics_result_or_logs``).
    """
    if shadow is False:
        return step(*args)
    keep = (lambda old, new: old) if shadow is True else (lambda old, new: keras.ops.where(shadow, old, new))
    stateless = _host.backend() == "jax" and isinstance(args[0], (list, tuple)) and len(args) == 2
    variables = list(model.metrics_variables)
    before = list(args[0][-1]) if stateless else [keras.ops.copy(v.value) for v in variables]  # (torch: in place)
    with _metrics_put_back(model, variables, before, keep) as put_back:
        out = step(*args)
    if put_back:  # (Keras's own compute_metrics ran, the step's last update of them, and put them back)
        return out
    if stateless:
        logs, state = out
        return logs, (*state[:-1], [keep(old, new) for old, new in zip(before, state[-1], strict=True)])
    for v, old in zip(variables, before, strict=True):
        v.assign(keep(old, v.value))
    return out


@contextlib.contextmanager
def _metrics_put_back(model: Any, variables: list[Any], before: list[Any],
                      keep: Callable[[Any, Any], Any]) -> Iterator[list[bool]]:
    """Within the block Keras's own ``compute_metrics`` puts ``variables`` back to ``before`` (by ``keep``) after
    its update, before its result ([Note: a shadow's metrics]); the list yielded is non-empty once it has (a
    ``compute_metrics`` of the user's is left as it is, and a step of the user's may not call it)."""
    done: list[bool] = []
    if getattr(type(model), "compute_metrics", None) is not keras.Model.compute_metrics:
        yield done
        return
    original = model.compute_metrics

    def compute_metrics(x: Any, y: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        with local_metrics():  # (its own result: the global one, a collective, is made once, below)
            original(x, y, y_pred, sample_weight)
        for v, old in zip(variables, before, strict=True):
            v.assign(keep(old, v.value))
        done.append(True)
        return model.get_metrics_result()

    with _instead(model, "compute_metrics", compute_metrics):
        yield done


def batch_rows_of(data: Any) -> Any:
    """This rank's rows in a step's batch (``data`` as a train step gets it), or None without inputs."""
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    leaves = [t for t in keras.tree.flatten(x) if t is not None]
    return _host.rows_of(leaves[0]) if leaves else None


def _jax_train_function(model: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """JAX's ``make_train_function``: the step as two jitted programs with the exchange between them
    where it can (see [Note: the JAX step in two programs] in ``_jax_step.py``), else Keras's own."""

    def make_train_function(force: bool = False) -> Any:
        from unison.keras import _jax_step

        if not _jax_step.applies(model):
            return original(force)
        if model.train_function is None or force:
            model.train_function = model._make_function(_jax_step.make_train_step(model))
        return model.train_function

    return make_train_function


def _jax_test_function(model: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """JAX's ``make_test_function``: with global metrics, Keras's own jitted test step runs with this
    rank's metrics and the logs come from the states summed after it (no host callback in the step)."""

    def make_test_function(force: bool = False) -> Any:
        from unison.keras import _jax_step

        if model.test_function is not None and not force:
            return model.test_function
        original(force)
        dp = getattr(model, "_unison_dp", None)
        if dp is not None and dp.global_metrics and _jax_step.keeps_test_step(model):
            model.test_function = _jax_step.with_global_logs(model, model.test_function, index=2)
        return model.test_function

    return make_test_function


def _global_metrics_result(model: Any) -> Callable[[], dict[str, Any]]:
    """``get_metrics_result`` computing each metric from its state summed over the ranks.

    Inside :func:`local_metrics` it is the class's own (this rank's states): JAX's two-program step
    sums the states between its programs instead ([Note: the JAX step in two programs])."""

    def get_metrics_result() -> dict[str, Any]:
        if _LOCAL_METRICS.get():
            return type(model).get_metrics_result(model)
        metrics = list(model.metrics)
        variables = [v for m in metrics for v in m.variables]
        summed = _host.host_call(lambda arrays, _rows: sum_states(arrays), [v.value for v in variables])
        return metrics_results(metrics, summed)

    return get_metrics_result


_LOCAL_METRICS: contextvars.ContextVar[bool] = contextvars.ContextVar("unison_keras_local_metrics", default=False)


@contextlib.contextmanager
def local_metrics() -> Iterator[None]:
    """Within the block a data-parallel model's ``get_metrics_result`` reports this rank's own states."""
    token = _LOCAL_METRICS.set(True)
    try:
        yield
    finally:
        _LOCAL_METRICS.reset(token)


def metrics_results(metrics: list[Any], states: list[Any]) -> dict[str, Any]:
    """Each metric's result from ``states`` (every metric's variables in turn, as ``model.metrics_variables``)."""
    results: dict[str, Any] = {}
    start = 0
    for metric in metrics:
        count = len(metric.variables)
        result = metric.stateless_result(states[start:start + count])
        start += count
        if isinstance(result, dict):
            results.update(result)
        else:
            results[metric.name] = result
    return results


class _Sync(keras.callbacks.Callback):
    """Broadcast rank 0's state when training starts; average non-trainable state at each epoch's end."""

    def __init__(self, dp: DataParallel, model: Any) -> None:
        super().__init__()
        self._dp, self._target = dp, model

    def on_train_begin(self, logs: Any = None) -> None:
        self._dp.broadcast_state(self._target)
        own_seed_streams(self._target, self._dp.rank)

    def on_test_begin(self, logs: Any = None) -> None:
        # fit validates before on_epoch_end: every rank validates the averaged statistics (it
        # validated with its own moving statistics, and the summed val_loss was no model's)
        if self._dp.average_non_trainable:
            self._dp.average_state(self._target)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self._dp.average_non_trainable:
            self._dp.average_state(self._target)


class _AgreeToStop(keras.callbacks.Callback):
    """Runs after the user's callbacks: ``model.stop_training`` set on any rank is set on every rank.

    A stop decided on one rank (``global_metrics=False`` with ``EarlyStopping``, ``TerminateOnNaN`` on
    a rank's own loss, a time limit) left that rank out of training while the others waited in the
    next step's gradient exchange for ever. One all-reduce of a flag per batch and per epoch."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self._target = model

    def _agree(self, name: str) -> None:
        if runtime.size() == 1:
            return
        mine = np.array([1 if getattr(self._target, "stop_training", False) else 0], np.int32)
        if frontend.allreduce(mine, Max, f"unison.keras.stop_training.{name}")[0]:
            self._target.stop_training = True

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._agree("batch")

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._agree("epoch")


def _quiet(verbose: Any, rank: int) -> Any:
    return verbose if rank == 0 else 0


def _fit(dp: DataParallel, model: Any, fit: Callable[..., Any]) -> Callable[..., Any]:
    def distributed_fit(*args: Any, **kwargs: Any) -> Any:
        a = _FIT.bind(model, *args, **kwargs).arguments
        a.pop("self")
        x, y, sw = a.pop("x", None), a.pop("y", None), a.pop("sample_weight", None)
        batch = a.pop("batch_size", None)
        split = a.pop("validation_split", 0.0)
        val = a.pop("validation_data", None)
        if split and val is None and data._is_arrays(x):
            (x, y, sw), (vx, vy, vsw) = data.split_validation((x, y, sw), split)
            val = (vx, vy, vsw)
        elif split and val is None:  # (given validation_data, Keras ignores the split: so do we, since 2026-12-06)
            raise ValueError("validation_split needs numpy arrays as x; pass validation_data instead")
        shuffle, class_weight = a.pop("shuffle", True), a.pop("class_weight", None)
        settings = f"shuffle={shuffle!r}, class_weight={_sorted(class_weight)}, validation=" + (
            f"{'given' if val is not None else 'none'}, split={split!r}, " + ", ".join(
                f"{k}={a.get(k, _FIT.parameters[k].default)!r}" for k in _FIT_SETTINGS))
        dp._fits += 1
        shadows = _shadows_allowed(model, sw, class_weight, ("train_step", "test_step"), training=True)
        train = dp.shard(x, y, sw, batch, shuffle, class_weight, "model.fit", settings,
                         call=dp._fits * 1_000_003 + int(a.get("initial_epoch") or 0), shadows=shadows)
        if class_weight is not None and not data._is_arrays(x):
            if data.is_loader(x):  # as Keras refuses it for a DataLoader
                raise ValueError("class_weight is not supported for a torch DataLoader (as in Keras); fold the "
                                 "class weights into each batch's sample weights")
            a["class_weight"] = class_weight  # Keras weighs the rows of each batch of ours (a PyDataset, tf.data)
        if val is not None:
            vx, vy, vsw = (tuple(val) + (None, None))[:3] if isinstance(val, (tuple, list)) else (val, None, None)
            val = dp.shard(vx, vy, vsw, a.pop("validation_batch_size", None) or batch, False, None,
                           "validation_data", shadows=_shadows_allowed(model, vsw, None, ("test_step",)))
        shadowed = _has_shadows(train) or _has_shadows(val)  # (before _unwrap: a TensorFlow pipeline has no plan)
        train, val = _unwrap(train, a, "steps_per_epoch"), _unwrap(val, a, "validation_steps")
        callbacks = list(a.pop("callbacks", None) or [])
        _refuse_unsafe_callbacks(callbacks)
        callbacks = _rank0.fit_callbacks(callbacks)  # [Note: rank-0-only files under fit]
        callbacks.insert(0, _Sync(dp, model))
        callbacks.append(_AgreeToStop(model))
        with _expecting_shadows(model, shadowed):
            return fit(train, validation_data=val, shuffle=False, callbacks=callbacks,
                       verbose=_quiet(a.pop("verbose", "auto"), dp.rank), **a)

    def collective_fit(*args: Any, **kwargs: Any) -> Any:
        with collective("model.fit"):
            return distributed_fit(*args, **kwargs)

    return collective_fit


def _evaluate(dp: DataParallel, model: Any, evaluate: Callable[..., Any]) -> Callable[..., Any]:
    def distributed_evaluate(*args: Any, **kwargs: Any) -> Any:
        a = _EVALUATE.bind(model, *args, **kwargs).arguments
        a.pop("self")
        extra = a.pop("kwargs", {})
        x = a.pop("x", None)
        if extra.get("_use_cached_eval_dataset") or _already_sharded(x):  # fit's validation
            return evaluate(x, verbose=a.pop("verbose", "auto"), **a, **extra)
        with collective("model.evaluate"):
            raw = x
            sw = a.pop("sample_weight", None)
            x = dp.shard(x, a.pop("y", None), sw, a.pop("batch_size", None), False, None, "model.evaluate",
                         shadows=_shadows_allowed(model, sw, None, ("test_step",)))
            _sync(dp, model, raw)
            shadowed = _has_shadows(x)
            x = _unwrap(x, a, "steps")
            with _expecting_shadows(model, shadowed):
                return evaluate(x, verbose=_quiet(a.pop("verbose", "auto"), dp.rank), **a, **extra)

    return distributed_evaluate


def _shadows_allowed(model: Any, sample_weight: Any, class_weight: Any, steps: tuple[str, ...],
                     training: bool = False) -> bool:
    """Whether a small last batch of ``model``'s arrays may go to shadows ([Note: shadow shares]).

    Their batches then carry sample weights: Keras's own steps read them, a step of the user's may unpack
    ``x, y = data`` and fail on a third part, unless the user gave weights already. Training also needs
    Unison's optimizer, which weighs each rank by its rows (another distributed optimizer averages plainly and
    would give a shadow's gradient its share). Otherwise the batch is dropped with a warning, as before.
    """
    if training and getattr(getattr(model, "optimizer", None), "_unison_settings", None) is None:
        return False
    return (sample_weight is not None or class_weight is not None
            or all(getattr(type(model), step, None) is getattr(keras.Model, step) for step in steps))


def _has_shadows(sharded: Any) -> bool:
    plan = getattr(sharded, "plan", None)
    return bool(plan is not None and plan.has_shadows)


#: the attributes that hold a model's steps as traced for one shadow setting
_COMPILED = ("train_step", "test_step", "train_function", "test_function")


@contextlib.contextmanager
def _expecting_shadows(model: Any, expected: bool) -> Iterator[None]:
    """Within the block, ``model``'s steps know whether a share may be a shadow (:func:`shadow_share` looks
    only then), and use compiled steps traced for that setting.

    [Note: compiled steps per shadow setting] A compiled step (tf.function, jax.jit) reads the setting when
    traced, so a change of setting makes new steps: new ``train_step``/``test_step`` objects (JAX's ``jax.jit``
    keeps its traces by the function: Keras's ``make_test_function``, and its ``make_train_function`` for a
    class with its own ``train_step``, jit ``model.test_step`` and ``model.train_step``) and no compiled
    functions, which Keras then makes. A block inside another (an ``evaluate`` called by a fit's callback) puts
    the outer call's steps back at its end; an outermost one leaves its own in place, as a plain fit does.
    Until 2026-12-07 a change dropped the compiled functions only, which failed three ways:

    * an ``evaluate`` called by a fit's callback dropped the fit's ``train_function``, which Keras makes once
      before its epochs: the next step called None (every backend);
    * with data of the other setting, it left the fit's validation reading the evaluate's setting (a shadow's
      row counted in ``val_loss``);
    * on JAX the old trace ran again with the old setting (a shadow weighed by its rows: loss, metrics and
      weights off one process's).
    """
    depth = model.__dict__.get("_unison_depth", 0)
    before = bool(getattr(model, "_unison_shadows", False))
    saved = tuple(model.__dict__.get(name) for name in _COMPILED)
    if before != expected:
        object.__setattr__(model, "_unison_shadows", expected)
        _set_steps(model)
        model.train_function = model.test_function = None
    _set(model, "_unison_depth", depth + 1)
    try:
        yield
    finally:
        _set(model, "_unison_depth", depth)
        if depth and before != expected:  # (nested: the outer call's steps and setting come back)
            object.__setattr__(model, "_unison_shadows", before)
            for name, value in zip(_COMPILED, saved, strict=True):
                _set(model, name, value)


def _unwrap(sharded: Any, args: dict[str, Any], steps: str) -> Any:
    """A TensorFlow pipeline's dataset; an endless (shuffled) one sets ``args[steps]`` to its batches, and
    where the caller gave ``args[steps]``, one pass per iterator is taken instead ([Note: a caller's
    steps_per_epoch over shuffled arrays] in ``unison.keras._tf_data``)."""
    if sharded is None or type(sharded).__name__ != "TFArrays":
        return sharded
    if sharded.endless and args.get(steps) is not None:
        return sharded.one_pass_each()
    if sharded.endless:
        args[steps] = sharded.plan.steps
    return sharded.dataset


def _refuse_unsafe_callbacks(callbacks: list[Any]) -> None:
    """Keras's own BackupAndRestore writes its metadata, copies and deletes its folder from every
    rank (rank 0's save raced the others' deletion): refused, on every rank alike (every rank
    passes the same callbacks), unless it is a rank-aware subclass."""
    for cb in callbacks:
        if type(cb) is keras.callbacks.BackupAndRestore:
            raise ValueError("keras.callbacks.BackupAndRestore writes and deletes its backup folder from every "
                             "rank, which races under DataParallel. Save with unison.keras.callbacks."
                             "ModelCheckpoint (rank 0 writes, atomically) and resume with load_weights and "
                             "initial_epoch; on the TensorFlow backend unison.tf_backend.keras.callbacks."
                             "BackupAndRestore is rank-aware")


def _sync(dp: DataParallel, model: Any, x: Any = None) -> None:
    """Rank 0's weights on every rank, at every top-level ``evaluate`` / ``predict`` (as ``fit`` starts from
    them at every call).

    [Note: rank 0's weights at every evaluate and predict] Until 2026-12-06 they were broadcast before the
    first evaluate or predict only: weights set apart afterwards on some rank (a rank-local
    ``load_weights``, ``set_weights``, a custom loop) gave a global loss that was no model's (each rank
    evaluated its rows with its own weights) and predictions whose rows came from different models, with no
    error (found by an audit). Now each call broadcasts the model's variables (not the optimizer's: ``fit``
    broadcasts those) and probes the function ([Note: one function on every rank]): one broadcast of the
    weights per call. fit's own validation runs on weights that already agree and broadcasts nothing.

    An unbuilt model (a subclassed one) is built first on one row of the (agreed) global data, in inference
    mode: Keras would build it inside the call with each rank's own random weights."""
    if not model.built and x is not None:
        first = data.first_inputs(x)  # (a PyDataset's, a loader's or a tf.data dataset's first batch too: before
        if first is None:  # 2026-12-05 those left each rank evaluating its own random weights)
            raise ValueError(f"DataParallel: the model is not built and its inputs cannot be read ahead from a "
                             f"{type(x).__name__} (a stream read once) to build it; build it first (model.build("
                             "input_shape), or call it on one batch), or fit before evaluating")
        model(keras.tree.map_structure(lambda a: np.asarray(a)[:1], first), training=False)
    if model.built:
        dp.broadcast_state(model, optimizer=False)


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Within the block, a stall or a peer's shutdown names the likely cause: ``what`` is collective.

    [Note: evaluate and predict are collective] Every rank splits the data and takes its rows, so every
    rank must call ``evaluate`` / ``predict`` with the same data. A Horovod-style ``if rank == 0:
    model.predict(...)`` waited for the other ranks until the engine's deadlock check
    (``UNISON_DEADLOCK_TIME_SECONDS``) raised a ``StallError`` naming tensors only (found by an audit)."""
    try:
        yield
    except (StallError, ShutdownError) as exc:
        raise type(exc)(f"{what} under unison.keras.DataParallel is collective: every rank must call it, with "
                        f"the same data (a Horovod-style `if rank == 0: model.{what.split('.')[-1]}(...)` waits "
                        f"for the other ranks); {exc}") from exc


def _predict(dp: DataParallel, model: Any, predict: Callable[..., Any]) -> Callable[..., Any]:
    def distributed_predict(*args: Any, **kwargs: Any) -> Any:
        a = _PREDICT.bind(model, *args, **kwargs).arguments
        a.pop("self")
        with collective("model.predict"):
            if data._is_arrays(a["x"]):
                return _predict_arrays(dp, model, predict, a)
            return _predict_batches(dp, model, predict, a)

    return distributed_predict


def _predict_batches(dp: DataParallel, model: Any, predict: Callable[..., Any], a: dict[str, Any]) -> Any:
    """``predict`` of a PyDataset, tf.data dataset or DataLoader of global batches (see ``_predict.py``)."""
    from unison.keras import _predict as batches

    x, steps = a.pop("x"), a.pop("steps", None)
    if a.pop("batch_size", None) is not None:  # (as Keras refuses it)
        raise ValueError(f"predict: batch_size goes with numpy arrays; a {type(x).__name__} gives its own batches")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ValueError(f"predict: steps={steps!r} must be a positive int")
    if dp.size > 1:
        _agree_on_inputs("model.predict", x, None, None, None, f"steps={steps!r}")
    source = batches.predict_batches(x, dp.rank, dp.size, steps, dp.seed())
    _sync(dp, model, x)
    outputs = predict(source, verbose=_quiet(a.pop("verbose", "auto"), dp.rank), **a)
    return keras.tree.map_structure(
        lambda o: batches.gather_batches(np.asarray(o), source.global_rows, dp.rank, dp.size), outputs)


def _predict_arrays(dp: DataParallel, model: Any, predict: Callable[..., Any], a: dict[str, Any]) -> Any:
    x, batch = a.pop("x"), a.pop("batch_size", None)
    steps = a.pop("steps", None)
    if steps is not None:  # Keras predicts the first `steps` batches: the plan must cover those rows only
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"predict: steps={steps!r} must be a positive int")
        rows = steps * (batch or 32)
        x = keras.tree.map_structure(lambda arr: np.asarray(arr)[:rows], x)
    sharded = dp.shard(x, None, None, batch, False, None, "model.predict")
    _sync(dp, model, x)
    if sharded.plan.steps == 0:  # fewer rows than ranks: every rank predicts them all (no collective here)
        return predict(x, batch_size=batch, verbose=_quiet(a.pop("verbose", "auto"), dp.rank), **a)
    outputs = predict(sharded, verbose=_quiet(a.pop("verbose", "auto"), dp.rank), **a)
    plan: BatchPlan = sharded.plan
    gathered = keras.tree.map_structure(lambda o: gather_rows(np.asarray(o), plan, dp.rank), outputs)
    if not plan.dropped:
        return gathered
    # a last batch with fewer rows than ranks: every rank predicts it whole (no collective in predict)
    tail = predict(keras.tree.map_structure(lambda a: np.asarray(a)[plan.samples - plan.dropped:], x),
                   verbose=0, **a)
    return keras.tree.map_structure(lambda g, t: np.concatenate([g, np.asarray(t)]), gathered, tail)


def _not_distributed(name: str) -> Callable[..., Any]:
    """``model.<name>`` under DataParallel: refused (it would run each rank's whole batch on a model
    that ``fit`` has not yet made the same on every rank: different models, silently)."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"model.{name} is not distributed by unison.keras.DataParallel (it neither splits the batch nor "
            "starts every rank from rank 0's weights); use fit / evaluate / predict, e.g. "
            "fit(x, y, batch_size=len(x), epochs=1) for one step on a global batch")
    return refuse


def _unmasked_loss(compute_loss: Callable[..., Any]) -> Callable[..., Any]:
    """Keras's ``compute_loss``, refusing a masked prediction (``mask_zero``, ``Masking`` reaching an
    output): Keras then averages each rank's loss over that rank's unmasked entries, whose counts
    differ between ranks, while DataParallel weighs each rank's gradient by its rows, so the
    global loss, gradients and weights would differ from one process's, silently."""
    try:
        from keras.src.backend import get_keras_mask
    except ImportError:  # pragma: no cover - a Keras without it keeps masks as attributes
        def get_keras_mask(x: Any) -> Any:
            return getattr(x, "_keras_mask", None)

    def checked(*args: Any, **kwargs: Any) -> Any:
        y_pred = kwargs["y_pred"] if "y_pred" in kwargs else (args[2] if len(args) > 2 else None)
        if any(get_keras_mask(t) is not None for t in keras.tree.flatten(y_pred) if t is not None):
            raise ValueError(
                "unison.keras.DataParallel: the model's output carries a mask (Embedding(mask_zero=True) or "
                "Masking reaching the output), so Keras averages each rank's loss over that rank's unmasked "
                "entries, which the ranks' averaged gradients do not reproduce (not supported yet). Give "
                "the padded positions a sample_weight of 0 instead of a mask, or consume the mask before "
                "the output (an RNN, a pooling layer)")
        return compute_loss(*args, **kwargs)
    return checked


def _sorted(class_weight: Any) -> str:
    if class_weight is None:
        return "none"
    return repr(sorted((int(k), float(w)) for k, w in dict(class_weight).items()))


def _rank0_save(save: Callable[..., Any]) -> Callable[..., Any]:
    """``save``/``save_weights`` from rank 0 only, through ``atomic_path`` (others return None)."""

    def rank0_save(filepath: Any, *args: Any, **kwargs: Any) -> Any:
        return None if runtime.rank() != 0 else atomic_keras_save(save, filepath, *args, **kwargs)

    return rank0_save


def _keras_global_seed() -> int | None:
    """The seed of ``keras.utils.set_random_seed``, or None when it was not called (Keras keeps it in its
    global state; read where Keras 3.15 keeps it, and None if a later Keras moved it)."""
    try:
        from keras.src.backend.common import global_state
    except ImportError:
        return None
    found = global_state.get_global_attribute("global_random_seed")
    return None if found is None else int(found)
