"""Tensor-parallel transformer pieces for Keras 3, built from the column and row layers.

The same blocks as the PyTorch backend's ``tensor_parallel_blocks.py``: each is one
tensor-parallel region, entered by a :class:`ColumnParallelLinear` (nothing sent forward) and
left by a :class:`RowParallelLinear` (one all-reduce), so a block costs one all-reduce forward
and one backward::

    ParallelMLP            x -> fc1 (column, activation) -> fc2 (row) -> y
    ParallelSelfAttention  x -> qkv (column: this rank's heads) -> attention per head -> out (row) -> y
    ParallelTransformerBlock  x + attn(ln1(x)), then + mlp(ln2(.))   (pre-norm; norms replicated)

Rank ``i`` of a group of ``tp`` computes heads ``[i * h/tp, (i+1) * h/tp)`` whole. The builders
take this rank's shard out of unsplit Keras layers: ``ParallelMLP.from_dense_pair`` (two
``Dense``, activations kept), ``ParallelSelfAttention.from_multi_head_attention`` (a
``keras.layers.MultiHeadAttention`` used as self-attention: its q/k/v ``EinsumDense`` kernels
``(hidden, heads, key_dim)`` become the fused column shard, its output kernel
``(heads, key_dim, hidden)`` the row shard) and ``ParallelTransformerBlock.from_layers``. Each
keeps its source's activations, biases (or their absence), and the regularizers and constraints
that split over the shards (``tensor_parallel.copy_penalty``); the rest are refused. Before
2026-12-05 the builders copied weight values only: the block dropped ``fc2``'s activation, every
builder but ``from_dense`` dropped the penalties, and bias-free sources were refused with a
misleading message.

Dropout and sequence parallelism as in the PyTorch blocks: ``attention_dropout`` draws from the
shard's own seed generator, ``hidden_dropout`` from the shared one (the shard's own under
``sequence_parallel=True``) — see ``tensor_parallel_random.py``; under sequence parallelism a
block takes and returns this rank's ``seq / tp`` positions, and the gradients of the replicated
norm weights and row biases are summed over the group.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import tensorflow as tf

from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.tensor_parallel.groups import agree_on_layer, agree_on_source
from unison.common.tensor_parallel.rng import check_probability
from unison.common.tensor_parallel.sharding import check_divisible, divisible_shard
from unison.tf_backend.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_penalty,
    group_position,
    refuse_activity_regularizer,
    refuse_other_backend,
    source_arrays,
)
from unison.tf_backend.tensor_parallel_comm import check_sequence, copy_to_group
from unison.tf_backend.tensor_parallel_random import LAYER_SEED_STRIDE, dropout_generators

__all__ = ["ParallelMLP", "ParallelSelfAttention", "ParallelTransformerBlock"]


class ParallelMLP(keras.layers.Layer):
    """``fc2(fc1(x))``, ``fc1`` with ``activation``, the hidden units (``ffn_hidden_size``) split over the group.

    Args:
        activation: ``fc1``'s, applied to this rank's hidden units: an element-wise one (default
            ``"gelu"``, Keras's exact erf GELU, as torch's ``F.gelu``); another raises
            ([Note: activations on a column shard] in ``tensor_parallel.py``).
        fc2_activation: ``fc2``'s, applied after the sum (default none, as in Megatron's MLP).
        sequence_parallel: input and output are this rank's positions along the sequence.
        **kwargs: ``keras.layers.Layer`` arguments (``dtype=``, ``name=``).

    Raises:
        ValueError: ``ffn_hidden_size`` not divisible by the group size, an ``activation`` that is
            not element-wise, or a Keras backend other than TensorFlow.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = True, activation: Any = "gelu",
                 process_set: ProcessSet = global_process_set, fc2_activation: Any = None,
                 sequence_parallel: bool = False, **kwargs: Any) -> None:
        refuse_other_backend("ParallelMLP")
        super().__init__(**kwargs)
        self.supports_jit = False  # collectives run outside XLA: compile(jit_compile="auto") must not pick it
        group_position(process_set, "ParallelMLP")
        # [Note: a layer built alike on every rank] (its two layers check theirs)
        agree_on_layer("ParallelMLP", process_set, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        dtype = kwargs.get("dtype")
        self.fc1 = ColumnParallelLinear(hidden_size, ffn_hidden_size, bias, process_set=process_set,
                                        activation=activation, sequence_parallel=sequence_parallel, dtype=dtype)
        self.fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, bias, process_set=process_set,
                                     activation=fc2_activation, sequence_parallel=sequence_parallel, dtype=dtype)
        self.built = True

    @classmethod
    def from_dense_pair(cls, fc1: keras.layers.Dense, fc2: keras.layers.Dense,
                        process_set: ProcessSet = global_process_set,
                        sequence_parallel: bool = False) -> ParallelMLP:
        """This rank's shard of the unsplit ``fc2(fc1(x))`` (both built, both with biases or neither).

        Their activations, and the regularizers and constraints ``from_dense`` keeps, are kept.

        Raises:
            ValueError: layers that do not chain, one with a bias and one without, or what
                ``ColumnParallelLinear.from_dense`` / ``RowParallelLinear.from_dense`` refuse.
        """
        found: dict[str, tuple[int, int]] = {}

        def source() -> list:
            found["sizes"] = _check_pair(fc1, fc2)
            return []  # (each from_dense compares its layer)

        refuse_other_backend("ParallelMLP.from_dense_pair")  # (before the agreement's collective)
        group_position(process_set, "ParallelMLP")
        agree_on_source("ParallelMLP.from_dense_pair", process_set, source)  # [Note: one unsplit source ...]
        hidden, ffn = found["sizes"]
        mlp = cls(hidden, ffn, fc1.use_bias, fc1.activation, process_set, fc2.activation, sequence_parallel,
                  dtype=fc1.dtype_policy)
        _load(mlp.fc1, ColumnParallelLinear.from_dense(fc1, process_set=process_set))
        _load(mlp.fc2, RowParallelLinear.from_dense(fc2, process_set=process_set))
        return mlp

    def call(self, inputs: Any) -> tf.Tensor:
        return self.fc2(self.fc1(inputs))


def _check_pair(fc1: Any, fc2: Any) -> tuple[int, int]:
    """``(hidden, ffn_hidden)`` of two built Dense layers ``hidden -> ffn_hidden -> hidden``."""
    for dense in (fc1, fc2):
        if not isinstance(dense, keras.layers.Dense) or not dense.built:
            raise ValueError("ParallelMLP.from_dense_pair needs two built keras.layers.Dense; received "
                             f"{type(dense).__name__} (built={getattr(dense, 'built', None)})")
    (hidden, ffn), (ffn2, out) = fc1.kernel.shape, fc2.kernel.shape
    if ffn != ffn2 or out != hidden:
        raise ValueError(f"ParallelMLP.from_dense_pair: fc1 maps {hidden} -> {ffn} features, fc2 {ffn2} -> "
                         f"{out}; fc2 must take fc1's {ffn} outputs and return its {hidden} inputs")
    if fc1.use_bias != fc2.use_bias:
        raise ValueError(f"ParallelMLP.from_dense_pair: the parallel MLP has biases on both layers or on neither; "
                         f"received fc1 use_bias={fc1.use_bias}, fc2 use_bias={fc2.use_bias}. Build both Dense "
                         "layers with the same use_bias")
    return int(hidden), int(ffn)


def _load(target: keras.layers.Layer, source: keras.layers.Layer) -> None:
    """Copy ``source``'s trainable weights into the same-shaped ``target``, values and the
    regularizers and constraints the builders attached (seed generators' states stay)."""
    mine, theirs = target.trainable_weights, source.trainable_weights
    if [tuple(v.shape) for v in mine] != [tuple(v.shape) for v in theirs]:  # an internal invariant, kept loud
        raise RuntimeError(f"{target.name}: weights of shapes {[tuple(v.shape) for v in theirs]} cannot load into "
                           f"{[tuple(v.shape) for v in mine]}")
    for variable, value in zip(mine, theirs, strict=True):
        variable.assign(value)
        variable.regularizer = getattr(value, "regularizer", None)
        variable.constraint = getattr(value, "constraint", None)


def _check_mha(mha: Any) -> tuple[int, int]:
    """``(hidden, heads)`` of a built MultiHeadAttention that the parallel layer can reproduce."""
    if not isinstance(mha, keras.layers.MultiHeadAttention) or not mha.built:
        raise ValueError("ParallelSelfAttention.from_multi_head_attention needs a built "
                         f"keras.layers.MultiHeadAttention; received {type(mha).__name__}")
    hidden = int(mha.query_dense.kernel.shape[0])
    out = int(mha.output_dense.kernel.shape[-1])
    plain = (mha.num_heads * mha.key_dim == hidden and mha.value_dim == mha.key_dim and out == hidden
             and not mha.dropout and not getattr(mha, "_use_gate", False)
             and getattr(mha, "_sliding_window", None) is None and tuple(mha.attention_axes or (1,)) == (1,))
    if not plain:
        raise ValueError("ParallelSelfAttention.from_multi_head_attention needs plain self-attention over "
                         "(batch, seq, hidden): num_heads * key_dim == hidden == output size, "
                         f"value_dim == key_dim, dropout=0, no gate or sliding window; received hidden={hidden}, "
                         f"num_heads={mha.num_heads}, key_dim={mha.key_dim}, value_dim={mha.value_dim}, "
                         f"output size={out}, dropout={mha.dropout}, attention_axes={mha.attention_axes}")
    return hidden, mha.num_heads


def _same(obj: Any) -> Any:
    """What makes two regularizers (constraints) the same: their class and config."""
    if obj is None or not hasattr(obj, "get_config"):
        return id(obj)
    return type(obj), repr(sorted(obj.get_config().items()))


def _penalty(variables: list[Any], owner: str, what: str) -> tuple[Any, Any]:
    """The one regularizer and constraint of ``variables`` (q, k and v's, fused into one weight)."""
    pairs = [(getattr(v, "regularizer", None), getattr(v, "constraint", None)) for v in variables]
    if len({(_same(r), _same(c)) for r, c in pairs}) > 1:
        raise ValueError(f"{owner}: the query, key and value {what}s have different regularizers or constraints "
                         f"({pairs}); the parallel layer fuses them into one weight. Give them the same, or none")
    return pairs[0]


def _copy_mha_penalties(mha: Any, attn: ParallelSelfAttention, process_set: ProcessSet) -> None:
    """``mha``'s regularizers and constraints on the parallel layer's weights, where they split:
    q/k/v and the output kernel are split (a penalty summed over the group), the output bias is
    replicated. A norm constraint is refused: the kernels are 3-D in the source, 2-D here."""
    owner = "ParallelSelfAttention.from_multi_head_attention"
    parts = (mha.query_dense, mha.key_dense, mha.value_dense, mha.output_dense)
    for layer in (mha, *parts):
        refuse_activity_regularizer(layer, owner)
    slots = [("kernel", attn.qkv.kernel, [p.kernel for p in parts[:3]], True),
             ("kernel", attn.out.kernel, [parts[3].kernel], True)]
    if mha.use_bias:
        slots += [("bias", attn.qkv.bias, [p.bias for p in parts[:3]], True),
                  ("bias", attn.out.bias, [parts[3].bias], False)]
    for what, weight, variables, split in slots:
        regularizer, constraint = _penalty(variables, owner, what)
        copy_penalty(owner, mha.name, what, weight, regularizer, constraint, process_set, split)


class ParallelSelfAttention(keras.layers.Layer):
    """Multi-head self-attention over ``(batch, seq, hidden)`` with the heads split over the group.

    The fused q/k/v projection is column-parallel (this rank's heads' columns of q, k and v);
    the output projection is row-parallel. ``causal=True`` lets position ``t`` attend to
    positions ``<= t`` only.

    Args:
        attention_dropout: dropout on the attention probabilities in training, from this
            shard's own seed generator.
        seed: the layer's seed (the same on every rank of the group); default: the next of
            ``model_parallel_manual_seed``'s sequence. Only used with dropout.
        sequence_parallel: input and output are this rank's positions along the sequence.

    Raises:
        ValueError: ``hidden_size`` not divisible by ``num_heads``, ``num_heads`` not divisible
            by the group size, a dropout probability outside [0, 1), dropout without a seed, or a
            Keras backend other than TensorFlow.
    """

    def __init__(self, hidden_size: int, num_heads: int, causal: bool = False, bias: bool = True,
                 process_set: ProcessSet = global_process_set, attention_dropout: float = 0.0,
                 seed: int | None = None, sequence_parallel: bool = False, **kwargs: Any) -> None:
        refuse_other_backend("ParallelSelfAttention")
        super().__init__(**kwargs)
        self.supports_jit = False  # collectives run outside XLA: compile(jit_compile="auto") must not pick it
        tp, shard = group_position(process_set, "ParallelSelfAttention")
        agree_on_layer("ParallelSelfAttention", process_set, hidden_size=hidden_size, num_heads=num_heads,
                       causal=causal, attention_dropout=attention_dropout, seed=seed,
                       sequence_parallel=sequence_parallel)  # [Note: a layer built alike on every rank]
        self.attention_dropout = check_probability("ParallelSelfAttention attention_dropout", attention_dropout)
        self.sequence_parallel = bool(sequence_parallel)
        if self.attention_dropout > 0:
            _, self._own_generator = dropout_generators("ParallelSelfAttention", seed, process_set)
        if hidden_size % num_heads:
            raise ValueError(f"ParallelSelfAttention: hidden_size ({hidden_size}) must be divisible by num_heads "
                             f"({num_heads}); choose num_heads dividing {hidden_size}")
        self.local_heads = check_divisible("ParallelSelfAttention num_heads", num_heads, tp)
        self.hidden_size, self.num_heads, self.causal = hidden_size, num_heads, causal
        self.head_dim = hidden_size // num_heads
        dtype = kwargs.get("dtype")
        self.qkv = ColumnParallelLinear(hidden_size, 3 * hidden_size, bias, process_set=process_set,
                                        sequence_parallel=sequence_parallel, dtype=dtype)
        self._keep_heads(divisible_shard("ParallelSelfAttention hidden_size", hidden_size, tp, shard))
        self.out = RowParallelLinear(hidden_size, hidden_size, bias, process_set=process_set,
                                     sequence_parallel=sequence_parallel, dtype=dtype)
        self.built = True

    def _keep_heads(self, heads: tuple[int, int]) -> None:
        """This rank's heads' columns of q, k and v in the whole fused ``(hidden, 3 * hidden)`` kernel.

        The column layer kept columns ``start:stop`` of the whole kernel, but :meth:`call` reads its columns
        as this rank's heads of q, k and v (the layout ``from_multi_head_attention`` and the checkpoints
        cut): before 2026-12-07 the tp = 2 layer built under a seed was not the tp = 1 one. Its seeded
        initializer draws the same whole kernel again ([Note: Keras shards drawn from the whole]), and this
        rank keeps the right columns of it; no seed is consumed, so the draws after it stay in step.
        """
        hidden, (start, stop) = self.hidden_size, heads
        whole = self.qkv.whole_kernel((hidden, 3 * hidden), dtype=self.qkv.kernel.dtype)
        self.qkv.kernel.assign(tf.concat([whole[:, part * hidden + start:part * hidden + stop]
                                          for part in range(3)], 1))

    @classmethod
    def from_multi_head_attention(cls, mha: keras.layers.MultiHeadAttention, causal: bool = False,
                                  process_set: ProcessSet = global_process_set, attention_dropout: float = 0.0,
                                  seed: int | None = None,
                                  sequence_parallel: bool = False) -> ParallelSelfAttention:
        """This rank's heads of a built ``keras.layers.MultiHeadAttention`` used as ``mha(x, x)``.

        Its biases (or their absence) and its L1 / L2 / L1L2 regularizers and NonNeg constraints
        are kept (each split weight's penalty summed over the group).

        Raises:
            ValueError: an attention the layer cannot reproduce (see :func:`_check_mha`), an
                ``activity_regularizer``, another regularizer or constraint, or q, k and v with
                different ones (they become one fused weight).
        """
        found: dict[str, tuple[int, int]] = {}

        def source() -> list:
            found["sizes"] = _check_mha(mha)
            return source_arrays(mha)

        refuse_other_backend("ParallelSelfAttention.from_multi_head_attention")  # (before the collective)
        group_position(process_set, "ParallelSelfAttention")
        # [Note: one unsplit source on every rank]
        agree_on_source("ParallelSelfAttention.from_multi_head_attention", process_set, source)
        hidden, heads = found["sizes"]
        attn = cls(hidden, heads, causal, mha.use_bias, process_set, attention_dropout, seed, sequence_parallel,
                   dtype=mha.dtype_policy)
        _copy_mha_penalties(mha, attn, process_set)
        start, stop = attn.out.start, attn.out.stop  # this rank's heads, as columns of (heads * key_dim)
        parts = (mha.query_dense, mha.key_dense, mha.value_dense)
        kernels = [tf.reshape(p.kernel, (hidden, hidden))[:, start:stop] for p in parts]
        attn.qkv.kernel.assign(tf.concat(kernels, 1))
        if mha.use_bias:
            attn.qkv.bias.assign(tf.concat([tf.reshape(p.bias, (hidden,))[start:stop] for p in parts], 0))
            attn.out.bias.assign(mha.output_dense.bias)
        attn.out.kernel.assign(tf.reshape(mha.output_dense.kernel, (hidden, hidden))[start:stop])
        return attn

    def _heads(self, x: tf.Tensor, batch: tf.Tensor, seq: tf.Tensor) -> tf.Tensor:
        return tf.transpose(tf.reshape(x, (batch, seq, self.local_heads, self.head_dim)), (0, 2, 1, 3))

    def call(self, inputs: Any, training: bool | None = None) -> tf.Tensor:
        x = tf.convert_to_tensor(inputs)
        if x.shape.rank != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"ParallelSelfAttention expects (batch, seq, {self.hidden_size}); received {x.shape}")
        qkv = self.qkv(x)  # under sequence parallelism: every position (the column layer gathered them)
        batch, seq = tf.shape(qkv)[0], tf.shape(qkv)[1]
        q, k, v = (self._heads(t, batch, seq) for t in tf.split(qkv, 3, axis=-1))
        scores = tf.matmul(q, k, transpose_b=True) * tf.cast(1.0 / math.sqrt(self.head_dim), q.dtype)
        if self.causal:
            allowed = tf.cast(tf.linalg.band_part(tf.ones((seq, seq)), -1, 0), tf.bool)
            scores = tf.where(allowed, scores, tf.cast(-math.inf, scores.dtype))
        probs = tf.nn.softmax(scores, axis=-1)
        if training and self.attention_dropout > 0:
            probs = keras.random.dropout(probs, self.attention_dropout, seed=self._own_generator)
        context = tf.transpose(tf.matmul(probs, v), (0, 2, 1, 3))
        return self.out(tf.reshape(context, (batch, seq, self.local_heads * self.head_dim)))


class ParallelTransformerBlock(keras.layers.Layer):
    """A pre-norm transformer block: ``x + attn(ln1(x))``, then ``+ mlp(ln2(.))``, heads and MLP split.

    The layer norms (``keras.layers.LayerNormalization``) are replicated on every rank of the
    group (their input and gradients are the same everywhere; under sequence parallelism their
    gradients are summed over the group).

    Args:
        hidden_dropout: dropout on the attention's and the MLP's outputs before each residual
            add, in training (the shared seed generator; the shard's own under sequence
            parallelism).
        attention_dropout: dropout on the attention probabilities (the shard's own generator).
        seed: the block's seed (the same on every rank of the group); default: the next of
            ``model_parallel_manual_seed``'s sequence. Only used with dropout.
        sequence_parallel: input and output are this rank's ``seq / tp`` positions.
        bias: the attention's projections have biases (``MultiHeadAttention(use_bias=)``).
        mlp_bias: the MLP's layers have biases (``Dense(use_bias=)``); None: as ``bias``.
        fc2_activation: the MLP's second layer's, applied after the sum (default none).

    Raises:
        ValueError: what :class:`ParallelSelfAttention` and :class:`ParallelMLP` refuse, or a Keras
            backend other than TensorFlow.
    """

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int, causal: bool = False,
                 eps: float = 1e-5, activation: Any = "gelu", process_set: ProcessSet = global_process_set,
                 hidden_dropout: float = 0.0, attention_dropout: float = 0.0, seed: int | None = None,
                 sequence_parallel: bool = False, bias: bool = True, mlp_bias: bool | None = None,
                 fc2_activation: Any = None, **kwargs: Any) -> None:
        refuse_other_backend("ParallelTransformerBlock")
        super().__init__(**kwargs)
        self.supports_jit = False  # collectives run outside XLA: compile(jit_compile="auto") must not pick it
        group_position(process_set, "ParallelTransformerBlock")
        # [Note: a layer built alike on every rank] (its attention and MLP check theirs)
        agree_on_layer("ParallelTransformerBlock", process_set, eps=eps, hidden_dropout=hidden_dropout, seed=seed)
        dtype = kwargs.get("dtype")
        self.hidden_dropout = check_probability("ParallelTransformerBlock hidden_dropout", hidden_dropout)
        self.sequence_parallel, self.process_set = bool(sequence_parallel), process_set
        if self.hidden_dropout > 0:
            shared, own = dropout_generators("ParallelTransformerBlock", seed, process_set)
            self._hidden_generator = own if self.sequence_parallel else shared
        self.ln1 = _norm(hidden_size, eps, dtype)
        self.attn = ParallelSelfAttention(hidden_size, num_heads, causal, bias, process_set=process_set,
                                          attention_dropout=attention_dropout,
                                          # half a layer's stride apart: seed + 1 made the attention's
                                          # own stream of shard s the block's hidden one on s + 1, and a
                                          # whole stride is the next automatic layer seed
                                          seed=None if seed is None else seed + LAYER_SEED_STRIDE // 2,
                                          sequence_parallel=sequence_parallel, dtype=dtype)
        self.ln2 = _norm(hidden_size, eps, dtype)
        self.mlp = ParallelMLP(hidden_size, ffn_hidden_size, bias if mlp_bias is None else mlp_bias, activation,
                               process_set, fc2_activation, sequence_parallel, dtype=dtype)
        self.built = True

    @classmethod
    def from_layers(cls, ln1: keras.layers.LayerNormalization, attn: keras.layers.MultiHeadAttention,
                    ln2: keras.layers.LayerNormalization, fc1: keras.layers.Dense, fc2: keras.layers.Dense,
                    causal: bool = False, process_set: ProcessSet = global_process_set,
                    hidden_dropout: float = 0.0, attention_dropout: float = 0.0, seed: int | None = None,
                    sequence_parallel: bool = False) -> ParallelTransformerBlock:
        """This rank's shard of the unsplit block made of these built layers (norms copied whole).

        The attention's and the MLP's biases (or their absence), both MLP activations, and the
        regularizers and constraints that split (the norms' whole: they are replicated) are
        kept, as the builders of the parts keep them.

        Raises:
            ValueError: what :func:`_check_norm`, ``ParallelSelfAttention.from_multi_head_attention``
                or ``ParallelMLP.from_dense_pair`` refuse.
        """
        found: dict[str, int] = {}

        def source() -> list:
            for norm in (ln1, ln2):
                _check_norm(norm)
            found["hidden"], found["heads"] = _check_mha(attn)
            found["ffn"] = _check_pair(fc1, fc2)[1]
            return source_arrays(ln1, ln2)  # (the attention and the MLP: their from_* compare them)

        refuse_other_backend("ParallelTransformerBlock.from_layers")  # (before the agreement's collective)
        group_position(process_set, "ParallelTransformerBlock")
        # [Note: one unsplit source on every rank]
        agree_on_source("ParallelTransformerBlock.from_layers", process_set, source)
        hidden, heads, ffn = found["hidden"], found["heads"], found["ffn"]
        block = cls(hidden, heads, ffn, causal, ln1.epsilon, fc1.activation, process_set, hidden_dropout,
                    attention_dropout, seed, sequence_parallel, attn.use_bias, fc1.use_bias, fc2.activation,
                    dtype=fc1.dtype_policy)
        block.ln2.epsilon = ln2.epsilon
        for mine, theirs in ((block.ln1, ln1), (block.ln2, ln2)):
            _copy_norm(mine, theirs)
        _load(block.attn, ParallelSelfAttention.from_multi_head_attention(attn, causal, process_set))
        _load(block.mlp, ParallelMLP.from_dense_pair(fc1, fc2, process_set))
        return block

    def _norm(self, norm: keras.layers.LayerNormalization, x: tf.Tensor) -> tf.Tensor:
        if not self.sequence_parallel:
            return norm(x)
        gamma, beta = (copy_to_group(w, self.process_set) for w in (norm.gamma, norm.beta))
        return keras.ops.layer_normalization(x, gamma, beta, norm.axis, norm.epsilon)

    def _dropout(self, h: tf.Tensor, training: bool | None) -> tf.Tensor:
        if not training or self.hidden_dropout == 0:
            return h
        return keras.random.dropout(h, self.hidden_dropout, seed=self._hidden_generator)

    def call(self, inputs: Any, training: bool | None = None) -> tf.Tensor:
        x = tf.convert_to_tensor(inputs)
        if self.sequence_parallel:
            check_sequence(x, self.process_set, "ParallelTransformerBlock", whole=False)
        x = x + self._dropout(self.attn(self._norm(self.ln1, x), training=training), training)
        return x + self._dropout(self.mlp(self._norm(self.ln2, x)), training)


def _norm(hidden: int, eps: float, dtype: Any) -> keras.layers.LayerNormalization:
    norm = keras.layers.LayerNormalization(epsilon=eps, dtype=dtype)
    norm.build((None, None, hidden))
    return norm


def _copy_norm(mine: keras.layers.LayerNormalization, theirs: keras.layers.LayerNormalization) -> None:
    """``theirs``'s weights, regularizers and constraints on the replicated ``mine`` (each rank
    holds the whole norm, so its penalty counts once and any constraint applies as it is)."""
    owner = "ParallelTransformerBlock.from_layers"
    refuse_activity_regularizer(theirs, owner)
    for what in ("gamma", "beta"):
        variable = getattr(theirs, what)
        getattr(mine, what).assign(variable)
        copy_penalty(owner, theirs.name, what, getattr(mine, what), getattr(variable, "regularizer", None),
                     getattr(variable, "constraint", None), None, split=False)  # replicated: no group sum


def _check_norm(norm: Any) -> None:
    plain = (isinstance(norm, keras.layers.LayerNormalization) and norm.built and norm.center and norm.scale
             and not getattr(norm, "rms_scaling", False) and tuple(norm.axis) in ((-1,), (2,)))
    if not plain:
        raise ValueError("ParallelTransformerBlock.from_layers needs built keras.layers.LayerNormalization norms "
                         "over the last axis with center=True, scale=True, rms_scaling=False; received "
                         f"{type(norm).__name__} {getattr(norm, 'name', '')!r}")
