"""Megatron-style tensor-parallel layers for PyTorch: each rank of a tensor group holds one shard.

The tensor group is a registered process set (``hvd.add_process_set``; ``Grid.register`` makes
one per grid row); ``global_process_set`` (the default) makes the whole job one group. Layers
split one weight dimension evenly (docs/tensor_parallel.md)::

    ColumnParallelLinear   weight rows (output features)   y_i = x W_i^T + b_i   (shard i of y)
    RowParallelLinear      weight columns (input features) y = sum_i x_i W_i^T + b
    VocabParallelEmbedding embedding rows (vocabulary)     each id looked up by the rank owning it

A column layer followed by a row layer needs one all-reduce forward (``g``) and one backward
(``f``): see ``tensor_parallel_comm.py`` for the operators and [Note: why g's backward is the
identity]. Each layer has ``from_linear`` / ``from_embedding``, which copies this rank's shard out
of an unsplit layer, so a pretrained model can be split and tests can compare with the unsplit
layer. Randomly initialised shards draw from the same distribution as ``nn.Linear`` (bound
``1/sqrt(in_features)`` of the whole layer); the row layer's replicated bias starts at zero so
that it is the same on every rank of the group.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.tensor_parallel.groups import (
    CHECKSUM_PRIME,
    agree_on_layer,
    agree_on_source,
    group_position,
    targets_mismatch,
)
from unison.common.tensor_parallel.sequence import check_column_options, check_row_options
from unison.common.tensor_parallel.sharding import divisible_shard
from unison.torch_backend.tensor_parallel_comm import (
    agree_on_input_once,
    allreduce_max_no_grad,
    copy_to_group,
    gather_from_group,
    gather_from_sequence,
    reduce_from_group,
    reduce_scatter_to_sequence,
    scatter_to_group,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "group_position", "shards_across"]


def _uniform(shape: tuple[int, ...], fan_in: int, dtype: Any, device: Any,
             part: tuple[int, int, int] | None = None) -> nn.Parameter:
    """``nn.Linear``'s draw of the WHOLE ``shape`` (bound ``1/sqrt(fan_in)``), of which this rank keeps
    ``part`` = (dimension, start, stop).

    [Note: shards drawn from the whole] Every rank draws the whole weight from its default generator and
    keeps its slice, so ranks seeded alike (``model_parallel_manual_seed``, or ``torch.manual_seed``)
    hold the slices of ONE weight, the unsplit layer's under that seed, and their generators stay in
    step. Drawn shard by shard (before 2026-12-05), ranks seeded alike held the same values in every
    shard: the layer's weight was tp copies of one block, which got equal gradients and stayed copies.
    """
    bound = 1.0 / math.sqrt(fan_in)
    whole = torch.empty(shape, dtype=dtype, device=device).uniform_(-bound, bound)
    if part is not None:
        dim, start, stop = part
        whole = whole.narrow(dim, start, stop - start).clone()
    return nn.Parameter(whole)


def _dtype(dtype: Any) -> torch.dtype:
    """The dtype a layer's parameters get: ``dtype``, or torch's default (which each process sets itself)."""
    return torch.get_default_dtype() if dtype is None else dtype


def _copy(param: nn.Parameter | None, source: torch.Tensor | None) -> None:
    """This shard's values of ``source``, and whether it trains (a frozen layer stays frozen)."""
    if param is None or source is None:
        return
    with torch.no_grad():
        param.copy_(source)
    param.requires_grad_(source.requires_grad)


#: every live parallel layer: :func:`shards_across` asks them for their split tensors when it runs and
#: recognises a shard by the memory it uses, wherever it is held: the layer's parameter itself,
#: ``state_dict()``'s detached tensors, parameters that ``load_state_dict(assign=True)`` or ``.to()`` put
#: in the layer, and layers made by ``copy.deepcopy`` (which registers the copies: ``__setstate__``)
_LAYERS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class _SplitLayer(nn.Module):
    """What the parallel layers share: registered in :data:`_LAYERS`, copies too."""

    #: the attributes holding this rank's piece of a split tensor (a replicated bias is not one)
    _split: tuple[str, ...] = ("weight",)

    def __init__(self) -> None:
        super().__init__()
        _LAYERS.add(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        _LAYERS.add(self)

    def split_tensors(self) -> list[torch.Tensor]:
        """This rank's pieces of the layer's split tensors (none when the group is one rank, or the layer
        was never finished: its constructor raised)."""
        if getattr(self, "tp", 1) <= 1:
            return []
        return [t for t in (getattr(self, name, None) for name in self._split) if t is not None]


def _memory(tensor: torch.Tensor) -> int | None:
    """Where a dense tensor's elements start (None for a sparse or empty one, which holds no shard)."""
    if tensor.layout != torch.strided or not tensor.numel():
        return None
    return tensor.data_ptr()


def shard_groups(tensors: list[torch.Tensor]) -> list[ProcessSet | None]:
    """Per tensor, the tensor group of the live parallel layer holding it as one of its shards (None: not a
    shard: a plain or replicated tensor, or a layer of one rank). Found by memory."""
    by_memory = {where: layer.process_set for layer in list(_LAYERS) for t in layer.split_tensors()
                 if (where := _memory(t)) is not None}
    return [None if (where := _memory(t)) is None else by_memory.get(where) for t in tensors]


def shards_across(named: Any, process_set: ProcessSet | None, what: str) -> None:
    """Raise when ``process_set`` (None: every rank) holds two ranks of the tensor group of one of
    ``named``'s ``(name, tensor)`` shards: those ranks hold different pieces, so averaging or broadcasting
    over them mixes the pieces. The same verdict on every rank (the model is built alike everywhere)."""
    from unison.common import runtime

    over = set(range(runtime.size())) if process_set is None or process_set.ranks is None else set(
        process_set.ranks)
    named = list(named)
    for (name, _), group in zip(named, shard_groups([t for _, t in named]), strict=True):
        if group is None:
            continue
        tensor_ranks = set(range(runtime.size())) if group.ranks is None else set(group.ranks)
        if len(tensor_ranks & over) > 1:
            used = "every rank" if process_set is None else repr(process_set)
            raise ValueError(
                f"{what}: {name!r} is one shard of a tensor-parallel layer split over ranks "
                f"{sorted(tensor_ranks)}, and the process set it would use ({used}) "
                f"holds {sorted(tensor_ranks & over)} of them, which hold different shards: averaging or "
                "broadcasting across them mixes the shards. Pass process_set= the data-parallel group (e.g. "
                "Grid(...).register().dp), whose ranks hold the same shard")


def _check_source(module: nn.Module, owner: str, method: str, kind: type) -> None:
    """``module`` is a plain ``kind`` whose weights ``from_*`` can copy without losing behaviour."""
    if not isinstance(module, kind):
        raise TypeError(f"{owner}.{method} needs a torch.nn.{kind.__name__}; received {type(module).__name__}")
    from torch.nn.utils import parametrize

    if parametrize.is_parametrized(module) or hasattr(module, "weight_g"):
        raise ValueError(f"{owner}.{method}: the {type(module).__name__} is parametrized (weight_norm, "
                         "spectral_norm, a registered parametrization): the split layer would hold plain copies "
                         "of the computed weights and lose it. Remove the parametrization first "
                         "(torch.nn.utils.parametrize.remove_parametrizations) or leave this layer unsplit")
    hooks = [kind for kind, held in (("forward pre-hooks", module._forward_pre_hooks),
                                     ("forward hooks", module._forward_hooks),
                                     ("backward hooks", module._backward_hooks)) if held]
    if hooks:
        raise ValueError(f"{owner}.{method}: the {type(module).__name__} has {' and '.join(hooks)}, which the "
                         "split layer would not carry; register them on the split layer after splitting")


def _check_linear(linear: nn.Linear, owner: str) -> None:
    _check_source(linear, owner, "from_linear", nn.Linear)


def source_arrays(*tensors: torch.Tensor | None) -> list:
    """The tensors as ``agree_on_source`` compares them: each one's bytes (any dtype: bfloat16 too), shape
    and dtype; a missing one (None) and a meta tensor (no data) by what they are."""
    out: list = []
    for tensor in tensors:
        if tensor is None:
            out.append("none")
        elif tensor.is_meta:
            out.append(f"meta {tuple(tensor.shape)} {tensor.dtype}")
        else:
            out.append(f"{tuple(tensor.shape)} {tensor.dtype}")
            out.append(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return out


def _linear_source(linear: nn.Linear, owner: str) -> list:
    _check_linear(linear, owner)
    return source_arrays(linear.weight, linear.bias)


class ColumnParallelLinear(_SplitLayer):
    """``nn.Linear(in_features, out_features)`` with the output features split over the tensor group.

    The input is replicated over the group; each rank computes its ``out_features / tp`` outputs.

    Args:
        gather_output: all-gather the shards' outputs so every rank gets all ``out_features``
            (otherwise each keeps its piece, ready for a :class:`RowParallelLinear`).
        process_set: the tensor group (default: every rank).
        sequence_parallel: the input is this rank's positions of a ``(batch, seq, in)`` tensor
            split along the sequence; they are all-gathered first (backward: reduce-scatter).

    Raises:
        ValueError: ``out_features`` not divisible by the group size (on every rank: all ranks
            pass the same sizes), this rank not in the group, or ``gather_output`` together
            with ``sequence_parallel``.
    """

    _split = ("weight", "bias")

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 process_set: ProcessSet = global_process_set, dtype: Any = None, device: Any = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp, self.shard = group_position(process_set, "ColumnParallelLinear")
        agree_on_layer("ColumnParallelLinear", process_set, in_features=in_features, out_features=out_features,
                       bias=bool(bias), gather_output=gather_output, sequence_parallel=sequence_parallel,
                       dtype=_dtype(dtype))  # [Note: a layer built alike on every rank]
        check_column_options(gather_output, sequence_parallel)
        self.sequence_parallel = bool(sequence_parallel)
        self.start, self.stop = divisible_shard("ColumnParallelLinear out_features", out_features, self.tp,
                                                self.shard)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.process_set = gather_output, process_set
        part = (0, self.start, self.stop)  # [Note: shards drawn from the whole]
        self.weight = _uniform((out_features, in_features), in_features, dtype, device, part)
        self.bias = _uniform((out_features,), in_features, dtype, device, part) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, gather_output: bool = False,
                    process_set: ProcessSet = global_process_set,
                    sequence_parallel: bool = False) -> ColumnParallelLinear:
        """This rank's shard (rows ``start:stop`` of weight and bias) of an unsplit ``linear``.

        Collective over the group: the ranks first agree that they hold the same ``linear`` ([Note: one
        unsplit source on every rank]; ``MismatchError`` on every rank when they do not).
        """
        group_position(process_set, "ColumnParallelLinear")
        agree_on_source("ColumnParallelLinear.from_linear", process_set,
                        lambda: _linear_source(linear, "ColumnParallelLinear"))
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, gather_output,
                    process_set, linear.weight.dtype, linear.weight.device, sequence_parallel)
        _copy(layer.weight, linear.weight[layer.start:layer.stop])
        _copy(layer.bias, None if linear.bias is None else linear.bias[layer.start:layer.stop])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            # the gathered x is the same on every rank by construction: it was compared whole where it was split
            # ([Note: a sequence split is checked where it starts] in tensor_parallel_comm.py)
            x = gather_from_sequence(x, self.process_set, to_parallel=True)
        else:
            if self.tp > 1:
                agree_on_input_once(self, x, "ColumnParallelLinear", self.process_set)
            x = copy_to_group(x, self.process_set)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_group(y, self.process_set) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (this shard: "
                f"[{self.start}, {self.stop}) of tp={self.tp}), gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_SplitLayer):
    """``nn.Linear(in_features, out_features)`` with the input features split over the tensor group.

    Each rank multiplies its ``in_features / tp`` input columns; the partial outputs are summed
    over the group (one all-reduce) and the bias, replicated, is added once.

    Args:
        input_is_parallel: the input is already this rank's piece of the last dimension (the
            output of a :class:`ColumnParallelLinear`); otherwise it is the whole input and
            each rank takes its piece.
        process_set: the tensor group (default: every rank).
        sequence_parallel: reduce-scatter the partial sums along the sequence (dimension 1 of
            ``(batch, seq, out)``) instead of all-reducing them: each rank keeps its positions. The
            replicated bias's gradient is then summed over the group (each rank saw some positions).

    Raises:
        ValueError: ``in_features`` not divisible by the group size, this rank not in the group,
            or ``sequence_parallel`` with ``input_is_parallel=False``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 process_set: ProcessSet = global_process_set, dtype: Any = None, device: Any = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp, self.shard = group_position(process_set, "RowParallelLinear")
        agree_on_layer("RowParallelLinear", process_set, in_features=in_features, out_features=out_features,
                       bias=bool(bias), input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel,
                       dtype=_dtype(dtype))  # [Note: a layer built alike on every rank]
        check_row_options(input_is_parallel, sequence_parallel)
        self.sequence_parallel = bool(sequence_parallel)
        self.start, self.stop = divisible_shard("RowParallelLinear in_features", in_features, self.tp, self.shard)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.process_set = input_is_parallel, process_set
        self.weight = _uniform((out_features, in_features), in_features, dtype, device,
                               (1, self.start, self.stop))  # [Note: shards drawn from the whole]
        zeros = torch.zeros(out_features, dtype=self.weight.dtype, device=device)
        self.bias = nn.Parameter(zeros) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_is_parallel: bool = True,
                    process_set: ProcessSet = global_process_set,
                    sequence_parallel: bool = False) -> RowParallelLinear:
        """This rank's shard (weight columns ``start:stop``, the whole bias) of an unsplit ``linear``.

        Collective over the group: the ranks first agree that they hold the same ``linear`` ([Note: one
        unsplit source on every rank]).
        """
        group_position(process_set, "RowParallelLinear")
        agree_on_source("RowParallelLinear.from_linear", process_set,
                        lambda: _linear_source(linear, "RowParallelLinear"))
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, input_is_parallel,
                    process_set, linear.weight.dtype, linear.weight.device, sequence_parallel)
        _copy(layer.weight, linear.weight[:, layer.start:layer.stop])
        _copy(layer.bias, linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            if self.tp > 1:
                agree_on_input_once(self, x, "RowParallelLinear", self.process_set)
            x = scatter_to_group(x, self.process_set)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(F.linear(x, self.weight), self.process_set)
            return y if self.bias is None else y + copy_to_group(self.bias, self.process_set)
        y = reduce_from_group(F.linear(x, self.weight), self.process_set)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this shard: [{self.start}, {self.stop}) of tp={self.tp}), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(_SplitLayer):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with the vocabulary rows split over the group.

    Each rank looks up the ids it owns (zeros for the others); one all-reduce sums the pieces,
    so every rank gets every id's vector.

    Raises:
        ValueError: ``num_embeddings`` not divisible by the group size, or this rank not in the group.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, process_set: ProcessSet = global_process_set,
                 dtype: Any = None, device: Any = None) -> None:
        super().__init__()
        self.tp, self.shard = group_position(process_set, "VocabParallelEmbedding")
        # [Note: a layer built alike on every rank]
        agree_on_layer("VocabParallelEmbedding", process_set, num_embeddings=num_embeddings,
                       embedding_dim=embedding_dim, dtype=_dtype(dtype))
        self.start, self.stop = divisible_shard("VocabParallelEmbedding num_embeddings",
                                                num_embeddings, self.tp, self.shard)
        self.num_embeddings, self.embedding_dim, self.process_set = num_embeddings, embedding_dim, process_set
        rows = torch.empty(num_embeddings, embedding_dim, dtype=dtype, device=device).normal_()
        self.weight = nn.Parameter(rows[self.start:self.stop].clone())  # [Note: shards drawn from the whole]

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding,
                       process_set: ProcessSet = global_process_set) -> VocabParallelEmbedding:
        """This rank's rows ``start:stop`` of an unsplit ``embedding`` (no padding_idx, max_norm).

        Collective over the group: the ranks first agree that they hold the same ``embedding`` ([Note: one
        unsplit source on every rank]).
        """

        def source() -> list:
            _check_source(embedding, "VocabParallelEmbedding", "from_embedding", nn.Embedding)
            if (embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse
                    or embedding.scale_grad_by_freq):
                raise ValueError("VocabParallelEmbedding.from_embedding: padding_idx, max_norm, sparse and "
                                 "scale_grad_by_freq are not supported; received "
                                 f"padding_idx={embedding.padding_idx}, max_norm={embedding.max_norm}, "
                                 f"sparse={embedding.sparse}, scale_grad_by_freq={embedding.scale_grad_by_freq}")
            return source_arrays(embedding.weight)

        group_position(process_set, "VocabParallelEmbedding")
        agree_on_source("VocabParallelEmbedding.from_embedding", process_set, source)
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, process_set, embedding.weight.dtype,
                    embedding.weight.device)
        _copy(layer.weight, embedding.weight[layer.start:layer.stop])
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # an id no shard owns would come out as zeros (every shard masks it): refuse it as nn.Embedding
        # does (every rank of the group holds the same ids, so all raise before the reduction)
        bad = (ids < 0) | (ids >= self.num_embeddings)
        if bool(bad.any()):
            raise IndexError(f"VocabParallelEmbedding: ids must be in [0, {self.num_embeddings}) (the whole "
                             f"vocabulary); received {int(ids[bad][0])}")
        if self.tp > 1:
            agree_on_input_once(self, ids, "VocabParallelEmbedding", self.process_set)
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        vectors = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return reduce_from_group(vectors, self.process_set)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (this shard: rows [{self.start}, {self.stop}) "
                f"of tp={self.tp})")


def _targets_checksum(target: torch.Tensor) -> torch.Tensor:
    """:func:`~unison.common.tensor_parallel.groups.targets_checksum` of ``target``, on its device (int64)."""
    flat = target.reshape(-1).to(torch.int64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64, device=flat.device) % CHECKSUM_PRIME
    return (weights * (flat.remainder(CHECKSUM_PRIME) + 1) % CHECKSUM_PRIME).sum() % CHECKSUM_PRIME


def _check_targets(target: torch.Tensor, piece: int, tp: int, ignore_index: int,
                   process_set: ProcessSet) -> torch.Tensor:
    """``target != ignore_index``, once the group agreed that every rank holds a piece of one width, no rank
    holds a target outside the vocabulary, and every rank holds the same targets (their number and checksum:
    [Note: one set of targets per tensor group]); else every rank raises. One all-reduce (max) of each value
    and its negative checks all three. Checked on each rank alone (before 2026-12-05), pieces of different
    widths gave a wrong loss silently (the vocabulary and each rank's start are inferred from the width), and
    a target one rank refused left the others in the all-reduce; different targets were not checked before
    2026-12-07 (a wrong loss)."""
    vocab = piece * tp
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= vocab))
    count, checksum = target.numel(), int(_targets_checksum(target))
    mine = torch.tensor([piece, -piece, int(bool(bad.any())), count, -count, checksum, -checksum],
                        dtype=torch.int64)
    agreed = allreduce_max_no_grad(mine, process_set) * torch.tensor([1, -1, 1, 1, -1, 1, -1])
    most, least, refused, most_count, least_count, most_sum, least_sum = (int(v) for v in agreed)
    if most != least:
        raise ValueError(f"vocab_parallel_cross_entropy: the group's logits pieces are {least} to {most} wide "
                         f"(this rank {piece}); every rank must hold vocabulary / tp columns: pad the vocabulary "
                         "to a multiple of the tensor group size")
    if refused:
        got = f"received {int(target[bad][0])}" if bool(bad.any()) else "another rank of the group received one"
        raise ValueError(f"vocab_parallel_cross_entropy: targets must be in [0, {vocab}) (the whole vocabulary: "
                         f"logits' last dimension x tensor group size) or ignore_index={ignore_index}; {got}")
    if most_count != least_count or most_sum != least_sum:
        raise targets_mismatch((least_count, most_count), count, checksum)
    return valid


def _reduce(loss: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 process_set: ProcessSet = global_process_set, ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over a vocabulary split along the logits' last dimension; no rank holds it all.

    ``logits`` is this rank's ``(..., vocab / tp)`` piece (the output of a
    :class:`ColumnParallelLinear` without ``gather_output``), ``target`` holds whole-vocabulary
    ids of shape ``(...)``. The maximum and the sum of exponentials are all-reduced over the
    group (a scalar per position), and the target's logit comes from the rank that owns it,
    so the result, and the gradient of this rank's piece, equal ``F.cross_entropy`` on the
    gathered logits (class dimension last).

    Args:
        ignore_index: targets with this value add nothing (and are not counted by ``"mean"``).
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"`` (a loss per position).

    Raises:
        ValueError: an unknown reduction, a shape mismatch, or a target outside the vocabulary.
        MismatchError: the ranks of the group hold different targets (on every rank of the group).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none'; "
                         f"received {reduction!r}")
    if tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} must be target's shape "
                         f"{tuple(target.shape)} plus the vocabulary piece as the last dimension")
    tp, index = group_position(process_set, "vocab_parallel_cross_entropy")
    piece = logits.shape[-1]
    start = index * piece
    valid = _check_targets(target, piece, tp, ignore_index, process_set)
    shifted = logits - allreduce_max_no_grad(logits.max(dim=-1).values, process_set).unsqueeze(-1)
    sum_exp = reduce_from_group(shifted.exp().sum(dim=-1), process_set)
    mine = valid & (target >= start) & (target < start + piece)
    local = torch.where(mine, target - start, torch.zeros_like(target))
    picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    picked = reduce_from_group(torch.where(mine, picked, torch.zeros_like(picked)), process_set)
    loss = torch.where(valid, torch.log(sum_exp) - picked, torch.zeros_like(picked))
    return _reduce(loss, valid, reduction)
