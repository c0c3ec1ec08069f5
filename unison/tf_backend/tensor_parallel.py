"""Megatron-style tensor-parallel layers for Keras 3 (TensorFlow backend): each rank of a group holds one shard.

The same layers, names and split as the PyTorch backend's ``tensor_parallel.py`` (see its
docstring and docs/tensor_parallel.md), as ``keras.layers.Layer`` subclasses. The tensor group is
a registered process set (``hvd.add_process_set``; ``Grid.register`` makes one per grid row);
``global_process_set`` (the default) makes the whole job one group::

    ColumnParallelLinear   kernel columns (output units)  y_i = act(x K_i + b_i)   (shard i of y)
    RowParallelLinear      kernel rows (input features)   y = act(sum_i x_i K_i + b)
    VocabParallelEmbedding embedding rows (vocabulary)    each id looked up by the rank owning it

Keras's ``Dense`` keeps its kernel as ``(in, out)``, the transpose of ``nn.Linear.weight``, so a
column shard is a slice of kernel *columns* here. ``Dense`` also carries an activation; the
parallel layers keep it (a column shard applies an element-wise one to its own units, any other
after the gather; a row layer any activation after the sum: [Note: activations on a column shard]),
and ``from_dense`` copies it. Randomly initialised shards are this rank's slices of
the whole layer's Glorot-uniform kernel (an embedding's: of the whole table's "uniform"), drawn under
Keras's global seed ([Note: Keras shards drawn from the whole]); biases start at zero, as
``Dense``'s, so the row layer's replicated bias is the same on every rank of the group.

[Note: activations on a column shard] A column shard applies to its own units only the
activations known to act unit by unit (relu, gelu, tanh...: ``_ELEMENTWISE``, Keras's, ``keras.ops``'
and ``tf.nn``'s functions by name). Any other (softmax, glu, which pairs unit ``j`` with unit
``j + n/2`` of the whole layer, or a function of the user's) runs on the gathered output
(``gather_output=True``) and is refused without it: before 2026-12-07 only softmax's family was
known, and a glu on a column layer gave each shard's own pairs, 0.35 off the unsplit ``Dense``
at tp = 2 with no error (found by an audit). A row layer applies its activation to the summed
output (and bias), which every rank holds whole (under ``sequence_parallel``, whole rows of its
positions), so any activation over the units is right there.

The layers run on Keras's TensorFlow backend only (their collectives are TensorFlow ops with
``tf.custom_gradient``); on JAX or torch they raise on construction (:func:`refuse_other_backend`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.tensor_parallel.groups import (
    CHECKSUM_PRIME,
    agree_on_layer,
    agree_on_source,
    describe,
    group_position,
    targets_mismatch,
)
from unison.common.tensor_parallel.sequence import check_column_options, check_row_options
from unison.common.tensor_parallel.sharding import divisible_shard
from unison.tf_backend.tensor_parallel_comm import (
    agree_on_input_once,
    allreduce_max_no_grad,
    copy_to_group,
    gather_from_group,
    gather_from_sequence,
    input_check,
    reduce_from_group,
    reduce_scatter_to_sequence,
    scatter_to_group,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "group_position"]


def _glorot(fan_in: int, fan_out: int) -> keras.initializers.Initializer:
    """Glorot-uniform of a whole ``(fan_in, fan_out)`` kernel, as ``Dense``'s default draws it."""
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return keras.initializers.RandomUniform(-limit, limit)


class ShardOfWhole(keras.initializers.Initializer):
    """Draws the WHOLE ``shape`` with ``whole`` and keeps ``keep(drawn)``, this rank's shard.

    [Note: Keras shards drawn from the whole] A Keras initializer made without a seed takes one from
    Python's generator (``keras.utils.set_random_seed`` seeds it), so ranks seeded alike, the normal path,
    give every layer's initializer the same seed on every rank. Drawn at the shard's shape (before
    2026-12-07), every shard of a layer held the SAME values: the layer was tp copies of one block, which got
    equal gradients and stayed copies (found by an audit). Drawn whole and sliced, as the PyTorch layers do
    ([Note: shards drawn from the whole]), the shards are the slices of the unsplit layer drawn under that
    seed: a tp = 1 and a tp = 2 model built under one seed are the same model. Each rank draws the whole
    tensor once, when the layer is built. The seed is an integer, so calling ``whole`` again draws the same
    values (Keras documents it): ``ParallelSelfAttention`` redraws its fused kernel to keep its heads' columns.
    """

    def __init__(self, whole: keras.initializers.Initializer, shape: tuple[int, ...],
                 keep: Callable[[Any], Any]) -> None:
        self.whole, self.shape, self.keep = whole, tuple(shape), keep

    def __call__(self, shape: Any, dtype: Any = None) -> Any:
        return self.keep(self.whole(self.shape, dtype=dtype))


def _activation_text(activation: Any) -> str:
    """An activation as every rank names it alike (a name, ``None`` or a function: the function it means)."""
    return describe(keras.activations.get(activation))


def _check_dense(dense: Any, owner: str) -> None:
    if not isinstance(dense, keras.layers.Dense):
        raise TypeError(f"{owner}.from_dense needs a keras.layers.Dense; received {type(dense).__name__}")
    refuse_quantized(dense, f"{owner}.from_dense")
    if not dense.built:
        raise ValueError(f"{owner}.from_dense needs a built Dense (its kernel exists); call it on an input or "
                         f"dense.build(input_shape) first: {dense.name!r} is not built")


def source_arrays(*layers: Any) -> list:
    """Built Keras layers as ``agree_on_source`` compares them: each one's class and configuration (without
    its per-process name: activation, regularizers, constraints) and its weights' values."""
    out: list = []
    for layer in layers:
        out.append(describe(layer))
        out.extend(keras.ops.convert_to_numpy(weight) for weight in layer.weights)
    return out


def _agree_on_dense(dense: Any, owner: str, process_set: ProcessSet) -> None:
    """``from_dense``'s check of ``dense``, and the group's agreement that every rank holds the same one."""

    def source() -> list:
        _check_dense(dense, owner)
        return source_arrays(dense)

    refuse_other_backend(f"{owner}.from_dense")  # (before the agreement's collective)
    group_position(process_set, owner)
    agree_on_source(f"{owner}.from_dense", process_set, source)  # [Note: one unsplit source on every rank]


def refuse_other_backend(owner: str) -> None:
    """Raise unless Keras runs on TensorFlow: the layers' collectives are TensorFlow ops with custom
    gradients (before 2026-12-07 JAX failed in ``parallelize`` with an AttributeError, torch in ``fit``
    with "Can't call numpy() on Tensor that requires grad"). The backend is the same on every rank, so
    every rank raises here, before any collective."""
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ValueError(f"{owner}: Unison's Keras tensor parallelism runs on Keras's TensorFlow backend only "
                         f"(KERAS_BACKEND is {backend!r}): its collectives are TensorFlow ops with custom "
                         "gradients, which a JAX or torch model cannot differentiate. Set "
                         "KERAS_BACKEND=tensorflow, or on torch use unison.torch_backend's tensor-parallel "
                         "layers with torch modules")


#: activations that act on each unit alone, so a column shard may apply them to its own units ([Note:
#: activations on a column shard]); by function name, as Keras's, keras.ops' and tf.nn's are different objects
_ELEMENTWISE = frozenset({
    "linear", "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "gelu", "sigmoid", "hard_sigmoid",
    "log_sigmoid", "sparse_sigmoid", "silu", "swish", "hard_silu", "hard_swish", "mish", "tanh", "hard_tanh",
    "tanh_shrink", "hard_shrink", "soft_shrink", "softplus", "softsign", "sparse_plus", "squareplus",
    "exponential", "exp", "threshold"})
#: activations known to mix a layer's units (for the error message; any activation not in _ELEMENTWISE is
#: applied after the gather)
_ACROSS_UNITS = frozenset({"softmax", "log_softmax", "sparsemax", "softmax_v2", "log_softmax_v2", "glu"})


def _activation_name(activation: Any) -> str:
    function = activation.func if isinstance(activation, functools.partial) else activation
    return getattr(function, "__name__", type(function).__name__)


def _unit_by_unit(activation: Any) -> bool:
    """Whether ``activation`` (``keras.activations.get``'s result) is one of Keras's or TensorFlow's
    element-wise functions (a ``functools.partial`` of one included: ``leaky_relu`` with a slope)."""
    function = activation.func if isinstance(activation, functools.partial) else activation
    library = (getattr(function, "__module__", None) or "").split(".")[0]
    return library in ("keras", "tensorflow") and getattr(function, "__name__", None) in _ELEMENTWISE


class _GroupPenalty:
    """A shard's regularizer summed over the tensor group (forward: all-reduce; backward: each
    shard's own gradient), so the loss counts the whole layer's penalty on every rank."""

    def __init__(self, regularizer: Any, process_set: ProcessSet) -> None:
        self.regularizer, self.process_set = regularizer, process_set

    def __call__(self, weight: Any) -> tf.Tensor:
        return reduce_from_group(self.regularizer(weight), self.process_set)


_SEPARABLE = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)
_NORMS = (keras.constraints.MaxNorm, keras.constraints.MinMaxNorm, keras.constraints.UnitNorm)


def copy_penalty(owner: str, source: str, what: str, weight: Any, regularizer: Any, constraint: Any,
                 process_set: ProcessSet | None, split: bool, whole_axes: tuple[int, ...] = ()) -> None:
    """Give ``weight`` (a shard, or with ``split=False`` a whole replicated copy) ``regularizer``
    and ``constraint``, where they split over the shards: L1, L2 and L1L2 (sums over elements:
    each shard's penalty, summed over the group), NonNeg (element-wise), and norm constraints
    over an axis a shard holds whole (``whole_axes``). A replicated copy keeps any (before
    2026-12-05 a row layer's bias refused all but these). The others raise, naming ``source``'s
    ``what`` (``"kernel"``): a norm over a split axis, say, would differ on every shard."""
    if regularizer is not None and split and not isinstance(regularizer, _SEPARABLE):
        raise ValueError(f"{owner}: {source!r} has {what}_regularizer {type(regularizer).__name__}, which does "
                         "not split over the shards; only L1, L2 and L1L2 do. Remove it, or add its penalty to "
                         "the loss yourself")
    whole = isinstance(constraint, _NORMS) and getattr(constraint, "axis", None) in whole_axes
    if constraint is not None and not (isinstance(constraint, keras.constraints.NonNeg) or whole or not split):
        raise ValueError(f"{owner}: {source!r} has {what}_constraint {type(constraint).__name__}, which does not "
                         "split over the shards here; only NonNeg does (and a norm over the axis a shard holds "
                         "whole). Remove it, or apply it to the gathered weights yourself")
    if weight is None:
        return
    if regularizer is not None:
        weight.regularizer = _GroupPenalty(regularizer, process_set) if split else regularizer
    if constraint is not None:
        weight.constraint = constraint


def refuse_activity_regularizer(layer: Any, owner: str) -> None:
    """The parallel layers apply no ``activity_regularizer`` (the output of a shard is not the layer's)."""
    if getattr(layer, "activity_regularizer", None) is not None:
        raise ValueError(f"{owner}: {layer.name!r} has an activity_regularizer, which the parallel layers do not "
                         "apply; remove it, or add its penalty to the loss yourself")


def refuse_quantized(layer: Any, owner: str) -> None:
    """A quantized layer's weights are integers and scales that the shards cannot slice."""
    mode = getattr(layer, "quantization_mode", None)
    if mode is not None:
        raise ValueError(f"{owner}: {layer.name!r} is quantized ({mode!r}), and its integer weights and scales "
                         "do not split over the shards; split the float layer, then quantize the model if you "
                         "need to")


def _copy_penalties(dense: keras.layers.Dense, layer: Any, owner: str) -> None:
    """Give the shard ``dense``'s regularizers and constraints where they split (:func:`copy_penalty`):
    a column shard holds whole kernel columns (norms over axis 0) and a bias piece, a row shard
    whole kernel rows (axis 1) and the whole bias (replicated: its penalty counted once)."""
    column = owner == "ColumnParallelLinear"
    for what, weight in (("kernel", layer.kernel), ("bias", layer.bias)):
        whole_axes = ((0, -2) if column else (1, -1)) if what == "kernel" else ()
        copy_penalty(f"{owner}.from_dense", dense.name, what, weight, getattr(dense, f"{what}_regularizer", None),
                     getattr(dense, f"{what}_constraint", None), layer.process_set,
                     split=not (what == "bias" and not column), whole_axes=whole_axes)
    refuse_activity_regularizer(dense, f"{owner}.from_dense")


def _in_out(dense: keras.layers.Dense) -> tuple[int, int]:
    fan_in, fan_out = dense.kernel.shape
    return int(fan_in), int(fan_out)


class _ParallelDense(keras.layers.Layer):
    """What the column and row layers share: sizes, the group, kernel, bias and activation."""

    _owner = ""

    def __init__(self, in_features: int, out_features: int, use_bias: bool, activation: Any,
                 process_set: ProcessSet, options: dict[str, bool], **kwargs: Any) -> None:
        refuse_other_backend(self._owner)
        super().__init__(**kwargs)
        self.supports_jit = False  # collectives run outside XLA: compile(jit_compile="auto") must not pick it
        self.tp, self.shard = group_position(process_set, self._owner)
        agree_on_layer(self._owner, process_set, in_features=in_features, out_features=out_features,
                       bias=bool(use_bias), activation=_activation_text(activation), dtype=self.dtype_policy.name,
                       **options)  # [Note: a layer built alike on every rank]
        self._check_options(**options)
        self.in_features, self.out_features = in_features, out_features
        self.process_set = process_set
        self.activation = keras.activations.get(activation)
        self.start, self.stop = self._split()
        #: the seeded Glorot-uniform of the whole (in, out) kernel ([Note: Keras shards drawn from the whole])
        self.whole_kernel = _glorot(in_features, out_features)
        self.kernel = self.add_weight(shape=self._kernel_shape(), name="kernel", initializer=ShardOfWhole(
            self.whole_kernel, (in_features, out_features), self._keep))
        self.bias = self.add_weight(shape=(self._bias_size(),), initializer="zeros",
                                    name="bias") if use_bias else None
        self.built = True

    def _check_options(self, **options: bool) -> None:
        raise NotImplementedError

    def _split(self) -> tuple[int, int]:
        raise NotImplementedError

    def _kernel_shape(self) -> tuple[int, int]:
        raise NotImplementedError

    def _bias_size(self) -> int:
        raise NotImplementedError

    def _keep(self, kernel: Any) -> Any:
        """This rank's shard of the whole ``(in, out)`` kernel."""
        raise NotImplementedError

    def _load(self, kernel: Any, bias: Any) -> None:
        self.kernel.assign(kernel)
        if self.bias is not None and bias is not None:
            self.bias.assign(bias)

    def _finish(self, y: tf.Tensor) -> tf.Tensor:
        return self.activation(y if self.bias is None else y + self.bias)


class ColumnParallelLinear(_ParallelDense):
    """``keras.layers.Dense(out_features)`` on ``in_features`` inputs, output units split over the group.

    The input is replicated over the group; each rank computes its ``out_features / tp`` units.

    Args:
        gather_output: all-gather the shards' outputs so every rank gets all ``out_features``
            (otherwise each keeps its piece, ready for a :class:`RowParallelLinear`).
        activation: as ``Dense``'s: an element-wise one (relu, gelu, tanh...) applied to this rank's
            units; any other (softmax, glu, a function of your own) to the gathered output, so it
            needs ``gather_output=True`` ([Note: activations on a column shard]).
        process_set: the tensor group (default: every rank).
        sequence_parallel: the input is this rank's positions of a ``(batch, seq, in)`` tensor
            split along the sequence; they are all-gathered first (backward: reduce-scatter).
        **kwargs: ``keras.layers.Layer`` arguments (``dtype=``, ``name=``).

    Raises:
        ValueError: ``out_features`` not divisible by the group size, this rank not in the group,
            ``gather_output`` together with ``sequence_parallel``, an activation that is not
            element-wise without ``gather_output``, or a Keras backend other than TensorFlow.
    """

    _owner = "ColumnParallelLinear"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 process_set: ProcessSet = global_process_set, activation: Any = None,
                 sequence_parallel: bool = False, **kwargs: Any) -> None:
        super().__init__(in_features, out_features, bias, activation, process_set,
                         {"gather_output": gather_output, "sequence_parallel": sequence_parallel}, **kwargs)
        self.gather_output, self.sequence_parallel = gather_output, bool(sequence_parallel)
        if not self.sequence_parallel:
            input_check(self, process_set)
        #: an activation not known to act unit by unit (softmax, glu) runs on the gathered output ([Note:
        #: activations on a column shard])
        self._after_gather = not _unit_by_unit(self.activation)
        if self._after_gather and not gather_output:
            name = _activation_name(self.activation)
            why = ("mixes the output units" if name in _ACROSS_UNITS else
                   "is not one of the element-wise activations a shard can apply to its own units (relu, gelu, "
                   "tanh, sigmoid...: Keras's, keras.ops' or tf.nn's), so it may mix the output units")
            raise ValueError(f"ColumnParallelLinear: activation {name!r} {why}, which are split over the tensor "
                             "group, so no rank can apply it to its shard; pass gather_output=True (it then runs "
                             "on the gathered output), or build the layer without it and apply it after the layer "
                             "that combines the shards (a RowParallelLinear, or keras.layers.Activation after a "
                             "gathered output)")

    def _check_options(self, gather_output: bool, sequence_parallel: bool) -> None:  # type: ignore[override]
        check_column_options(gather_output, sequence_parallel)

    def _split(self) -> tuple[int, int]:
        return divisible_shard("ColumnParallelLinear out_features", self.out_features, self.tp, self.shard)

    def _kernel_shape(self) -> tuple[int, int]:
        return self.in_features, self.stop - self.start

    def _bias_size(self) -> int:
        return self.stop - self.start

    def _keep(self, kernel: Any) -> Any:
        return kernel[:, self.start:self.stop]

    @classmethod
    def from_dense(cls, dense: keras.layers.Dense, gather_output: bool = False,
                   process_set: ProcessSet = global_process_set,
                   sequence_parallel: bool = False) -> ColumnParallelLinear:
        """This rank's shard (kernel columns and bias ``start:stop``, the activation) of a built ``dense``.

        Collective over the group: the ranks first agree that they hold the same ``dense`` (configuration and
        weights: [Note: one unsplit source on every rank]; ``MismatchError`` on every rank when they do not).
        """
        _agree_on_dense(dense, cls._owner, process_set)
        fan_in, fan_out = _in_out(dense)
        layer = cls(fan_in, fan_out, dense.bias is not None, gather_output, process_set, dense.activation,
                    sequence_parallel, dtype=dense.dtype_policy)
        layer._load(dense.kernel[:, layer.start:layer.stop],
                    None if dense.bias is None else dense.bias[layer.start:layer.stop])
        _copy_penalties(dense, layer, cls._owner)
        return layer

    def call(self, inputs: Any) -> tf.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence(inputs, self.process_set, to_parallel=True)
        else:
            x = copy_to_group(agree_on_input_once(self, inputs, self._owner, self.process_set), self.process_set)
        if self._after_gather:
            y = keras.ops.matmul(x, self.kernel)
            y = gather_from_group(y if self.bias is None else y + self.bias, self.process_set)
            return self.activation(y)
        y = self._finish(keras.ops.matmul(x, self.kernel))
        return gather_from_group(y, self.process_set) if self.gather_output else y


class RowParallelLinear(_ParallelDense):
    """``keras.layers.Dense(out_features)`` on ``in_features`` inputs, input features split over the group.

    Each rank multiplies its ``in_features / tp`` input features; the partial outputs are summed
    over the group (one all-reduce), then the replicated bias and the activation are applied.

    Args:
        input_is_parallel: the input is already this rank's piece of the last dimension (the
            output of a :class:`ColumnParallelLinear`); otherwise each rank takes its piece.
        process_set: the tensor group (default: every rank).
        activation: as ``Dense``'s, applied to the summed output plus the bias, which every rank
            holds whole: any activation (softmax, glu) is right here.
        sequence_parallel: reduce-scatter the partial sums along the sequence (dimension 1)
            instead of all-reducing them; the replicated bias's gradient is summed over the group.
        **kwargs: ``keras.layers.Layer`` arguments (``dtype=``, ``name=``).

    Raises:
        ValueError: ``in_features`` not divisible by the group size, this rank not in the group,
            ``sequence_parallel`` with ``input_is_parallel=False``, or a Keras backend other than
            TensorFlow.
    """

    _owner = "RowParallelLinear"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 process_set: ProcessSet = global_process_set, activation: Any = None,
                 sequence_parallel: bool = False, **kwargs: Any) -> None:
        options = {"input_is_parallel": input_is_parallel, "sequence_parallel": sequence_parallel}
        super().__init__(in_features, out_features, bias, activation, process_set, options, **kwargs)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, bool(sequence_parallel)
        if not input_is_parallel:
            input_check(self, process_set)

    def _check_options(self, input_is_parallel: bool, sequence_parallel: bool) -> None:  # type: ignore[override]
        check_row_options(input_is_parallel, sequence_parallel)

    def _split(self) -> tuple[int, int]:
        return divisible_shard("RowParallelLinear in_features", self.in_features, self.tp, self.shard)

    def _kernel_shape(self) -> tuple[int, int]:
        return self.stop - self.start, self.out_features

    def _bias_size(self) -> int:
        return self.out_features

    def _keep(self, kernel: Any) -> Any:
        return kernel[self.start:self.stop]

    @classmethod
    def from_dense(cls, dense: keras.layers.Dense, input_is_parallel: bool = True,
                   process_set: ProcessSet = global_process_set,
                   sequence_parallel: bool = False) -> RowParallelLinear:
        """This rank's shard (kernel rows ``start:stop``, the whole bias, the activation) of a built ``dense``.

        Collective over the group: the ranks first agree that they hold the same ``dense`` (configuration and
        weights: [Note: one unsplit source on every rank]; ``MismatchError`` on every rank when they do not).
        """
        _agree_on_dense(dense, cls._owner, process_set)
        fan_in, fan_out = _in_out(dense)
        layer = cls(fan_in, fan_out, dense.bias is not None, input_is_parallel, process_set, dense.activation,
                    sequence_parallel, dtype=dense.dtype_policy)
        layer._load(dense.kernel[layer.start:layer.stop], dense.bias)
        _copy_penalties(dense, layer, cls._owner)
        return layer

    def call(self, inputs: Any) -> tf.Tensor:
        x = inputs if self.input_is_parallel else scatter_to_group(
            agree_on_input_once(self, inputs, self._owner, self.process_set), self.process_set)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(keras.ops.matmul(x, self.kernel), self.process_set)
            return self.activation(y if self.bias is None else y + copy_to_group(self.bias, self.process_set))
        return self._finish(reduce_from_group(keras.ops.matmul(x, self.kernel), self.process_set))


class VocabParallelEmbedding(keras.layers.Layer):
    """``keras.layers.Embedding(num_embeddings, embedding_dim)`` with the vocabulary rows split over the group.

    Each rank looks up the ids it owns (zeros for the others); one all-reduce sums the pieces,
    so every rank gets every id's vector.

    Raises:
        ValueError: ``num_embeddings`` not divisible by the group size, this rank not in the group,
            or a Keras backend other than TensorFlow.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, process_set: ProcessSet = global_process_set,
                 **kwargs: Any) -> None:
        refuse_other_backend("VocabParallelEmbedding")
        super().__init__(**kwargs)
        self.supports_jit = False  # collectives run outside XLA: compile(jit_compile="auto") must not pick it
        self.tp, self.shard = group_position(process_set, "VocabParallelEmbedding")
        # [Note: a layer built alike on every rank]
        agree_on_layer("VocabParallelEmbedding", process_set, num_embeddings=num_embeddings,
                       embedding_dim=embedding_dim, dtype=self.dtype_policy.name)
        self.start, self.stop = divisible_shard("VocabParallelEmbedding num_embeddings", num_embeddings, self.tp,
                                                self.shard)
        self.num_embeddings, self.embedding_dim, self.process_set = num_embeddings, embedding_dim, process_set
        # Embedding's "uniform" of the whole table, this rank's rows ([Note: Keras shards drawn from the whole])
        whole = ShardOfWhole(keras.initializers.get("uniform"), (num_embeddings, embedding_dim),
                             lambda table: table[self.start:self.stop])
        self.embeddings = self.add_weight(shape=(self.stop - self.start, embedding_dim), initializer=whole,
                                          name="embeddings")
        input_check(self, process_set)
        self.built = True

    @classmethod
    def from_embedding(cls, embedding: keras.layers.Embedding,
                       process_set: ProcessSet = global_process_set) -> VocabParallelEmbedding:
        """This rank's rows ``start:stop`` of a built ``embedding`` (no ``mask_zero``, not quantized),
        with its regularizer and constraint where they split (:func:`copy_penalty`; dropped before
        2026-12-05).

        Raises:
            TypeError: not a ``keras.layers.Embedding``.
            ValueError: not built, ``mask_zero``, quantized, an ``activity_regularizer``, or a
                regularizer or constraint that does not split over the vocabulary.
        """
        owner = "VocabParallelEmbedding.from_embedding"

        def source() -> list:
            if not isinstance(embedding, keras.layers.Embedding):
                raise TypeError("VocabParallelEmbedding.from_embedding needs a keras.layers.Embedding; received "
                                f"{type(embedding).__name__}")
            if not embedding.built or embedding.mask_zero:
                raise ValueError("VocabParallelEmbedding.from_embedding needs a built Embedding without "
                                 f"mask_zero; received built={embedding.built}, mask_zero={embedding.mask_zero}")
            refuse_quantized(embedding, owner)
            refuse_activity_regularizer(embedding, owner)
            return source_arrays(embedding)

        refuse_other_backend(owner)  # (before the agreement's collective)
        group_position(process_set, "VocabParallelEmbedding")
        agree_on_source(owner, process_set, source)  # [Note: one unsplit source on every rank]
        layer = cls(embedding.input_dim, embedding.output_dim, process_set, dtype=embedding.dtype_policy)
        layer.embeddings.assign(embedding.embeddings[layer.start:layer.stop])
        # a shard holds whole vectors (rows): a norm over axis 1 is whole on it, one over axis 0 is not
        copy_penalty(owner, embedding.name, "embeddings", layer.embeddings, embedding.embeddings_regularizer,
                     embedding.embeddings_constraint, process_set, split=True, whole_axes=(1, -1))
        return layer

    def call(self, inputs: Any) -> tf.Tensor:
        inputs = agree_on_input_once(self, inputs, "VocabParallelEmbedding", self.process_set)
        ids = _check_ids(tf.cast(inputs, tf.int64), self.num_embeddings)
        mine = (ids >= self.start) & (ids < self.stop)
        local = tf.where(mine, ids - self.start, tf.zeros_like(ids))
        vectors = tf.gather(tf.convert_to_tensor(self.embeddings), local)
        return reduce_from_group(vectors * tf.expand_dims(tf.cast(mine, vectors.dtype), -1), self.process_set)


def _refusing(result: tf.Tensor, bad: tf.Tensor, values: tf.Tensor, message: str,
              error: Callable[[str], Exception]) -> tf.Tensor:
    """``result``, after raising ``error`` (eagerly, naming the first bad value) or failing the graph
    (inside a ``tf.function``) where ``bad`` holds anywhere."""
    if tf.executing_eagerly():
        if bool(tf.reduce_any(bad)):
            raise error(f"{message}; received {int(tf.boolean_mask(values, bad)[0])}")
        return result
    with tf.control_dependencies([tf.debugging.Assert(tf.logical_not(tf.reduce_any(bad)), [message])]):
        return tf.identity(result)


def _check_ids(ids: tf.Tensor, vocab: int) -> tf.Tensor:
    """``ids``, refusing one outside ``[0, vocab)``: no shard owns it, so it would come out as zeros
    (every rank of the group holds the same ids and fails alike)."""
    return _refusing(ids, (ids < 0) | (ids >= vocab), ids,
                     f"VocabParallelEmbedding: ids must be in [0, {vocab}) (the whole vocabulary)",
                     lambda text: tf.errors.InvalidArgumentError(None, None, text))


def _targets_checksum(target: tf.Tensor) -> tf.Tensor:
    """:func:`~unison.common.tensor_parallel.groups.targets_checksum` of the int64 ``target``, as a tensor."""
    flat = tf.reshape(target, [-1])
    weights = tf.math.floormod(tf.range(1, tf.size(flat, out_type=tf.int64) + 1, dtype=tf.int64), CHECKSUM_PRIME)
    terms = tf.math.floormod(weights * (tf.math.floormod(flat, CHECKSUM_PRIME) + 1), CHECKSUM_PRIME)
    return tf.math.floormod(tf.reduce_sum(terms), CHECKSUM_PRIME)


def _check_targets(target: tf.Tensor, piece: int, tp: int, ignore_index: int,
                   process_set: ProcessSet) -> tf.Tensor:
    """``target != ignore_index``, once the group agreed that every rank holds a piece of one width, no rank
    holds a target outside the vocabulary, and every rank holds the same targets (their number and checksum:
    [Note: one set of targets per tensor group]); else every rank raises (eagerly) or fails its graph. One
    all-reduce (max) of each value and its negative checks all three. Checked on each rank alone (before
    2026-12-05), pieces of different widths gave a wrong loss silently, and a target one rank refused left
    the others in the all-reduce; different targets were not checked before 2026-12-07 (torch's
    ``_check_targets`` likewise)."""
    vocab = piece * tp
    valid = tf.not_equal(target, ignore_index)
    bad = valid & ((target < 0) | (target >= vocab))
    count, checksum = tf.size(target, out_type=tf.int64), _targets_checksum(target)
    mine = tf.stack([tf.constant(piece, tf.int64), tf.constant(-piece, tf.int64),
                     tf.cast(tf.reduce_any(bad), tf.int64), count, -count, checksum, -checksum])
    agreed = allreduce_max_no_grad(mine, process_set)
    widths = (f"vocab_parallel_cross_entropy: the group's logits pieces differ in width (this rank {piece}); "
              "every rank must hold vocabulary / tp columns: pad the vocabulary to a multiple of the tensor "
              "group size")
    targets = (f"vocab_parallel_cross_entropy: targets must be in [0, {vocab}) (the whole vocabulary: logits' "
               f"last dimension x tensor group size) or ignore_index={ignore_index}")
    if tf.executing_eagerly():
        most, least, refused = int(agreed[0]), -int(agreed[1]), int(agreed[2])
        if most != least:
            raise ValueError(f"{widths}: {least} to {most}")
        if refused:
            got = (f"received {int(tf.boolean_mask(target, bad)[0])}" if bool(tf.reduce_any(bad))
                   else "another rank of the group received one")
            raise ValueError(f"{targets}; {got}")
        if int(agreed[3]) != -int(agreed[4]) or int(agreed[5]) != -int(agreed[6]):
            raise targets_mismatch((-int(agreed[4]), int(agreed[3])), int(count), int(checksum))
        return valid
    differ = str(targets_mismatch())  # (the numbers are not known when the graph is traced)
    checks = [tf.debugging.Assert(tf.equal(agreed[0], -agreed[1]), [widths]),
              tf.debugging.Assert(tf.equal(agreed[2], 0), [targets]),
              tf.debugging.Assert(tf.equal(agreed[3], -agreed[4]) & tf.equal(agreed[5], -agreed[6]),
                                  [differ, "this rank's count and checksum:", count, checksum])]
    with tf.control_dependencies(checks):
        return tf.identity(valid)


def _reduce(loss: tf.Tensor, valid: tf.Tensor, reduction: str) -> tf.Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return tf.reduce_sum(loss)
    return tf.reduce_sum(loss) / tf.reduce_sum(tf.cast(valid, loss.dtype))


def _check_shapes(logits: tf.Tensor, target: tf.Tensor, reduction: str) -> int:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none'; "
                         f"received {reduction!r}")
    if not logits.shape[:-1].is_compatible_with(target.shape) or logits.shape[-1] is None:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {logits.shape} must be target's shape "
                         f"{target.shape} plus the vocabulary piece (a known size) as the last dimension")
    return int(logits.shape[-1])


def vocab_parallel_cross_entropy(logits: Any, target: Any, process_set: ProcessSet = global_process_set,
                                 ignore_index: int = -100, reduction: str = "mean") -> tf.Tensor:
    """Cross-entropy over a vocabulary split along the logits' last dimension; no rank holds it all.

    ``logits`` is this rank's ``(..., vocab / tp)`` piece (the output of a
    :class:`ColumnParallelLinear` without ``gather_output``), ``target`` holds whole-vocabulary
    ids of shape ``(...)``. The maximum and the sum of exponentials are all-reduced over the
    group (a number per position), and the target's logit comes from the rank that owns it, so
    the result, and the gradient of this rank's piece, equal
    ``keras.losses.sparse_categorical_crossentropy(target, logits, from_logits=True)`` on the
    gathered logits.

    Args:
        ignore_index: targets with this value add nothing (and are not counted by ``"mean"``).
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"`` (a loss per position).

    Raises:
        ValueError: an unknown reduction, a shape mismatch, (eagerly) a target outside the
            vocabulary (inside ``tf.function`` such a target fails the graph at run time), or a
            Keras backend other than TensorFlow.
        MismatchError: (eagerly) the ranks of the group hold different targets, on every rank of
            the group; inside ``tf.function`` they fail the graph at run time.
    """
    refuse_other_backend("vocab_parallel_cross_entropy")
    logits, target = tf.convert_to_tensor(logits), tf.cast(tf.convert_to_tensor(target), tf.int64)
    piece = _check_shapes(logits, target, reduction)
    tp, index = group_position(process_set, "vocab_parallel_cross_entropy")
    start = index * piece
    valid = _check_targets(target, piece, tp, ignore_index, process_set)
    top = allreduce_max_no_grad(tf.reduce_max(logits, axis=-1), process_set)
    shifted = logits - tf.expand_dims(top, -1)
    sum_exp = reduce_from_group(tf.reduce_sum(tf.exp(shifted), axis=-1), process_set)
    mine = valid & (target >= start) & (target < start + piece)
    local = tf.where(mine, target - start, tf.zeros_like(target))
    # the target's logit, gathered (a one-hot product made -inf * 0 = NaN of masked logits)
    at = tf.squeeze(tf.gather(shifted, tf.expand_dims(local, -1), batch_dims=len(target.shape)), -1)
    picked = reduce_from_group(tf.where(mine, at, tf.zeros_like(at)), process_set)
    loss = tf.where(valid, tf.math.log(sum_exp) - picked, tf.zeros_like(picked))
    return _reduce(loss, valid, reduction)
