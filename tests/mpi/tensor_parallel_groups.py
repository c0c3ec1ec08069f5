"""What the torch and Keras tensor-parallel rank suites share: the groups and the bad-size cases.

Both suites cut the job into consecutive groups of tp ranks for tp = 1..4 (at np 4: {0} {1} {2}
{3}; {0,1} {2,3}; {0,1,2} with rank 3 idle; {0,1,2,3}), registered on every rank in the same
order, and check the same size errors; ``hvd`` is the backend module (both export the same names).
"""

from __future__ import annotations

from typing import Any

import pytest
from mpi4py import MPI

N, R = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
TPS = [tp for tp in (1, 2, 3, 4) if tp <= N]


def register_groups(hvd: Any) -> dict[int, Any]:
    """tp -> this rank's registered group (None where this rank is idle at that tp)."""
    sets: dict[int, Any] = {}
    for tp in TPS:
        sets[tp] = None
        for first in range(0, N - N % tp, tp):
            ps = hvd.add_process_set(hvd.ProcessSet(range(first, first + tp)))
            if R in ps.ranks:
                sets[tp] = ps
    return sets


def group_or_refusal(hvd: Any, sets: dict[int, Any], tp: int) -> Any:
    """This rank's group at ``tp``; on an idle rank, check that joining another group is refused."""
    ps = sets[tp]
    if ps is None:
        with pytest.raises(ValueError, match="not in the tensor group"):
            hvd.ColumnParallelLinear(4, 4 * tp, process_set=hvd.ProcessSet(range(tp)))
    return ps


#: (builder(hvd, tp, ps), the size named in the error)
BAD_SIZES = [
    (lambda hvd, tp, ps: hvd.ColumnParallelLinear(4, 2 * tp + 1, process_set=ps), "out_features"),
    (lambda hvd, tp, ps: hvd.RowParallelLinear(2 * tp + 1, 4, process_set=ps), "in_features"),
    (lambda hvd, tp, ps: hvd.VocabParallelEmbedding(5 * tp + 1, 4, process_set=ps), "num_embeddings"),
    (lambda hvd, tp, ps: hvd.ParallelSelfAttention(2 * (tp + 1), tp + 1, process_set=ps), "num_heads"),
    (lambda hvd, tp, ps: hvd.ParallelMLP(4, 3 * tp + 1, process_set=ps), "out_features"),
]
BAD_SIZE_IDS = ["column", "row", "vocab", "heads", "mlp"]


def check_bad_size(hvd: Any, sets: dict[int, Any], tp: int, build: Any, what: str) -> None:
    """Building with a size not divisible by ``tp`` raises the ValueError that says how to pad."""
    ps = group_or_refusal(hvd, sets, tp)
    if ps is None:
        return
    with pytest.raises(ValueError, match=rf"{what} \(\d+\) is not divisible by the tensor group size \({tp}\).*"
                                         rf"[Pp]ad .* to a multiple of {tp}"):
        build(hvd, tp, ps)


#: (builder(hvd, tp, ps, odd), the field the error names): ``odd`` is True on the group's last rank only, which
#: builds the layer with one argument different ([Note: a layer built alike on every rank]). Before 2026-12-05
#: these ran: a vocabulary, width or head count that differed gave wrong values silently, and an option on one
#: rank only left the others waiting in a collective it never made.
DIFFERENT_BUILDS = [
    (lambda hvd, tp, ps, odd: hvd.ColumnParallelLinear(4, (8 if odd else 4) * tp, process_set=ps), "out_features"),
    (lambda hvd, tp, ps, odd: hvd.ColumnParallelLinear(4, 4 * tp, gather_output=odd, process_set=ps),
     "gather_output"),
    (lambda hvd, tp, ps, odd: hvd.ColumnParallelLinear(4, 4 * tp, process_set=ps, sequence_parallel=odd),
     "sequence_parallel"),
    (lambda hvd, tp, ps, odd: hvd.RowParallelLinear(4 * tp, 4, bias=not odd, process_set=ps), "bias"),
    (lambda hvd, tp, ps, odd: hvd.RowParallelLinear(4 * tp, 4, input_is_parallel=not odd, process_set=ps),
     "input_is_parallel"),
    (lambda hvd, tp, ps, odd: hvd.VocabParallelEmbedding((6 if odd else 5) * tp, 4, process_set=ps),
     "num_embeddings"),
    (lambda hvd, tp, ps, odd: hvd.ParallelSelfAttention(4 * tp, (2 if odd else 1) * tp, process_set=ps),
     "num_heads"),
    (lambda hvd, tp, ps, odd: hvd.ParallelSelfAttention(4 * tp, tp, causal=odd, process_set=ps), "causal"),
    (lambda hvd, tp, ps, odd: hvd.ParallelTransformerBlock(4 * tp, tp, 4 * tp, eps=1e-3 if odd else 1e-5,
                                                           process_set=ps), "eps"),
]
DIFFERENT_BUILD_IDS = ["out-features", "gather-output", "sequence-parallel", "bias", "input-is-parallel",
                       "vocab", "heads", "causal", "block-eps"]


def check_different_build(hvd: Any, sets: dict[int, Any], tp: int, build: Any, what: str) -> None:
    """A layer one rank of the group builds with other arguments raises MismatchError on every rank of the group,
    naming the argument and each rank's value; the same layer built alike then works (nothing was left over)."""
    ps = group_or_refusal(hvd, sets, tp)
    if ps is None:
        return
    odd = ps.rank() == tp - 1
    with pytest.raises(hvd.MismatchError, match=rf"the ranks passed different values: {what} is .* on rank \d.*"
                                                r"Every rank of a tensor group must build each parallel layer"):
        build(hvd, tp, ps, odd)
    build(hvd, tp, ps, False)
