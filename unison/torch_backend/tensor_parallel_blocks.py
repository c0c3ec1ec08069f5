"""Tensor-parallel transformer pieces built from the column and row layers.

Each block is one tensor-parallel region: a :class:`ColumnParallelLinear` enters it (``f``:
nothing sent forward), a :class:`RowParallelLinear` leaves it (``g``: one all-reduce), so a
block costs one all-reduce forward and one backward::

    ParallelMLP            x -> fc1 (column) -> activation -> fc2 (row) -> y
    ParallelSelfAttention  x -> qkv (column: this rank's heads) -> attention per head -> out (row) -> y
    ParallelTransformerBlock  x + attn(ln1(x)), then + mlp(ln2(.))   (pre-norm; norms replicated)

Attention heads are the unit of the split: rank ``i`` of a group of ``tp`` computes heads
``[i * h/tp, (i+1) * h/tp)`` whole, so no head's scores ever cross ranks.

Dropout: ``attention_dropout`` (on the attention probabilities, inside the region: each shard's
heads draw from the shard's own stream) and ``hidden_dropout`` (the block's, after each row
layer, on the residual stream: the shared stream, the same mask on every rank of the group) —
[Note: two random streams per rank]. With ``sequence_parallel=True`` a block takes and returns
this rank's ``seq / tp`` positions: the column layers all-gather them, the row layers
reduce-scatter, the layer norms and the hidden dropout (now the shard's own stream: each rank
holds different positions) run on the local positions, and the gradients of the replicated
norm weights and row biases are summed over the group, since each rank saw only its positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.tensor_parallel.groups import agree_on_layer, agree_on_source
from unison.common.tensor_parallel.rng import check_probability
from unison.common.tensor_parallel.sharding import check_divisible, divisible_shard
from unison.torch_backend.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    _uniform,
    group_position,
    source_arrays,
)
from unison.torch_backend.tensor_parallel_comm import check_sequence, copy_to_group
from unison.torch_backend.tensor_parallel_random import get_rng_tracker, refuse_forked_off_cpu

__all__ = ["ParallelMLP", "ParallelSelfAttention", "ParallelTransformerBlock"]

Activation = Callable[[torch.Tensor], torch.Tensor]


class ParallelMLP(nn.Module):
    """``fc2(activation(fc1(x)))`` with the hidden features (``ffn_hidden_size``) split over the group.

    Args:
        activation: applied element-wise to this rank's hidden piece (default GELU).
        sequence_parallel: input and output are this rank's positions along the sequence.

    Raises:
        ValueError: ``ffn_hidden_size`` not divisible by the group size.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = True,
                 activation: Activation = F.gelu, process_set: ProcessSet = global_process_set,
                 dtype: torch.dtype | None = None, sequence_parallel: bool = False) -> None:
        super().__init__()
        group_position(process_set, "ParallelMLP")
        agree_on_layer("ParallelMLP", process_set, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                       activation=activation)  # [Note: a layer built alike on every rank] (its linears: theirs)
        self.fc1 = ColumnParallelLinear(hidden_size, ffn_hidden_size, bias, process_set=process_set, dtype=dtype,
                                        sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, bias, process_set=process_set, dtype=dtype,
                                     sequence_parallel=sequence_parallel)
        self.activation = activation

    @classmethod
    def from_linears(cls, fc1: nn.Linear, fc2: nn.Linear, activation: Activation = F.gelu,
                     process_set: ProcessSet = global_process_set, sequence_parallel: bool = False) -> ParallelMLP:
        """This rank's shard of the unsplit ``fc2(activation(fc1(x)))``.

        Collective over the group: the ranks first agree that they hold the same linears ([Note: one unsplit
        source on every rank]; each ``from_linear`` compares the weights).
        """

        def source() -> list:
            if not (isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear)):
                raise TypeError("ParallelMLP.from_linears needs two torch.nn.Linear; received "
                                f"{type(fc1).__name__} and {type(fc2).__name__}")
            if fc1.out_features != fc2.in_features:
                raise ValueError(f"ParallelMLP.from_linears: fc1's out_features ({fc1.out_features}) must equal "
                                 f"fc2's in_features ({fc2.in_features})")
            return []

        group_position(process_set, "ParallelMLP")
        agree_on_source("ParallelMLP.from_linears", process_set, source)
        mlp = cls(fc1.in_features, fc1.out_features, activation=activation, process_set=process_set,
                  dtype=fc1.weight.dtype, sequence_parallel=sequence_parallel)
        mlp.fc1 = ColumnParallelLinear.from_linear(fc1, process_set=process_set,
                                                   sequence_parallel=sequence_parallel)
        mlp.fc2 = RowParallelLinear.from_linear(fc2, process_set=process_set, sequence_parallel=sequence_parallel)
        return mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))


def _head_rows(weight: torch.Tensor, hidden: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of each of the q, k and v blocks of a fused ``(3 * hidden, ...)`` tensor."""
    return torch.cat([weight[part * hidden + start:part * hidden + stop] for part in range(3)])


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention over ``(batch, seq, hidden)`` with the heads split over the group.

    The fused q/k/v projection is column-parallel (this rank's heads' rows of q, k and v);
    the output projection is row-parallel. ``causal=True`` lets position ``t`` attend to
    positions ``<= t`` only.

    Args:
        attention_dropout: dropout on the attention probabilities in training, drawn from this
            shard's stream (``model_parallel_manual_seed`` first).
        sequence_parallel: input and output are this rank's positions along the sequence.
        batch_first: the input and output are ``(batch, seq, hidden)`` (default); False:
            ``(seq, batch, hidden)``, as ``nn.MultiheadAttention``'s default (not with
            ``sequence_parallel``).

    Raises:
        ValueError: ``hidden_size`` not divisible by ``num_heads``, ``num_heads`` not
            divisible by the group size, a dropout probability outside [0, 1), or
            ``batch_first=False`` with ``sequence_parallel``.
    """

    def __init__(self, hidden_size: int, num_heads: int, causal: bool = False, bias: bool = True,
                 process_set: ProcessSet = global_process_set, dtype: torch.dtype | None = None,
                 attention_dropout: float = 0.0, sequence_parallel: bool = False,
                 batch_first: bool = True) -> None:
        super().__init__()
        tp, shard = group_position(process_set, "ParallelSelfAttention")
        agree_on_layer("ParallelSelfAttention", process_set, hidden_size=hidden_size, num_heads=num_heads,
                       causal=causal, attention_dropout=attention_dropout, sequence_parallel=sequence_parallel,
                       batch_first=batch_first)  # [Note: a layer built alike on every rank]
        self.attention_dropout = check_probability("ParallelSelfAttention attention_dropout", attention_dropout)
        self.sequence_parallel = bool(sequence_parallel)
        self.batch_first = bool(batch_first)
        if sequence_parallel and not self.batch_first:
            raise ValueError("ParallelSelfAttention: sequence_parallel splits dimension 1 of (batch, seq, hidden) "
                             "inputs; it needs batch_first=True (transpose (seq, batch, hidden) inputs first)")
        if hidden_size % num_heads:
            raise ValueError(f"ParallelSelfAttention: hidden_size ({hidden_size}) must be divisible by num_heads "
                             f"({num_heads}); choose num_heads dividing {hidden_size}")
        self.local_heads = check_divisible("ParallelSelfAttention num_heads", num_heads, tp)
        self.hidden_size, self.num_heads, self.causal = hidden_size, num_heads, causal
        self.head_dim = hidden_size // num_heads
        self.qkv = ColumnParallelLinear(hidden_size, 3 * hidden_size, bias, process_set=process_set, dtype=dtype,
                                        device="meta", sequence_parallel=sequence_parallel)  # (drawn below)
        self._draw_qkv(divisible_shard("ParallelSelfAttention hidden_size", hidden_size, tp, shard), dtype)
        self.out = RowParallelLinear(hidden_size, hidden_size, bias, process_set=process_set, dtype=dtype,
                                     sequence_parallel=sequence_parallel)

    def _draw_qkv(self, heads: tuple[int, int], dtype: torch.dtype | None) -> None:
        """This rank's heads' rows of the whole fused ``(3 * hidden, hidden)`` weight and bias, drawn as
        ``nn.Linear(hidden, 3 * hidden)`` draws them ([Note: shards drawn from the whole]).

        The column layer's own draw would keep rows ``start:stop`` of the fused weight, but :meth:`_attend`
        reads its rows as this rank's heads of q, k and v (the layout ``_head_rows`` cuts, as
        ``from_multihead_attention`` and the checkpoints do): before 2026-12-07 the tp = 2 layer built under
        a seed was not the tp = 1 layer built under it (an audit measured 0.48 between their outputs). The
        column layer is built on the meta device (no draw) and given these rows instead, so the generator
        moves as for the unsplit layer.
        """
        hidden = self.hidden_size
        weight = _uniform((3 * hidden, hidden), hidden, dtype, None).detach()
        self.qkv.weight = nn.Parameter(_head_rows(weight, hidden, *heads))
        if self.qkv.bias is not None:
            bias = _uniform((3 * hidden,), hidden, dtype, None).detach()
            self.qkv.bias = nn.Parameter(_head_rows(bias, hidden, *heads))

    @classmethod
    def from_multihead_attention(cls, mha: nn.MultiheadAttention, causal: bool = False,
                                 process_set: ProcessSet = global_process_set, attention_dropout: float = 0.0,
                                 sequence_parallel: bool = False,
                                 batch_first: bool | None = None) -> ParallelSelfAttention:
        """This rank's heads of an unsplit ``nn.MultiheadAttention`` (self-attention, no dropout).

        The result reads the layout ``mha`` read (its ``batch_first``) unless ``batch_first`` says
        otherwise, takes one input ``x`` (self-attention) and returns the attention's output
        alone, not ``(output, weights)``.

        Raises:
            ValueError: separate q/k/v sizes, ``add_bias_kv``, ``add_zero_attn`` or dropout.
        """

        def source() -> list:
            if not isinstance(mha, nn.MultiheadAttention):
                raise TypeError("ParallelSelfAttention.from_multihead_attention needs a "
                                f"torch.nn.MultiheadAttention; received {type(mha).__name__}")
            if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn or mha.dropout:
                raise ValueError("ParallelSelfAttention.from_multihead_attention needs plain self-attention: "
                                 "kdim == vdim == embed_dim, no add_bias_kv, no add_zero_attn, dropout=0; "
                                 f"received kdim={mha.kdim}, vdim={mha.vdim}, "
                                 f"add_bias_kv={mha.bias_k is not None}, add_zero_attn={mha.add_zero_attn}, "
                                 f"dropout={mha.dropout}")
            return source_arrays(mha.in_proj_weight, mha.in_proj_bias)  # (out_proj: from_linear compares it)

        group_position(process_set, "ParallelSelfAttention")
        agree_on_source("ParallelSelfAttention.from_multihead_attention", process_set, source)
        weight = mha.in_proj_weight
        attn = cls(mha.embed_dim, mha.num_heads, causal, mha.in_proj_bias is not None, process_set, weight.dtype,
                   attention_dropout, sequence_parallel,
                   batch_first=mha.batch_first if batch_first is None else batch_first)
        start, stop = attn.out.start, attn.out.stop
        with torch.no_grad():
            attn.qkv.weight.copy_(_head_rows(weight, mha.embed_dim, start, stop))
            if attn.qkv.bias is not None and mha.in_proj_bias is not None:
                attn.qkv.bias.copy_(_head_rows(mha.in_proj_bias, mha.embed_dim, start, stop))
                attn.qkv.bias.requires_grad_(mha.in_proj_bias.requires_grad)
        attn.qkv.weight.requires_grad_(weight.requires_grad)
        attn.out = RowParallelLinear.from_linear(mha.out_proj, process_set=process_set,
                                                 sequence_parallel=sequence_parallel)
        return attn

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        return x.view(batch, seq, self.local_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            layout = "batch, seq" if self.batch_first else "seq, batch"
            raise ValueError(f"ParallelSelfAttention expects ({layout}, {self.hidden_size}); received "
                             f"{tuple(x.shape)}")
        if not self.batch_first:
            return self._attend(x.transpose(0, 1)).transpose(0, 1)
        return self._attend(x)

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self._heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        if self.training and self.attention_dropout > 0:
            refuse_forked_off_cpu(q, "ParallelSelfAttention")
            with get_rng_tracker().fork():
                context = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attention_dropout,
                                                         is_causal=self.causal)
        else:
            context = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        batch, _, seq, _ = context.shape
        return self.out(context.transpose(1, 2).reshape(batch, seq, self.local_heads * self.head_dim))


class ParallelTransformerBlock(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln1(x))``, then ``+ mlp(ln2(.))``, heads and MLP split.

    The layer norms are replicated on every rank of the group (their input and gradients are
    the same everywhere; under sequence parallelism their gradients are summed over the group).

    Args:
        hidden_dropout: dropout on the attention's and the MLP's outputs before each residual
            add, in training (the shared stream; the shard's own under sequence parallelism).
        attention_dropout: dropout on the attention probabilities (the shard's own stream).
        sequence_parallel: input and output are this rank's ``seq / tp`` positions of
            ``(batch, seq, hidden)``; ``scatter_to_sequence`` / ``gather_from_sequence`` enter
            and leave the split around a stack of blocks.
    """

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int, causal: bool = False,
                 eps: float = 1e-5, activation: Activation = F.gelu, process_set: ProcessSet = global_process_set,
                 dtype: torch.dtype | None = None, hidden_dropout: float = 0.0, attention_dropout: float = 0.0,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        group_position(process_set, "ParallelTransformerBlock")
        # [Note: a layer built alike on every rank] (its attention and MLP check theirs)
        agree_on_layer("ParallelTransformerBlock", process_set, eps=eps, hidden_dropout=hidden_dropout)
        self.hidden_dropout = check_probability("ParallelTransformerBlock hidden_dropout", hidden_dropout)
        self.sequence_parallel, self.process_set = bool(sequence_parallel), process_set
        self.ln1 = nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)
        self.attn = ParallelSelfAttention(hidden_size, num_heads, causal, process_set=process_set, dtype=dtype,
                                          attention_dropout=attention_dropout, sequence_parallel=sequence_parallel)
        self.ln2 = nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)
        self.mlp = ParallelMLP(hidden_size, ffn_hidden_size, activation=activation, process_set=process_set,
                               dtype=dtype, sequence_parallel=sequence_parallel)

    @classmethod
    def from_modules(cls, ln1: nn.LayerNorm, attn: nn.MultiheadAttention, ln2: nn.LayerNorm, fc1: nn.Linear,
                     fc2: nn.Linear, causal: bool = False, activation: Activation = F.gelu,
                     process_set: ProcessSet = global_process_set, hidden_dropout: float = 0.0,
                     attention_dropout: float = 0.0, sequence_parallel: bool = False) -> ParallelTransformerBlock:
        """This rank's shard of the unsplit block made of these modules (norms copied whole).

        Collective over the group: the ranks first agree that they hold the same modules ([Note: one unsplit
        source on every rank]).
        """

        def source() -> list:
            for module, kind in ((ln1, nn.LayerNorm), (attn, nn.MultiheadAttention), (ln2, nn.LayerNorm),
                                 (fc1, nn.Linear), (fc2, nn.Linear)):
                if not isinstance(module, kind):
                    raise TypeError("ParallelTransformerBlock.from_modules needs (LayerNorm, MultiheadAttention, "
                                    f"LayerNorm, Linear, Linear); received a {type(module).__name__} where a "
                                    f"torch.nn.{kind.__name__} belongs")
            return source_arrays(ln1.weight, ln1.bias, ln2.weight, ln2.bias) + [f"eps {ln1.eps} {ln2.eps}"]

        group_position(process_set, "ParallelTransformerBlock")
        agree_on_source("ParallelTransformerBlock.from_modules", process_set, source)
        block = cls(attn.embed_dim, attn.num_heads, fc1.out_features, causal, ln1.eps, activation, process_set,
                    fc1.weight.dtype, hidden_dropout, attention_dropout, sequence_parallel)
        block.ln1, block.ln2 = _clone_norm(ln1), _clone_norm(ln2)
        # the block reads (batch, seq, hidden) whatever layout the source attention read
        block.attn = ParallelSelfAttention.from_multihead_attention(attn, causal, process_set, attention_dropout,
                                                                    sequence_parallel, batch_first=True)
        block.mlp = ParallelMLP.from_linears(fc1, fc2, activation, process_set, sequence_parallel)
        return block

    def _norm(self, norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel or norm.weight is None:
            return norm(x)
        weight, bias = copy_to_group(norm.weight, self.process_set), norm.bias
        if bias is not None:
            bias = copy_to_group(bias, self.process_set)
        return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)

    def _dropout(self, h: torch.Tensor) -> torch.Tensor:
        if not self.training or self.hidden_dropout == 0:
            return h
        if self.sequence_parallel:
            refuse_forked_off_cpu(h, "ParallelTransformerBlock")
            with get_rng_tracker().fork():
                return F.dropout(h, self.hidden_dropout)
        if not get_rng_tracker().has():
            # the replicated activations need one mask on every rank of the group: torch's default generator
            # seeded alike, which model_parallel_manual_seed does (and agrees on). Before 2026-12-05 this drew
            # from whatever each rank had seeded (torch.manual_seed(seed + rank), say), and the copies drifted
            # apart silently; the attention's dropout and this one under sequence parallelism refused it
            raise ValueError("ParallelTransformerBlock: hidden dropout in training needs the ranks of the tensor "
                             "group to draw one mask: call model_parallel_manual_seed(seed, process_set) on "
                             "every rank of the group first (the same seed)")
        return F.dropout(h, self.hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            check_sequence(x, self.process_set, "ParallelTransformerBlock", whole=False)
        x = x + self._dropout(self.attn(self._norm(self.ln1, x)))
        return x + self._dropout(self.mlp(self._norm(self.ln2, x)))


def _clone_norm(norm: nn.LayerNorm) -> nn.LayerNorm:
    """A copy of ``norm`` on its device, each parameter training or frozen as in ``norm`` (a frozen norm
    became trainable, and a meta or GPU one was copied onto the CPU, before 2026-12-05)."""
    like = norm.weight if norm.weight is not None else None
    copy = nn.LayerNorm(norm.normalized_shape, eps=norm.eps, elementwise_affine=norm.elementwise_affine,
                        bias=norm.bias is not None, dtype=None if like is None else like.dtype,
                        device=None if like is None else like.device)
    if like is not None and like.device.type != "meta":
        copy.load_state_dict(norm.state_dict())
    for name, param in copy.named_parameters():
        param.requires_grad_(getattr(norm, name).requires_grad)
    return copy
