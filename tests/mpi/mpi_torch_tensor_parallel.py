"""Tensor-parallel PyTorch layers under mpirun: every layer equals the unsplit layer, forward and backward.

One launch covers tp = 1, 2, 3 and 4 (each tp up to the job's size). The job is cut into
consecutive groups of tp ranks (at np 4: {0} {1} {2} {3}; {0,1} {2,3}; {0,1,2} with rank 3
idle; {0,1,2,3}), every group registered as a process set on every rank in the same order.
Every rank builds the same unsplit float64 layers and inputs from one seed and computes the
reference locally; the ranks of a group run the parallel layer built from it and compare the
output, the input's gradient and their shard of every parameter's gradient. A rank outside
every group of a tp checks that building a layer on a group it is not in is refused.
``parallelize`` is checked the same way on whole models, and by training on a dp x tp grid
against one process trained on the global batch.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from mpi4py import MPI
from tensor_parallel_groups import (
    BAD_SIZE_IDS,
    BAD_SIZES,
    DIFFERENT_BUILD_IDS,
    DIFFERENT_BUILDS,
    TPS,
    check_bad_size,
    check_different_build,
    group_or_refusal,
    register_groups,
)
from torch import nn
from torch.nn import functional as F

import unison.torch_backend as hvd
from unison.common.tensor_parallel import Grid, shard_range

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
torch.set_num_threads(1)
TOL = dict(rtol=1e-10, atol=1e-11)
D = torch.float64
SETS: dict[int, hvd.ProcessSet | None] = {}  # tp -> this rank's registered group (None: idle)


@pytest.fixture(scope="module", autouse=True)
def _session():
    hvd.init()
    SETS.update(register_groups(hvd))
    yield
    hvd.barrier()  # a rank that shuts down stops the engine for all: wait for every group's last call
    hvd.shutdown()


def group(tp: int) -> hvd.ProcessSet | None:
    """This rank's group at ``tp`` (None: idle; then joining another group must be refused)."""
    return group_or_refusal(hvd, SETS, tp)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, **TOL)


def piece(t: torch.Tensor, ps: hvd.ProcessSet, dim: int = -1) -> torch.Tensor:
    """This rank's equal piece of ``t`` along ``dim``."""
    start, stop = shard_range(t.shape[dim], ps.size(), ps.rank())
    return t.narrow(dim, start, stop - start)


def seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def linear(seed: int, fan_in: int, fan_out: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(fan_in, fan_out, bias=bias, dtype=D)


# ------------------------------------------------------------------ linear layers


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel_linear(tp, gather_output):
    ref = linear(1, 5, 4 * tp)
    x, upstream = seeded(2, 3, 2, 5), seeded(3, 3, 2, 4 * tp)
    x_ref = leaf(x)
    (ref(x_ref) * upstream).sum().backward()
    ps = group(tp)
    if ps is None:
        return
    layer = hvd.ColumnParallelLinear.from_linear(ref, gather_output=gather_output, process_set=ps)
    x_par = leaf(x)
    out = layer(x_par)
    close(out, ref(x) if gather_output else piece(ref(x), ps))
    (out * (upstream if gather_output else piece(upstream, ps))).sum().backward()
    close(x_par.grad, x_ref.grad)
    close(layer.weight.grad, piece(ref.weight.grad, ps, 0))
    close(layer.bias.grad, piece(ref.bias.grad, ps, 0))


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear(tp, input_is_parallel):
    ref = linear(4, 3 * tp, 5)
    x, upstream = seeded(5, 4, 3 * tp), seeded(6, 4, 5)
    x_ref = leaf(x)
    (ref(x_ref) * upstream).sum().backward()
    ps = group(tp)
    if ps is None:
        return
    layer = hvd.RowParallelLinear.from_linear(ref, input_is_parallel=input_is_parallel, process_set=ps)
    x_par = leaf(piece(x, ps) if input_is_parallel else x)
    out = layer(x_par)
    close(out, ref(x))
    (out * upstream).sum().backward()
    close(x_par.grad, piece(x_ref.grad, ps) if input_is_parallel else x_ref.grad)
    close(layer.weight.grad, piece(ref.weight.grad, ps, 1))
    close(layer.bias.grad, ref.bias.grad)


@pytest.mark.parametrize("tp", TPS)
def test_column_then_row_without_bias(tp):
    fc1, fc2 = linear(7, 6, 2 * tp, bias=False), linear(8, 2 * tp, 3, bias=False)
    x, upstream = seeded(9, 5, 6), seeded(10, 5, 3)
    x_ref = leaf(x)
    (fc2(torch.tanh(fc1(x_ref))) * upstream).sum().backward()
    ps = group(tp)
    if ps is None:
        return
    col = hvd.ColumnParallelLinear.from_linear(fc1, process_set=ps)
    row = hvd.RowParallelLinear.from_linear(fc2, process_set=ps)
    assert col.bias is None and row.bias is None
    x_par = leaf(x)
    out = row(torch.tanh(col(x_par)))
    close(out, fc2(torch.tanh(fc1(x))))
    (out * upstream).sum().backward()
    close(x_par.grad, x_ref.grad)
    close(col.weight.grad, piece(fc1.weight.grad, ps, 0))
    close(row.weight.grad, piece(fc2.weight.grad, ps, 1))


# ------------------------------------------------------------------ vocabulary


@pytest.mark.parametrize("tp", TPS)
def test_vocab_parallel_embedding(tp):
    torch.manual_seed(11)
    ref = nn.Embedding(5 * tp, 4, dtype=D)
    ids = torch.randint(0, 5 * tp, (3, 7), generator=torch.Generator().manual_seed(12))
    ids[0, :3] = torch.tensor([0, 5 * tp - 1, 0])  # both ends of the vocabulary, one id twice
    upstream = seeded(13, 3, 7, 4)
    (ref(ids) * upstream).sum().backward()
    ps = group(tp)
    if ps is None:
        return
    layer = hvd.VocabParallelEmbedding.from_embedding(ref, process_set=ps)
    out = layer(ids)
    close(out, ref(ids))
    (out * upstream).sum().backward()
    close(layer.weight.grad, piece(ref.weight.grad, ps, 0))
    for bad in (5 * tp, -1):  # no shard owns it: it used to come out as zeros; nn.Embedding raises
        with pytest.raises(IndexError, match=rf"ids must be in \[0, {5 * tp}\).*received {bad}"):
            layer(torch.tensor([[1, bad]]))


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_cross_entropy(tp, reduction):
    vocab = 3 * tp + 3 * (tp % 2)  # 6, 6, 12, 12: divisible by tp
    logits = seeded(14, 4, 5, vocab) * 30  # large logits: the max must be subtracted
    target = torch.randint(0, vocab, (4, 5), generator=torch.Generator().manual_seed(15))
    target[0, 0], target[1, 1], target[2, 2] = -100, 0, vocab - 1
    upstream = seeded(16, 4, 5) if reduction == "none" else torch.tensor(1.7, dtype=D)
    full = leaf(logits)
    expected = F.cross_entropy(full.reshape(-1, vocab), target.reshape(-1), reduction=reduction)
    expected = expected.reshape(target.shape) if reduction == "none" else expected
    (expected * upstream).sum().backward()
    ps = group(tp)
    if ps is None:
        return
    mine = leaf(piece(logits, ps))
    loss = hvd.vocab_parallel_cross_entropy(mine, target, process_set=ps, reduction=reduction)
    close(loss, expected)
    (loss * upstream).sum().backward()
    close(mine.grad, piece(full.grad, ps))


@pytest.mark.parametrize("tp", TPS)
def test_cross_entropy_refuses_a_target_outside_the_vocabulary(tp):
    ps = group(tp)
    if ps is None:
        return
    with pytest.raises(ValueError, match=rf"targets must be in \[0, {2 * tp}\)"):
        hvd.vocab_parallel_cross_entropy(torch.zeros(3, 2, dtype=D), torch.tensor([0, 2 * tp, 1]), process_set=ps)
    if tp == 1:
        return
    # found by an audit (2026-12-05): a target only one rank refused left the others in the all-reduce, and
    # pieces of different widths (a vocabulary the group does not divide) gave a wrong loss silently
    first = ps.rank() == 0
    with pytest.raises(ValueError, match=r"targets must be in .*(received 99|another rank of the group)"):
        hvd.vocab_parallel_cross_entropy(torch.zeros(3, 2, dtype=D), torch.tensor([0, 99 if first else 1, 1]),
                                         process_set=ps)
    with pytest.raises(ValueError, match=r"logits pieces are 2 to 3 wide"):
        hvd.vocab_parallel_cross_entropy(torch.zeros(3, 3 if first else 2, dtype=D), torch.tensor([0, 1, 1]),
                                         process_set=ps)
    loss = hvd.vocab_parallel_cross_entropy(torch.zeros(3, 2, dtype=D), torch.tensor([0, 1, 1]), process_set=ps)
    close(loss, torch.log(torch.tensor(2.0 * tp, dtype=D)))


@pytest.mark.parametrize("tp", [tp for tp in TPS if tp > 1])
def test_cross_entropy_refuses_targets_that_differ_across_the_group(tp):
    """[Note: one set of targets per tensor group] One rank of the group given other targets (other values, the
    same targets in another order, or fewer of them) gave a wrong loss with no error before 2026-12-07 (an
    audit: 2.53 on one rank against 2.44 on the other, each right for neither). Now every rank raises."""
    ps = group(tp)
    if ps is None:
        return
    last = ps.rank() == tp - 1
    logits = seeded(17, 4, 2 * tp)
    target = torch.tensor([1, 0, 2 * tp - 1, 3])
    mine = piece(logits, ps)
    differ = r"vocab_parallel_cross_entropy: the ranks of the tensor group were given different targets"
    values = r" \(4 targets each, of different values; this rank's checksum \d+\)\. .*shard the data by the data-"
    with pytest.raises(hvd.MismatchError, match=differ + values):
        hvd.vocab_parallel_cross_entropy(mine, torch.tensor([1, 0, 2, 3]) if last else target, process_set=ps)
    with pytest.raises(hvd.MismatchError, match=differ):  # the same targets in another order
        hvd.vocab_parallel_cross_entropy(mine, target.flip(0) if last else target, process_set=ps)
    with pytest.raises(hvd.MismatchError, match=differ + rf" \(3 to 4 targets; this rank {3 if last else 4}\)"):
        hvd.vocab_parallel_cross_entropy(mine[:3] if last else mine, target[:3] if last else target,
                                         process_set=ps)
    close(hvd.vocab_parallel_cross_entropy(mine, target, process_set=ps), F.cross_entropy(logits, target))


# ------------------------------------------------------------------ blocks


def mha(seed: int, hidden: int, heads: int) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    attn = nn.MultiheadAttention(hidden, heads, batch_first=True, dtype=D)
    with torch.no_grad():  # torch starts the in/out biases at zero; give them values to check
        attn.in_proj_bias.normal_()
        attn.out_proj.bias.normal_()
    return attn


def causal_mask(seq: int) -> torch.Tensor:
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)  # True: may not attend


def heads_rows(grad: torch.Tensor, hidden: int, ps: hvd.ProcessSet) -> torch.Tensor:
    """This rank's rows of q, k and v in a fused (3 * hidden, ...) gradient."""
    return torch.cat([piece(grad[i * hidden:(i + 1) * hidden], ps, 0) for i in range(3)])


@pytest.mark.parametrize("tp", TPS)
def test_parallel_mlp(tp):
    fc1, fc2 = linear(17, 6, 4 * tp), linear(18, 4 * tp, 6)
    x, upstream = seeded(19, 2, 3, 6), seeded(20, 2, 3, 6)
    x_ref = leaf(x)
    (fc2(F.gelu(fc1(x_ref))) * upstream).sum().backward()
    ps = group(tp)
    if ps is None:
        return
    mlp = hvd.ParallelMLP.from_linears(fc1, fc2, process_set=ps)
    x_par = leaf(x)
    out = mlp(x_par)
    close(out, fc2(F.gelu(fc1(x))))
    (out * upstream).sum().backward()
    close(x_par.grad, x_ref.grad)
    close(mlp.fc1.weight.grad, piece(fc1.weight.grad, ps, 0))
    close(mlp.fc1.bias.grad, piece(fc1.bias.grad, ps, 0))
    close(mlp.fc2.weight.grad, piece(fc2.weight.grad, ps, 1))
    close(mlp.fc2.bias.grad, fc2.bias.grad)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("causal", [True, False])
def test_parallel_self_attention(tp, causal):
    heads, hidden, seq = 2 * tp, 4 * tp, 5
    ref = mha(21, hidden, heads)
    x, upstream = seeded(22, 2, seq, hidden), seeded(23, 2, seq, hidden)
    x_ref = leaf(x)
    mask = causal_mask(seq) if causal else None
    (ref(x_ref, x_ref, x_ref, attn_mask=mask, need_weights=False)[0] * upstream).sum().backward()
    ps = group(tp)
    if ps is None:
        return
    attn = hvd.ParallelSelfAttention.from_multihead_attention(ref, causal=causal, process_set=ps)
    x_par = leaf(x)
    out = attn(x_par)
    close(out, ref(x, x, x, attn_mask=mask, need_weights=False)[0])
    (out * upstream).sum().backward()
    close(x_par.grad, x_ref.grad)
    close(attn.qkv.weight.grad, heads_rows(ref.in_proj_weight.grad, hidden, ps))
    close(attn.qkv.bias.grad, heads_rows(ref.in_proj_bias.grad, hidden, ps))
    close(attn.out.weight.grad, piece(ref.out_proj.weight.grad, ps, 1))
    close(attn.out.bias.grad, ref.out_proj.bias.grad)


class Block(nn.Module):
    """The unsplit pre-norm block that ParallelTransformerBlock splits."""

    def __init__(self, hidden: int, heads: int, ffn: int, causal: bool, seq: int = 7) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden, dtype=D), nn.LayerNorm(hidden, dtype=D)
        self.attn = mha(24, hidden, heads)
        self.fc1, self.fc2 = linear(25, hidden, ffn), linear(26, ffn, hidden)
        with torch.no_grad():
            for norm in (self.ln1, self.ln2):
                norm.weight.normal_()
                norm.bias.normal_()
        self.mask = causal_mask(seq) if causal else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


@pytest.mark.parametrize("tp", TPS)
def test_parallel_transformer_block(tp):
    hidden = 4 * tp
    ref = Block(hidden, 2 * tp, 8 * tp, causal=True)
    x, upstream = seeded(27, 2, 7, hidden), seeded(28, 2, 7, hidden)
    x_ref = leaf(x)
    (ref(x_ref) * upstream).sum().backward()
    ps = group(tp)
    if ps is None:
        return
    block = hvd.ParallelTransformerBlock.from_modules(ref.ln1, ref.attn, ref.ln2, ref.fc1, ref.fc2, causal=True,
                                                      process_set=ps)
    x_par = leaf(x)
    out = block(x_par)
    close(out, ref(x))
    (out * upstream).sum().backward()
    close(x_par.grad, x_ref.grad)
    for name in ("ln1", "ln2"):
        close(getattr(block, name).weight.grad, getattr(ref, name).weight.grad)
        close(getattr(block, name).bias.grad, getattr(ref, name).bias.grad)
    close(block.attn.qkv.weight.grad, heads_rows(ref.attn.in_proj_weight.grad, hidden, ps))
    close(block.mlp.fc1.weight.grad, piece(ref.fc1.weight.grad, ps, 0))
    close(block.mlp.fc2.weight.grad, piece(ref.fc2.weight.grad, ps, 1))


@pytest.mark.parametrize("tp", TPS)
def test_transformer_block_from_layer_norms_without_bias(tp):
    hidden = 4 * tp
    ref = Block(hidden, 2 * tp, 8 * tp, causal=True)
    ref.ln1, ref.ln2 = nn.LayerNorm(hidden, bias=False, dtype=D), nn.LayerNorm(hidden, bias=False, dtype=D)
    x = seeded(29, 2, 7, hidden)
    ps = group(tp)
    if ps is None:
        return
    block = hvd.ParallelTransformerBlock.from_modules(ref.ln1, ref.attn, ref.ln2, ref.fc1, ref.fc2, causal=True,
                                                      process_set=ps)
    assert block.ln1.bias is None and block.ln2.bias is None
    close(block(x), ref(x))
    # a frozen norm stays frozen (it trained after from_modules before 2026-12-05, found by an audit)
    ref.ln1.weight.requires_grad_(False)
    block = hvd.ParallelTransformerBlock.from_modules(ref.ln1, ref.attn, ref.ln2, ref.fc1, ref.fc2, causal=True,
                                                      process_set=ps)
    assert not block.ln1.weight.requires_grad and block.ln2.weight.requires_grad


# ------------------------------------------------------------------ sequence parallelism, dropout

SEQ = 12  # divisible by every tp of the suite


@pytest.mark.parametrize("tp", TPS)
def test_sequence_parallel_block_equals_the_unsplit_block(tp):
    hidden = 4 * tp
    ref = Block(hidden, 2 * tp, 8 * tp, causal=True, seq=SEQ)
    with torch.no_grad():
        for fc in (ref.fc2, ref.attn.out_proj):
            fc.bias.normal_()
    x, upstream = seeded(29, 2, SEQ, hidden), seeded(30, 2, SEQ, hidden)
    x_ref = leaf(x)
    (ref(x_ref) * upstream).sum().backward()
    ps = group(tp)
    if ps is None:
        return
    block = hvd.ParallelTransformerBlock.from_modules(ref.ln1, ref.attn, ref.ln2, ref.fc1, ref.fc2, causal=True,
                                                      process_set=ps, sequence_parallel=True)
    x_par = leaf(x)
    mine = hvd.scatter_to_sequence(x_par, ps)
    assert mine.shape == (2, SEQ // tp, hidden)
    out_mine = block(mine)
    close(out_mine, piece(ref(x), ps, 1))  # each rank holds its own positions of the output
    out = hvd.gather_from_sequence(out_mine, ps, to_parallel=False)
    close(out, ref(x))
    (out * upstream).sum().backward()
    close(x_par.grad, x_ref.grad)
    for name in ("ln1", "ln2"):  # replicated: the gradient of every position, summed over the group
        close(getattr(block, name).weight.grad, getattr(ref, name).weight.grad)
        close(getattr(block, name).bias.grad, getattr(ref, name).bias.grad)
    close(block.attn.out.bias.grad, ref.attn.out_proj.bias.grad)
    close(block.mlp.fc2.bias.grad, ref.fc2.bias.grad)
    close(block.attn.qkv.weight.grad, heads_rows(ref.attn.in_proj_weight.grad, hidden, ps))
    close(block.attn.out.weight.grad, piece(ref.attn.out_proj.weight.grad, ps, 1))
    close(block.mlp.fc1.weight.grad, piece(ref.fc1.weight.grad, ps, 0))
    close(block.mlp.fc2.weight.grad, piece(ref.fc2.weight.grad, ps, 1))


@pytest.mark.parametrize("tp", [tp for tp in TPS if tp > 1])
def test_sequence_parallel_inputs_that_differ_across_the_group_are_refused(tp):
    """[Note: a sequence split is checked where it starts] Each rank of the group given its own batch under
    sequence parallelism: scatter_to_sequence compared nothing and the column layers all-gathered the pieces
    of different batches, so the block mixed them with no error before 2026-12-07 (an audit). Now the
    replicated tensor is compared whole at each call site's first call."""
    hidden = 4 * tp
    ref = Block(hidden, 2 * tp, 8 * tp, causal=True, seq=SEQ)
    ps = group(tp)
    if ps is None:
        return
    block = hvd.ParallelTransformerBlock.from_modules(ref.ln1, ref.attn, ref.ln2, ref.fc1, ref.fc2, causal=True,
                                                      process_set=ps, sequence_parallel=True)
    with pytest.raises(hvd.MismatchError, match=r"scatter_to_sequence: the tensor group \(ranks? .*\) was given "
                                                r"different inputs \(rank .* differs .*shard the data by the "
                                                r"data-parallel rank"):
        block(hvd.scatter_to_sequence(seeded(70 + ps.rank(), 2, SEQ, hidden), ps))
    with pytest.raises(hvd.MismatchError, match=rf"rank .*'s is \[1, {SEQ}, {hidden}\] float64, rank .*'s "
                                                rf"\[2, {SEQ}, {hidden}\] float64"):
        hvd.scatter_to_sequence(seeded(71, 1 if ps.rank() else 2, SEQ, hidden), ps)
    x = seeded(72, 2, SEQ, hidden)
    for _ in range(2):  # one call site: agreed at its first call
        out = hvd.gather_from_sequence(block(hvd.scatter_to_sequence(x, ps)), ps, to_parallel=False)
        close(out, ref(x))


@pytest.mark.parametrize("tp", [tp for tp in TPS if tp > 1])
def test_sequence_parallel_refuses_a_sequence_the_group_does_not_divide(tp):
    ps = group(tp)
    if ps is None:
        return
    with pytest.raises(ValueError, match=rf"sequence length \({2 * tp + 1}\) is not divisible by the tensor group "
                                         rf"size \({tp}\); pad the sequence to a multiple of {tp}"):
        hvd.scatter_to_sequence(torch.zeros(2, 2 * tp + 1, 4, dtype=D), ps)
    with pytest.raises(ValueError, match="sequence_parallel=True needs input_is_parallel=True"):
        hvd.RowParallelLinear(2 * tp, 4, input_is_parallel=False, process_set=ps, sequence_parallel=True)


@pytest.mark.parametrize("tp", TPS)
def test_layers_built_from_a_seed_hold_slices_of_one_weight(tp):
    """[Note: shards drawn from the whole] Each rank drew its shard alone before 2026-12-05: ranks seeded
    alike held identical shards (a weight of tp copies of one block, found by an audit). Now the shards are
    the slices of the unsplit layer drawn under that seed, and the generators stay in step."""
    ps = group(tp)
    if ps is None:
        return
    hvd.model_parallel_manual_seed(5, ps)
    col = hvd.ColumnParallelLinear(4, 4 * tp, process_set=ps, dtype=D)
    row = hvd.RowParallelLinear(2 * tp, 3, process_set=ps, dtype=D)
    emb = hvd.VocabParallelEmbedding(2 * tp, 3, process_set=ps, dtype=D)
    after = torch.rand(3).tolist()
    torch.manual_seed(5)
    bound_c, bound_r = 1 / 4 ** 0.5, 1 / (2 * tp) ** 0.5
    whole_cw = torch.empty(4 * tp, 4, dtype=D).uniform_(-bound_c, bound_c)
    whole_cb = torch.empty(4 * tp, dtype=D).uniform_(-bound_c, bound_c)
    whole_rw = torch.empty(3, 2 * tp, dtype=D).uniform_(-bound_r, bound_r)
    whole_e = torch.empty(2 * tp, 3, dtype=D).normal_()
    close(col.weight.detach(), piece(whole_cw, ps, 0))
    close(col.bias.detach(), piece(whole_cb, ps, 0))
    close(row.weight.detach(), piece(whole_rw, ps, 1))
    close(emb.weight.detach(), piece(whole_e, ps, 0))
    assert torch.rand(3).tolist() == after  # in step with the unsplit draws
    shards = hvd.allgather_object(col.weight.detach().tolist(), process_set=ps)
    assert len({str(s) for s in shards}) == tp  # every shard its own values
    assert hvd.allgather_object(after, process_set=ps) == [after] * tp


def drawn_block(seed: int, hidden: int, heads: int, ffn: int) -> Block:
    """The unsplit block as ParallelTransformerBlock draws it under ``seed``: nn.Linear's bounds, the fused q/k/v
    weight and bias first, then the output projection (bias zero), fc1, fc2 (bias zero); norms at one and zero."""
    block = Block(hidden, heads, ffn, causal=True, seq=SEQ)
    torch.manual_seed(seed)
    b_h, b_f = hidden ** -0.5, ffn ** -0.5
    draws = [(block.attn.in_proj_weight, b_h), (block.attn.in_proj_bias, b_h), (block.attn.out_proj.weight, b_h),
             (block.fc1.weight, b_h), (block.fc1.bias, b_h), (block.fc2.weight, b_f)]
    with torch.no_grad():
        for norm in (block.ln1, block.ln2):
            norm.reset_parameters()
        block.attn.out_proj.bias.zero_()
        block.fc2.bias.zero_()
        for param, bound in draws:
            param.uniform_(-bound, bound)
    return block


@pytest.mark.parametrize("tp", TPS)
def test_attention_and_block_built_from_a_seed_are_the_unsplit_ones_drawn_under_it(tp):
    """[Note: shards drawn from the whole] for the fused q/k/v: the column layer kept rows start:stop of the
    whole (3 * hidden, hidden) weight, which the attention reads as this rank's heads of q, k and v, so before
    2026-12-07 the tp > 1 attention built under a seed was not the unsplit one (an audit: 0.48 between the
    outputs of tp = 2 and tp = 1). Now each rank holds its heads' rows of the whole draw."""
    hidden, heads, ffn = 4 * tp, 2 * tp, 8 * tp
    ref = drawn_block(9, hidden, heads, ffn)
    x = seeded(73, 2, SEQ, hidden)
    with torch.no_grad():
        h = ref.ln1(x)
        expected_attn = ref.attn(h, h, h, attn_mask=ref.mask, need_weights=False)[0]
        expected = ref(x)
    ps = group(tp)
    if ps is None:
        return
    hvd.model_parallel_manual_seed(9, ps)
    block = hvd.ParallelTransformerBlock(hidden, heads, ffn, causal=True, process_set=ps, dtype=D)
    after = torch.rand(2).tolist()
    drawn_block(9, hidden, heads, ffn)
    assert torch.rand(2).tolist() == after  # the generator moved as for the unsplit block
    close(block.attn.qkv.weight.detach(), heads_rows(ref.attn.in_proj_weight.detach(), hidden, ps))
    close(block.attn.qkv.bias.detach(), heads_rows(ref.attn.in_proj_bias.detach(), hidden, ps))
    with torch.no_grad():
        close(block(x), expected)
        close(block.attn(ref.ln1(x)), expected_attn)
    hvd.model_parallel_manual_seed(9, ps)
    attn = hvd.ParallelSelfAttention(hidden, heads, causal=True, process_set=ps, dtype=D)
    with torch.no_grad():
        close(attn(ref.ln1(x)), expected_attn)


@pytest.mark.parametrize("tp", TPS)
def test_random_streams_shared_outside_and_per_shard_inside_a_region(tp):
    ps = group(tp)
    if ps is None:
        return
    tracker = hvd.get_rng_tracker()
    hvd.model_parallel_manual_seed(1234, ps)
    shared = torch.rand(6)
    with tracker.fork():
        own = torch.rand(6)
    after = torch.rand(6)
    torch.manual_seed(1234)
    torch.rand(6)
    close(after, torch.rand(6).to(after.dtype))  # the fork did not move the shared stream
    shared_all = hvd.allgather_object(shared.tolist(), process_set=ps)
    own_all = hvd.allgather_object(own.tolist(), process_set=ps)
    assert all(row == shared_all[0] for row in shared_all)
    assert len({tuple(row) for row in own_all}) == tp  # every shard draws its own numbers
    assert own.tolist() != shared.tolist()
    hvd.model_parallel_manual_seed(1234, ps)  # reproducible: the same seed, the same draws
    torch.rand(6)
    with tracker.fork():
        assert torch.rand(6).tolist() == own.tolist()
    with pytest.raises(ValueError, match="non-negative integer"):
        hvd.model_parallel_manual_seed(-1, ps)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_block_dropout_is_reproducible_and_the_group_agrees(tp, sequence_parallel):
    hidden = 4 * tp
    ref = Block(hidden, 2 * tp, 8 * tp, causal=False, seq=SEQ)
    x = seeded(31, 2, SEQ, hidden)
    ps = group(tp)
    if ps is None:
        return
    block = hvd.ParallelTransformerBlock.from_modules(ref.ln1, ref.attn, ref.ln2, ref.fc1, ref.fc2, process_set=ps,
                                                      hidden_dropout=0.3, attention_dropout=0.3,
                                                      sequence_parallel=sequence_parallel)

    def run() -> torch.Tensor:
        inp = hvd.scatter_to_sequence(x, ps) if sequence_parallel else x
        out = block(inp)
        return hvd.gather_from_sequence(out, ps, to_parallel=False) if sequence_parallel else out

    hvd.model_parallel_manual_seed(7, ps)
    first = run()
    hvd.model_parallel_manual_seed(7, ps)
    close(run(), first)  # the same seed: the same masks
    outs = hvd.allgather_object(first.tolist(), process_set=ps)
    assert all(o == outs[0] for o in outs)  # replicated output: every rank of the group agrees
    block.eval()
    assert not torch.allclose(run(), first)  # dropout did act in training
    close(run(), ref(x))  # and evaluation is the plain block
    block.train()
    hvd.get_rng_tracker().reset()
    with pytest.raises(ValueError, match="model_parallel_manual_seed"):
        run()
    with pytest.raises(ValueError, match="must be a probability"):
        hvd.ParallelTransformerBlock(hidden, 2 * tp, 8 * tp, process_set=ps, hidden_dropout=1.0)


@pytest.mark.parametrize("tp", [tp for tp in TPS if tp > 1])
def test_dropout_seeds_that_differ_are_refused(tp):
    """A seed that differs on one rank of the group (seed + rank) raises MismatchError on every rank of it, and
    hidden dropout without model_parallel_manual_seed is refused; before 2026-12-05 both ran, and the block's
    replicated output differed between the ranks by up to 4.8 (the audit's measurement)."""
    ps = group(tp)
    if ps is None:
        return
    with pytest.raises(hvd.MismatchError, match=r"model_parallel_manual_seed: the ranks passed different values: "
                                                r"seed is 3 on ranks? .*Every rank of a tensor group must use"):
        hvd.model_parallel_manual_seed(3 + (ps.rank() == tp - 1), ps)
    block = hvd.ParallelTransformerBlock(4 * tp, tp, 4 * tp, process_set=ps, dtype=D, hidden_dropout=0.3)
    hvd.get_rng_tracker().reset()
    torch.manual_seed(100 + R)  # each rank its own default generator
    with pytest.raises(ValueError, match="hidden dropout in training needs .*model_parallel_manual_seed"):
        block(seeded(47, 2, SEQ, 4 * tp))
    hvd.model_parallel_manual_seed(3, ps)
    out = block(seeded(47, 2, SEQ, 4 * tp))
    outs = hvd.allgather_object(out.tolist(), process_set=ps)
    assert all(o == outs[0] for o in outs)  # one mask on the replicated activations


@pytest.mark.parametrize("tp", [tp for tp in TPS if tp > 1])
def test_inputs_that_differ_across_the_group_are_refused_at_the_first_call(tp):
    """Each rank of a group fed its own batch (a loader sharded by the job's rank instead of the data-parallel
    rank): the column layer multiplied different inputs by each rank's columns and the embedding looked up
    different ids, with no error, before 2026-12-06. Now each layer's first call compares its replicated input
    over the group; last-bit differences (replicated activations) pass, a later call is not checked."""
    ps = group(tp)
    if ps is None:
        return
    mine = ps.rank()
    col = hvd.ColumnParallelLinear.from_linear(linear(5, 6, 2 * tp), process_set=ps)
    with pytest.raises(hvd.MismatchError, match=r"ColumnParallelLinear: the tensor group \(ranks? .*\) "
                                                r"was given different inputs \(rank .* differs .* at 12 of 12 "
                                                r"sampled elements.*shard the data by the data-parallel rank"):
        col(seeded(60 + mine, 2, 6))
    col(seeded(61, 2, 6) + mine * 1e-13)  # checked once: a later call is not compared
    row = hvd.RowParallelLinear.from_linear(linear(6, 2 * tp, 3), input_is_parallel=False, process_set=ps)
    row(seeded(62, 300, 2 * tp) * (1 + mine * 1e-9))  # last bits: the same input (256 of 600 sampled)
    emb = hvd.VocabParallelEmbedding(4 * tp, 3, process_set=ps, dtype=D)
    ids = torch.tensor([[0, 1, 2], [3, 0, 1]])
    with pytest.raises(hvd.MismatchError, match=r"VocabParallelEmbedding: .* at 1 of 6 sampled elements \(the "
                                                r"first: .*"):
        emb(torch.where(ids == 2, ids + (mine == tp - 1), ids))
    other = hvd.ColumnParallelLinear.from_linear(linear(5, 6, 2 * tp), process_set=ps)
    with pytest.raises(hvd.MismatchError, match=r"rank .*'s is \[2, 6\] float64, rank .*'s \[3, 6\] float64"):
        other(seeded(63, 2 if mine else 3, 6))


def test_dropout_in_a_region_off_the_cpu_is_refused():
    """The tracker's streams are CPU generator states, so dropout inside fork() on a CUDA tensor would draw
    the CUDA generator's one mask on every shard: refused until per-device streams exist (meta tensors stand
    in for CUDA ones here, on a group of one)."""
    ps = group(1)
    hvd.model_parallel_manual_seed(1, ps)
    attn = hvd.ParallelSelfAttention(8, 2, attention_dropout=0.1, process_set=ps).to("meta")
    with pytest.raises(NotImplementedError, match="ParallelSelfAttention: dropout inside a tensor-parallel "
                                                  "region on meta tensors is not supported yet"):
        attn(torch.empty(2, 4, 8, device="meta"))
    attn.eval()
    assert attn(torch.empty(2, 4, 8, device="meta")).shape == (2, 4, 8)  # no dropout: runs


# ------------------------------------------------------------------ a GPT on the data x pipeline x tensor grid

VOCAB, GPT_SEQ, GPT_HIDDEN, GPT_HEADS, GPT_FFN = 16, 6, 8, 4, 16


class Embed(nn.Module):
    """Token embedding (split over the vocabulary in the parallel model) plus learned positions."""

    def __init__(self, tok: nn.Module, pos: nn.Embedding) -> None:
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos.weight[:ids.shape[1]]


class Head(nn.Module):
    """Final norm and the vocabulary projection (column-parallel, logits left split, in the parallel model)."""

    def __init__(self, norm: nn.LayerNorm, proj: nn.Module) -> None:
        super().__init__()
        self.norm, self.proj = norm, proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def reference_gpt() -> nn.Sequential:
    torch.manual_seed(40)
    blocks = [Block(GPT_HIDDEN, GPT_HEADS, GPT_FFN, causal=True, seq=GPT_SEQ) for _ in range(2)]
    with torch.no_grad():  # the blocks' seeds are fixed: make the second one different
        for p in blocks[1].parameters():
            p.add_(0.1 * torch.randn(p.shape, dtype=D))
    embed = Embed(nn.Embedding(VOCAB, GPT_HIDDEN, dtype=D), nn.Embedding(GPT_SEQ, GPT_HIDDEN, dtype=D))
    head = Head(nn.LayerNorm(GPT_HIDDEN, dtype=D), nn.Linear(GPT_HIDDEN, VOCAB, bias=False, dtype=D))
    return nn.Sequential(embed, *blocks, head)


def parallel_gpt(ref: nn.Sequential, ps: hvd.ProcessSet) -> list[nn.Module]:
    import copy

    embed = Embed(hvd.VocabParallelEmbedding.from_embedding(ref[0].tok, ps), copy.deepcopy(ref[0].pos))
    blocks = [hvd.ParallelTransformerBlock.from_modules(b.ln1, b.attn, b.ln2, b.fc1, b.fc2, causal=True,
                                                        process_set=ps) for b in list(ref)[1:-1]]
    head = Head(copy.deepcopy(ref[-1].norm), hvd.ColumnParallelLinear.from_linear(ref[-1].proj, process_set=ps))
    return [embed, *blocks, head]


@pytest.mark.parametrize("dp,pp,tp", [(1, 2, 2), (2, 1, 2), (2, 2, 1), (1, 1, 4)])
def test_gpt_trains_on_the_grid_like_one_process(dp, pp, tp):
    from unison.common.tensor_parallel import grid_pipeline

    if dp * pp * tp != N:
        pytest.skip(f"needs {dp * pp * tp} ranks")
    grid = Grid(dp=dp, pp=pp, tp=tp)
    sets = grid.register()
    ids = torch.randint(0, VOCAB, (8, GPT_SEQ), generator=torch.Generator().manual_seed(41))
    targets = torch.randint(0, VOCAB, (8, GPT_SEQ), generator=torch.Generator().manual_seed(42))
    ref = reference_gpt()
    pipe = hvd.Pipeline(parallel_gpt(ref, sets.tp), balance=[2, 2] if pp == 2 else [4], chunks=2,
                        loss_fn=lambda out, tgt: hvd.vocab_parallel_cross_entropy(out, tgt, process_set=sets.tp),
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.2), grid=grid_pipeline(grid, sets))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    _, d, _ = grid.coords(R)
    rows = slice(d * 8 // dp, (d + 1) * 8 // dp)  # this replica's part of the global batch
    try:
        for _ in range(3):
            loss = pipe.train_step(ids[rows], targets[rows])
            ref_opt.zero_grad()
            ref_loss = F.cross_entropy(ref(ids).reshape(-1, VOCAB), targets.reshape(-1))
            ref_loss.backward()
            ref_opt.step()
            assert abs(loss - ref_loss.item()) < 1e-10
        expected = parallel_gpt(ref, sets.tp)  # the trained reference, split the same way
        for stage, layers in pipe.layer_ranges.items():
            for mine, want in zip(pipe.stages[stage], (expected[i] for i in layers), strict=True):
                for (name, got), (_, exp) in zip(mine.named_parameters(), want.named_parameters(), strict=True):
                    torch.testing.assert_close(got, exp, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        pipe.close()


# ------------------------------------------------------------------ parallelize(model, plan)


def mlp(seed: int, hidden: int = 16, fan_in: int = 8, fan_out: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(fan_in, hidden, dtype=D), nn.GELU(), nn.Linear(hidden, fan_out, dtype=D))


MLP_PLAN = {"0": "colwise", "2": "rowwise"}


@pytest.mark.parametrize("tp", [tp for tp in TPS if 16 % tp == 0])
def test_parallelize_mlp_equals_the_unsplit_model(tp):
    ref = mlp(31)
    x, upstream = seeded(32, 4, 8), seeded(33, 4, 8)
    x_ref = leaf(x)
    (ref(x_ref) * upstream).sum().backward()
    ps = group(tp)
    if ps is None:
        return
    model = mlp(31)  # the same weights, split from a model of its own
    assert hvd.parallelize(model, MLP_PLAN, ps) is model
    assert [type(m) for m in model] == [hvd.ColumnParallelLinear, nn.GELU, hvd.RowParallelLinear]
    x_par = leaf(x)
    out = model(x_par)
    close(out, ref(x))
    (out * upstream).sum().backward()
    close(x_par.grad, x_ref.grad)
    close(model[0].weight.grad, piece(ref[0].weight.grad, ps, 0))
    close(model[0].bias.grad, piece(ref[0].bias.grad, ps, 0))
    close(model[2].weight.grad, piece(ref[2].weight.grad, ps, 1))
    close(model[2].bias.grad, ref[2].bias.grad)


class TinyLM(nn.Module):
    """Embedding, tanh, a linear head over the vocabulary."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        torch.manual_seed(34)
        self.embed, self.head = nn.Embedding(vocab, dim, dtype=D), nn.Linear(dim, vocab, dtype=D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


@pytest.mark.parametrize("tp", TPS)
def test_parallelize_embedding_and_head_with_the_vocab_parallel_loss(tp):
    vocab = 12
    ids = torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(35))
    target = torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(36))
    ref = TinyLM(vocab, 4)
    expected = F.cross_entropy(ref(ids).reshape(-1, vocab), target.reshape(-1))
    expected.backward()
    ps = group(tp)
    if ps is None:
        return
    model = hvd.parallelize(TinyLM(vocab, 4), {"embed": "vocab", "head": "colwise"}, ps)
    assert isinstance(model.embed, hvd.VocabParallelEmbedding) and isinstance(model.head, hvd.ColumnParallelLinear)
    loss = hvd.vocab_parallel_cross_entropy(model(ids), target, process_set=ps)
    close(loss, expected)
    loss.backward()
    close(model.embed.weight.grad, piece(ref.embed.weight.grad, ps, 0))
    close(model.head.weight.grad, piece(ref.head.weight.grad, ps, 0))
    close(model.head.bias.grad, piece(ref.head.bias.grad, ps, 0))


def test_parallelize_trains_on_a_dp_x_tp_grid_like_one_process():
    """dp = N/2 data groups x tp = 2: k SGD-momentum steps, each data group on its slice of the
    global batch, its gradients averaged over the data group only; every shard ends equal to its
    slice of one process trained on the whole global batch."""
    if N % 2:
        pytest.skip("the dp x tp grid needs an even job")
    grid, steps, per = Grid(dp=N // 2, tp=2), 3, 3
    sets, mine = grid.register(), grid.coords(R).dp
    ref = mlp(37, hidden=8, fan_in=6, fan_out=4)
    model = hvd.parallelize(mlp(37, hidden=8, fan_in=6, fan_out=4), MLP_PLAN, sets.tp)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), process_set=sets.dp)
    for step in range(steps):
        x, y = seeded(40 + step, per * grid.dp, 6), seeded(50 + step, per * grid.dp, 4)
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        F.mse_loss(model(x[mine * per:(mine + 1) * per]), y[mine * per:(mine + 1) * per]).backward()
        opt.step()
    close(model[0].weight, piece(ref[0].weight, sets.tp, 0))
    close(model[0].bias, piece(ref[0].bias, sets.tp, 0))
    close(model[2].weight, piece(ref[2].weight, sets.tp, 1))
    close(model[2].bias, ref[2].bias)


BAD_PLANS = [
    ({"9": "colwise"}, r"plan entry '9' matches no layer path .* paths are \['0', '1', '2'\]"),
    ({"1": "colwise"}, r"style 'colwise' splits a torch.nn.Linear layer, but '1' is a GELU"),
    ({"0": "vocab"}, r"style 'vocab' splits a torch.nn.Embedding layer, but '0' is a torch.nn.Linear"),
    ({"0": "colwise", "[02]": "rowwise"}, r"layer '0' is matched by two plan entries, '0' and '\[02\]'"),
    ({"0": "diagonal"}, r"the style must be one of \['colwise', 'rowwise', 'vocab'\]; received 'diagonal'"),
]


@pytest.mark.parametrize("plan,message", BAD_PLANS, ids=["nothing", "not-linear", "not-embedding", "twice",
                                                         "style"])
def test_bad_plans_raise_the_same_error_on_every_rank(plan, message):
    model = mlp(38)
    with pytest.raises(ValueError, match=message) as err:
        hvd.parallelize(model, plan, hvd.global_process_set)
    assert [type(m) for m in model] == [nn.Linear, nn.GELU, nn.Linear]
    assert hvd.allgather_object(str(err.value)) == [str(err.value)] * N


def test_parallelize_refuses_sizes_the_group_does_not_divide_and_leaves_the_model():
    if N == 1:
        pytest.skip("every size divides a group of one")
    model = nn.Sequential(nn.Linear(8, 4 * N, dtype=D), nn.GELU(), nn.Linear(2 * N + 1, 8, dtype=D))
    with pytest.raises(ValueError, match=rf"RowParallelLinear in_features \({2 * N + 1}\) is not divisible by the "
                                         rf"tensor group size \({N}\)"):
        hvd.parallelize(model, MLP_PLAN, hvd.global_process_set)
    assert [type(m) for m in model] == [nn.Linear, nn.GELU, nn.Linear]  # the column layer was not swapped in


# ------------------------------------------------------------------ bad sizes and the grid


@pytest.mark.parametrize("tp", [tp for tp in TPS if tp > 1])
@pytest.mark.parametrize("build,what", BAD_SIZES, ids=BAD_SIZE_IDS)
def test_sizes_not_divisible_by_the_group_raise(tp, build, what):
    check_bad_size(hvd, SETS, tp, build, what)


@pytest.mark.parametrize("tp", [tp for tp in TPS if tp > 1])
@pytest.mark.parametrize("build,what", DIFFERENT_BUILDS + [
    (lambda hvd, tp, ps, odd: hvd.ColumnParallelLinear(4, 4 * tp, process_set=ps,
                                                       dtype=torch.float32 if odd else D), "dtype"),
    (lambda hvd, tp, ps, odd: hvd.ParallelMLP(4, 4 * tp, activation=F.relu if odd else F.gelu, process_set=ps),
     "activation")], ids=DIFFERENT_BUILD_IDS + ["dtype", "mlp-activation"])
def test_a_layer_built_differently_on_one_rank_raises_on_every_rank(tp, build, what):
    check_different_build(hvd, SETS, tp, build, what)


SOURCE_MISMATCH = (r"the ranks passed different values: .*{what} is .* on rank \d.*"
                   r"Every rank of a tensor group must split the same unsplit model")


@pytest.mark.parametrize("tp", [tp for tp in TPS if tp > 1])
@pytest.mark.parametrize("case", ["weights", "hook-on-one-rank", "hook-everywhere", "norm", "parallelize-rest",
                                  "parallelize-plan"])
def test_splitting_different_sources_raises_on_every_rank(tp, case):
    """[Note: one unsplit source on every rank]: from_* and parallelize refuse, on every rank of the group, a
    source that differs between the ranks (before 2026-12-05 the shards came from different matrices and the
    replicated parts differed per rank, silently) or that one rank refuses (that rank raised alone and the
    others waited in the layer's collectives); then the same split made alike works."""
    ps = group(tp)
    if ps is None:
        return
    odd = ps.rank() == tp - 1
    if case == "weights":
        with pytest.raises(hvd.MismatchError, match=SOURCE_MISMATCH.format(what=r"source weights \(digest\)")):
            hvd.ColumnParallelLinear.from_linear(linear(40 + odd, 4, 4 * tp), process_set=ps)
    elif case in ("hook-on-one-rank", "hook-everywhere"):
        source = linear(40, 4 * tp, 4)
        if odd or case == "hook-everywhere":
            source.register_forward_hook(lambda *args: None)
        error = hvd.MismatchError if case == "hook-on-one-rank" else ValueError
        with pytest.raises(error, match="forward hooks") as info:
            hvd.RowParallelLinear.from_linear(source, process_set=ps)
        assert (type(info.value) is ValueError) == (case == "hook-everywhere")
    elif case == "norm":
        ln1, attn, ln2 = nn.LayerNorm(4 * tp, dtype=D), mha(41, 4 * tp, tp), nn.LayerNorm(4 * tp, dtype=D)
        with torch.no_grad():
            ln2.weight.fill_(2.0 if odd else 1.0)
        with pytest.raises(hvd.MismatchError, match=SOURCE_MISMATCH.format(what=r"source weights \(digest\)")):
            hvd.ParallelTransformerBlock.from_modules(ln1, attn, ln2, linear(42, 4 * tp, 4 * tp),
                                                      linear(43, 4 * tp, 4 * tp), process_set=ps)
    else:
        model = mlp(31)
        plan = dict(MLP_PLAN)
        if case == "parallelize-rest":
            model.append(linear(44 + odd, 8, 8))  # a layer the plan leaves whole, different on one rank
        elif odd:
            plan.pop("2")
        with pytest.raises(hvd.MismatchError, match=SOURCE_MISMATCH.format(what="")):
            hvd.parallelize(model, plan, ps)
        assert isinstance(model[0], nn.Linear)  # unchanged
    layer = hvd.ColumnParallelLinear.from_linear(linear(40, 4, 4 * tp), gather_output=True, process_set=ps)
    x = seeded(45, 2, 4)
    close(layer(x), linear(40, 4, 4 * tp)(x))


def test_grid_registers_its_tensor_groups():
    if N % 2:
        pytest.skip("the grid of tensor pairs needs an even job")
    grid = Grid(tp=2)
    sets = grid.register()
    assert grid.register() == sets  # registered once per session
    assert sets.tp.ranks == grid.tp_group_ranks(R) == [R - R % 2, R - R % 2 + 1]
    assert sets.dp.ranks == grid.dp_group_ranks(R) == list(range(R % 2, N, 2))
    assert sets.pp.ranks == [R]
    ref = linear(29, 3, 4)
    layer = hvd.ColumnParallelLinear.from_linear(ref, gather_output=True, process_set=sets.tp)
    x = seeded(30, 2, 3)
    close(layer(x), ref(x))
    total = hvd.allreduce(torch.tensor([float(R)]), op=hvd.Sum, process_set=sets.dp)
    assert total.item() == sum(grid.dp_group_ranks(R))


# ------------------------------------------------------------------ what a split must not lose (audit 2026-12-04)


class TiedLM(nn.Module):
    """A language model whose output head is its input embedding (one tensor, as GPT-2's)."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        torch.manual_seed(60)
        self.embed = nn.Embedding(vocab, dim, dtype=D)
        self.head = nn.Linear(dim, vocab, bias=False, dtype=D)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


@pytest.mark.parametrize("tp", TPS)
def test_parallelize_keeps_a_tied_embedding_and_head_tied_and_trains_like_the_unsplit_model(tp):
    """Before: each split layer got its own copy, so the tie was lost and 3 SGD steps ended elsewhere."""
    vocab, steps = 12, 3
    ref = TiedLM(vocab, 4)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    def ids(seed: int) -> torch.Tensor:
        return torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(seed))

    batches = [(ids(61 + s), ids(71 + s)) for s in range(steps)]
    for tokens, target in batches:
        ref_opt.zero_grad()
        F.cross_entropy(ref(tokens).reshape(-1, vocab), target.reshape(-1)).backward()
        ref_opt.step()
    ps = group(tp)
    if ps is None:
        return
    model = hvd.parallelize(TiedLM(vocab, 4), {"embed": "vocab", "head": "colwise"}, ps)
    assert model.head.weight is model.embed.weight and len(list(model.parameters())) == 1
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for tokens, target in batches:
        opt.zero_grad()
        hvd.vocab_parallel_cross_entropy(model(tokens), target, process_set=ps).backward()
        opt.step()
    close(model.embed.weight, piece(ref.embed.weight, ps, 0))


def test_parallelize_refuses_to_untie_a_shared_weight_and_leaves_the_model():
    model = TiedLM(4 * N, 4)
    with pytest.raises(ValueError, match=r"\['embed.weight', 'head.weight'\] are one shared tensor, and the plan "
                                         r"would split it in some places and not in others"):
        hvd.parallelize(model, {"embed": "vocab"}, hvd.global_process_set)
    assert type(model.embed) is nn.Embedding and model.head.weight is model.embed.weight
    shared = nn.Sequential(nn.Linear(4, 4, dtype=D), nn.Linear(4, 4, dtype=D))
    shared[1].weight = shared[0].weight
    with pytest.raises(ValueError, match="split it differently in each place"):
        hvd.parallelize(shared, {"0": "colwise", "1": "rowwise"}, hvd.global_process_set)
    aliased = nn.Module()  # one module at two paths is not a tie: replaced at its first path, as documented
    aliased.a = nn.Linear(4, 4 * N, dtype=D)
    aliased.b = aliased.a
    hvd.parallelize(aliased, {"a": "colwise"}, hvd.global_process_set)
    assert isinstance(aliased.a, hvd.ColumnParallelLinear)


def test_parallelize_keeps_frozen_weights_frozen_and_refuses_what_a_split_would_drop():
    model = mlp(62)
    model[0].weight.requires_grad_(False)
    hvd.parallelize(model, MLP_PLAN, hvd.global_process_set)
    assert [p.requires_grad for p in (model[0].weight, model[0].bias, model[2].weight, model[2].bias)] == [
        False, True, True, True]
    normed = mlp(63)
    torch.nn.utils.parametrizations.weight_norm(normed[0])
    with pytest.raises(ValueError, match="is parametrized"):
        hvd.parallelize(normed, MLP_PLAN, hvd.global_process_set)
    hooked = mlp(64)
    hooked[2].register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="has forward hooks"):
        hvd.parallelize(hooked, MLP_PLAN, hvd.global_process_set)
    assert type(hooked[0]) is nn.Linear  # nothing swapped

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2, dtype=D)

    with pytest.raises(ValueError, match=r"'attn.out_proj' belongs to an nn.MultiheadAttention"):
        hvd.parallelize(Attn(), {"attn.out_proj": "rowwise"}, hvd.global_process_set)

    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    with pytest.raises(ValueError, match="a subclass of Linear with its own forward"):
        hvd.parallelize(nn.Sequential(Scaled(4, 4 * N)), {"0": "colwise"}, hvd.global_process_set)
    with pytest.raises(ValueError, match="scale_grad_by_freq"):
        hvd.VocabParallelEmbedding.from_embedding(nn.Embedding(4 * N, 2, scale_grad_by_freq=True))


def test_activation_checkpoint_replays_the_tracker_so_attention_dropout_gets_the_forward_masks():
    """torch.utils.checkpoint alone redraws the attention-dropout mask in the recompute: wrong gradients."""
    ps = group(2) if N >= 2 else group(1)
    if ps is None:
        return
    tp = ps.size()
    ref = Block(4 * tp, 2 * tp, 8 * tp, causal=False, seq=SEQ)
    block = hvd.ParallelTransformerBlock.from_modules(ref.ln1, ref.attn, ref.ln2, ref.fc1, ref.fc2, process_set=ps,
                                                      attention_dropout=0.5)
    x = seeded(65, 2, SEQ, 4 * tp)

    def grads(wrap) -> list[torch.Tensor]:
        block.zero_grad()
        hvd.model_parallel_manual_seed(9, ps)
        inp = leaf(x)
        (wrap(inp) * x).sum().backward()
        return [inp.grad] + [p.grad.clone() for p in block.parameters()]

    plain = grads(block)
    for got, want in zip(grads(lambda t: hvd.activation_checkpoint(block, t)), plain, strict=True):
        close(got, want)
    redrawn = grads(lambda t: torch.utils.checkpoint.checkpoint(block, t, use_reentrant=False))
    assert not torch.allclose(redrawn[0], plain[0])  # what the wrapper is for (the test can fail)
    with pytest.raises(ValueError, match="use_reentrant=True is not supported"):
        hvd.activation_checkpoint(block, x, use_reentrant=True)


def test_a_distributed_optimizer_or_broadcast_over_ranks_holding_different_shards_is_refused():
    """Before: averaging or broadcasting over the whole job silently mixed the shards of a tp group."""
    if N < 2:
        pytest.skip("needs a tensor group of 2")
    grid = Grid(dp=N // 2, tp=2) if N % 2 == 0 else None
    if grid is None:
        pytest.skip("the grid needs an even job")
    sets = grid.register()
    model = hvd.parallelize(mlp(66), MLP_PLAN, sets.tp)
    with pytest.raises(ValueError, match=r"'0.weight' is one shard of a tensor-parallel layer split over ranks "
                                         r".*Pass process_set= the data-parallel group"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters())
    with pytest.raises(ValueError, match="is one shard of a tensor-parallel layer"):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="is one shard of a tensor-parallel layer"):
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    import copy

    clone = copy.deepcopy(model)  # new parameters, without the attribute: known by the layers that hold them
    with pytest.raises(ValueError, match="is one shard of a tensor-parallel layer"):
        hvd.DistributedOptimizer(torch.optim.SGD(clone.parameters(), lr=0.1),
                                 named_parameters=clone.named_parameters())
    clone.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    with pytest.raises(ValueError, match="is one shard of a tensor-parallel layer"):
        hvd.broadcast_parameters(clone.state_dict(), root_rank=0)
    # over the data group (the ranks holding the same shard) both are fine
    before = {k: v.clone() for k, v in model.state_dict().items()}
    root = sets.dp.ranks[0]
    if R != root:
        with torch.no_grad():
            model[0].weight.add_(1.0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=root, process_set=sets.dp)
    for k, v in model.state_dict().items():
        close(v, before[k])
    hvd.broadcast_optimizer_state(opt, root_rank=root, process_set=sets.dp)


@pytest.mark.parametrize("tp", [tp for tp in TPS if tp > 1])
def test_a_sequence_gathered_from_uneven_pieces_raises(tp):
    """Before: ranks holding 3 and 1 positions were re-split 2 and 2, silently, and backward diverged."""
    ps = group(tp)
    if ps is None:
        return
    mine = 3 if ps.rank() == 0 else 1
    with pytest.raises(ValueError, match="every rank of the group must hold the same number"):
        hvd.gather_from_sequence(seeded(67, 2, mine, 4), ps)


def test_attention_from_a_sequence_first_multihead_attention_reads_its_layout():
    """nn.MultiheadAttention's default is batch_first=False: the split layer now reads (seq, batch, hidden) too."""
    ps = group(2) if N >= 2 else group(1)
    if ps is None:
        return
    tp = ps.size()
    torch.manual_seed(68)
    ref = nn.MultiheadAttention(4 * tp, 2 * tp, dtype=D)  # batch_first=False
    x = seeded(69, 5, 3, 4 * tp)  # (seq, batch, hidden)
    attn = hvd.ParallelSelfAttention.from_multihead_attention(ref, process_set=ps)
    close(attn(x), ref(x, x, x, need_weights=False)[0])
    with pytest.raises(ValueError, match="needs batch_first=True"):
        hvd.ParallelSelfAttention.from_multihead_attention(ref, process_set=ps, sequence_parallel=True)
    # a block made from a sequence-first attention still reads (batch, seq, hidden), as documented
    block_ref = Block(4 * tp, 2 * tp, 8 * tp, causal=False, seq=SEQ)
    seq_first = nn.MultiheadAttention(4 * tp, 2 * tp, dtype=D)
    seq_first.load_state_dict(block_ref.attn.state_dict())
    for sp in (False, True):
        block = hvd.ParallelTransformerBlock.from_modules(block_ref.ln1, seq_first, block_ref.ln2, block_ref.fc1,
                                                          block_ref.fc2, process_set=ps, sequence_parallel=sp)
        xb = seeded(70, 2, SEQ, 4 * tp)
        out = block(hvd.scatter_to_sequence(xb, ps)) if sp else block(xb)
        close(hvd.gather_from_sequence(out, ps, to_parallel=False) if sp else out, block_ref(xb))


# ------------------------------------------------------ ZeRO and checkpoints on a dp x tp grid (audit 2026-12-07)


def dp_tp_grid() -> tuple[Grid, Any]:
    """The dp = N/2 x tp = 2 grid and this rank's sets (skips an odd job)."""
    if N % 2:
        pytest.skip("the dp x tp grid needs an even job")
    grid = Grid(dp=N // 2, tp=2)
    return grid, grid.register()


def normed_mlp() -> nn.Sequential:
    """A layer norm (replicated under tp, its weight moved off 1 so its gradient matters) before the MLP."""
    torch.manual_seed(71)
    model = nn.Sequential(nn.LayerNorm(6, dtype=D), nn.Linear(6, 8, dtype=D), nn.GELU(), nn.Linear(8, 4, dtype=D))
    with torch.no_grad():
        model[0].weight.add_(seeded(72, 6))
    return model


NORMED_PLAN = {"1": "colwise", "3": "rowwise"}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_clipping_of_a_tensor_parallel_model_uses_the_global_norm_like_one_process(stage):
    """hvd.clip_grad_norm_ under ZeRO over the data group of a dp x tp grid returns one process's norm, and
    3 clipped Adam steps leave every shard equal to its slice of one process's model, the replicated layer
    norm equal on the tensor group. Before 2026-12-07 the norm was summed over the data group only: each
    tensor shard was clipped by its own norm (0.66 where one process had 1.04), and the layer norm's copies
    drifted apart across the tensor group (4.9e-3)."""
    grid, sets = dp_tp_grid()
    mine, per, clip = grid.coords(R).dp, 2, 0.05
    ref = normed_mlp()
    model = hvd.parallelize(normed_mlp(), NORMED_PLAN, sets.tp)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    if stage == 3:
        hvd.shard_module(model, process_set=sets.dp)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        target = model
    else:
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(), process_set=sets.dp,
                                       zero_stage=stage)
        target = opt
    for step in range(3):
        x, y = seeded(73 + step, per * grid.dp, 6), seeded(76 + step, per * grid.dp, 4)
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        opt.zero_grad()
        F.mse_loss(model(x[mine * per:(mine + 1) * per]), y[mine * per:(mine + 1) * per]).backward()
        norm = hvd.clip_grad_norm_(target, clip)
        opt.step()
        assert expected > clip  # (every step clips)
        torch.testing.assert_close(norm, expected.float())  # (the norm is returned in float32)
    weights = hvd.full_state_dict(model) if stage == 3 else model.state_dict()
    close(weights["0.weight"], ref[0].weight)
    close(weights["1.weight"], piece(ref[1].weight, sets.tp, 0))
    close(weights["1.bias"], piece(ref[1].bias, sets.tp, 0))
    close(weights["3.weight"], piece(ref[3].weight, sets.tp, 1))
    close(weights["3.bias"], ref[3].bias)
    norms = hvd.allgather(weights["0.weight"].detach().reshape(1, -1), process_set=sets.tp)
    assert torch.equal(norms[0], norms[1])


def test_shard_module_over_ranks_holding_different_shards_is_refused_on_every_rank():
    """Before 2026-12-07 shard_module over every rank broadcast rank 0's tensor shard over rank 1's and
    averaged the gradients of different shards, silently; over the data group it trains (test above)."""
    _, sets = dp_tp_grid()
    model = hvd.parallelize(mlp(74, hidden=8, fan_in=6, fan_out=4), MLP_PLAN, sets.tp)
    kept = model[0].weight.detach().clone()
    with pytest.raises(ValueError, match=r"shard_module: '0.weight' is one shard of a tensor-parallel layer split "
                                         r"over ranks .*Pass process_set= the data-parallel group"):
        hvd.shard_module(model)
    close(model[0].weight, kept)  # (nothing was broadcast)


@pytest.fixture
def shared_dir():
    """A folder every rank sees (rank 0's temporary folder), removed afterwards."""
    import shutil
    import tempfile

    path = WORLD.bcast(tempfile.mkdtemp(prefix="tp-zero-") if R == 0 else None)
    yield path
    WORLD.Barrier()
    if R == 0:
        shutil.rmtree(path, ignore_errors=True)


def test_save_sharded_of_a_tensor_parallel_model_is_refused_on_every_rank_naming_save_tensor_parallel(shared_dir):
    """Before 2026-12-07 save_sharded stored each tensor shard as one replicated copy (rank 0's), and
    load_sharded gave the other shard's ranks shard 0's weights, silently."""
    _, sets = dp_tp_grid()
    model = hvd.parallelize(mlp(75, hidden=8, fan_in=6, fan_out=4), MLP_PLAN, sets.tp)
    path = os.path.join(shared_dir, "ckpt")
    for what, call in (("save_sharded", hvd.save_sharded), ("load_sharded", hvd.load_sharded)):
        with pytest.raises(ValueError, match=rf"{what}: '0.weight' is one shard of a tensor-parallel layer.*"
                                             r"save_tensor_parallel\(path, model, data_process_set="):
            call(path, model)


def test_save_sharded_of_a_tensor_parallel_stage3_model_says_it_is_not_built(shared_dir):
    """shard_module over the data group of a dp x tp grid: before 2026-12-07 the refusal advised sharding over the
    global process set (refused for such a model) or full_state_dict (one tensor shard's weights)."""
    _, sets = dp_tp_grid()
    model = hvd.shard_module(hvd.parallelize(mlp(76, hidden=8, fan_in=6, fan_out=4), MLP_PLAN, sets.tp),
                             process_set=sets.dp)
    path = os.path.join(shared_dir, "ckpt3")
    for call in (hvd.save_sharded, hvd.load_sharded):
        with pytest.raises(ValueError, match=r"tensor-parallel model sharded by shard_module is not built.*"
                                             r"save_tensor_parallel\(path, model, data_process_set="):
            call(path, model)


def test_saving_a_zero_optimizer_of_a_tensor_parallel_model_is_refused_naming_this_ranks_data_group(shared_dir):
    """Before 2026-12-07 the refusal said "Save with the global process set", which a tensor-parallel model
    cannot (its optimizer over every rank is refused), and every rank quoted rank 0's data group."""
    _, sets = dp_tp_grid()
    model = hvd.parallelize(mlp(76, hidden=8, fan_in=6, fan_out=4), MLP_PLAN, sets.tp)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(),
                                   process_set=sets.dp, zero_stage=1)
    with pytest.raises(ValueError, match="the optimizer state of a tensor-parallel model is not built") as err:
        hvd.save_sharded(os.path.join(shared_dir, "ckpt"), model, opt)
    assert repr(sets.dp) in str(err.value)
    assert "save_tensor_parallel(path, model, data_process_set=" in str(err.value)


def test_a_tensor_parallel_save_of_data_replicas_without_their_data_group_names_data_process_set(shared_dir):
    """Before 2026-12-07 the replicas' shards reached the core save as overlapping runs, whose advice
    ("or pass the entry as Replicated") a caller of save_tensor_parallel cannot follow."""
    grid, sets = dp_tp_grid()
    if grid.dp < 2:
        pytest.skip("needs two data replicas")
    model = hvd.parallelize(mlp(77, hidden=8, fan_in=6, fan_out=4), MLP_PLAN, sets.tp)
    path = os.path.join(shared_dir, "ckpt")
    with pytest.raises(ValueError, match=r"ranks \d+ and \d+ both hold shard 0 of 2 of tensor-parallel entry "
                                         r"'0\.\w+'.*data_process_set=sets\.dp"):
        hvd.save_tensor_parallel(path, model)
    hvd.save_tensor_parallel(path, model, data_process_set=sets.dp)  # the fix it names works
