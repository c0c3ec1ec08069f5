"""Tensor-parallel transformer pieces built from the column and row layers.

Each block is one tensor-parallel region: a :class:`ColumnParallelLinear` enters it (``f``:
nothing sent forward), a :class:`RowParallelLinear` leaves it (``g``: one all-reduce), so a
block costs one all-reduce forward and one backward::

    ParallelMLP            x -> fc1 (column) -> activation -> fc2 (row) -> y
    ParallelSelfAttention  x -> qkv (column: this rank's heads) -> attention per head -> out (row) -> y
    ParallelTransformerBlock  x + attn(ln1(x)), then + mlp(ln2(.))   (pre-norm; norms replicated)

Attention heads are the unit of the split: rank ``i`` of a group of ``tp`` computes heads
``[i * h/tp, (i+1) * h/tp)`` whole, so no head's scores ever cross ranks. Dropout is not offered
yet: inside a tensor-parallel region it needs per-shard random streams (docs/tensor_parallel.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.tensor_parallel.sharding import check_divisible
from unison.torch_backend.tensor_parallel import ColumnParallelLinear, RowParallelLinear, group_position

__all__ = ["ParallelMLP", "ParallelSelfAttention", "ParallelTransformerBlock"]

Activation = Callable[[torch.Tensor], torch.Tensor]


class ParallelMLP(nn.Module):
    """``fc2(activation(fc1(x)))`` with the hidden features (``ffn_hidden_size``) split over the group.

    Args:
        activation: applied element-wise to this rank's hidden piece (default GELU).

    Raises:
        ValueError: ``ffn_hidden_size`` not divisible by the group size.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = True,
                 activation: Activation = F.gelu, process_set: ProcessSet = global_process_set,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden_size, ffn_hidden_size, bias, process_set=process_set, dtype=dtype)
        self.fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, bias, process_set=process_set, dtype=dtype)
        self.activation = activation

    @classmethod
    def from_linears(cls, fc1: nn.Linear, fc2: nn.Linear, activation: Activation = F.gelu,
                     process_set: ProcessSet = global_process_set) -> ParallelMLP:
        """This rank's shard of the unsplit ``fc2(activation(fc1(x)))``."""
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"ParallelMLP.from_linears: fc1's out_features ({fc1.out_features}) must equal fc2's "
                             f"in_features ({fc2.in_features})")
        mlp = cls(fc1.in_features, fc1.out_features, activation=activation, process_set=process_set,
                  dtype=fc1.weight.dtype)
        mlp.fc1 = ColumnParallelLinear.from_linear(fc1, process_set=process_set)
        mlp.fc2 = RowParallelLinear.from_linear(fc2, process_set=process_set)
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

    Raises:
        ValueError: ``hidden_size`` not divisible by ``num_heads``, or ``num_heads`` not
            divisible by the group size.
    """

    def __init__(self, hidden_size: int, num_heads: int, causal: bool = False, bias: bool = True,
                 process_set: ProcessSet = global_process_set, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        tp, _ = group_position(process_set, "ParallelSelfAttention")
        if hidden_size % num_heads:
            raise ValueError(f"ParallelSelfAttention: hidden_size ({hidden_size}) must be divisible by num_heads "
                             f"({num_heads}); choose num_heads dividing {hidden_size}")
        self.local_heads = check_divisible("ParallelSelfAttention num_heads", num_heads, tp)
        self.hidden_size, self.num_heads, self.causal = hidden_size, num_heads, causal
        self.head_dim = hidden_size // num_heads
        self.qkv = ColumnParallelLinear(hidden_size, 3 * hidden_size, bias, process_set=process_set, dtype=dtype)
        self.out = RowParallelLinear(hidden_size, hidden_size, bias, process_set=process_set, dtype=dtype)

    @classmethod
    def from_multihead_attention(cls, mha: nn.MultiheadAttention, causal: bool = False,
                                 process_set: ProcessSet = global_process_set) -> ParallelSelfAttention:
        """This rank's heads of an unsplit ``nn.MultiheadAttention`` (self-attention, no dropout).

        Raises:
            ValueError: separate q/k/v sizes, ``add_bias_kv``, ``add_zero_attn`` or dropout.
        """
        if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn or mha.dropout:
            raise ValueError("ParallelSelfAttention.from_multihead_attention needs plain self-attention: "
                             "kdim == vdim == embed_dim, no add_bias_kv, no add_zero_attn, dropout=0; received "
                             f"kdim={mha.kdim}, vdim={mha.vdim}, add_bias_kv={mha.bias_k is not None}, "
                             f"add_zero_attn={mha.add_zero_attn}, dropout={mha.dropout}")
        weight = mha.in_proj_weight
        attn = cls(mha.embed_dim, mha.num_heads, causal, mha.in_proj_bias is not None, process_set, weight.dtype)
        start, stop = attn.out.start, attn.out.stop
        with torch.no_grad():
            attn.qkv.weight.copy_(_head_rows(weight, mha.embed_dim, start, stop))
            if attn.qkv.bias is not None and mha.in_proj_bias is not None:
                attn.qkv.bias.copy_(_head_rows(mha.in_proj_bias, mha.embed_dim, start, stop))
        attn.out = RowParallelLinear.from_linear(mha.out_proj, process_set=process_set)
        return attn

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        return x.view(batch, seq, self.local_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"ParallelSelfAttention expects (batch, seq, {self.hidden_size}); received "
                             f"{tuple(x.shape)}")
        q, k, v = (self._heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        context = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        batch, _, seq, _ = context.shape
        return self.out(context.transpose(1, 2).reshape(batch, seq, self.local_heads * self.head_dim))


class ParallelTransformerBlock(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln1(x))``, then ``+ mlp(ln2(.))``, heads and MLP split.

    The layer norms are replicated on every rank of the group (their input and gradients are
    the same everywhere).
    """

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int, causal: bool = False,
                 eps: float = 1e-5, activation: Activation = F.gelu, process_set: ProcessSet = global_process_set,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)
        self.attn = ParallelSelfAttention(hidden_size, num_heads, causal, process_set=process_set, dtype=dtype)
        self.ln2 = nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)
        self.mlp = ParallelMLP(hidden_size, ffn_hidden_size, activation=activation, process_set=process_set,
                               dtype=dtype)

    @classmethod
    def from_modules(cls, ln1: nn.LayerNorm, attn: nn.MultiheadAttention, ln2: nn.LayerNorm, fc1: nn.Linear,
                     fc2: nn.Linear, causal: bool = False, activation: Activation = F.gelu,
                     process_set: ProcessSet = global_process_set) -> ParallelTransformerBlock:
        """This rank's shard of the unsplit block made of these modules (norms copied whole)."""
        block = cls(attn.embed_dim, attn.num_heads, fc1.out_features, causal, ln1.eps, activation, process_set,
                    fc1.weight.dtype)
        block.ln1, block.ln2 = _clone_norm(ln1), _clone_norm(ln2)
        block.attn = ParallelSelfAttention.from_multihead_attention(attn, causal, process_set)
        block.mlp = ParallelMLP.from_linears(fc1, fc2, activation, process_set)
        return block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _clone_norm(norm: nn.LayerNorm) -> nn.LayerNorm:
    copy = nn.LayerNorm(norm.normalized_shape, eps=norm.eps, elementwise_affine=norm.elementwise_affine,
                        dtype=None if norm.weight is None else norm.weight.dtype)
    copy.load_state_dict(norm.state_dict())
    return copy
