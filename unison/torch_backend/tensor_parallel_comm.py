"""The four communication operators of Megatron-style tensor parallelism, as autograd functions.

A tensor-parallel region starts where a replicated activation enters column-split weights
and ends where row-split partial sums leave it. Each boundary is an operator whose backward
is the *conjugate* of its forward, over the ranks of the tensor group (a process set)::

    operator              forward                              backward
    copy_to_group   (f)   identity                             all-reduce (sum) of the gradient
    reduce_from_group (g) all-reduce (sum)                     identity
    gather_from_group     all-gather along the last dim        this shard's slice of the gradient
    scatter_to_group      this shard's slice of the last dim   all-gather of the gradient

Sequence parallelism (Korthikanti et al., "Reducing activation recomputation in large
transformer models") keeps the activations *between* regions split along the sequence
(dimension 1 of ``(batch, seq, hidden)``), so layer norms, dropout and residual adds each work on
``seq / tp`` positions; ``f`` and ``g`` become an all-gather and a reduce-scatter of the same
total volume as ``g``'s all-reduce::

    scatter_to_sequence    this shard's positions               all-gather of the gradient
    gather_from_sequence   all-gather of the positions          reduce-scatter (sum) of the gradient
                                                                (this shard's positions only when the
                                                                consumer is replicated, not split)
    reduce_scatter_to_sequence  reduce-scatter (sum) along      all-gather of the gradient
                           the positions

[Note: why g's backward is the identity] Every rank of the group goes on to compute the same
loss from the replicated output of ``g``; each rank's backward is the gradient of that one loss,
so the gradient reaching ``g`` is already the full gradient for its replicated output and,
because the sum's partial derivative is 1 for every term, also for this rank's partial input.
Summing it again over the group would count the loss ``tp`` times. ``f`` is the mirror image:
the replicated input feeds ``tp`` different shards, so its gradient is the sum of theirs.

On a group of one rank every operator is the identity and nothing is sent. The collectives go
through Unison's engine on the group's process set, blocking.

The calls are unnamed: the engine counts unnamed calls per process set (frontend [Note: a
counter per process set]), so ranks that sat out other groups' calls still agree on the names.
The ranks of a group must run the same layers in the same order.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Any

import torch

from unison.common.engine.process_sets import ProcessSet, set_rank, set_size
from unison.common.ops import Max, Sum
from unison.common.tensor_parallel.groups import agree_on_input, call_site, input_sample_positions
from unison.common.tensor_parallel.sequence import check_gathered_sequence, sequence_problem
from unison.torch_backend.allreduce_ops import allreduce_async
from unison.torch_backend.gather_ops import allgather_async, reducescatter_async
from unison.torch_backend.handles import synchronize

__all__ = ["copy_to_group", "reduce_from_group", "gather_from_group", "scatter_to_group",
           "allreduce_max_no_grad", "scatter_to_sequence", "gather_from_sequence", "reduce_scatter_to_sequence",
           "agree_on_input_once", "input_sample"]

SEQ_DIM = 1


# ----------------------------------------------------------------- one input per tensor group

def input_sample(x: torch.Tensor) -> Any:
    """The values :func:`~unison.common.tensor_parallel.groups.agree_on_input` compares, as a numpy array
    (float64, complex128 or int64): a few hundred elements, whatever ``x``'s size or device."""
    flat = x.detach().reshape(-1)
    pos = torch.from_numpy(input_sample_positions(flat.numel())).to(flat.device)
    values = flat[pos]
    if values.is_complex():
        return values.to(torch.complex128).cpu().numpy()
    return values.to(torch.float64 if values.is_floating_point() else torch.int64).cpu().numpy()


def agree_on_input_once(holder: Any, x: torch.Tensor, owner: str, process_set: ProcessSet) -> None:
    """At ``holder``'s first call, check that every rank of the group was given the same ``x`` ([Note: one input
    per tensor group] in ``unison/common/tensor_parallel/groups.py``): a ``MismatchError`` on every rank of the
    group otherwise. Not checked: inputs on the meta device (no values) or while torch compiles a graph."""
    if holder.__dict__.get("_unison_input_agreed"):
        return
    holder.__dict__["_unison_input_agreed"] = True  # (a plain attribute: not a parameter, buffer or module)
    if x.device.type == "meta" or torch.compiler.is_compiling():
        return
    agree_on_input(owner, process_set, tuple(x.shape), str(x.dtype).removeprefix("torch."), input_sample(x))


#: per tensor group, the holder of each call site of :func:`scatter_to_sequence` that checked its input
_SITES: weakref.WeakKeyDictionary[ProcessSet, dict[tuple, SimpleNamespace]] = weakref.WeakKeyDictionary()


def _call_site_holder(group: ProcessSet) -> SimpleNamespace:
    """The holder :func:`agree_on_input_once` marks for the code that called this function's caller."""
    return _SITES.setdefault(group, {}).setdefault(call_site(2), SimpleNamespace())


def _allreduce(tensor: torch.Tensor, group: ProcessSet, op: Any, kind: str) -> torch.Tensor:
    if set_size(group) == 1:
        return tensor
    return synchronize(allreduce_async(tensor.contiguous(), op=op, process_set=group))


def _allreduce_sum(tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    return _allreduce(tensor, group, Sum, "sum")


def _gather_last(tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """Every shard's ``tensor`` concatenated along the last dimension, in shard order."""
    if set_size(group) == 1:
        return tensor
    front = tensor.movedim(-1, 0).contiguous()
    gathered = synchronize(allgather_async(front, process_set=group))
    return gathered.movedim(0, -1)


def _my_slice(tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """This shard's equal piece of ``tensor``'s last dimension."""
    parts = set_size(group)
    if parts == 1:
        return tensor
    width = tensor.shape[-1]
    if width % parts:
        raise ValueError(f"scatter_to_group: the last dimension ({width}) is not divisible by the tensor group "
                         f"size ({parts}); pad it to a multiple of {parts}")
    piece = width // parts
    return tensor.narrow(-1, set_rank(group) * piece, piece).contiguous()


def _fresh(out: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """``out``, as a view when it is the forward's input itself (a group of one rank)."""
    return out.view_as(out) if out is given else out


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _allreduce_sum(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
        return _fresh(_allreduce_sum(tensor, group), tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
        ctx.group = group
        return _fresh(_gather_last(tensor, group), tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _my_slice(grad, ctx.group), None


class _ScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
        ctx.group = group
        return _fresh(_my_slice(tensor, group), tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gather_last(grad, ctx.group), None


def copy_to_group(tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """``f``: identity forward, gradient summed over ``group`` backward (enter a parallel region)."""
    return _CopyToGroup.apply(tensor, group)


def reduce_from_group(tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """``g``: sum over ``group`` forward, identity backward (leave a parallel region)."""
    return _ReduceFromGroup.apply(tensor, group)


def gather_from_group(tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """Concatenate the shards' last dimensions forward; keep this shard's slice of the gradient backward."""
    return _GatherFromGroup.apply(tensor, group)


def scatter_to_group(tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """Keep this shard's slice of the last dimension forward; all-gather the gradient backward."""
    return _ScatterToGroup.apply(tensor, group)


def allreduce_max_no_grad(tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """The element-wise maximum over ``group`` of a tensor that carries no gradient."""
    return _allreduce(tensor.detach(), group, Max, "max")


# ----------------------------------------------------------------- sequence parallelism

def check_sequence(tensor: torch.Tensor, group: ProcessSet, what: str, whole: bool) -> None:
    """Raise unless ``tensor`` is ``(batch, seq, ...)`` with a sequence the group divides (``whole``)."""
    problem = sequence_problem(tuple(tensor.shape), set_size(group), what, whole)
    if problem:
        raise ValueError(problem)


def _gather_seq(tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """Every shard's positions concatenated along the sequence, in shard order."""
    if set_size(group) == 1:
        return tensor
    front = tensor.movedim(SEQ_DIM, 0).contiguous()
    return synchronize(allgather_async(front, process_set=group)).movedim(0, SEQ_DIM)


def _seq_slice(tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """This shard's equal piece of the sequence."""
    parts = set_size(group)
    if parts == 1:
        return tensor
    piece = tensor.shape[SEQ_DIM] // parts
    return tensor.narrow(SEQ_DIM, set_rank(group) * piece, piece).contiguous()


def _reduce_scatter_seq(tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """The sum over the group, this shard's positions of it."""
    if set_size(group) == 1:
        return tensor
    front = tensor.movedim(SEQ_DIM, 0).contiguous()
    return synchronize(reducescatter_async(front, op=Sum, process_set=group)).movedim(0, SEQ_DIM).contiguous()


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
        ctx.group = group
        return _fresh(_seq_slice(tensor, group), tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gather_seq(grad, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessSet, to_parallel: bool) -> torch.Tensor:
        ctx.group, ctx.to_parallel = group, to_parallel
        whole = _gather_seq(tensor, group)
        check_gathered_sequence(whole.shape[SEQ_DIM], tensor.shape[SEQ_DIM], set_size(group),
                                "gather_from_sequence")
        return _fresh(whole, tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.to_parallel:
            return _reduce_scatter_seq(grad, ctx.group), None, None
        return _seq_slice(grad, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
        ctx.group = group
        return _fresh(_reduce_scatter_seq(tensor, group), tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gather_seq(grad, ctx.group), None


def scatter_to_sequence(tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """This shard's ``seq / tp`` positions of a replicated ``(batch, seq, ...)`` tensor.

    Enters sequence parallelism; backward all-gathers the gradient along the sequence.

    [Note: a sequence split is checked where it starts] A column layer under sequence parallelism
    all-gathers its input, which is then the same on every rank by construction: it cannot tell that the
    ranks held pieces of different batches. So the replicated tensor is compared here, whole, before it is
    split ([Note: one input per tensor group]), once per call site (the first call of each place in the
    code that calls this; a loop's later calls are not compared), as a layer compares its input at its
    first call. Before 2026-12-07 nothing was: each rank of the group went on with its positions of its own
    batch, and the block mixed them with no error.

    Raises:
        ValueError: fewer than 2 dimensions, or a sequence the group does not divide.
        MismatchError: the ranks of the group passed different tensors at this call site's first call (on
            every rank of the group).
    """
    check_sequence(tensor, group, "scatter_to_sequence", whole=True)
    if set_size(group) > 1 and not torch.compiler.is_compiling():
        agree_on_input_once(_call_site_holder(group), tensor, "scatter_to_sequence", group)
    return _ScatterToSequence.apply(tensor, group)


def gather_from_sequence(tensor: torch.Tensor, group: ProcessSet, to_parallel: bool = True) -> torch.Tensor:
    """All the shards' positions, concatenated along the sequence (dimension 1).

    Args:
        to_parallel: the result feeds a tensor-parallel layer (a column layer: every rank's
            gradient is a partial sum, so backward reduce-scatters it); False when it feeds
            computation replicated on every rank (every rank's gradient is already whole, so
            backward keeps this shard's positions).
    """
    check_sequence(tensor, group, "gather_from_sequence", whole=False)
    return _GatherFromSequence.apply(tensor, group, bool(to_parallel))


def reduce_scatter_to_sequence(tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """The sum over the group of ``(batch, seq, ...)`` partial results, this shard's positions of it.

    A row layer's exit under sequence parallelism (instead of ``g``'s all-reduce); backward
    all-gathers the gradient.
    """
    check_sequence(tensor, group, "reduce_scatter_to_sequence", whole=True)
    return _ReduceScatterToSequence.apply(tensor, group)
